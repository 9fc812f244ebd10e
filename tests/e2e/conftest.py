"""One real cluster per test module: local Ray on 127.0.0.1, worker actors, NIXL over UCX loopback, and
the router's gRPC server on 127.0.0.1 in front of the disaggregated engine client."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import pytest

# Ray reads this when first imported: all of its listeners then bind 127.0.0.1 (see cluster/placement.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

# The tiny test model (window 8, vocab 1024): prompts straddle the sliding window in a few tokens.
TOPOLOGY = """
model: {name: tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 2, max_prompt_tokens: 1024}  # two, so a killed one has a stand-in
decode: {workers: 2, max_batch: 32, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
kv_transfer: {lease_seconds: 30}
device: cpu
"""


@dataclass
class RunningCluster:
    topology: Any
    cluster: Any
    grpc_target: str
    client: Any  # the DisaggregatedEngineClient behind the router
    supervisor: Any = None  # the Supervisor replacing dead workers, if the test asked for one


def tiny_topology(text: str = TOPOLOGY):
    from kvrelay.cluster.topology import parse_topology

    return parse_topology(text, source="e2e")


@contextlib.contextmanager
def serving(text: str = TOPOLOGY, *, supervise: bool = False, **supervisor_kwargs):
    """A real cluster of `text`'s topology with a router on 127.0.0.1: (RunningCluster, RouterServer).
    `supervise`: dead workers are replaced as under `kvrelay serve` (cluster/supervisor.py); without it
    they stay dead, so a test can look at the cluster one worker short."""
    from kvrelay.cluster.serve import Cluster
    from kvrelay.router.server import BackgroundRouter

    topo = tiny_topology(text)
    cluster = Cluster.start(topo)
    supervisor = None
    try:
        client = cluster.engine_client(stall_check_s=5.0)
        if supervise:
            supervisor = cluster.supervise(client, **supervisor_kwargs)
        with BackgroundRouter(client, model_name=client.model_name, host="127.0.0.1") as server:
            yield RunningCluster(topo, cluster, server.grpc_target, client, supervisor), server
    finally:
        if supervisor is not None:
            supervisor.stop()
        cluster.shutdown()


@pytest.fixture(scope="module")
def running():
    with serving() as (run, _):
        yield run


@pytest.fixture(scope="module")
def reference():
    """Single-process generation on the same model: the oracle every cluster stream must equal."""
    from kvrelay.engine.llm import LLM

    return LLM("tiny", dummy=True, seed=0, page_size=16, kv_tokens=8192)
