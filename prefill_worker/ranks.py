"""The ranks of a TP prefill worker: rank 0 (the `PrefillWorker` actor, the leader) and N-1 followers.

Every rank is its own Ray actor in the worker's placement group (one bundle per GPU, or per logical CPU
on the CPU preset) holding its shard of the model and its own KV pool behind its own NIXL agent. The
leader alone talks to the router, decides what runs, samples (the model all-gathers full-vocab logits
on every rank) and owns the leases; followers only mirror the leader's KV-changing Runner calls.

Lockstep without a step protocol: the leader sends each engine op to every follower as a Ray call and
then runs it itself, so the collectives inside the forward meet; it waits for all of them before the
next op. Followers therefore see ops in the leader's order and, since every rank's page allocator
starts empty and sees the same calls, hand out the same page ids (checked, not assumed).

decode_worker/ranks.py has the same group plumbing: the two workers never import each other.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from kvrelay.engine.kv_cache import OutOfPages

T = TypeVar("T")
# Errors the Runner raises while checking a call, before any collective (bad ids, unknown or duplicate
# sequence, no free pages): every rank raises them alike, so they reject the request, not the group.
REQUEST_ERRORS: tuple[type[BaseException], ...] = (ValueError, LookupError, OutOfPages)
_STARTUP_S = 300.0


@dataclass(frozen=True)
class RankStatus:
    """`kvrelay status` row of a follower rank."""

    rank: int  # the worker's index in its pool
    tp_rank: int
    tp_size: int
    pid: int
    node: str
    healthy: bool
    pages_in_use: dict[str, int]
    pages_total: dict[str, int]
    agent: str
    role: str = "prefill"


def join_group(topology, tp_rank: int, port: int):
    """This rank's ParallelContext in its worker's group. The ranks of a worker share a node (STRICT_PACK),
    so the rendezvous is always on loopback."""
    import torch

    from kvrelay.engine.parallel import init_parallel

    tp = topology.prefill.tp
    if topology.device == "cpu":
        torch.set_num_threads(1)  # N ranks on a few cores: oversubscription makes gloo crawl
    device = "cuda" if topology.device == "cuda" else "cpu"
    return init_parallel(tp_rank, tp, "127.0.0.1", port, device=device, expert_parallel=True,
                         timeout_s=_STARTUP_S)


def spawn_followers(cls: type, topology, worker: int, port: int) -> list:
    """Start ranks 1..tp-1 of this (leader) actor's worker, one per bundle of its placement group."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    tp = topology.prefill.tp
    ctx = ray.get_runtime_context()
    pg = get_current_placement_group()
    name = ctx.get_actor_name()
    env = {k: os.environ[k] for k in ("UCX_TLS", "UCX_NET_DEVICES", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
           if k in os.environ}
    followers = []
    for r in range(1, tp):
        opts: dict[str, Any] = dict(max_restarts=0, max_concurrency=4, runtime_env={"env_vars": env},
                                    num_cpus=1 if pg is not None else 0)
        if topology.device == "cuda":
            opts["num_gpus"] = 1
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
        if name:  # named like the leader, so `kvrelay status` finds every rank
            opts.update(name=f"{name}-tp{r}", namespace=ctx.namespace)
        followers.append(ray.remote(cls).options(**opts).remote(topology, worker, r, port))
    return followers


class Followers:
    """The leader's handle on its follower ranks: runs one engine op on all ranks in lockstep."""

    def __init__(self, actors: list):
        self.actors = actors
        self._started: list = []

    def join(self, join: Callable[[], T], timeout_s: float = _STARTUP_S) -> T:
        """Run the leader's rendezvous (`join`) while watching the followers start: one that fails
        before it joins (bad config, no memory) is reported at once, not after the rendezvous times out."""
        import ray

        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["ctx"] = join()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box["error"] = e

        thread = threading.Thread(target=run, name="rank-join", daemon=True)
        thread.start()
        self._started = [a.health.remote() for a in self.actors]
        while thread.is_alive():
            done, _ = ray.wait(self._started, num_returns=len(self._started), timeout=0.5)
            for ref in done:
                ray.get(ref)  # raises the follower's constructor error
            thread.join(0.0)
        if "error" in box:
            raise box["error"]
        return box["ctx"]

    def wait_ready(self, timeout_s: float = _STARTUP_S) -> None:
        """Every follower finished its constructor (model shard loaded, NIXL agent up)."""
        import ray

        ray.get(self._started, timeout=timeout_s)

    def run(self, method: str, args: tuple, local: Callable[[], T]) -> tuple[T, list]:
        """`method(*args)` on every follower and `local()` here, concurrently; (local result, follower
        results in rank order). The same error on every rank is re-raised as it is (a bad request);
        a rank that died, or failed alone, ends the worker (`fail`)."""
        import ray

        refs = [getattr(a, method).remote(*args) for a in self.actors]
        try:
            out = local()
        except REQUEST_ERRORS:
            # Raised before any collective: the followers refuse the same op alike (or else they no
            # longer agree with this rank).
            errs = _errors(refs)
            if len(errs) != len(refs) or not all(isinstance(getattr(x, "cause", None), REQUEST_ERRORS)
                                                 for x in errs):
                self.fail(f"{method}: rank 0 refused the op, followers answered {errs!r}")
            raise
        except BaseException as e:
            # A failed collective (a rank died, or gave up on one that did): the followers are leaving
            # too (`follower_op`) or stuck in the same collective, so there is nothing to wait for.
            self.fail(f"{method}: rank 0 failed: {e!r}")
        try:
            results = ray.get(refs)
        except Exception as e:
            self.fail(f"{method}: a follower rank failed where rank 0 did not: {e!r}")
        return out, results

    def fail(self, reason: str) -> NoReturn:
        """The ranks no longer agree on the KV they hold, or one is gone (a collective cannot complete
        without it). Neither is repairable in place and a silent restart would hide it, so the whole
        worker goes down: Ray fails its pending calls and open streams with RayActorError, which the
        client re-routes, kills the follower actors this one owns, and `kvrelay status` shows it DOWN."""
        print(f"kvrelay: TP group broken, stopping this worker: {reason}", file=sys.stderr, flush=True)
        os._exit(70)

    def shutdown(self) -> None:
        import ray

        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=10)
        except Exception:  # dead or hung ranks are killed below anyway
            pass
        for a in self.actors:
            ray.kill(a, no_restart=True)


