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

The pool this client routes over (live workers, the prefill pick, decode reservations, deaths and
replacements) is cluster/worker_pool.py; what it measures per request, cluster/request_metrics.py.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from kvrelay.cluster import cache_metrics
from kvrelay.cluster.admission import AdmissionQueue
from kvrelay.cluster.fork_group import ForkGroup
from kvrelay.cluster.request_metrics import (
    KV_BYTES,
    KV_TRANSFER_S,
    PREFILL_S,
    PREFILLS,
    PREFIX_HITS,
    PREFIX_QUERIES,
    REQUESTS,
    RETRIES,
    ClusterTokenOutput,
    RequestMetrics,
    _Acc,
    request_metrics,
)
from kvrelay.cluster.routing import KV_AWARE, POLICIES, PrefixIndex, block_hashes
from kvrelay.cluster.worker_pool import WorkerPool, _NoLiveWorker, _Retry, _Worker
from kvrelay.transfer.handle import KVLayoutMismatch, KVTransferError
from kvrelay.engine.sampling_params import SamplingParams, TokenOutput, token_set
from kvrelay.router.engine_client import EngineUnavailable, engine_prompt, flatten

log = logging.getLogger("kvrelay.requests")


__all__ = ["DisaggregatedEngineClient", "EngineUnavailable", "RequestMetrics", "ClusterTokenOutput"]


class _Aborted(Exception):
    """The decode worker ended the request on an abort."""


_CHANNEL_GONE = object()  # put on every request queue of a channel whose stream ended


@dataclass
class _Channel:
    id: str
    queues: dict = field(default_factory=dict)  # attempt id -> asyncio.Queue of token events
    task: object = None
    worker: object = None  # the _Worker it streams from


