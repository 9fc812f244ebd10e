"""Prefill worker: one prompt at a time, then the KV stays pinned for the decode side to pull.

Runs as a threaded Ray actor (cluster/serve.py wraps it with `ray.remote`): `prefill` calls queue on one
lock, since prefill is compute-bound at batch 1 and overlapping two prompts only slows both, while
`release`/`stats`/`health` answer at once from other threads even during a long prompt. A release
therefore never touches the Runner itself (a prefill may be mid-forward); it queues the sequence, and
whoever holds the engine next frees it.

With `prefill.tp` > 1 this actor is rank 0 of the worker's group and starts the other ranks itself
(ranks.py, over engine/rank_group.py): every prefill and free runs on all of them in lockstep, the
handle lists every rank's pages under one lease, and the pages are freed on all ranks once that lease
is released or reclaimed.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass

from kvrelay.engine.kv_transfer import KVExporter, KVHandle, configure_ucx, layout_of
from kvrelay.engine.rank_group import Followers, join_group, lead_group, node_name
from kvrelay.engine.rank_group import load_runner as _load_runner
from kvrelay.engine.sampling import SamplingParams, TokenOutput, finish_reason
from kvrelay.prefill_worker.ranks import PrefillRank


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first: TokenOutput  # the sampled token; finish_reason set if the request ends with it
    handle: KVHandle | None  # None when the request already finished (nothing to decode)
    prompt_tokens: int
    queue_s: float  # waiting for the worker (other prompts ahead)
    prefill_s: float  # forward + sampling + pinning


@dataclass(frozen=True)
class PrefillStatus:
    rank: int
    pid: int
    node: str  # host name / Ray node id prefix
    healthy: bool
    pages_in_use: dict[str, int]
    pages_total: dict[str, int]
    queued_tokens: int  # prompt tokens waiting or running
    leases: int  # pinned sequences awaiting a pull
    completed: int
    expired_leases: int
    agent: str
    role: str = "prefill"
    tp_rank: int = 0
    tp_size: int = 1


def pool_tokens(topology) -> int:
    """Room for a few prompts in flight: one running plus the ones whose KV still waits for a pull."""
    return 4 * topology.prefill.max_prompt_tokens


def load_runner(topology, kv_tokens: int, shard=None):
    """This worker's Runner (this rank's shard of it when `shard` is a TP rank's ParallelContext)."""
    # decode's page size: both pools must share it for pages to be copyable.
    return _load_runner(topology.model, device=topology.device, page_size=topology.decode.page_size,
                        kv_tokens=kv_tokens, shard=shard)


