"""Decode worker: a page pool, a continuous-batching step loop, and the token streams of its requests.

Runs as an async Ray actor (cluster/serve.py wraps it with `ray.remote`), built from its `DecodeSpec`
(workers/specs.py), which is all it knows of the topology. The event loop only coordinates: admission,
the NIXL pull (in a thread, it blocks), and the token streams. A dedicated step thread (step_thread.py)
owns the Runner and the Scheduler: every other engine call is queued and run by it between two steps, all
pending ones at once. Tokens a step produced reach the event loop in one hand-off per step and go to each
caller's channel (`start` + `channel`: one Ray message per step for all of a router's requests) or to a
request's own stream (`generate`).

With `decode.tp` > 1 this actor is rank 0 of the worker's group and starts the other ranks itself
(ranks.py, over workers/rank_group.py): the Scheduler drives a `GroupRunner` that runs every import,
decode step and free on all ranks in lockstep, and each rank pulls only its own KV heads from whichever
prefill ranks hold them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence

from kvrelay.decode_worker.ranks import DecodeRank, GroupRunner, decode_join, load_rank_runner, pool_tokens
from kvrelay.decode_worker.scheduler import Scheduler
from kvrelay.decode_worker.step_thread import StepThread
from kvrelay.engine.sampling import SamplingParams
from kvrelay.transfer.handle import KVHandle, KVLeaseExpired, KVReadInFlight, KVTransferError, TransferStats, layout_of
from kvrelay.transfer.nixl import KVImporter
from kvrelay.workers.loading import load_sized_runner
from kvrelay.workers.logs import REQUEST_LOG, request_extra
from kvrelay.workers.messages import DecodeChunk, PullMetrics, WorkerStatus
from kvrelay.workers.rank_group import Followers, lead_group, node_name
from kvrelay.workers.specs import DecodeSpec

RELEASE_TIMEOUT_S = 10.0  # for the prefill worker's answer to a lease release after a pull
_ABORTED = object()  # put on a stream's queue by `abort`: end the stream without a finish reason
_CLOSED = object()  # put on a channel's queue by `reset`: end that channel's stream

req_log = logging.getLogger(REQUEST_LOG)  # per-request lines, with --log-requests (workers/logs.py)


class DecodeWorker(StepThread):
    log_role = "decode"  # names the worker in log lines
    colocated = False

    def __init__(self, spec: DecodeSpec, rank: int = 0):
        spec.ucx.apply()
        self.rank = rank
        self.tp_size = spec.tp
        self.group: Followers | None = None  # ranks 1.. of a TP group; None at TP1
        self.plan_log: list[str] = []
        if self.tp_size == 1:
            self.runner = self._load_single(spec)
        else:
            kv_tokens = pool_tokens(spec)  # before any rank allocates: followers reuse this count
            self.group, runner = lead_group(
                DecodeRank, device=spec.device, tp_size=self.tp_size, max_concurrency=16,
                args=lambda r, port: (spec, rank, r, port, kv_tokens),
                join=lambda port: decode_join(spec, 0, port),
                load=lambda ctx: load_rank_runner(spec, kv_tokens, ctx))
            self.runner = GroupRunner(runner, self.group)
        for line in self.plan_log:  # reaches `kvrelay serve`'s output through Ray's log forwarding
            print(f"kvrelay: {'colocated' if self.colocated else 'decode'} worker {rank}: {line}", flush=True)
        self.importer = None
        if not self.colocated:
            layout, pools = layout_of(self.runner.kv)
            self.importer = KVImporter(layout, pools, name_prefix=f"decode{rank}")
        self.scheduler = Scheduler(self.runner, max_batch=spec.max_batch,
                                   headroom=self._headroom(spec), overlap=spec.overlap_steps)
        # The step thread owns the Runner and the Scheduler: every other call is an op it runs between two
        # steps (decode_worker/step_thread.py).
        StepThread.__init__(self, f"decode worker {rank}")
        self._streams: dict[str, asyncio.Queue] = {}  # request -> its own stream (generate)
        self._route: dict[str, str] = {}  # request -> channel id (start)
        self._channels: dict[str, asyncio.Queue] = {}  # channel id -> batches of events
        self._readers: set[str] = set()  # channel ids with an open `channel` stream
        self._outbox: list = []  # (request, TokenOutput | error) of the current step (step thread)
        self.completed = 0
        self.decode_tokens = 0  # tokens computed by decode steps (a pulled prompt is never recomputed)
        self._thread.start()

    def _load_single(self, spec: DecodeSpec, chunk_tokens: int | None = None, cache_share: float = 0.0):
        """TP1: the pool is sized after the weights, from what is measured free then (engine/memory.py),
        around one forward of `chunk_tokens` (default: a decode step of a full batch); `cache_share`: the
        sliding group's share for a prefix cache (a colocated worker's; a decode worker has no cache)."""
        return load_sized_runner(
            spec.model, device=spec.device, page_size=spec.page_size, fraction=spec.kv_memory_fraction,
            max_seqs=spec.max_batch, chunk_tokens=max(spec.max_batch, 16) if chunk_tokens is None else chunk_tokens,
            max_tokens=spec.max_batch * spec.model.max_context, need_tokens=spec.need_tokens,
            key="decode.kv_memory_fraction", graph_sizes=spec.graph_sizes, log=self.plan_log.append,
            cache_share=cache_share, gpu_share=spec.gpu_memory_fraction, share_key="decode.gpu_memory_fraction")

    def _headroom(self, spec: DecodeSpec) -> dict[str, int]:
        return {}

    # ---- admission ---------------------------------------------------------------------------
    async def reserve(self, request_id: str, prompt_tokens: int, max_tokens: int,
                      siblings: Sequence[str] = ()) -> dict[str, int]:
        """Commit pages for the request's worst case (and its `siblings`': the other choices of an n > 1
        request, all or none); raises AdmissionRefused (with `retryable`). Answered at once, not at the
        next step boundary: a reservation is bookkeeping under its own lock."""
        if self._stop:
            raise RuntimeError(f"decode worker {self.rank} is shutting down")
        return self.scheduler.reserve(request_id, prompt_tokens, max_tokens, siblings)

    async def unreserve(self, request_id: str) -> None:
        await self._locked(self.scheduler.release, request_id)

    def _import(self, request_id: str, handle: KVHandle, generated: int, params: SamplingParams):
        """Under the engine lock: reserve if the client did not, allocate the pages, and mark them as
        being written by a READ from here on."""
        if not self.scheduler.has_reservation(request_id):
            self.scheduler.reserve(request_id, handle.num_tokens, params.max_tokens - generated + 1)
        self.importer.check(handle)
        kv = self.runner.import_sequence(request_id, handle.num_tokens)
        if kv.first_page != handle.first_blocks():
            raise RuntimeError(f"request {request_id}: page windows differ (prefill "
                               f"{handle.first_blocks()}, decode {kv.first_page})")
        self.scheduler.begin_pull(request_id)
        return kv

    # ---- the streams -------------------------------------------------------------------------
    async def _admit(self, request_id: str, handle, first_token: int, generated: int, params: SamplingParams,
                     prefill, register, history: Sequence[int] = (),
                     prompt_tokens: Sequence[int] = (), children: Sequence[tuple] | None = None) -> PullMetrics | None:
        """Pull the handle's KV, release the prefill lease, call `register()` (where the request's tokens
        go) and join the batch. None if the request was released during the pull. `children`: (request
        id, first token, params) of the choices that decode from this KV (default: the request alone);
        each other than `request_id` gets a fork of its sequence (`Runner.fork_sequence`), and a
        `request_id` not among them is freed once they have theirs."""
        self._loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        # Shielded: a call cancelled mid-pull leaves the task running, so the pages are freed only once
        # every rank's READ has ended (the release below is deferred until then).
        stats, dropped = await asyncio.shield(asyncio.ensure_future(
            self._pull(handle, request_id, generated, params)))
        if dropped:  # aborted during the pull; its pages are free again now
            await _quietly(prefill.release.remote(handle.lease_id))
            return None
        # Every rank's READ has finished (the prefill side frees only after this release, so no rank can
        # read a page that was handed to another prompt). The pull is only trustworthy if the lease was
        # still valid when released: an expired lease may have had its pages reused during the READ.
        if not await self._release_lease(prefill, handle):
            raise KVLeaseExpired(f"request {request_id}: lease {handle.lease_id} expired before the "
                                 f"pull was confirmed; re-run prefill")
        register()
        kids = ((request_id, first_token, params),) if children is None else tuple(children)

        def join() -> None:
            for rid, token, p in kids:
                if rid != request_id:
                    if not self.scheduler.has_reservation(rid):
                        # Aborted during the pull: nothing to fork for it, but its route is set, so its
                        # caller hears "aborted" rather than waiting for a token that never comes.
                        self._emit(rid, _ABORTED)
                        continue
                    self.runner.fork_sequence(request_id, rid)
                self.scheduler.join(rid, p, token, generated, lambda out, rid=rid: self._emit(rid, out), history,
                                    prompt_tokens)
            if all(rid != request_id for rid, _, _ in kids):
                self.scheduler.release(request_id)  # a choice that ended on its first token: pages only

        await self._locked(join)
        return PullMetrics(stats.nbytes, stats.seconds, time.perf_counter() - t0)

    async def start(self, request_id: str, handle, first_token: int, generated: int, params: SamplingParams,
                    prefill, channel_id: str, history: Sequence[int] = (),
                    prompt_tokens: Sequence[int] = ()) -> PullMetrics | None:
        """Like `generate`, but the tokens go to the caller's `channel(channel_id)` stream, which carries
        every request of that caller in one message per step. Returns once the request decodes (None if
        it was released during the pull). Why: a Ray stream per request cost one Ray message per token
        per request, which held the served rate to a few thousand tokens/s in the router process."""
        joined = False
        try:
            pull = await self._admit(request_id, handle, first_token, generated, params, prefill,
                                     lambda: self._route.__setitem__(request_id, channel_id), history,
                                     prompt_tokens)
            joined = pull is not None
            return pull
        except BaseException:
            self._route.pop(request_id, None)
            await self._locked(self._end, request_id, joined)
            raise

    async def start_group(self, request_id: str, handle, generated: int, params: SamplingParams, prefill,
                          channel_id: str, children: Sequence[tuple], history: Sequence[int] = (),
                          prompt_tokens: Sequence[int] = ()) -> PullMetrics | None:
        """`start` for the n choices of one prompt (workers/forks.py): the prompt's KV is pulled once
        into `request_id` (choice 0, `params` its own) and forked into each of `children` ((request id,
        first token, params), each holding a reservation: `reserve(..., siblings)`); their tokens go to
        the caller's channel under their own ids. `request_id` decodes only if it is among `children`."""
        ids = [rid for rid, _, _ in children]
        joined = False
        try:
            pull = await self._admit(request_id, handle, None, generated, params, prefill,
                                     lambda: self._route.update((rid, channel_id) for rid in ids), history,
                                     prompt_tokens, children=children)
            joined = pull is not None
            return pull
        except BaseException:
            for rid in ids:
                self._route.pop(rid, None)
            await self._locked(self._end_all, [request_id, *ids], joined)
            raise

    def _end_all(self, ids: Sequence[str], joined: bool) -> None:
        for rid in ids:
            self._end(rid, joined)

    async def channel(self, channel_id: str) -> AsyncIterator[list[tuple]]:
        """Streaming generator: batches of (request_id, token_id, logprob, finish_reason, error, top_logprobs)
        for the requests started with this channel id; error is None, "aborted", or a failure's text.
        One reader per id: a second stream under an id still being read is refused, since the two would
        take turns at its queue and each lose the other's events (a request whose finish went to the
        other reader waited for good: a caller that dropped its stream leaves this generator waiting here,
        Ray does not cancel it)."""
        if channel_id in self._readers:
            raise ValueError(f"decode worker {self.rank}: token channel {channel_id!r} is already open")
        self._readers.add(channel_id)
        queue = self._channels.setdefault(channel_id, asyncio.Queue())
        try:
            while True:
                batch = await queue.get()
                while not queue.empty():
                    batch += queue.get_nowait()
                if _CLOSED in batch:  # reset(): its router is gone
                    return
                yield batch
        finally:
            self._readers.discard(channel_id)
            if self._channels.get(channel_id) is queue:
                del self._channels[channel_id]

    async def streaming(self, request_id: str) -> bool:
        """Will this worker still send an event for `request_id` (a token, its finish, an error or
        "aborted")? The engine client asks when a request it waits for has had no token for a while:
        False means its last event has left (or never will come), so a wait for more is a lost stream.
        Answered at once, like `reserve`."""
        return request_id in self._route or request_id in self._streams

    async def generate(self, request_id: str, handle: KVHandle, first_token: int, generated: int,
                       params: SamplingParams, prefill) -> AsyncIterator[DecodeChunk]:
        """Pull the handle's KV, release the prefill lease, decode until a stop condition, streaming
        chunks of tokens (one Ray stream for this request; the router uses `start` + `channel`).
        `generated` counts the tokens the request already has (first_token included). `prefill` is the
        exporting worker's actor handle (only `.release` is called on it)."""
        queue: asyncio.Queue = asyncio.Queue()
        joined = False
        try:
            pull = await self._admit(request_id, handle, first_token, generated, params, prefill,
                                     lambda: self._streams.__setitem__(request_id, queue))
            if pull is None:
                return
            joined = True
            while True:
                item = await queue.get()
                tokens = [item]
                while not queue.empty():
                    tokens.append(queue.get_nowait())
                if any(isinstance(t, BaseException) for t in tokens):
                    raise next(t for t in tokens if isinstance(t, BaseException))
                if _ABORTED in tokens:
                    return
                yield DecodeChunk(tuple(tokens), pull)
                pull = None
                if tokens[-1].finish_reason is not None:
                    self.completed += 1
                    return
        finally:
            # Normal end: the scheduler already freed the pages. Errors, aborts and a consumer that went
            # away (the generator is closed) land here too and must give every page back (after the
            # READ, if one may still be writing into them: the scheduler defers it).
            self._streams.pop(request_id, None)
            await self._locked(self._end, request_id, joined)

    @staticmethod
    async def _release_lease(prefill, handle: KVHandle) -> bool:
        """Unpin the pulled pages; False if the lease had expired. A prefill worker that died meanwhile
        cannot confirm the READ saw its pages intact, which the client fixes like an expiry: re-prefill."""
        import ray

        try:
            # Bounded: a hung prefill worker would otherwise hold this request (and its pulled pages) for
            # good; the supervisor replaces a worker that stops answering.
            return await asyncio.wait_for(prefill.release.remote(handle.lease_id), timeout=RELEASE_TIMEOUT_S)
        except ray.exceptions.RayActorError as e:
            raise KVTransferError(f"request {handle.request_id}: prefill worker gone before the pull was "
                                  f"confirmed ({type(e).__name__}); re-run prefill") from None
        except asyncio.TimeoutError:
            raise KVTransferError(f"request {handle.request_id}: prefill worker did not confirm the pull within "
                                  f"{RELEASE_TIMEOUT_S:g} s; re-run prefill") from None

    def _end(self, request_id: str, joined: bool) -> None:
        if joined:
            self.scheduler.abort(request_id)
        else:
            self.scheduler.release(request_id)

    async def _pull(self, handle: KVHandle, request_id: str, generated: int,
                    params: SamplingParams) -> tuple[TransferStats, bool]:
        """Allocate the pages, run every rank's READ of its heads into them, then close the pull window:
        (stats, whether the request was released meanwhile, its pages now freed). One task from the
        allocation on, so no cancellation can separate a `begin_pull` from its `end_pull`."""
        kv = await self._locked(self._import, request_id, handle, generated, params)
        try:
            stats = await self._read(handle, request_id, kv.pages)
        except KVReadInFlight:
            # A READ that could be neither finished nor cancelled may still write into these pages, so
            # they stay allocated (in their pull state) for good rather than be handed to another request.
            raise
        except Exception:
            await self._locked(self.scheduler.end_pull, request_id)
            raise
        return stats, await self._locked(self.scheduler.end_pull, request_id)

    async def _read(self, handle: KVHandle, request_id: str, pages) -> TransferStats:
        """This rank's READ, and every follower's READ of its own heads, concurrently; returns once all
        of them have ended, whether or not one failed."""
        local = asyncio.to_thread(self.importer.pull, handle, pages)
        if self.group is None:
            return await local
        import ray

        refs = self.runner.pull_refs(handle, request_id)
        results = await asyncio.gather(local, *refs, return_exceptions=True)
        for r in results:
            if isinstance(r, ray.exceptions.RayTaskError) and isinstance(r.cause, Exception):
                raise r.cause  # e.g. KVLeaseExpired: the client re-prefills, as for rank 0's own pull
            if isinstance(r, BaseException):
                raise r
        return TransferStats(nbytes=sum(r.nbytes for r in results), seconds=max(r.seconds for r in results),
                             descriptors=sum(r.descriptors for r in results))

    def _emit(self, request_id: str, out) -> None:
        """Called on the step thread: collected, and handed to the event loop once per step (_flush)."""
        self._outbox.append((request_id, out))

    def _flush(self) -> None:
        if self._outbox and self._loop is not None:
            batch, self._outbox = self._outbox, []
            self._loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch: list) -> None:
        """On the event loop: each token to its request's stream, or into its caller's channel batch."""
        out: dict[str, list] = {}
        for rid, item in batch:
            queue = self._streams.get(rid)
            if queue is not None:
                queue.put_nowait(item)
                continue
            ch = self._route.get(rid)
            if ch is None:
                continue
            if isinstance(item, BaseException):
                ev = (rid, None, None, None, f"{type(item).__name__}: {item}", None)
            elif item is _ABORTED:
                ev = (rid, None, None, None, "aborted", None)
            else:
                ev = (rid, item.token_id, item.logprob, item.finish_reason, None, item.top_logprobs)
            if ev[3] is not None or ev[4] is not None:
                self._route.pop(rid, None)
                if ev[3] is not None:
                    self.completed += 1
                if req_log.isEnabledFor(logging.INFO):
                    req_log.info("decode ended: %s", ev[4] or f"finish_reason {ev[3]}",
                                 extra=request_extra(rid, f"{self.log_role}-{self.rank}"))
            out.setdefault(ch, []).append(ev)
        for ch, events in out.items():
            self._channels.setdefault(ch, asyncio.Queue()).put_nowait(events)

    async def abort(self, request_id: str) -> bool:
        def abort() -> bool:
            return self.scheduler.abort(request_id)

        found = await self._locked(abort)
        if request_id in self._streams or request_id in self._route:
            self._deliver([(request_id, _ABORTED)])
        return found

    async def reset(self) -> int:
        """End every request an earlier router left here, freeing its pages and reservation; returns how
        many. A router re-attaching after its predecessor died calls this before routing anything here:
        those requests' streams have no reader any more, and their KV would otherwise stay until each
        ran to max_tokens."""
        n = await self._locked(self._forget_all)
        for rid in list(self._streams) + list(self._route):
            self._deliver([(rid, _ABORTED)])
        for queue in self._channels.values():  # the earlier router's streams: nobody reads them any more
            queue.put_nowait([_CLOSED])
        self._channels.clear()
        return n

    def _forget_all(self) -> int:
        """(step thread) Abort every request: a running one leaves at the next step boundary."""
        ids = self.scheduler.request_ids()
        for rid in ids:
            self.scheduler.abort(rid)
        return len(ids)

    # ---- the step loop -----------------------------------------------------------------------
    def _has_work(self) -> bool:
        return self.scheduler.has_work()

    def _step(self) -> None:
        self.decode_tokens += self.scheduler.step()

    def _running(self) -> list[str]:
        return self.scheduler.running_ids()

    def _step_failed(self, running: list[str], exc: BaseException) -> None:
        for rid in running:
            self._emit(rid, RuntimeError(f"decode step failed on worker {self.rank}: {exc!r}"))
            self.scheduler.release(rid)

    # ---- introspection -----------------------------------------------------------------------
    async def health(self) -> bool:
        return self._thread.is_alive() and not self._stop

    async def load(self) -> tuple[int, int]:
        """(pages a new request could still reserve, requests admitted): what the router ranks by (at once,
        like `reserve`)."""
        return self.scheduler.admission_load()

    async def status(self) -> WorkerStatus:
        s = await self._locked(self.scheduler.stats) if self._thread.is_alive() else self.scheduler.stats()
        return WorkerStatus(
            role="colocated" if self.colocated else "decode", rank=self.rank, tp_rank=0, tp_size=self.tp_size,
            pid=os.getpid(), node=node_name(), healthy=await self.health(),
            pages_in_use=s.pages_in_use, pages_reserved=s.pages_reserved, pages_total=s.pages_total,
            free_budget=s.free_budget, admitted=s.reserved, running=s.running, steps=self.steps,
            completed=self.completed, agent=self.importer.agent_name if self.importer else "-",
            last_step_error=repr(self._step_error) if self._step_error else None,
            decode_tokens=self.decode_tokens, step_phases={**self.scheduler.times.as_dict(), "ops_s": self.ops_s})

    async def shutdown(self) -> None:
        self._stop_steps()
        if self.importer is not None:
            self.importer.close()
        if self.group is not None:  # blocks on Ray: off the event loop
            await asyncio.get_running_loop().run_in_executor(None, self.group.shutdown)


async def _quietly(ref) -> None:
    """A courtesy call whose failure changes nothing for this request (the peer may be gone)."""
    try:
        await ref
    except Exception:
        pass
