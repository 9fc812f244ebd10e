"""The ranks of one TP worker: rank 0 (the worker actor, the leader) and N-1 follower actors.

Both roles run the same group plumbing, so it lives here rather than in either worker (the two workers
never import each other): starting the followers in the worker's placement group, the process-group
rendezvous, running one engine op on every rank in lockstep, health, and taking the whole worker down
when its ranks stop agreeing. What each rank does with its shard (prefill and export, or import, pull
and decode) stays in prefill_worker/ranks.py and decode_worker/ranks.py. Here, not in engine/: this is
distribution over Ray actors (and the one place that takes a process down, `os._exit`), which the
engine's model and runtime know nothing of.

Every rank is its own Ray actor holding its shard of the model and its own KV pool behind its own NIXL
agent. The leader alone talks to the router, decides what runs and samples (the model all-gathers
full-vocab logits on every rank); followers only mirror the leader's KV-changing Runner calls.

Lockstep without a step protocol: the leader sends each engine op to every follower as a Ray call and
then runs it itself, so the collectives inside the forward meet; it waits for all of them before the
next op. Followers therefore see ops in the leader's order and, since every rank's page allocator
starts empty and sees the same calls, hand out the same page ids (checked by the callers, not assumed).

Ray is imported inside the functions: the roles' modules are importable (and unit-tested) without a
Ray runtime.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from kvrelay.engine.kv_cache import OutOfPages
from kvrelay.transfer import ucx
from kvrelay.workers.messages import WorkerStatus

T = TypeVar("T")
# Errors the Runner raises while checking a call, before any collective (bad ids, unknown or duplicate
# sequence, no free pages): every rank raises them alike, so they reject the request, not the group.
REQUEST_ERRORS: tuple[type[BaseException], ...] = (ValueError, LookupError, OutOfPages)
STARTUP_S = 300.0
# Forwarded to the follower actors: UCX picks its transports once per process, and Ray's own listeners
# must stay on loopback in the followers exactly as in the leader.
_FORWARDED_ENV = (*ucx.ENV_KEYS, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


def node_name() -> str:
    try:
        import ray

        node = ray.get_runtime_context().get_node_id()[:12]
    except Exception:  # outside Ray (unit tests)
        node = "local"
    return f"{socket.gethostname()}/{node}"


def join_group(device: str, tp_rank: int, tp_size: int, port: int, *, expert_parallel: bool = True):
    """This rank's ParallelContext in its worker's group. The ranks of a worker share a node (STRICT_PACK),
    so the rendezvous is always on loopback."""
    import torch

    from kvrelay.engine.parallel import init_parallel

    if device == "cpu":
        torch.set_num_threads(1)  # N ranks on a few cores: oversubscription makes gloo crawl
    return init_parallel(tp_rank, tp_size, "127.0.0.1", port, device="cuda" if device == "cuda" else "cpu",
                         expert_parallel=expert_parallel, timeout_s=STARTUP_S)


def spawn_followers(cls: type, *, device: str, tp_size: int, max_concurrency: int,
                    args: Callable[[int], tuple]) -> list:
    """Start ranks 1..tp_size-1 of this (leader) actor's worker, one per bundle of its placement group;
    `cls(*args(tp_rank))` builds each."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ctx = ray.get_runtime_context()
    pg = get_current_placement_group()
    name = ctx.get_actor_name()
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    followers = []
    for r in range(1, tp_size):
        opts: dict[str, Any] = dict(max_restarts=0, max_concurrency=max_concurrency,
                                    runtime_env={"env_vars": env}, num_cpus=1 if pg is not None else 0)
        if device == "cuda":
            opts["num_gpus"] = 1
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
        if name:  # named like the leader, so `kvrelay status` finds every rank
            opts.update(name=f"{name}-tp{r}", namespace=ctx.namespace)
        followers.append(ray.remote(cls).options(**opts).remote(*args(r)))
    return followers


def lead_group(follower_cls: type, *, device: str, tp_size: int, max_concurrency: int,
               args: Callable[[int, int], tuple], join: Callable[[int], Any],
               load: Callable[[Any], T]) -> tuple[Followers, T]:
    """Become rank 0 of a new group: start the followers (`follower_cls(*args(tp_rank, port))`), join
    the rendezvous on a free loopback port (`join(port)` -> this rank's ParallelContext) and load this
    rank's shard (`load(ctx)`) while the followers load theirs. Returns (the followers, what `load`
    returned); on any failure the followers are stopped before the error propagates."""
    from kvrelay.engine.parallel import free_port

    port = free_port("127.0.0.1")
    group = Followers(spawn_followers(follower_cls, device=device, tp_size=tp_size, max_concurrency=max_concurrency,
                                      args=lambda r: args(r, port)))
    try:
        ctx = group.join(lambda: join(port))
        loaded = load(ctx)
        group.wait_ready()
    except BaseException:
        group.shutdown()
        raise
    return group, loaded


class Followers:
    """The leader's handle on its follower ranks: runs one engine op on all ranks in lockstep."""

    def __init__(self, actors: list):
        self.actors = actors
        self._started: list = []

    def join(self, join: Callable[[], T], timeout_s: float = STARTUP_S) -> T:
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

    def wait_ready(self, timeout_s: float = STARTUP_S) -> None:
        """Every follower finished its constructor (model shard loaded, NIXL agent up)."""
        import ray

        ray.get(self._started, timeout=timeout_s)

    def run(self, method: str, args: tuple, local: Callable[[], T]) -> tuple[T, list]:
        """`method(*args)` on every follower and `local()` here, concurrently; (local result, follower
        results in rank order). The same error on every rank is re-raised as it is (a bad request);
        a rank that died, or failed alone, ends the worker (`fail`). Blocks on Ray: call it from a
        thread, never from an actor's event loop."""
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
        print(f"kvrelay: follower rank stopping (a collective failed, or this rank no longer agrees with rank 0): "
              f"{e!r}", file=sys.stderr, flush=True)
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


class FollowerRank:
    """What every follower rank actor has, whatever its role: its Runner shard, its NIXL endpoint
    (`transfer`, a KVExporter or KVImporter), health, a status row and shutdown. Subclasses join the
    group, load the shard and call `__init__`, then add their role's ops on top of `op` and `free`."""

    role = ""

    def __init__(self, worker: int, tp_rank: int, tp_size: int, runner, transfer):
        self.worker, self.tp_rank, self.tp_size = worker, tp_rank, tp_size
        self.runner = runner
        self.transfer = transfer
        # Engine ops arrive one at a time (the leader waits for each); the lock only keeps a status call
        # (or a decode rank's page lookup) from reading the cache mid-op.
        self._lock = threading.Lock()
        self._stopped = False

    def op(self, fn: Callable[[], T]) -> T:
        with self._lock:
            return follower_op(fn)

    def free(self, rid: str) -> None:
        self.op(lambda: self.runner.free(rid))

    def health(self) -> bool:
        return not self._stopped

    def status(self) -> WorkerStatus:
        with self._lock:
            free = self.runner.free_pages()
            total = {g: a.num_pages for g, a in self.runner.kv.allocators.items()}
        return WorkerStatus(role=self.role, rank=self.worker, tp_rank=self.tp_rank, tp_size=self.tp_size,
                            pid=os.getpid(), node=node_name(), healthy=not self._stopped,
                            pages_in_use={g: total[g] - free[g] for g in total}, pages_total=total,
                            agent=self.transfer.agent_name)

    def shutdown(self) -> None:
        self._stopped = True
        self.transfer.close()