class PrefillWorker:
    def __init__(self, topology, rank: int = 0, *, lease_seconds: float | None = None):
        configure_ucx(topology.kv_transfer.ucx_tls, "lo" if topology.device == "cpu" else None)
        self.rank = rank
        self.max_prompt_tokens = topology.prefill.max_prompt_tokens
        self.max_context = topology.model.max_context
        self.tp_size = topology.prefill.tp
        self.group: Followers | None = None  # ranks 1.. of a TP group; None at TP1
        if self.tp_size == 1:
            self.runner = load_runner(topology, kv_tokens=pool_tokens(topology))
        else:
            self.group, self.runner = lead_group(
                PrefillRank, device=topology.device, tp_size=self.tp_size, max_concurrency=4,
                args=lambda r, port: (topology, rank, r, port),
                join=lambda port: join_group(topology.device, 0, self.tp_size, port),
                load=lambda ctx: load_runner(topology, kv_tokens=pool_tokens(topology), shard=ctx))
        layout, pools = layout_of(self.runner.kv)
        lease = topology.kv_transfer.lease_seconds if lease_seconds is None else lease_seconds
        self.exporter = KVExporter(layout, pools, lease_seconds=lease, grace_seconds=min(5.0, lease),
                                   name_prefix=f"prefill{rank}")
        self._run_lock = threading.Lock()  # one prompt at a time
        self._engine_lock = threading.Lock()  # Runner/KVCache are not thread-safe
        self._to_free: collections.deque[str] = collections.deque()
        self._queued_tokens = 0
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="lease-reaper", daemon=True)
        self._reaper.start()
        self.completed = 0

    # ---- the request path --------------------------------------------------------------------
    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                generated: int = 0) -> PrefillResult:
        """Prefill `prompt_ids` and sample the request's next token (its `generated`-th, 0-based: a
        retried request re-prefills prompt + tokens already streamed and continues from there)."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError(f"request {request_id}: empty prompt")
        if n > self.max_prompt_tokens + generated or n >= self.max_context:
            raise ValueError(f"request {request_id}: prompt of {n} tokens exceeds this worker's limit "
                             f"({self.max_prompt_tokens} prompt tokens, {self.max_context} context)")
        t_arrive = time.perf_counter()
        with self._count_lock:
            self._queued_tokens += n
        try:
            with self._run_lock:
                t_start = time.perf_counter()
                result = self._prefill(request_id, prompt_ids, params, generated)
                t_end = time.perf_counter()
        finally:
            with self._count_lock:
                self._queued_tokens -= n
        self.completed += 1
        return PrefillResult(request_id, result[0], result[1], n, t_start - t_arrive, t_end - t_start)

    def _prefill(self, rid: str, prompt_ids: list[int], params: SamplingParams, generated: int):
        deadline = time.monotonic() + self.exporter.lease_seconds + self.exporter.grace_seconds + 1
        while True:
            with self._engine_lock:
                self._drain_frees()
                if self.runner.has_sequence(rid):
                    raise ValueError(f"request {rid}: already being prefilled on this worker")
                if self.runner.can_admit(len(prompt_ids)):  # every rank's allocator is in the same state
                    logits, peers = self._run_prefill(rid, prompt_ids)
                    (token, logprob), = self.runner.sample(logits, [params], [generated])
                    break
            # Pages are held by leases that decode has not pulled yet; they come back on release or
            # expiry, both bounded by the lease, so this wait is bounded too.
            if time.monotonic() > deadline:
                raise RuntimeError(f"request {rid}: prefill worker {self.rank} has no free KV pages for "
                                   f"{len(prompt_ids)} tokens ({self.exporter.active_leases()} leases held)")
            time.sleep(0.005)
        reason = finish_reason(token, generated + 1, params)
        if reason is None and len(prompt_ids) + 1 >= self.max_context:
            reason = "length"
        first = TokenOutput(token, logprob, reason)
        if reason is not None:
            with self._engine_lock:
                self._free(rid)
            return first, None
        with self._engine_lock:
            kv = self.runner.export_sequence(rid)
        handle = self.exporter.pin(rid, kv.pages, kv.length, first_blocks=kv.first_page,
                                   on_release=lambda: self._queue_free(rid), peers=peers)
        return first, handle

    # ---- engine ops (under the engine lock; on every rank of a TP group) ---------------------
    def _run_prefill(self, rid: str, prompt_ids: list[int]) -> tuple:
        if self.group is None:
            return self.runner.prefill(rid, prompt_ids), ()
        logits, peers = self.group.run("prefill", (rid, prompt_ids), lambda: self.runner.prefill(rid, prompt_ids))
        # Same calls in the same order leave every rank's allocator in the same state; a difference
        # would mean the ranks no longer agree on what is where, so stop trusting this group.
        kv = self.runner.export_sequence(rid)
        own = self.exporter.describe(kv.pages, kv.length, first_blocks=kv.first_page)
        for shard in peers:
            if [g.page_ids for g in shard.groups] != [g.page_ids for g in own.groups]:
                self.group.fail(f"request {rid}: rank {shard.tp_rank} holds other pages than rank 0")
        return logits, tuple(peers)

    def _free(self, rid: str) -> None:
        if self.group is None:
            self.runner.free(rid)
        else:
            self.group.run("free", (rid,), lambda: self.runner.free(rid))

    def release(self, lease_id: int) -> bool:
        """Decode pulled the pages (or gave up): unpin. False if the lease had already expired."""
        return self.exporter.release(lease_id)

    # ---- freeing pages without blocking the caller -------------------------------------------
    def _queue_free(self, rid: str) -> None:
        self._to_free.append(rid)
        if self._engine_lock.acquire(blocking=False):
            try:
                self._drain_frees()
            finally:
                self._engine_lock.release()

    def _drain_frees(self) -> None:
        while self._to_free:
            self._free(self._to_free.popleft())

    def _reap_loop(self) -> None:
        while not self._stop.wait(0.25):
            self.exporter.reap()
            if self._to_free and self._engine_lock.acquire(timeout=0.1):
                try:
                    self._drain_frees()
                finally:
                    self._engine_lock.release()

    # ---- introspection -----------------------------------------------------------------------
    def health(self) -> bool:
        return not self._stop.is_set()

    def queued_tokens(self) -> int:
        return self._queued_tokens

    def status(self) -> PrefillStatus:
        with self._engine_lock:
            self._drain_frees()
            free = self.runner.free_pages()
            total = {g: a.num_pages for g, a in self.runner.kv.allocators.items()}
        return PrefillStatus(
            rank=self.rank, pid=os.getpid(), node=node_name(), healthy=self.health(),
            pages_in_use={g: total[g] - free[g] for g in total}, pages_total=total,
            queued_tokens=self._queued_tokens, leases=self.exporter.active_leases(),
            completed=self.completed, expired_leases=self.exporter.expired_count,
            agent=self.exporter.agent_name, tp_size=self.tp_size)

    def shutdown(self) -> None:
        self._stop.set()
        self.exporter.close()
        with self._engine_lock:
            try:
                self._drain_frees()
            finally:
                if self.group is not None:
                    self.group.shutdown()