def follower_op(fn: Callable[[], T]) -> T:
    """Run a follower's engine op. A request error is raised before any collective, on every rank alike,
    and goes back to the leader; any other failure means a collective broke (a peer is gone), and this
    rank exits at once, so its own peers' reads fail fast too instead of waiting out the gloo/NCCL
    timeout, and the leader learns it and takes the worker down."""
    try:
        return fn()
    except REQUEST_ERRORS:
        raise
    except BaseException as e:  # noqa: BLE001
        print(f"kvrelay: follower rank stopping after a failed collective: {e!r}", file=sys.stderr, flush=True)
        os._exit(70)


def _errors(refs: list) -> list[BaseException]:
    import ray

    errs = []
    for ref in refs:
        try:
            ray.get(ref)
        except Exception as e:
            errs.append(e)
    return errs


class PrefillRank:
    """A follower rank (tp_rank >= 1) of a TP prefill worker."""

    def __init__(self, topology, worker: int, tp_rank: int, port: int):
        from kvrelay.engine.kv_transfer import KVExporter, configure_ucx, layout_of
        from kvrelay.prefill_worker.worker import load_runner, pool_tokens

        configure_ucx(topology.kv_transfer.ucx_tls, "lo" if topology.device == "cpu" else None)
        self.worker, self.tp_rank, self.tp_size = worker, tp_rank, topology.prefill.tp
        self.ctx = join_group(topology, tp_rank, port)
        self.runner = load_runner(topology, kv_tokens=pool_tokens(topology), shard=self.ctx)
        layout, pools = layout_of(self.runner.kv)
        # Leases live on the leader; this exporter only registers the pool and describes pages.
        self.exporter = KVExporter(layout, pools, name_prefix=f"prefill{worker}r{tp_rank}")
        self._lock = threading.Lock()
        self._stopped = False

    def prefill(self, rid: str, prompt_ids: list[int]):
        """The leader's prefill, on this rank's shard; returns where this rank's pages are."""
        with self._lock:
            follower_op(lambda: self.runner.prefill(rid, prompt_ids))
            kv = self.runner.export_sequence(rid)
            return self.exporter.describe(kv.pages, kv.length, first_blocks=kv.first_page)

    def free(self, rid: str) -> None:
        with self._lock:
            follower_op(lambda: self.runner.free(rid))

    def health(self) -> bool:
        return not self._stopped

    def status(self) -> RankStatus:
        from kvrelay.prefill_worker.worker import node_name

        with self._lock:
            free = self.runner.free_pages()
            total = {g: a.num_pages for g, a in self.runner.kv.allocators.items()}
        return RankStatus(self.worker, self.tp_rank, self.tp_size, os.getpid(), node_name(), not self._stopped,
                          {g: total[g] - free[g] for g in total}, total, self.exporter.agent_name)

    def shutdown(self) -> None:
        self._stopped = True
        self.exporter.close()