class DisaggregatedEngineClient(WorkerPool):
    Aborted = _Aborted  # what `_next` raises once the worker reports a request aborted (cluster/fork_group.py)

    def __init__(self, prefill_actors: Sequence[object], decode_actors: Sequence[object], *,
                 model_name: str, max_context: int, vocab_size: int | None = None, max_retries: int = 2,
                 admission_timeout_s: float = 60.0, stall_check_s: float | None = None, colocated: bool = False,
                 policy: str = "least-loaded", max_waiting: int = 1024, resume_timeout_s: float = 120.0,
                 on_worker_dead: Callable[[str, int], None] | None = None, page_size: int = 16,
                 worker_timeout_s: float = 30.0, worker_step_timeout_s: float = 120.0):
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
        # router.worker_timeout_s: a worker that answers nothing for this long is hung (taken for dead).
        # A call or a stream that has waited stall_check_s pings the worker, which has the rest to answer.
        self.worker_timeout_s = worker_timeout_s
        # router.worker_step_timeout_s: a worker that answers but whose step loop has work and has made no
        # progress for this long is hung too (worker_pool._alive asks it with every ping).
        self.worker_step_timeout_s = worker_step_timeout_s
        self.stall_check_s = stall_check_s if stall_check_s is not None else worker_timeout_s / 2
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
        group = ForkGroup(self, list(request_ids), engine_prompt(prompt_ids), params)
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
                        attempt_stream = self._attempt(request_id, attempt, engine_prompt(prompt_ids), streamed, params, acc)
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
                await asyncio.wait_for(worker.actor.abort.remote(attempt_id), self.worker_timeout_s)
            except Exception as e:  # a dead (or hung) worker has nothing left to abort
                log.info("abort of %s on decode %d: %r", request_id, worker.rank, e)

    # ---- one attempt on one (prefill, decode) pair -------------------------------------------
    async def _attempt(self, request_id: str, attempt: int, prompt: list[int], streamed: list[int],
                       params: SamplingParams, acc: _Acc) -> AsyncIterator[list[TokenOutput]]:
        import ray

        attempt_id = request_id if attempt == 0 else f"{request_id}#retry{attempt}"
        # An array('i') prompt stays one (router/engine_client.engine_prompt): Ray pickles it as bytes.
        full = prompt + (array.array("i", streamed) if isinstance(prompt, array.array) else streamed)
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
                async with contextlib.aclosing(self._relay(queue, decode, attempt_id)) as relayed:
                    async for outs in relayed:
                        finished = outs[-1].finish_reason is not None
                        yield outs
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
                await _quietly(prefill.actor.release.remote(handle.lease_id), self.worker_timeout_s)
            if not finished and not decode.dead:
                await _quietly(decode.actor.abort.remote(attempt_id), self.worker_timeout_s)
                await _quietly(decode.actor.unreserve.remote(attempt_id), self.worker_timeout_s)
            elif finished and not decode.dead:
                await _quietly(decode.actor.unreserve.remote(attempt_id), self.worker_timeout_s)

    async def _prefill_once(self, prefill: _Worker, attempt_id: str, prompt: list[int], params: SamplingParams,
                            done: int, forks: tuple[SamplingParams, ...] = ()):
        """One prefill call (counted in /metrics); `forks`: the other choices of a fork group."""
        import ray

        try:
            if forks:
                call = prefill.actor.prefill.remote(attempt_id, prompt, params, done, forks)
            else:
                call = prefill.actor.prefill.remote(attempt_id, prompt, params, done)
            res = await self._watched(prefill, call, "prefill_unresponsive")
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
            # Unique for good, not per client object: an id built from id(self) came back when a later
            # client reused a collected one's address, and the worker's two readers split its events.
            ch = _Channel(f"{w.rank}-{uuid.uuid4().hex}", worker=w)
            ch.task = asyncio.ensure_future(self._pump(w, ch))
            self._channels[w.rank] = ch
        return ch

    async def _pump(self, w: _Worker, ch: "_Channel") -> None:
        import ray

        stream = w.actor.channel.options(num_returns="streaming").remote(ch.id)
        ended = False
        try:
            async for ref in stream:
                for rid, token, logprob, reason, error, top in await ref:
                    q = ch.queues.get(rid)
                    if q is not None:
                        q.put_nowait((token, logprob, reason, error, top))
            ended = True
        except ray.exceptions.RayActorError:
            self._mark_dead(w)
            ended = True
        except Exception as e:  # the channel broke: every request on it must learn it, not wait
            log.warning("token channel to decode %d failed: %r", w.rank, e)
        finally:
            # This client is closing (or gave up on the stream): end the worker's side too, which Ray
            # leaves waiting when the caller drops a stream. (ray.cancel would start Ray if it is not.)
            if not ended and ray.is_initialized():
                try:
                    ray.cancel(stream)
                except Exception as e:
                    log.debug("cancelling the token channel to decode %d: %r", w.rank, e)
            for q in list(ch.queues.values()):
                q.put_nowait(_CHANNEL_GONE)

    async def _start(self, decode: _Worker, attempt_id: str, handle, first: int, generated: int,
                     params: SamplingParams, prefill: _Worker, channel_id: str, history: tuple[int, ...] = (),
                     prompt_tokens: tuple[int, ...] = (), children: tuple | None = None):
        """The decode worker's `start` (or `start_group` for the `children` of a fork group)."""
        import ray

        try:
            if children is not None:
                call = decode.actor.start_group.remote(attempt_id, handle, generated, params, prefill.actor,
                                                       channel_id, children, history, prompt_tokens)
            else:
                call = decode.actor.start.remote(attempt_id, handle, first, generated, params, prefill.actor,
                                                 channel_id, history, prompt_tokens)
            return await self._watched(decode, call, "decode_unresponsive")
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

    async def _relay(self, queue: asyncio.Queue, decode: _Worker, attempt_id: str) -> AsyncIterator[list[TokenOutput]]:
        """A started request's tokens from its channel queue, as they arrive, up to the batch carrying its
        finish (an attempt's and a fork group choice's decode phase); `_next` raises what ends it early."""
        while True:
            outs = await self._next(queue, decode, attempt_id)
            yield outs
            if outs[-1].finish_reason is not None:
                return

    async def _next(self, queue: asyncio.Queue, decode: _Worker, attempt_id: str) -> list[TokenOutput]:
        """The request's tokens that arrived since the last call (waits for at least one); _Aborted once
        the worker reports the request aborted. Never waits for good: a worker that stops answering is
        hung, and one that answers but has sent this request's last event already (`streaming`) while
        nothing came here for two stall checks has lost its stream: both are retried (re-prefilled)."""
        items = []
        lost = False
        while queue.empty():  # wait_for costs a timer per call: only when nothing is queued yet
            try:
                items.append(await asyncio.wait_for(queue.get(), timeout=self.stall_check_s))
                break
            except asyncio.TimeoutError:
                # No token for a while: a busy worker answers a ping, a hung or gone one does not.
                if not await self._alive(decode):
                    raise _Retry(f"decode worker {decode.rank} stopped answering", "decode_unresponsive",
                                 decode) from None
                if await self._streaming(decode, attempt_id):
                    lost = False
                elif lost:  # its end left the worker a whole stall check ago and is not here
                    log.warning("request %s: decode worker %d ended its stream, but the end never reached "
                                "this client", attempt_id, decode.rank)
                    raise _Retry(f"decode worker {decode.rank} ended the stream of {attempt_id}, but its "
                                 "end never arrived", "decode_stream_lost", decode) from None
                else:
                    lost = True  # its last event may still be on its way: one more stall check
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

    async def _streaming(self, decode: _Worker, attempt_id: str) -> bool:
        """Does the decode worker still have events to send for the attempt? True when it cannot say in
        time (the next ping decides whether it is hung)."""
        try:
            return bool(await asyncio.wait_for(decode.actor.streaming.remote(attempt_id), self.worker_timeout_s))
        except Exception as e:
            log.info("asking decode %d about %s: %r", decode.rank, attempt_id, e)
            return True

    # ---- metrics, draining -------------------------------------------------------------------
    def _metrics(self, request_id: str, prompt_tokens: int, t0: float, acc: _Acc) -> RequestMetrics:
        return request_metrics(request_id, prompt_tokens, t0, acc)

    @property
    def draining(self) -> bool:
        """Shutting down: not ready for new requests (/health/ready)."""
        return self._draining

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait for the in-flight ones; True if all finished in time."""
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False


async def _quietly(ref, timeout_s: float | None = None) -> None:
    """Best-effort cleanup call: the worker may be gone (or hung: `timeout_s`), and the request is ending
    anyway."""
    try:
        await asyncio.wait_for(ref, timeout_s)
    except Exception as e:
        log.debug("cleanup call failed: %r", e)
