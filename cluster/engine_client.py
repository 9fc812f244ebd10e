"""The disaggregated EngineClient: the router's `generate` over a pool of prefill and decode actors.

Transport: Ray actor calls, with tokens on one Ray streaming generator per decode worker (its channel,
one message per step for all this client's requests, demultiplexed here), rather than gRPC
between the processes. Ray already places and starts these actors (placement groups, GPUs), so their
handles come for free; an actor's death fails its pending calls and open streams at once with
`RayActorError` instead of leaving us to tune socket timeouts; KVHandle and the other frozen dataclasses
travel as they are, with no second schema to keep in sync with the proto; and no worker opens a port of
its own (one fewer thing that could listen beyond loopback). The KV bytes never take this path: they go
worker to worker over NIXL (or stay in place on a colocated worker), and only token ids and small
handles cross Ray.

Per request: reserve pages on the decode worker with the most free budget (so a prompt is never
prefilled for a decode side that cannot take it), prefill on the worker with the fewest queued prompt
tokens (the same actor when colocated), stream the first token at once, then the decode worker's tokens. If a worker dies (or
the lease expired, or a KV pull failed), the request is re-prefilled with prompt + tokens already streamed
on a healthy pair and continues without a gap or a repeat. When no pair is live (the only one died), it
waits up to `resume_timeout_s` for the supervisor's replacement (cluster/supervisor.py swaps it in with
`replace_worker`) and resumes there; past that bound it fails with `EngineUnavailable` (HTTP 503 /
an in-band error event / gRPC UNAVAILABLE). New requests wait for a live pair the same way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field

from prometheus_client import Counter, Histogram

from kvrelay.cluster import cache_metrics
from kvrelay.cluster.admission import AdmissionQueue, AdmissionTimeout
from kvrelay.cluster.fork_group import ForkGroup
from kvrelay.cluster.routing import KV_AWARE, POLICIES, PrefixIndex, block_hashes, rank
from kvrelay.transfer.handle import KVLayoutMismatch, KVTransferError
from kvrelay.engine.sampling import SamplingParams, TokenOutput, token_set
from kvrelay.router.engine_client import EngineUnavailable, flatten
from kvrelay.workers.logs import request_extra

log = logging.getLogger("kvrelay.requests")

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# vLLM's request_queue_time_seconds and request_prefill_time_seconds; time to first token and inter-token
# latency are the router's (router/metrics.py), measured for every engine client alike.
QUEUE_S = Histogram("kvrelay_request_queue_time_seconds", "Admission wait + prefill queue per request",
                    buckets=_BUCKETS)
PREFILL_S = Histogram("kvrelay_request_prefill_time_seconds", "Prefill forward + first token per request",
                      buckets=_BUCKETS)
KV_TRANSFER_S = Histogram("kvrelay_kv_transfer_seconds", "NIXL READ of a request's KV", buckets=_BUCKETS)
KV_BYTES = Counter("kvrelay_kv_transfer_bytes", "KV bytes moved prefill -> decode")
REQUESTS = Counter("kvrelay_requests", "Finished requests", ["outcome"])
# vLLM's prefix_cache_queries / prefix_cache_hits, both in tokens: hits / queries is the hit rate.
PREFIX_QUERIES = Counter("kvrelay_prefix_cache_queries", "Prompt tokens looked up in a prefill worker's prefix cache")
PREFIX_HITS = Counter("kvrelay_prefix_cache_hits", "Prompt tokens a prefix cache supplied instead of a prefill")
# One per prefill run (a request's first attempt, each re-prefill): a request with n choices counts one.
PREFILLS = Counter("kvrelay_prefills", "Prompt prefills run (n choices of one prompt share one)")
RETRIES = Counter("kvrelay_request_retries", "Requests re-prefilled on another worker pair, by cause", ["cause"])


__all__ = ["DisaggregatedEngineClient", "EngineUnavailable", "RequestMetrics", "ClusterTokenOutput"]


class _Retry(Exception):
    """An attempt failed in a way a fresh attempt on other workers can fix. `cause` labels the
    re-prefill in /metrics (kvrelay_request_retries{cause=...}); `worker` is the one that failed (the
    re-prefill is counted against it in `kvrelay status`)."""

    def __init__(self, message: str, cause: str, worker: "_Worker | None" = None):
        super().__init__(message)
        self.cause = cause
        self.role = worker.role if worker is not None else ""
        self.rank = worker.rank if worker is not None else -1


class _NoLiveWorker(_Retry):
    """No live worker of a role right now (they died, replacements are loading): wait for one, within
    the resume bound, then try again. Nothing was prefilled for it, so it is no re-prefill."""

    def __init__(self, message: str):
        super().__init__(message, "")


class _Aborted(Exception):
    """The decode worker ended the request on an abort."""


_CHANNEL_GONE = object()  # put on every request queue of a channel whose stream ended


@dataclass
class _Channel:
    id: str
    queues: dict = field(default_factory=dict)  # attempt id -> asyncio.Queue of token events
    task: object = None
    worker: object = None  # the _Worker it streams from


@dataclass(frozen=True)
class RequestMetrics:
    request_id: str
    prompt_tokens: int
    output_tokens: int
    queue_s: float  # waiting for decode admission and for the prefill worker
    prefill_s: float
    kv_bytes: int
    kv_transfer_s: float
    ttft_s: float  # from the request reaching the engine client to its first token here
    tpot_s: float  # mean gap between output tokens after the first
    decode_tokens_per_s: float
    retries: int
    prefill_worker: int
    decode_worker: int
    cached_tokens: int = 0  # prompt tokens the prefill worker's prefix cache supplied (first attempt)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def timings(self) -> dict[str, float | int]:
        """The TTFT breakdown clients see (HTTP `kvrelay_timings`): queue + prefill compute + delivery =
        TTFT; the KV handoff happens after the first token and delays only the second."""
        return {"queue_s": self.queue_s, "prefill_compute_s": self.prefill_s, "kv_handoff_s": self.kv_transfer_s,
                "kv_bytes": self.kv_bytes, "ttft_s": self.ttft_s,
                "delivery_s": max(0.0, self.ttft_s - self.queue_s - self.prefill_s), "tpot_s": self.tpot_s}


@dataclass(frozen=True)
class ClusterTokenOutput(TokenOutput):
    """A TokenOutput; the final one of a stream also carries the request's metrics."""

    metrics: RequestMetrics | None = None


