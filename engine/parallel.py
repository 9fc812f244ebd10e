"""Tensor and expert parallelism: process groups and the collectives the model needs (which rank holds
which heads, experts and vocabulary is engine/partition.py, torch-free, shared with the topology check).

One process (a Ray actor on a cluster, a spawned process on CPU) runs each rank of a worker's group.
Rank 0 is the group leader: it picks the rendezvous address (its own host and a free port) and the
other ranks connect to it, so a worker needs no port assigned by the topology. GPUs use NCCL, CPUs use
gloo; the model code only ever sees a `ParallelContext` and calls its collectives, which are no-ops at
world 1 so the single-process path pays nothing.

"EPn TPn" means n ranks: attention heads, experts and the vocabulary are partitioned over the same n
ranks. Hidden states stay replicated on every rank (TP-only MoE dispatch/combine), so the only
communication is one all-reduce after attention, one after the MoE, one after the embedding lookup and
an all-gather of the logits.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvrelay.engine.partition import ParallelConfigError, shard_range


# ---------------------------------------------------------------------------------------------------
# The context handed to the model
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in its worker's group. `group` None means torch.distributed's default group
    (each rank process belongs to exactly one worker, so the default group is the worker's group).

    `expert_parallel` picks the MoE split: True ("EPn TPn") gives each rank whole experts; False
    ("EP1 TPn") gives each rank a slice of every expert's intermediate dimension. Either way the MoE
    ends in one all-reduce."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    expert_parallel: bool = True

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ParallelConfigError(f"rank {self.rank} is outside a group of {self.world_size}")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def span(self, total: int, what: str = "items") -> tuple[int, int]:
        return shard_range(total, self.rank, self.world_size, what)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(x, self)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather(x, self, dim=-1)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


SINGLE = ParallelContext()


def all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum x over the group, in place (and returned). A no-op at world 1."""
    if ctx.world_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=ctx.group)
    return x


def all_gather(x: torch.Tensor, ctx: ParallelContext, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x (same shape on all ranks) along `dim` in rank order: the vocab-sharded
    logits become full logits on every rank, so each rank can sample the same token."""
    if ctx.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ctx.world_size)]
    dist.all_gather(parts, x.contiguous(), group=ctx.group)
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: Any, ctx: ParallelContext, src: int = 0) -> Any:
    """The leader's Python object on every rank (e.g. the sampled token ids when only rank 0 samples)."""
    if ctx.world_size == 1:
        return obj
    box = [obj if ctx.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=ctx.group)
    return box[0]


def held_tensor_bytes(root: Any) -> int:
    """Bytes of the distinct tensors reachable from `root` through attributes, lists and dicts: a
    model's per-rank weight memory, measured on what it holds rather than what it was meant to load."""
    seen: set[int] = set()
    stack, total = [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            stack.extend(vars(obj).values())
    return total


# ---------------------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on `host`. The leader calls this and passes (host, port) to the
    other ranks; the tiny race with another process taking it shows up as a rendezvous error."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_parallel(rank: int, world_size: int, master_addr: str, master_port: int, *,
                  device: str | torch.device = "cpu", expert_parallel: bool = True,
                  timeout_s: float = 300.0) -> ParallelContext:
    """Join the worker's group as `rank` (blocks until every rank has joined or `timeout_s` passes).
    World 1 creates no process group at all, so a single-GPU worker has no rendezvous to fail."""
    if world_size == 1:
        return ParallelContext(0, 1, None, expert_parallel)
    backend = backend_for(device)
    if backend == "nccl":
        # Before init so NCCL's communicator binds the right GPU (one rank per GPU in this process).
        torch.cuda.set_device(torch.device(device))
    elif master_addr in ("127.0.0.1", "localhost"):
        # gloo otherwise picks the interface the hostname resolves to, which on some hosts is not
        # reachable from itself; loopback is right whenever the leader is local.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelContext(rank, world_size, None, expert_parallel)


def shutdown_parallel(ctx: ParallelContext) -> None:
    if ctx.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# Local multi-process runner (CPU tests, `kvrelay generate --tp N` on CPU)
# ---------------------------------------------------------------------------------------------------


class RankFailed(RuntimeError):
    """A rank raised, died, or did not finish in time; carries that rank's traceback."""


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, expert_parallel: bool,
               results) -> None:
    try:
        torch.set_num_threads(1)  # N ranks on a small CPU box: oversubscription makes gloo crawl
        ctx = init_parallel(rank, world, "127.0.0.1", port, device="cpu", expert_parallel=expert_parallel,
                            timeout_s=120.0)
        try:
            # Plain pickle copies tensors by value; the queue's own pickler would pass them as shared
            # memory handles that die with this process, which may exit before the parent reads them.
            results.put((rank, True, pickle.dumps(fn(ctx, *args))))
        finally:
            shutdown_parallel(ctx)
    except BaseException:  # noqa: BLE001 - the parent must hear about every failure, or it waits
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = 120.0,
              expert_parallel: bool = True) -> list[Any]:
    """Run `fn(ctx, *args)` on `world` spawned CPU processes joined by gloo over 127.0.0.1 and return
    their results in rank order. `fn` and its results must be picklable (a module-level function).
    Raises RankFailed with the first failing rank's traceback, or on timeout; all ranks are stopped."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, expert_parallel, results),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailed(f"ranks {sorted(set(range(world)) - set(out))} did not finish in {timeout_s} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    raise RankFailed(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}") from None
                continue
            if not ok:
                raise RankFailed(f"rank {rank} of {world} failed:\n{value}")
            out[rank] = pickle.loads(value)
        return [out[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
