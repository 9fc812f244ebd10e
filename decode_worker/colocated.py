"""A colocated worker: both roles of one GPU in one process, over one copy of the weights and one KV pool.

Why one process rather than two actors sharing weights over CUDA IPC: with two processes each role
still needs its own KV pool, CUDA context, allocator cache and activation headroom on the same GPU, the
handoff is a copy (NIXL READ, same device), and the two processes' kernels interleave on the GPU at the
driver's whim. Measured on the H200 before this worker existed (issue 10's table): 20b colocated as two
actors reached 1,045 tok/s at 64 streams, a fifth of the engine's own batch-64 decode rate, and 120b could
not run at all (two copies of 117 GB do not fit one GPU). In one process the handoff is no copy at all:
a prefilled sequence's pages are already where the decode steps read them (an `InPlaceKV` handle), and
one scheduler decides what runs, so prompts join the decode batch's forward instead of competing with it.

Prompts are prefilled inside the decode loop's forwards (chunked prefill, as vLLM and SGLang do): each
step takes queued prompt tokens up to `prefill.chunk_tokens` (several prompts per forward when a queue
forms; a longer prompt in chunks over several steps) and runs them in one ragged forward together with
the running sequences' next tokens, so decode never stalls behind a long prompt and prefill keeps up
under load. A step without queued prompts is a plain (CUDA-graph) decode step.

The router talks to this actor exactly as to a prefill worker and a decode worker (it is both): reserve,
prefill -> PrefillResult with an InPlaceKV handle, generate(handle) -> the token stream, release.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from dataclasses import dataclass, field

from kvrelay.decode_worker.worker import DecodeWorker, req_log
from kvrelay.engine.kv_geometry import SLIDING, window_pages
from kvrelay.engine.memory import chunk_headroom
from kvrelay.engine.sampling import (PROMPT_LOGPROB_CHUNK, PromptLogprobs, SamplingParams, TokenOutput,
                                     finish_reason_at, prompt_logprobs, top_logprobs)
from kvrelay.transfer.handle import TransferStats
from kvrelay.workers.forks import any_continues, sample_forks
from kvrelay.workers.logs import request_extra
from kvrelay.workers.messages import InPlaceKV, PrefillResult, WorkerStatus
from kvrelay.workers.specs import ColocatedSpec, DecodeSpec, check_prompt_limits
from kvrelay.engine.structured import masks_for, sample_constrained


@dataclass(eq=False)
class _Prompt:
    request_id: str
    ids: list[int]
    params: SamplingParams
    generated: int  # tokens the request already has (a retried request re-prefills prompt + these)
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    t_arrive: float
    t_start: float | None = None
    done: int = 0  # prompt tokens already in the cache
    begun: bool = False  # its sequence exists (begun under the prefix cache, which may have hit)
    cached: int = 0  # prompt tokens the prefix cache supplied
    cached_host: int = 0  # ... of them, those its host tier held
    cancelled: bool = False
    plp: list[PromptLogprobs] = field(default_factory=list)  # prompt logprobs of the chunks so far
    forks: tuple[SamplingParams, ...] = ()  # choices 1..n-1 of the same prompt (workers/forks.py)

    @property
    def every(self) -> bool:
        """Every position's logits are needed (the prompt's own logprobs)."""
        return self.params.prompt_logprobs is not None


@dataclass
class _Counters:
    prompt_tokens: int = 0  # computed by prefill chunks
    prompts: int = 0
    chunks: int = field(default=0)  # forwards that carried prompt tokens
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied instead
    cache_hits: int = 0  # prompts that reused a cached prefix
    cached_host_tokens: int = 0  # of cached_tokens, those the host tier held (copied back)


class ColocatedWorker(DecodeWorker):
    colocated = True
    log_role = "colocated"

    def __init__(self, spec: ColocatedSpec, rank: int = 0):
        self.chunk_tokens = spec.chunk_tokens
        self._sliding_share = spec.prefix_cache_sliding_share  # read by _load_single, in super().__init__
        self.max_prompt_tokens = spec.max_prompt_tokens
        self.max_context = spec.decode.model.max_context
        self._prompts: collections.deque[_Prompt] = collections.deque()
        self._plock = threading.Lock()  # guards _prompts only: the event loop never waits for a forward
        self._lease = 0
        self.prefill_counters = _Counters()
        self.prefix = None  # the step thread starts in super().__init__, before the pool is final
        super().__init__(spec.decode, rank)
        if spec.prefix_cache:  # nothing is queued yet: the step loop has not looked
            self.prefix = self.runner.kv.enable_prefix_cache(spec.prefix_cache_host_bytes)

    def _load_single(self, spec: DecodeSpec, chunk_tokens: int | None = None):
        # The pool is sized around a forward of a whole prompt chunk, not just a decode step, and its
        # sliding group keeps windows for the prefix cache too (engine/memory.py).
        return super()._load_single(spec, self.chunk_tokens, self._sliding_share)

    def _headroom(self, spec: DecodeSpec) -> dict[str, int]:
        """Sliding pages that a forward's prompt chunks hold beyond one window each (see Scheduler)."""
        ps = spec.page_size
        want = chunk_headroom(chunk_tokens=self.chunk_tokens, page_size=ps, max_seqs=spec.max_batch)
        room = self.runner.kv.allocators[SLIDING].num_pages - window_pages(self.runner.cfg.sliding_window, ps)
        return {SLIDING: max(0, min(want, room))}

    # ---- the prefill role --------------------------------------------------------------------
    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      generated: int = 0, forks: tuple[SamplingParams, ...] = ()) -> PrefillResult:
        """Queue the prompt for the step loop and wait for its first token. The request must hold a
        reservation (`reserve`), which already counts its pages. `forks`: the other choices of an n > 1
        request, sampled from the same forward (`PrefillResult.forks`); their sequences are forked from
        this one when they start decoding (`start_group`)."""
        n = len(prompt_ids)
        check_prompt_limits(request_id, n, generated, self.max_prompt_tokens, self.max_context)
        loop = asyncio.get_running_loop()
        item = _Prompt(request_id, list(prompt_ids), params, generated, loop.create_future(), loop,
                       time.perf_counter(), forks=tuple(forks))
        with self._plock:
            self._prompts.append(item)
        with self._wake:  # a sleeping step loop wakes up; a busy one sees the queue after its step
            self._wake.notify()
        try:
            result = await asyncio.shield(item.future)
        except asyncio.CancelledError:
            item.cancelled = True  # the step loop drops it and frees whatever it had in the cache
            raise
        req_log.info("prefilled %d prompt tokens in %.1f ms", n, 1000 * (time.perf_counter() - item.t_arrive),
                     extra=request_extra(request_id, f"colocated-{self.rank}"))
        return result

    async def release(self, lease_id: int) -> bool:
        """The decode role adopted the pages (or the request ended): nothing is pinned in place."""
        return True

    async def queued_tokens(self) -> int:
        with self._plock:
            return sum(len(p.ids) - p.done for p in self._prompts)

    # ---- the handoff: adopt the sequence in place --------------------------------------------
    async def _pull(self, handle, request_id: str, generated: int, params: SamplingParams):
        if not isinstance(handle, InPlaceKV):
            raise TypeError(f"request {request_id}: a colocated worker decodes only its own prefills")

        def adopt() -> bool:
            if not self.runner.has_sequence(request_id):  # released meanwhile (abort, unreserve)
                self.scheduler.release(request_id)
                return True
            if self.runner.length(request_id) != handle.num_tokens:
                raise RuntimeError(f"request {request_id}: {self.runner.length(request_id)} positions in "
                                   f"the cache, the handle says {handle.num_tokens}")
            if not self.scheduler.has_reservation(request_id):
                self.scheduler.reserve(request_id, handle.num_tokens, params.max_tokens - generated + 1)
            return False

        dropped = await self._locked(adopt)
        return TransferStats(0, 0.0, 0), dropped

    @staticmethod
    async def _release_lease(prefill, handle) -> bool:
        return True

    def _forget_all(self) -> int:
        """(step thread) Also the queued prompts: dropped at the next chunk, their callers told."""
        with self._plock:
            queued = [p for p in self._prompts if not p.cancelled]
            for p in queued:
                p.cancelled = True
        for p in queued:
            self._resolve(p, exc=RuntimeError(f"request {p.request_id}: ended by a router re-attaching"))
        return super()._forget_all()

    # ---- the step loop -----------------------------------------------------------------------
    def _has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._prompts)

    def _take_chunk(self) -> list[tuple[_Prompt, int, int]]:
        """Queued prompt tokens for this forward, oldest first, within the token budget and the pages
        that are free now: (prompt, start, end) slices."""
        budget = self.chunk_tokens
        chunk = []
        with self._plock:
            for p in [p for p in self._prompts if p.cancelled]:
                self._prompts.remove(p)
                self._drop(p)
            if self.prefix is not None:
                # Before counting free pages: a hit takes references on cached pages, which are then no
                # longer evictable. A prompt whose logprobs are asked for computes every position.
                for p in self._prompts:
                    if not p.begun:
                        p.begun = True
                        if self.runner.has_sequence(p.request_id):
                            continue  # not a fresh sequence (cannot happen today): computed in full
                        p.done = p.cached = self.runner.kv.begin_prefix(p.request_id, p.ids, lookup=not p.every)
                        if p.cached:
                            p.cached_host = self.runner.kv.host_hit(p.request_id)
                            self.prefill_counters.cache_hits += 1
                            self.prefill_counters.cached_tokens += p.cached
                            self.prefill_counters.cached_host_tokens += p.cached_host
        free = dict(self.runner.free_pages())
        with self._plock:
            for p in self._prompts:
                if budget <= 0:
                    break
                n = min(len(p.ids) - p.done, budget)
                if p.every:  # [n, vocab] logits come back for this one: bounded (PROMPT_LOGPROB_CHUNK)
                    n = min(n, PROMPT_LOGPROB_CHUNK)
                need = self.runner.pages_needed(n, length=p.done)
                if any(need[g] > free[g] for g in need):
                    break  # pages come back as sequences finish; try again next step
                for g in need:
                    free[g] -= need[g]
                chunk.append((p, p.done, p.done + n))
                budget -= n
        return chunk

    def _drop(self, p: _Prompt) -> None:
        if self.runner.has_sequence(p.request_id) and p.request_id not in self.scheduler.running_ids():
            self.runner.free(p.request_id)

    def _step(self) -> None:
        chunk = self._take_chunk()
        if not chunk:
            self.decode_tokens += self.scheduler.step()
            return
        now = time.perf_counter()
        for p, start, _ in chunk:
            if p.t_start is None:
                p.t_start = now
        try:
            running, logits = self.scheduler.step_with([(p.request_id, p.ids[s:e]) for p, s, e in chunk],
                                                       [i for i, (p, _, _) in enumerate(chunk) if p.every])
        except BaseException as e:
            for p, _, _ in chunk:
                with self._plock:
                    if p in self._prompts:
                        self._prompts.remove(p)
                if self.runner.has_sequence(p.request_id):
                    self.scheduler.release(p.request_id)
                self._resolve(p, exc=RuntimeError(f"prefill of {p.request_id} failed on worker {self.rank}: {e!r}"))
            raise
        self.decode_tokens += running
        self.prefill_counters.chunks += 1
        last = []  # each item's last row in `logits`
        at = 0
        for p, s, e in chunk:
            if p.every:
                p.plp.append(prompt_logprobs(logits[at: at + e - s], p.ids, s, p.params.prompt_logprobs))
                at += e - s
            else:
                at += 1
            last.append(at - 1)
        finished = [(last[i], p) for i, (p, s, e) in enumerate(chunk) if e == len(p.ids)]
        for p, s, e in chunk:
            p.done = e
            self.prefill_counters.prompt_tokens += e - s
        if not finished:
            return
        with self._plock:
            for _, p in finished:
                self._prompts.remove(p)
        rows = logits[[i for i, _ in finished]]
        params, done = [p.params for _, p in finished], [p.ids[len(p.ids) - p.generated:] for _, p in finished]
        sampled = sample_constrained(self.runner.sample, rows, params, [p.generated for _, p in finished], done,
                                     [p.ids for _, p in finished], masks=masks_for(params, done))
        tops = top_logprobs(rows, [p.params for _, p in finished])
        t_end = time.perf_counter()
        for k, ((_, p), (token, logprob), top) in enumerate(zip(finished, sampled, tops)):
            self.prefill_counters.prompts += 1
            reason = finish_reason_at(token, p.generated + 1, p.params, len(p.ids) + 1, self.max_context)
            plp = PromptLogprobs.join(p.plp) if p.every else None
            first = TokenOutput(token, logprob, reason, top, plp)
            forked = sample_forks(self.runner.sample, rows[k], p.forks, p.ids, p.generated, self.max_context, first)
            handle = None
            if not any_continues(first, forked) or p.cancelled:
                self.scheduler.release(p.request_id)  # nothing to decode: pages and budget back now
            else:
                self._lease += 1
                handle = InPlaceKV(p.request_id, self._lease, len(p.ids))
                if self.prefix is not None:  # its first decode step writes this token's KV
                    self.runner.kv.extend_tokens(p.request_id, (token,))
            moved = self.prefix.stats.host_bytes if self.prefix is not None else (0, 0)
            self._resolve(p, result=PrefillResult(p.request_id, first, handle,
                                                  len(p.ids), p.t_start - p.t_arrive, t_end - p.t_start,
                                                  cached_tokens=p.cached, forks=forked,
                                                  cached_host_tokens=p.cached_host, host_bytes=moved,
                                                  cache_queried=len(p.ids) if p.begun and not p.every else 0))

    @staticmethod
    def _resolve(p: _Prompt, *, result=None, exc: BaseException | None = None) -> None:
        def set_() -> None:
            if p.future.done():
                return
            if exc is not None:
                p.future.set_exception(exc)
            else:
                p.future.set_result(result)

        p.loop.call_soon_threadsafe(set_)

    # ---- introspection -----------------------------------------------------------------------
    async def status(self) -> WorkerStatus:
        st = await super().status()
        cache = None
        if self.prefix is not None:
            cache = await self._locked(self.prefix.summary) if self._thread.is_alive() else self.prefix.summary()
        return dataclasses.replace(st, prompt_tokens=self.prefill_counters.prompt_tokens, prefix_cache=cache)

    async def counters(self) -> dict[str, int]:
        """Tokens each role computed: a prompt is prefilled once and never recomputed by decode."""
        c = self.prefill_counters
        return {"prompt_tokens": c.prompt_tokens, "prompts": c.prompts, "prefill_forwards": c.chunks,
                "cached_tokens": c.cached_tokens, "cache_hits": c.cache_hits,
                "cached_host_tokens": c.cached_host_tokens,
                "decode_tokens": self.decode_tokens, "steps": self.steps,
                "overlapped_steps": self.scheduler.times.overlapped}
