"""Prefill worker: one prompt at a time, then the KV stays pinned for the decode side to pull.

Runs as a threaded Ray actor (cluster/serve.py wraps it with `ray.remote`), built from its `PrefillSpec`
(workers/specs.py), which is all it knows of the topology: `prefill` calls queue on one
lock, since prefill is compute-bound at batch 1 and overlapping two prompts only slows both, while
`release`/`stats`/`health` answer at once from other threads even during a long prompt. A release
therefore never touches the Runner itself (a prefill may be mid-forward); it queues the sequence, and
whoever holds the engine next frees it.

With `prefill.tp` > 1 this actor is rank 0 of the worker's group and starts the other ranks itself
(ranks.py, over workers/rank_group.py): every prefill and free runs on all of them in lockstep, the
handle lists every rank's pages under one lease, and the pages are freed on all ranks once that lease
is released or reclaimed. With the prefix cache each rank keeps the same cache over its own KV heads
(ranks.py `begin_cached`/`finish_cached`); the counters, the status row and cached_tokens are this rank's, once per
group.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass

from kvrelay.engine.sampling import (PROMPT_LOGPROB_CHUNK, PromptLogprobs, SamplingParams, TokenOutput,
                                     finish_reason_at, prompt_logprobs, top_logprobs)
from kvrelay.engine.structured import masks_for, sample_constrained
from kvrelay.prefill_worker.ranks import PrefillRank, begin_cached, finish_cached, load_rank_runner
from kvrelay.transfer.handle import layout_of
from kvrelay.transfer.nixl import KVExporter
from kvrelay.workers.loading import load_sized_runner
from kvrelay.workers.forks import any_continues, sample_forks
from kvrelay.workers.logs import REQUEST_LOG, request_extra
from kvrelay.workers.messages import PrefillResult, WorkerStatus
from kvrelay.workers.rank_group import Followers, join_group, lead_group, node_name
from kvrelay.workers.specs import PrefillSpec, check_prompt_limits

req_log = logging.getLogger(REQUEST_LOG)  # per-request lines, with --log-requests (workers/logs.py)


class _NoRoom(Exception):
    """A batch of prompts does not fit the free pages (run one by one instead)."""


@dataclass(eq=False)
class _Job:
    """One caller's prompt while it waits for (or rides along in) a prefill forward."""

    request_id: str
    ids: list[int]
    params: SamplingParams
    generated: int
    result: tuple | None = None
    error: BaseException | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    cached: int = 0  # prompt tokens the prefix cache supplied
    forks: tuple[SamplingParams, ...] = ()  # choices 1..n-1 of the same prompt (workers/forks.py)
    cached_host: int = 0  # ... of them, those its host tier held


