"""Ray start-up and placement of the worker actors.

Each worker gets its own placement group: one bundle per rank of its TP/EP group (a GPU, or one logical
CPU on the CPU preset), STRICT_PACK so the ranks of one worker share a node (their collectives need
NVLink, not the network, and their rendezvous is on loopback). The worker actor placed here is rank 0;
it starts its other ranks in bundles 1.. itself (prefill_worker/ranks.py, decode_worker/ranks.py). On the
CPU preset Ray itself is pinned to 127.0.0.1: nothing it starts listens anywhere else, and UCX is told to
use the loopback device only.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from kvrelay.cluster import signals
from kvrelay.cluster.topology import Topology
from kvrelay.transfer.ucx import UcxSettings

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
COLOCATED = "colocated"  # one actor per GPU serving both roles (decode_worker/colocated.py)


def roles(topology: Topology) -> tuple[str, ...]:
    """The kinds of worker actor a topology starts."""
    return (COLOCATED,) if topology.colocate else ROLES


def section(topology: Topology, role: str):
    """The topology section that sizes a role's workers (a colocated worker counts as a decode one)."""
    return topology.decode if role == COLOCATED else getattr(topology, role)


def actor_name(role: str, rank: int) -> str:
    return f"kvrelay-{role}-{rank}"


def on_loopback(topology: Topology) -> bool:
    """Everything stays on 127.0.0.1: the CPU preset, and any single-machine topology whose router
    serves loopback only (a private Ray, nothing to reach from elsewhere: GPU tests, local benchmarks)."""
    return topology.device == "cpu" or (topology.ray.address is None and topology.router.host.startswith("127."))


def ucx_settings(topology: Topology) -> UcxSettings:
    """UCX's transports for every worker of this topology; the loopback device only when everything
    stays on 127.0.0.1 (see on_loopback)."""
    return UcxSettings(topology.kv_transfer.ucx_tls, "lo" if on_loopback(topology) else None)


def worker_env(topology: Topology) -> dict[str, str]:
    """Environment for every worker process (UCX reads it when the first NIXL agent starts)."""
    from kvrelay.workers import logs

    env = {**ucx_settings(topology).env(), **logs.worker_env()}  # and the router's log format
    if on_loopback(topology):
        env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    return env


def loopback_env(topology: Topology) -> None:
    """Pin Ray and UCX to loopback (see on_loopback). Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once,
    when it is first imported, so this must run before any `import ray` in the process; with it, every
    Ray listener (GCS, raylet, object manager, workers) binds 127.0.0.1."""
    if on_loopback(topology):
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


def prepare_ray_env(topology: Topology, address: str | None = None) -> None:
    """Environment Ray reads once, at import: call before the first `import ray` in the process."""
    loopback_env(topology)
    if (address if address is not None else topology.ray.address) is not None:
        # Heads started by `ray start --head` (Ray >= 2.5x) use token auth by default; a driver that joins
        # presents the token (~/.ray/auth_token) only when told the mode. RAY_AUTH_MODE=disabled opts out.
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def init_ray(topology: Topology, *, address: str | None = None) -> bool:
    """Start or join Ray. Returns True if this call started a private local instance."""
    prepare_ray_env(topology, address)
    import ray
    from ray._private import ray_constants

    if on_loopback(topology) and ray_constants.ENABLE_RAY_CLUSTER:
        log.warning("ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set; some Ray "
                    "listeners may bind a non-loopback address (set it in the environment)")

    if ray.is_initialized():
        return False
    address = address if address is not None else topology.ray.address
    local = address is None
    kwargs: dict[str, Any] = dict(namespace=topology.ray.namespace, include_dashboard=False,
                                  runtime_env={"env_vars": worker_env(topology),
                                               # each worker process logs as the router does (workers/logs.py)
                                               "worker_process_setup_hook": "kvrelay.workers.logs.setup_worker"},
                                  log_to_driver=True)
    if on_loopback(topology):
        kwargs["_node_ip_address"] = "127.0.0.1"
    if local:
        if topology.device == "cpu":
            # Logical CPUs: one per rank plus slack; the ranks are mostly waiting on each other.
            kwargs["num_cpus"] = sum(len(bundles(topology, role)) * section(topology, role).workers
                                     for role in roles(topology)) + 2
        if os.environ.get("RAY_ADDRESS"):
            log.info("RAY_ADDRESS=%s ignored: ray.address is null, so a private Ray starts (--address joins)",
                     os.environ["RAY_ADDRESS"])
        # "local", not None: with None Ray joins whatever RAY_ADDRESS or /tmp/ray/ray_current_cluster names
        # (a leftover `ray start --head`), and then refuses our num_cpus; "local" always starts a new one.
        # Ray reads RAY_ADDRESS only for None and "auto", so the private cluster wins over it too.
        kwargs["address"] = "local"
    else:
        kwargs.pop("include_dashboard")
        kwargs["address"] = address
    with signals.kept_through_ray_init():  # `kvrelay serve`'s start-up handler stays (cluster/signals.py)
        ray.init(**kwargs)
    return local


@dataclass(frozen=True)
class WorkerSlot:
    role: str
    rank: int
    placement_group: Any
    bundle_count: int