@dataclass
class _Worker:
    role: str
    rank: int
    actor: object
    queued_tokens: int = 0  # prefill: prompt tokens this client has in flight there
    last_pick: float = 0.0
    dead: bool = False


@dataclass
class _Acc:
    """Running totals for one request across attempts."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_bytes: int = 0
    kv_transfer_s: float = 0.0
    retries: int = 0
    prefill_worker: int = -1
    decode_worker: int = -1
    cached_tokens: int = 0
    times: list[float] = field(default_factory=list)  # perf_counter of each streamed token


class DisaggregatedEngineClient:
    Aborted = _Aborted  # what `_next` raises once the worker reports a request aborted (cluster/fork_group.py)

    def __init__(self, prefill_actors: Sequence[object], decode_actors: Sequence[object], *,
                 model_name: str, max_context: int, vocab_size: int | None = None, max_retries: int = 2,
                 admission_timeout_s: float = 60.0, stall_check_s: float = 10.0, colocated: bool = False,
                 policy: str = "least-loaded", max_waiting: int = 1024, resume_timeout_s: float = 120.0,
                 on_worker_dead: Callable[[str, int], None] | None = None, page_size: int = 16):
        self.prefill = [_Worker("prefill", i, a) for i, a in enumerate(prefill_actors)]
        self.decode = [_Worker("decode", i, a) for i, a in enumerate(decode_actors)]
        self._model_name = model_name
        self._max_context = max_context
        if vocab_size is not None:
            self.vocab_size = vocab_size
        self.max_retries = max_retries
        # How long a request whose workers died waits for a live (or replacement) pair before it fails.
        self.resume_timeout_s = resume_timeout_s
        # Told of every worker this client finds dead (the supervisor replaces it); from any thread.
        self.on_worker_dead = on_worker_dead
        self.reprefills: collections.Counter[tuple[str, int, str]] = collections.Counter()  # (role, rank, cause)
        self.admission_timeout_s = admission_timeout_s
        self.stall_check_s = stall_check_s
        # Colocated: prefill[i] and decode[i] are one actor, so a request's pair is always (i, i) and its
        # KV never leaves the GPU (decode_worker/colocated.py).
        self.colocated = colocated
        if policy not in POLICIES:
            raise ValueError(f"router.policy: {policy!r} is not one of {', '.join(POLICIES)}")
        self.policy = policy
        # kv-aware: what this router sent where, per prefill role (cluster/routing.py)
        self.prefix_index = PrefixIndex(page_size) if policy == KV_AWARE else None
        self._turn = itertools.count()
        self._channels: dict[int, _Channel] = {}  # decode worker rank -> its token channel
        self._active: dict[str, tuple[_Worker, str]] = {}  # request -> (decode worker, attempt id)
        self._aborted: set[str] = set()
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self._admit_lock = asyncio.Lock()
        self.admission = AdmissionQueue(max_waiting)

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_context(self) -> int:
        return self._max_context

    # ---- EngineClient ------------------------------------------------------------------------
    def generate(self, request_id: str, prompt_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[TokenOutput]:
        return flatten(self.generate_batches(request_id, prompt_ids, params))

    def fork_batches(self, request_ids: Sequence[str], prompt_ids: list[int],
                     params: Sequence[SamplingParams]) -> list[AsyncIterator[list[TokenOutput]]]:
        """The n choices of one prompt (OpenAI's `n`): one token stream per choice, as `generate_batches`
        gives, but the prompt is prefilled once and its KV forked on one decode worker
        (cluster/fork_group.py). After that first attempt each choice stands alone: a failure re-prefills
        only that choice, with its prompt + its own tokens so far, as for any request."""
        params = [p.resolved() for p in params]
        group = ForkGroup(self, list(request_ids), list(prompt_ids), params)
        return [self.generate_batches(rid, prompt_ids, p, first_attempt=lambda acc, j=j: group.stream(j, acc))
                for j, (rid, p) in enumerate(zip(request_ids, params))]

    async def generate_batches(self, request_id: str, prompt_ids: list[int],
                               params: SamplingParams, *,
                               first_attempt: Callable | None = None) -> AsyncIterator[list[TokenOutput]]:
        """The request's tokens as they arrive: each list holds what came in since the last one (one
        decode step's token, or several when the consumer runs behind). `first_attempt(acc)`, if given,
        is the first attempt's stream in place of `_attempt` (a choice of a fork group)."""
        if self._draining:
            raise EngineUnavailable("the cluster is shutting down; not accepting new requests")
        params = params.resolved()  # one concrete seed, so a retried request draws the same tokens
        acc = _Acc()
        t0 = time.perf_counter()
        streamed: list[int] = []
        deadline = time.monotonic() + self.resume_timeout_s  # for a live pair; renewed at each failure
        failures = 0
        self._in_flight += 1
        self._idle.clear()
        outcome = "error"
        try:
            for attempt in itertools.count():
                try:
                    await self._until_live(request_id, deadline)
                    # aclosing: if our consumer goes away mid-stream, the attempt's cleanup (abort on
                    # decode, lease release on prefill) runs now, not whenever the GC finalises it.
                    if first_attempt is not None:
                        attempt_stream, first_attempt = first_attempt(acc), None
                    else:
                        attempt_stream = self._attempt(request_id, attempt, list(prompt_ids), streamed, params, acc)
                    async with contextlib.aclosing(attempt_stream) as batches:
                        async for outs in batches:
                            now = time.perf_counter()
                            for i, out in enumerate(outs):
                                streamed.append(out.token_id)
                                acc.times.append(now)
                                if out.finish_reason is not None:
                                    m = self._metrics(request_id, len(prompt_ids), t0, acc)
                                    outcome = "ok"
                                    yield outs[:i] + [ClusterTokenOutput(
                                        out.token_id, out.logprob, out.finish_reason, out.top_logprobs,
                                        out.prompt_logprobs, metrics=m)]
                                    return
                            yield outs
                    if request_id in self._aborted:
                        outcome = "aborted"
                        return
                    raise EngineUnavailable(f"request {request_id}: decode stream ended without a finish")
                except _Retry as e:
                    if request_id in self._aborted:
                        outcome = "aborted"
                        return
                    if isinstance(e, _NoLiveWorker):  # nothing prefilled: wait for a worker, no re-prefill
                        continue
                    failures += 1
                    if failures > self.max_retries:
                        raise EngineUnavailable(f"request {request_id}: gave up after {failures} failed "
                                                f"attempts; last failure: {e}") from None
                    acc.retries += 1
                    RETRIES.labels(e.cause).inc()
                    self.reprefills[(e.role, e.rank, e.cause)] += 1
                    deadline = time.monotonic() + self.resume_timeout_s
                    log.warning("request %s: %s; re-prefilling %d + %d tokens on a live or replacement pair",
                                request_id, e, len(prompt_ids), len(streamed))
        finally:
            REQUESTS.labels(outcome).inc()
            self._aborted.discard(request_id)
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        active = self._active.get(request_id)
        if active is not None:
            worker, attempt_id = active
            try:
                await worker.actor.abort.remote(attempt_id)
            except Exception as e:  # a dead worker has nothing left to abort
                log.info("abort of %s on decode %d: %r", request_id, worker.rank, e)

    # ---- one attempt on one (prefill, decode) pair -------------------------------------------
    async def _attempt(self, request_id: str, attempt: int, prompt: list[int], streamed: list[int],
                       params: SamplingParams, acc: _Acc) -> AsyncIterator[list[TokenOutput]]:
        import ray

        attempt_id = request_id if attempt == 0 else f"{request_id}#retry{attempt}"
        full = prompt + streamed
        done = len(streamed)  # `streamed` grows as we yield; the attempt starts from this count
        remaining = params.max_tokens - done
        t_q = time.perf_counter()
        hashes = block_hashes(full, self.prefix_index.page_size) if self.prefix_index is not None else ()
        decode = await self._reserve(attempt_id, len(full), remaining, hashes)
        acc.queue_s += time.perf_counter() - t_q
        acc.decode_worker = decode.rank
        handle = None
        prefill = None
        finished = False
        self._active[request_id] = (decode, attempt_id)
        try:
            prefill = self.prefill[decode.rank] if self.colocated else self._pick_prefill(hashes, len(full))
            acc.prefill_worker = prefill.rank
            prefill.queued_tokens += len(full)
            # The prompt's own logprobs went out with the first token: a retry after it skips them.
            prefill_params = params if done == 0 else dataclasses.replace(params, prompt_logprobs=None)
            try:
                res = await self._prefill_once(prefill, attempt_id, full, prefill_params, done)
            finally:
                prefill.queued_tokens -= len(full)
            acc.queue_s += res.queue_s
            acc.prefill_s += res.prefill_s
            if done == 0:  # usage counts the prompt's own tokens; a resumed attempt re-prefills more
                acc.cached_tokens = res.cached_tokens
            handle = res.handle
            finished = res.first.finish_reason is not None
            yield [res.first]
            if finished or request_id in self._aborted:
                return
            channel = self._channel(decode)
            queue: asyncio.Queue = asyncio.Queue()
            channel.queues[attempt_id] = queue
            try:
                # Penalties count every token generated so far, including the ones a failed attempt sent;
                # the repetition penalty also the prompt's (its distinct ids only).
                pull = await self._start(decode, attempt_id, handle, res.first.token_id, done + 1, params,
                                         prefill, channel.id, tuple(streamed[:done]) if params.penalized or params.structured else (),
                                         token_set(prompt) if params.needs_prompt_tokens else ())
                if pull is None:  # released during the pull (aborted)
                    return
                handle = None  # decode owns the lease now (it released it after the pull)
                acc.kv_bytes += pull.kv_bytes
                acc.kv_transfer_s += pull.kv_transfer_s
                self._record_pull(pull)
                while True:
                    outs = await self._next(queue, decode)
                    finished = outs[-1].finish_reason is not None
                    yield outs
                    if finished:
                        return
            except _Aborted:
                return  # generate() sees the abort it asked for
            except _Retry:
                if handle is not None:  # the KV was never confirmed pulled: is its prefill worker gone?
                    await self._alive(prefill)
                raise
            finally:
                channel.queues.pop(attempt_id, None)
        finally:
            self._active.pop(request_id, None)
            # Whatever went wrong, leave no pages behind on either side.
            if handle is not None and prefill is not None and not prefill.dead:
                await _quietly(prefill.actor.release.remote(handle.lease_id))
            if not finished and not decode.dead:
                await _quietly(decode.actor.abort.remote(attempt_id))
                await _quietly(decode.actor.unreserve.remote(attempt_id))
            elif finished and not decode.dead:
                await _quietly(decode.actor.unreserve.remote(attempt_id))

    async def _prefill_once(self, prefill: _Worker, attempt_id: str, prompt: list[int], params: SamplingParams,
                            done: int, forks: tuple[SamplingParams, ...] = ()):
        """One prefill call (counted in /metrics); `forks`: the other choices of a fork group."""
        import ray

        try:
            if forks:
                res = await prefill.actor.prefill.remote(attempt_id, prompt, params, done, forks)
            else:
                res = await prefill.actor.prefill.remote(attempt_id, prompt, params, done)
        except ray.exceptions.RayActorError as e:
            self._mark_dead(prefill)
            raise _Retry(f"prefill worker {prefill.rank} died ({type(e).__name__})", "prefill_died",
                         prefill) from None
        PREFILLS.inc()
        PREFILL_S.observe(res.prefill_s)
        PREFIX_QUERIES.inc(res.cache_queried)
        PREFIX_HITS.inc(res.cached_tokens)
        cache_metrics.observe((prefill.role, prefill.rank), res.cached_host_tokens, res.host_bytes)
        return res

    @staticmethod
    def _record_pull(pull) -> None:
        KV_BYTES.inc(pull.kv_bytes)
        KV_TRANSFER_S.observe(pull.kv_transfer_s)

    # ---- the token channel of each decode worker ----------------------------------------------
    def _channel(self, w: _Worker) -> "_Channel":
        """This client's channel to decode worker `w`: one Ray stream carrying every request's tokens,
        one message per decode step, demultiplexed here into per-request queues."""
        ch = self._channels.get(w.rank)
        if ch is None or ch.task.done() or ch.worker is not w:  # a replaced worker gets a channel of its own
            ch = _Channel(f"{id(self):x}-{w.rank}-{next(self._turn)}", worker=w)
            ch.task = asyncio.ensure_future(self._pump(w, ch))
            self._channels[w.rank] = ch
        return ch

    async def _pump(self, w: _Worker, ch: "_Channel") -> None:
        import ray

        stream = w.actor.channel.options(num_returns="streaming").remote(ch.id)
        try:
            async for ref in stream:
                for rid, token, logprob, reason, error, top in await ref:
                    q = ch.queues.get(rid)
                    if q is not None:
                        q.put_nowait((token, logprob, reason, error, top))
        except ray.exceptions.RayActorError:
            self._mark_dead(w)
        except Exception as e:  # the channel broke: every request on it must learn it, not wait
            log.warning("token channel to decode %d failed: %r", w.rank, e)
        finally:
            for q in list(ch.queues.values()):
                q.put_nowait(_CHANNEL_GONE)

    async def _start(self, decode: _Worker, attempt_id: str, handle, first: int, generated: int,
                     params: SamplingParams, prefill: _Worker, channel_id: str, history: tuple[int, ...] = (),
                     prompt_tokens: tuple[int, ...] = (), children: tuple | None = None):
        """The decode worker's `start` (or `start_group` for the `children` of a fork group)."""
        import ray

        try:
            if children is not None:
                return await decode.actor.start_group.remote(attempt_id, handle, generated, params, prefill.actor,
                                                             channel_id, children, history, prompt_tokens)
            return await decode.actor.start.remote(attempt_id, handle, first, generated, params, prefill.actor,
                                                   channel_id, history, prompt_tokens)
        except ray.exceptions.RayActorError as e:
            self._mark_dead(decode)
            raise _Retry(f"decode worker {decode.rank} died ({type(e).__name__})", "decode_died", decode) from None
        except ray.exceptions.RayTaskError as e:
            # An expired lease, a READ that failed (the prefill worker died under it) or a prefill worker
            # gone before the pull was confirmed: prefill again and pull fresh pages. A layout mismatch
            # would only recur.
            if isinstance(e.cause, KVTransferError) and not isinstance(e.cause, KVLayoutMismatch):
                raise _Retry(str(e.cause), "kv_transfer", prefill) from None
            raise e.cause if isinstance(e.cause, Exception) else e from None

    async def _next(self, queue: asyncio.Queue, decode: _Worker) -> list[TokenOutput]:
        """The request's tokens that arrived since the last call (waits for at least one); _Aborted once
        the worker reports the request aborted."""
        items = []
        while queue.empty():  # wait_for costs a timer per call: only when nothing is queued yet
            try:
                items.append(await asyncio.wait_for(queue.get(), timeout=self.stall_check_s))
                break
            except asyncio.TimeoutError:
                # No token for a while: a busy worker answers a ping, a hung or gone one does not.
                if not await self._alive(decode):
                    raise _Retry(f"decode worker {decode.rank} stopped answering", "decode_unresponsive",
                                 decode) from None
        while not queue.empty():
            items.append(queue.get_nowait())
        out = []
        for item in items:
            if item is _CHANNEL_GONE:
                if decode.dead or not await self._alive(decode):
                    raise _Retry(f"decode worker {decode.rank} died", "decode_died", decode)
                raise EngineUnavailable(f"the token channel to decode worker {decode.rank} broke")
            token, logprob, reason, error, top = item
            if error == "aborted":
                raise _Aborted()
            if error is not None:
                raise RuntimeError(error)
            out.append(TokenOutput(token, logprob, reason, top))
        return out

    async def _alive(self, worker: _Worker) -> bool:
        try:
            await asyncio.wait_for(asyncio.wrap_future(worker.actor.health.remote().future()), timeout=5.0)
            return True
        except Exception:
            self._mark_dead(worker)
            return False

    # ---- the pool: deaths, replacements ------------------------------------------------------
    def _mark_dead(self, w: _Worker) -> None:
        """Route nothing more to `w` and tell the supervisor (once per worker object). Colocated, the
        prefill and decode entries of a rank are one actor: both go."""
        pair = [w]
        if self.colocated:
            other = (self.decode if w.role == "prefill" else self.prefill)[w.rank]
            if other.actor is w.actor:
                pair.append(other)
        newly = [x for x in pair if not x.dead]
        for x in pair:
            x.dead = True
        if self.prefix_index is not None and (w.role == "prefill" or self.colocated):
            self.prefix_index.forget(w.rank)  # the index is per prefill role; a replacement starts empty
        if newly and self.on_worker_dead is not None:
            try:
                self.on_worker_dead(w.role, w.rank)
            except Exception as e:  # the supervisor's own checks find it anyway
                log.warning("telling the supervisor of %s %d failed: %r", w.role, w.rank, e)

    def replace_worker(self, role: str, rank: int, actor: object) -> None:
        """Swap a replacement actor into the pool (thread-safe: one list item assignment per role; the
        event loop sees either the dead entry or the new one). Requests waiting for a live pair pick it
        up; attempts still holding the old entry keep seeing it dead."""
        roles = ("prefill", "decode") if self.colocated or role == "colocated" else (role,)
        for r in roles:
            pool = self.prefill if r == "prefill" else self.decode
            pool[rank] = _Worker(r, rank, actor)

    def _missing_role(self) -> str | None:
        """The role with no live worker (None when a live pair exists)."""
        if self.colocated:
            live = any(not p.dead and not d.dead for p, d in zip(self.prefill, self.decode))
            return None if live else "colocated"
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            if all(w.dead for w in pool):
                return role
        return None

    async def _until_live(self, request_id: str, deadline: float) -> None:
        """Return once a live prefill + decode pair exists; EngineUnavailable at `deadline`, or at once
        when no supervisor replaces dead workers (nothing would come back). Polled: this only runs while
        every worker of a role is down (a replacement loads its weights meanwhile)."""
        while (role := self._missing_role()) is not None:
            if self._draining:
                raise EngineUnavailable("the cluster is shutting down; not accepting new requests")
            dead = ", ".join(f"{r} {i}" for r, i in self.dead_workers())
            if self.on_worker_dead is None:
                raise EngineUnavailable(f"request {request_id}: no live {role} worker (down: {dead}; "
                                        "no supervisor replaces them)")
            if time.monotonic() >= deadline:
                raise EngineUnavailable(f"request {request_id}: no live {role} worker within "
                                        f"{self.resume_timeout_s:g} s (router.resume_timeout_s; down: {dead}; "
                                        "replacements are starting)",
                                        retry_after_s=max(1, min(30, round(self.resume_timeout_s / 4))))
            await asyncio.sleep(0.05)

    # ---- placement ---------------------------------------------------------------------------
    def _pick_prefill(self, hashes: Sequence[int] = (), prompt_tokens: int = 0) -> _Worker:
        live = [w for w in self.prefill if not w.dead]
        if not live:
            raise _NoLiveWorker("no live prefill worker")
        if self.policy == "round-robin":
            w = live[next(self._turn) % len(live)]
        elif self.prefix_index is not None:  # kv-aware: least queued + uncached prompt work
            w = self._rank_by_prefix(live, live, hashes, prompt_tokens)[0]
            self.prefix_index.record(w.rank, hashes)
        else:  # least-loaded: fewest prompt tokens in flight, then the longest unused
            w = min(live, key=lambda w: (w.queued_tokens, w.last_pick))
        w.last_pick = time.monotonic()
        return w

    def check_admission(self) -> None:
        """EngineOverloaded now if the admission line is full (the router asks before it answers)."""
        self.admission.check()

    def _rank_by_prefix(self, candidates: list, prefills: list, hashes: Sequence[int], prompt_tokens: int) -> list:
        """`candidates` by cluster/routing.rank; `prefills[i]` is the prefill role of candidates[i]."""
        idx = self.prefix_index
        return rank(candidates, prompt_tokens, [idx.matched_tokens(p.rank, hashes) for p in prefills],
                    [p.queued_tokens for p in prefills], [p.last_pick for p in prefills])

    async def _reserve(self, attempt_id: str, prompt_tokens: int, max_tokens: int,
                       hashes: Sequence[int] = (), siblings: Sequence[str] = ()) -> _Worker:
        """Reserve pages on the decode worker with the most free budget (for `siblings` too, on the same
        worker: the other choices of a fork group); when none has room, wait in line
        (cluster/admission.py)."""
        reasons: list[str] = []

        async def try_once() -> _Worker | None:
            live = sum(not w.dead for w in self.decode)
            if live > 1 and self.policy != "round-robin":
                async with self._admit_lock:  # each ranking sees the reservations made before it
                    return await self._try_reserve(attempt_id, prompt_tokens, max_tokens, reasons, hashes, siblings)
            return await self._try_reserve(attempt_id, prompt_tokens, max_tokens, reasons, hashes, siblings)

        try:
            return await self.admission.admit(try_once, self.admission_timeout_s)
        except AdmissionTimeout:
            raise EngineUnavailable(f"request {attempt_id}: no decode worker admitted it within "
                                    f"{self.admission_timeout_s:g} s ({'; '.join(reasons)})") from None

    async def _try_reserve(self, attempt_id: str, prompt_tokens: int, max_tokens: int,
                           reasons: list[str], hashes: Sequence[int] = (),
                           siblings: Sequence[str] = ()) -> _Worker | None:
        import ray

        from kvrelay.workers.messages import AdmissionRefused

        live = [w for w in self.decode if not w.dead]
        if not live:
            raise _NoLiveWorker("no live decode worker")
        if self.colocated and self.prefix_index is not None and len(live) > 1:
            # kv-aware, colocated: the decode worker is the prefill worker, so rank by the prompt's
            # cached prefix there against its queued prompt tokens; a full one refuses and the next is tried.
            ranked = [(0, 0, w) for w in self._rank_by_prefix(live, [self.prefill[w.rank] for w in live],
                                                              hashes, prompt_tokens)]
        elif len(live) == 1 or self.policy == "round-robin":
            # Nothing to rank (or no ranking wanted): skip the load round trips, try in turn.
            k = next(self._turn) % len(live)
            ranked = [(0, 0, w) for w in live[k:] + live[:k]]
        else:  # least-loaded: most free KV budget, then fewest admitted requests
            loads = await asyncio.gather(*(self._load(w) for w in live))
            ranked = sorted((ld for ld in loads if ld is not None), key=lambda x: (-x[0], x[1], x[2].rank))
        reasons.clear()
        for _, _, w in ranked:
            try:
                if siblings:
                    await w.actor.reserve.remote(attempt_id, prompt_tokens, max_tokens, tuple(siblings))
                else:
                    await w.actor.reserve.remote(attempt_id, prompt_tokens, max_tokens)
                if self.colocated and self.prefix_index is not None:
                    self.prefix_index.record(w.rank, hashes)
                    self.prefill[w.rank].last_pick = time.monotonic()
                return w
            except ray.exceptions.RayActorError:
                self._mark_dead(w)
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(e.cause, AdmissionRefused) else None
                if cause is None:
                    raise
                if not cause.retryable:
                    raise cause from None
                reasons.append(f"decode {w.rank}: {cause.reason}")
        return None

    async def _load(self, w: _Worker):
        import ray

        try:
            free, admitted = await w.actor.load.remote()
            return free, admitted, w
        except ray.exceptions.RayActorError:
            self._mark_dead(w)
            return None

    # ---- metrics, draining -------------------------------------------------------------------
    def _metrics(self, request_id: str, prompt_tokens: int, t0: float, acc: _Acc) -> RequestMetrics:
        n = len(acc.times)
        ttft = acc.times[0] - t0
        span = acc.times[-1] - acc.times[0]
        tpot = span / (n - 1) if n > 1 else 0.0
        m = RequestMetrics(
            request_id=request_id, prompt_tokens=prompt_tokens, output_tokens=n, queue_s=acc.queue_s,
            prefill_s=acc.prefill_s, kv_bytes=acc.kv_bytes, kv_transfer_s=acc.kv_transfer_s, ttft_s=ttft,
            tpot_s=tpot, decode_tokens_per_s=(n - 1) / span if span > 0 else 0.0, retries=acc.retries,
            prefill_worker=acc.prefill_worker, decode_worker=acc.decode_worker, cached_tokens=acc.cached_tokens)
        QUEUE_S.observe(m.queue_s)
        log.info("request %s metrics %s", request_id, m.to_json(), extra=request_extra(request_id))
        return m

    def dead_workers(self) -> list[tuple[str, int]]:
        return [(w.role, w.rank) for w in self.prefill + self.decode if w.dead]

    @property
    def draining(self) -> bool:
        """Shutting down: not ready for new requests (/health/ready)."""
        return self._draining

    async def gauges(self) -> dict:
        """What /metrics reads at scrape time (router/metrics.refresh): the admission line's length and
        each live decode worker's share of KV pages in use."""
        live = [w for w in self.decode if not w.dead]
        stats = await asyncio.gather(*(w.actor.status.remote() for w in live), return_exceptions=True)
        usage = {}
        for w, st in zip(live, stats):
            if not isinstance(st, BaseException) and sum(st.pages_total.values()):
                usage[f"decode-{w.rank}"] = sum(st.pages_in_use.values()) / sum(st.pages_total.values())
        return {"waiting": self.admission.waiting, "kv_cache_usage": usage}

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait for the in-flight ones; True if all finished in time."""
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False


async def _quietly(ref) -> None:
    """Best-effort cleanup call: the worker may be gone, and the request is ending anyway."""
    try:
        await ref
    except Exception as e:
        log.debug("cleanup call failed: %r", e)