class PrefillWorker:
    def __init__(self, spec: PrefillSpec, rank: int = 0, *, lease_seconds: float | None = None):
        spec.ucx.apply()
        self.rank = rank
        self.max_prompt_tokens = spec.max_prompt_tokens
        self.max_context = spec.model.max_context
        self.tp_size = spec.tp
        self.group: Followers | None = None  # ranks 1.. of a TP group; None at TP1
        self.chunk_tokens = spec.chunk_tokens
        self.plan_log: list[str] = []
        if self.tp_size == 1:
            # Sized after the weights (engine/memory.py): room for a few prompts in flight, at least one
            # of max_prompt_tokens, in what the weights and one chunk's activations leave free.
            self.runner = load_sized_runner(
                spec.model, device=spec.device, page_size=spec.page_size,
                fraction=0.9, max_seqs=64, chunk_tokens=min(self.chunk_tokens, self.max_prompt_tokens),
                max_tokens=spec.pool_tokens, need_tokens=self.max_prompt_tokens,
                key="prefill.max_prompt_tokens", graph_sizes=(), log=self.plan_log.append,
                cache_share=spec.prefix_cache_sliding_share, gpu_share=spec.gpu_memory_fraction,
                share_key="prefill.gpu_memory_fraction")
        else:
            self.group, self.runner = lead_group(
                PrefillRank, device=spec.device, tp_size=self.tp_size, max_concurrency=4,
                args=lambda r, port: (spec, rank, r, port),
                join=lambda port: join_group(spec.device, 0, self.tp_size, port),
                load=lambda ctx: load_rank_runner(spec, ctx))
        for line in self.plan_log:
            print(f"kvrelay: prefill worker {rank}: {line}", flush=True)
        # A TP group's ranks enabled theirs as they loaded (load_rank_runner): this is rank 0's, the same.
        self.prefix = self.runner.kv.enable_prefix_cache(spec.prefix_cache_host_bytes) if spec.prefix_cache else None
        layout, pools = layout_of(self.runner.kv)
        lease = spec.lease_seconds if lease_seconds is None else lease_seconds
        self.exporter = KVExporter(layout, pools, lease_seconds=lease, grace_seconds=min(5.0, lease),
                                   name_prefix=f"prefill{rank}")
        self._run_lock = threading.Lock()  # one prompt at a time
        self._running_since: float | None = None  # the current prefill run's start or last progress (step_stall_s)
        self._debug_stall_s = 0.0  # debug_stall_steps
        self._engine_lock = threading.Lock()  # Runner/KVCache are not thread-safe
        self._to_free: collections.deque[str] = collections.deque()
        self._queued_tokens = 0
        self._queue: collections.deque[_Job] = collections.deque()
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="lease-reaper", daemon=True)
        self._reaper.start()
        self.completed = 0

    # ---- the request path --------------------------------------------------------------------
    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                generated: int = 0, forks: tuple[SamplingParams, ...] = ()) -> PrefillResult:
        """Prefill `prompt_ids` and sample the request's next token (its `generated`-th, 0-based: a
        retried request re-prefills prompt + tokens already streamed and continues from there). `forks`:
        the other choices of an n > 1 request, whose first tokens come from the same forward
        (`PrefillResult.forks`); the KV is pinned while any choice goes on."""
        n = len(prompt_ids)
        check_prompt_limits(request_id, n, generated, self.max_prompt_tokens, self.max_context)
        t_arrive = time.perf_counter()
        job = _Job(request_id, list(prompt_ids), params, generated, forks=tuple(forks))
        with self._count_lock:
            self._queued_tokens += n
            self._queue.append(job)
        try:
            # Whoever holds the run lock prefills every queued prompt that fits one forward, its own
            # and those of the callers waiting behind it (several short prompts per forward when a
            # queue forms: prefill is then compute-bound at a larger, more efficient batch).
            while job.result is None and job.error is None:
                with self._run_lock:
                    if job.result is None and job.error is None:
                        self._running_since = time.monotonic()  # step_stall_s
                        try:
                            if self._debug_stall_s:  # debug_stall_steps: as a forward stuck on the device
                                stall, self._debug_stall_s = self._debug_stall_s, 0.0
                                time.sleep(stall)
                            self._run_jobs(self._take_jobs())
                        finally:
                            self._running_since = None
        finally:
            with self._count_lock:
                self._queued_tokens -= n
                if job in self._queue:
                    self._queue.remove(job)
        if job.error is not None:
            raise job.error
        self.completed += 1
        first, handle, forked = job.result
        req_log.info("prefilled %d prompt tokens (queued %.1f ms, forward %.1f ms)", n,
                     1000 * (job.t_start - t_arrive), 1000 * (job.t_end - job.t_start),
                     extra=request_extra(request_id, f"prefill-{self.rank}"))
        return PrefillResult(request_id, first, handle, n, job.t_start - t_arrive, job.t_end - job.t_start,
                             cached_tokens=job.cached, forks=forked, cached_host_tokens=job.cached_host,
                             host_bytes=self.prefix.stats.host_bytes if self.prefix is not None else (0, 0),
                             cache_queried=n if self.prefix is not None and params.prompt_logprobs is None else 0)

    def _take_jobs(self) -> list[_Job]:
        """The oldest queued prompt, plus the next ones while they fit one forward of chunk_tokens (TP1
        only: a TP group runs one prompt per op)."""
        with self._count_lock:
            jobs = [self._queue.popleft()]
            total = len(jobs[0].ids)
            # A prompt that wants its logprobs runs alone, in smaller chunks (see _run_prefill).
            while (self.group is None and self._queue and jobs[0].params.prompt_logprobs is None
                   and self._queue[0].params.prompt_logprobs is None
                   and total + len(self._queue[0].ids) <= self.chunk_tokens):
                total += len(self._queue[0].ids)
                jobs.append(self._queue.popleft())
        return jobs

    def _run_jobs(self, jobs: list[_Job]) -> None:
        t0 = time.perf_counter()
        for j in jobs:
            j.t_start = t0
        if len(jobs) > 1:
            try:
                sampled = self._prefill_batch(jobs)
            except Exception:  # one by one below, where each prompt gets its own error
                sampled = None
            if sampled is not None:
                for j, (token, logprob, peers, top, forked) in zip(jobs, sampled):
                    self._settle(j, lambda: self._finish(j.request_id, j.ids, j.params, j.generated, token,
                                                         logprob, peers, top, forked=forked))
                return
        for j in jobs:
            self._settle(j, lambda: self._prefill(j.request_id, j.ids, j.params, j.generated, j))

    def _settle(self, job: _Job, fn) -> None:
        try:
            job.result = fn()
        except Exception as e:
            job.error = e
        job.t_end = time.perf_counter()
        if self._running_since is not None:
            self._running_since = time.monotonic()  # a prompt done: progress

    def _prefill_batch(self, jobs: list[_Job]):
        """Several whole prompts in one ragged forward (TP1); None if their pages are not all free."""
        with self._engine_lock:
            self._drain_frees()
            if any(self.runner.has_sequence(j.request_id) for j in jobs):
                return None
            if self.prefix is not None:
                logits = self._prefill_batch_cached(jobs)
                if logits is None:
                    return None
            else:
                if not self.runner.can_admit(sum(len(j.ids) + self.runner.page_size for j in jobs)):
                    return None
                logits = self.runner.prefill_batch([(j.request_id, j.ids) for j in jobs])
            params, done = [j.params for j in jobs], [j.ids[len(j.ids) - j.generated:] for j in jobs]
            sampled = sample_constrained(self.runner.sample, logits, params, [j.generated for j in jobs], done,
                                         [j.ids for j in jobs], masks=masks_for(params, done))
            tops = top_logprobs(logits, [j.params for j in jobs])
            forked = [self._sample_forks(j, logits[i], TokenOutput(t, lp, None, top))
                      for i, (j, (t, lp), top) in enumerate(zip(jobs, sampled, tops))]
        return [(t, lp, (), top, f) for (t, lp), top, f in zip(sampled, tops, forked)]

    def _sample_forks(self, job: _Job, row, first: TokenOutput) -> tuple[TokenOutput, ...]:
        return sample_forks(self.runner.sample, row, job.forks, job.ids, job.generated, self.max_context, first)

    def _prefill_batch_cached(self, jobs: list[_Job]):
        """`_prefill_batch` under the prefix cache: each prompt resumes after its cached prefix; None (and
        nothing left behind) if the rest does not fit."""
        starts = [self.runner.kv.begin_prefix(j.request_id, j.ids) for j in jobs]
        hosts = [self.runner.kv.host_hit(j.request_id) for j in jobs]
        try:
            if not self.runner.can_admit(sum(len(j.ids) - s + self.runner.page_size for j, s in zip(jobs, starts))):
                raise _NoRoom
            logits = self.runner.forward_mixed([(j.request_id, j.ids[s:]) for j, s in zip(jobs, starts)])
        except Exception:  # no room, or a failed forward: one by one, as without the cache
            for j in jobs:
                if self.runner.has_sequence(j.request_id):
                    self.runner.free(j.request_id)
            for j, s, h in zip(jobs, starts, hosts):  # each runs (and looks up) again on its own
                self.prefix.retract(len(j.ids), s, h)
            return None
        for j, s, h in zip(jobs, starts, hosts):
            j.cached, j.cached_host = s, h
        return logits

    def _prefill(self, rid: str, prompt_ids: list[int], params: SamplingParams, generated: int,
                 job: _Job | None = None):
        deadline = time.monotonic() + self.exporter.lease_seconds + self.exporter.grace_seconds + 1
        while True:
            with self._engine_lock:
                self._drain_frees()
                if self.runner.has_sequence(rid):
                    raise ValueError(f"request {rid}: already being prefilled on this worker")
                if self.group is not None and self.prefix is not None:
                    start, host, ran = self._group_prefill_cached(rid, prompt_ids, params.prompt_logprobs)
                else:
                    start, host, ran = self._prefill_here(rid, prompt_ids, params.prompt_logprobs)
                if ran is not None:
                    logits, peers, plp = ran
                    if job is not None:
                        job.cached, job.cached_host = start, host
                    done = [prompt_ids[len(prompt_ids) - generated:]]
                    (token, logprob), = sample_constrained(self.runner.sample, logits, [params], [generated], done,
                                                           [prompt_ids], masks=masks_for([params], done))
                    top, = top_logprobs(logits, [params])
                    forked = self._sample_forks(job, logits, TokenOutput(token, logprob, None, top, plp)) if job else ()
                    break
            # Pages are held by leases that decode has not pulled yet; they come back on release or
            # expiry, both bounded by the lease, so this wait is bounded too.
            if time.monotonic() > deadline:
                raise RuntimeError(f"request {rid}: prefill worker {self.rank} has no free KV pages for "
                                   f"{len(prompt_ids)} tokens ({self.exporter.active_leases()} leases held)")
            time.sleep(0.005)
        return self._finish(rid, prompt_ids, params, generated, token, logprob, peers, top, plp, forked)

    def _finish(self, rid: str, prompt_ids: list[int], params: SamplingParams, generated: int, token: int,
                logprob, peers, top=None, plp: PromptLogprobs | None = None, forked: tuple[TokenOutput, ...] = ()):
        reason = finish_reason_at(token, generated + 1, params, len(prompt_ids) + 1, self.max_context)
        first = TokenOutput(token, logprob, reason, top, plp)
        if not any_continues(first, forked):
            with self._engine_lock:
                self._free(rid)
            return first, None, forked
        with self._engine_lock:
            kv = self.runner.export_sequence(rid)
        handle = self.exporter.pin(rid, kv.pages, kv.length, first_blocks=kv.first_page,
                                   on_release=lambda: self._queue_free(rid), peers=peers)
        return first, handle, forked

    def _prefill_here(self, rid: str, prompt_ids: list[int], k: int | None):
        """(cached positions, of them from the host tier, `_run_prefill`'s result or None: no room yet,
        nothing kept) on this worker's Runner (TP1), or on a TP group without the prefix cache."""
        start = host = 0
        if self.prefix is not None:  # a prompt that wants its own logprobs computes every position
            start = self.runner.kv.begin_prefix(rid, prompt_ids, lookup=k is None)
            host = self.runner.kv.host_hit(rid)
        if self.runner.can_admit(len(prompt_ids) - start, length=start):  # all ranks' allocators agree
            return start, host, self._run_prefill(rid, prompt_ids, k, start)
        if self.prefix is not None:  # try again from scratch once pages come back
            self.runner.free(rid)
            if k is None:
                self.prefix.retract(len(prompt_ids), start, host)
        return start, host, None

    def _group_prefill_cached(self, rid: str, prompt_ids: list[int], k: int | None):
        """`_prefill_here` for a TP group under the prefix cache: this rank's cache decides (`begin_cached`,
        no collective), then every rank runs the same lookup and the forward as one op, each follower
        checking that its cache decided the same before its forward (ranks.py); every rank's pages are
        checked after."""
        every = k is not None
        begun = begin_cached(self.runner, rid, prompt_ids, every)
        logits, shards = self.group.run("prefill_cached", (rid, prompt_ids, every, begun),
                                        lambda: finish_cached(self.runner, rid, prompt_ids, begun, every))
        if not begun.room:
            return begun.start, begun.host, None
        plp = None
        if every:
            plp = prompt_logprobs(logits, prompt_ids, 0, k)
            logits = logits[-1]
        self._check_peer_pages(rid, shards)
        return begun.start, begun.host, (logits, tuple(shards), plp)

    def _check_peer_pages(self, rid: str, peers) -> None:
        # Same calls in the same order leave every rank's allocator in the same state; a difference
        # would mean the ranks no longer agree on what is where, so stop trusting this group.
        kv = self.runner.export_sequence(rid)
        own = self.exporter.describe(kv.pages, kv.length, first_blocks=kv.first_page)
        for shard in peers:
            if [g.page_ids for g in shard.groups] != [g.page_ids for g in own.groups]:
                self.group.fail(f"request {rid}: rank {shard.tp_rank} holds other pages than rank 0")

    # ---- engine ops (under the engine lock; on every rank of a TP group) ---------------------
    def _run_prefill(self, rid: str, prompt_ids: list[int], k: int | None = None, start: int = 0) -> tuple:
        """(last position's logits, follower pages, prompt logprobs with k alternatives or None). Under the
        prefix cache the sequence exists already (begin_prefix) holding `start` cached positions."""
        every = k is not None  # every position's logits: the prompt's own logprobs
        if self.group is None:
            # In chunks: activations stay within what the pool was sized around (engine/memory.py); with
            # prompt logprobs also the [chunk, vocab] logits (PROMPT_LOGPROB_CHUNK).
            c = min(self.chunk_tokens, PROMPT_LOGPROB_CHUNK) if every else self.chunk_tokens
            parts = []
            try:
                for s in range(start, len(prompt_ids), c):
                    piece = prompt_ids[s:s + c]
                    out = (self.runner.prefill(rid, piece, all_logits=every) if s == 0 and self.prefix is None
                           else self.runner.extend(rid, piece, all_logits=every))
                    if every:
                        parts.append(prompt_logprobs(out, prompt_ids, s, k))
                        out = out[-1]
                    logits = out
            except BaseException:
                if self.runner.has_sequence(rid):
                    self.runner.free(rid)
                raise
            return logits, (), PromptLogprobs.join(parts) if every else None
        # A TP group runs the prompt as one op on every rank (the same rows on each: the vocabulary
        # gather is a collective).
        logits, peers = self.group.run("prefill", (rid, prompt_ids, every),
                                       lambda: self.runner.prefill(rid, prompt_ids, all_logits=every))
        plp = None
        if every:
            plp = prompt_logprobs(logits, prompt_ids, 0, k)
            logits = logits[-1]
        self._check_peer_pages(rid, peers)
        return logits, tuple(peers), plp

    def _free(self, rid: str) -> None:
        if self.group is None:
            self.runner.free(rid)
        else:
            self.group.run("free", (rid,), lambda: self.runner.free(rid))

    def release(self, lease_id: int) -> bool:
        """Decode pulled the pages (or gave up): unpin. False if the lease had already expired."""
        return self.exporter.release(lease_id)

    def reset(self) -> int:
        """Unpin every lease an earlier router left (it died before its decode side pulled them): a
        router re-attaching calls this, rather than leave the pages until the leases expire."""
        return self.exporter.release_all()

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

    def step_stall_s(self) -> float:
        """Seconds the current prefill run (the prompts taken into one go) has taken since it started or
        last finished a prompt; 0 while none runs. As the decode worker's (router.worker_step_timeout_s):
        a worker stuck in a forward still answers health()."""
        since = self._running_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def debug_stall_steps(self, seconds: float) -> None:
        """Test only (tests/e2e/test_supervision_hung.py): the next prefill run sleeps `seconds` in the
        calling thread, holding the run lock, before its forward, as a forward stuck on the device would;
        health() and every other call still answer. Returns at once."""
        self._debug_stall_s = float(seconds)

    def queued_tokens(self) -> int:
        return self._queued_tokens

    def status(self) -> WorkerStatus:
        with self._engine_lock:
            self._drain_frees()
            free = self.runner.free_pages()
            total = {g: a.num_pages for g, a in self.runner.kv.allocators.items()}
            cache = self.prefix.summary() if self.prefix is not None else None
        return WorkerStatus(
            role="prefill", rank=self.rank, tp_rank=0, tp_size=self.tp_size, pid=os.getpid(), node=node_name(),
            healthy=self.health(),
            pages_in_use={g: total[g] - free[g] for g in total}, pages_total=total,
            queued_tokens=self._queued_tokens, leases=self.exporter.active_leases(),
            completed=self.completed, expired_leases=self.exporter.expired_count,
            agent=self.exporter.agent_name, prefix_cache=cache)

    def shutdown(self) -> None:
        self._stop.set()
        self.exporter.close()
        with self._engine_lock:
            try:
                self._drain_frees()
            finally:
                if self.group is not None:
                    self.group.shutdown()