def bundles(topology: Topology, role: str) -> list[dict[str, float]]:
    """One bundle per rank of a worker ("EPn TPn" is n ranks, so tp counts them for decode too)."""
    tp = section(topology, role).tp
    if topology.device == "cpu":
        return [{"CPU": 1} for _ in range(tp)]
    return [{"GPU": gpu_share(topology, role), "CPU": 1} for _ in range(tp)]


def gpu_share(topology: Topology, role: str) -> float:
    """The GPU a worker rank asks Ray for: a whole one, or its pool's gpu_memory_fraction where the pools
    share GPUs (Ray then packs a prefill and a decode process on one GPU, never over 1 in sum, which is
    what keeps their memory shares within the GPU however Ray places them)."""
    share = section(topology, role).gpu_memory_fraction if topology.shares_gpus else None
    return 1 if share is None else share


def rank_names(topology: Topology, role: str, worker: int) -> list[str]:
    """Actor names of a worker's ranks, rank 0 first (the followers take the leader's name + -tpN)."""
    lead = actor_name(role, worker)
    return [lead] + [f"{lead}-tp{r}" for r in range(1, section(topology, role).tp)]


def check_supported(topology: Topology) -> None:
    """Refuse what the workers cannot run before any actor starts (an uneven head or expert split)."""
    from kvrelay.engine.config import load_model_config
    from kvrelay.engine.partition import check_partition

    cfg = load_model_config(topology.model.name)
    for role in ROLES:
        tp = getattr(topology, role).tp
        ep = topology.decode.ep if role == "decode" else tp
        if tp > 1:
            check_partition(cfg, tp, expert_parallel=ep == tp)


class NotEnoughResources(RuntimeError):
    """The Ray cluster lacks the GPUs (or CPUs) the topology's workers ask for."""


def check_resources(topology: Topology, have: dict[str, float]) -> None:
    """Refuse at once what Ray could only wait for: more GPUs or CPUs than the cluster has (a placement
    group that cannot be placed waits until the start-up timeout, with no word of why)."""
    need: dict[str, float] = {}
    for role in roles(topology):
        for _ in range(section(topology, role).workers):
            for b in bundles(topology, role):
                for k, v in b.items():
                    need[k] = need.get(k, 0.0) + v
    for k in ("GPU", "CPU"):
        if need.get(k, 0.0) > have.get(k, 0.0):
            key = "gpus" if k == "GPU" else "device"
            raise NotEnoughResources(
                f"{key}: the workers need {need[k]:g} {k}s ({describe_need(topology)}) but the Ray cluster has "
                f"{have.get(k, 0.0):g}" + (" (no GPU is visible here: use a cpu topology, or "
                                            "`kvrelay serve MODEL --device cpu`)" if k == "GPU" and not have.get(k) else ""))


def describe_need(topology: Topology) -> str:
    parts = [f"{section(topology, r).workers} {r} worker(s) x {section(topology, r).tp} rank(s)" for r in roles(topology)]
    return ", ".join(parts)


def pg_name(role: str, rank: int) -> str:
    return f"{actor_name(role, rank)}-pg"


def place(topology: Topology, timeout_s: float = 120.0, *, detached: bool = False) -> list[WorkerSlot]:
    """Create and wait for one placement group per worker."""
    import ray
    from ray.util.placement_group import placement_group

    check_resources(topology, ray.cluster_resources())
    slots = []
    for role in roles(topology):
        for rank in range(section(topology, role).workers):
            b = bundles(topology, role)
            pg = placement_group(b, strategy="STRICT_PACK", name=pg_name(role, rank),
                                 lifetime="detached" if detached else None)
            slots.append(WorkerSlot(role, rank, pg, len(b)))
    ready = ray.get([s.placement_group.ready() for s in slots], timeout=timeout_s)
    assert len(ready) == len(slots)
    return slots


def actor_options(topology: Topology, slot: WorkerSlot, *, detached: bool = False) -> dict[str, Any]:
    """`detached`: the actor outlives the router process that made it (a joined Ray cluster: a router
    restarted after a crash re-attaches to it, cluster/serve.py)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    opts: dict[str, Any] = dict(
        name=actor_name(slot.role, slot.rank), namespace=topology.ray.namespace,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            slot.placement_group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True),
        # Ray does not restart a dead worker behind the same handle: the engine client sees the death at
        # once (its requests resume elsewhere or wait, bounded), and cluster/supervisor.py starts a
        # replacement visibly (`kvrelay status`: restarting, restarts).
        max_restarts=0, runtime_env={"env_vars": worker_env(topology)},
    )
    if detached:
        opts["lifetime"] = "detached"
    if topology.device == "cpu":
        opts["num_cpus"] = 1
    else:
        opts.update(num_cpus=1, num_gpus=gpu_share(topology, slot.role))
    if slot.role == "prefill":
        # release/status/health must answer while a prompt runs (worker.py serialises prefills itself).
        opts["max_concurrency"] = 16
    else:  # decode or colocated
        opts["max_concurrency"] = 1000  # async actor: one coroutine per open stream
    return opts
