"""The documented multi-machine path, on one box: `ray start --head`, then `kvrelay serve` joining it.

`ray up configs/cluster.yaml` ends in the same state (a head started by `ray start --head`), so this is
the part of that path a CPU machine can check: serve joins an existing Ray instead of starting its own,
serves, and on SIGTERM leaves the external Ray running (it does not own it).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from serve_proc import ray_head, serving_cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

CONFIG = """
model: {name: tiny, dummy: true, seed: 0, max_context: 1024}
prefill: {workers: 1, max_prompt_tokens: 512}
decode: {workers: 1, max_batch: 4, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
ray: {address: null, namespace: kvrelay-join-test}
device: cpu
"""


def test_serve_joins_a_ray_head_started_by_hand(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG)
    # Loopback only: in the children's environment (serve_proc.child_env) Ray binds every listener to 127.0.0.1.
    with ray_head() as head, serving_cli(str(cfg), "--address", head.address, env=head.env, ready_timeout_s=240,
                                         term_timeout_s=0) as served:
        serve, lines, ready, address, env = served.proc, served.lines, served.ready, head.address, head.env
        assert ready["ray"] == address

        from kvrelay.router.client import RouterClient
        from kvrelay.router.types import SamplingOptions

        with RouterClient(ready["grpc"], timeout_s=120) as client:
            got = [t for r in client.generate([5, 6, 7], SamplingOptions(temperature=0.0, max_tokens=12))
                   for t in r.token_ids]
        assert len(got) == 12

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=90) == 0, "".join(lines[-30:])
        # serve did not start this Ray, so it must leave it running.
        assert head.proc.poll() is None, "serve shut down a Ray cluster it only joined"
        probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{address}'); "
                                "print(int(ray.cluster_resources()['CPU'])); ray.shutdown()"],
                               env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=120)
        assert probe.returncode == 0 and probe.stdout.strip().splitlines()[-1] == "4", probe.stderr[-2000:]


def test_serve_with_ray_address_null_starts_its_own_ray_beside_a_leftover_head():
    """`ray.address: null` (cpu-tiny.yaml, `make demo`) starts a private Ray even when the machine has a
    head left by `ray start --head` (its address in Ray's ray_current_cluster file) and RAY_ADDRESS names
    it: joining it made ray.init refuse serve's num_cpus and serve die."""
    with ray_head(current=True) as head:
        assert (Path(head.env["RAY_TMPDIR"]) / "ray" / "ray_current_cluster").read_text().strip() == head.address
        env = {**head.env, "RAY_ADDRESS": head.address}
        with serving_cli("cpu-tiny.yaml", "--grpc-port", "0", "--http-port", "0", env=env, ready_timeout_s=240,
                         term_timeout_s=0) as served:
            assert served.ready["ray"] != head.address

            from kvrelay.router.client import RouterClient
            from kvrelay.router.types import SamplingOptions

            with RouterClient(served.ready["grpc"], timeout_s=120) as client:
                got = [t for r in client.generate([5, 6, 7], SamplingOptions(temperature=0.0, max_tokens=4))
                       for t in r.token_ids]
            assert len(got) == 4
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(timeout=90) == 0, "".join(served.lines[-30:])
        assert head.proc.poll() is None, "serve stopped the head it should have left alone"
