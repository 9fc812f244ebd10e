"""The engine client's pool of worker actors: which are live, where a request goes (the prefill worker it
is prefilled on, the decode worker that reserves its pages, or the admission line when none has room),
and what happens when one dies (marked dead at once, the supervisor told; `replace_worker` swaps its
replacement in).

`WorkerPool` is the pool half of `DisaggregatedEngineClient` (cluster/engine_client.py), which sets
the attributes it uses: `prefill`, `decode` (lists of `_Worker`), `colocated`, `policy`, `prefix_index`,
`_turn`, `_admit_lock`, `admission`, `admission_timeout_s`, `on_worker_dead`, `resume_timeout_s`,
`worker_timeout_s`, `worker_step_timeout_s`, `stall_check_s` and `_draining`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.cluster.admission import AdmissionTimeout
from kvrelay.cluster.routing import rank
from kvrelay.router.engine_client import EngineUnavailable

log = logging.getLogger("kvrelay.requests")


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


@dataclass
class _Worker:
    role: str
    rank: int
    actor: object
    queued_tokens: int = 0  # prefill: prompt tokens this client has in flight there
    last_pick: float = 0.0
    dead: bool = False


class WorkerPool:
    """The pool half of DisaggregatedEngineClient (see the module docstring for what it expects)."""

    async def _alive(self, worker: _Worker) -> bool:
        """Does `worker` answer a health check within what is left of router.worker_timeout_s after the
        stall check, with its step loop making progress? One that does not (dead; hung: a stopped
        process; or answering while its step loop has had work and no progress for
        router.worker_step_timeout_s: a step stuck in a kernel or a collective) is marked dead."""
        timeout = max(1.0, self.worker_timeout_s - self.stall_check_s)
        try:
            calls = (worker.actor.health.remote(), worker.actor.step_stall_s.remote())
            _, stalled_s = await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(c.future()) for c in calls)),
                                                  timeout=timeout)
        except Exception:
            self._mark_dead(worker)
            return False
        if stalled_s >= self.worker_step_timeout_s:
            log.warning("%s worker %d: its step loop has made no progress with work for %.0f s "
                        "(router.worker_step_timeout_s %g): taken for hung", worker.role, worker.rank,
                        stalled_s, self.worker_step_timeout_s)
            self._mark_dead(worker)
            return False
        return True

    async def _watched(self, worker: _Worker, call, cause: str):
        """The result of the actor call `call` (an ObjectRef) on `worker`, however long it runs (a long
        prompt's prefill, a queue), as long as the worker answers a health check every stall_check_s;
        one that stops answering is hung: _Retry(`cause`), the call is left to fail with its actor."""
        fut = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=self.stall_check_s)
                if done:
                    return fut.result()
                if not await self._alive(worker):
                    raise _Retry(f"{worker.role} worker {worker.rank} stopped answering", cause, worker)
        finally:
            if not fut.done():
                fut.cancel()

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
                    call = w.actor.reserve.remote(attempt_id, prompt_tokens, max_tokens, tuple(siblings))
                else:
                    call = w.actor.reserve.remote(attempt_id, prompt_tokens, max_tokens)
                await self._watched(w, call, "decode_unresponsive")
                if self.colocated and self.prefix_index is not None:
                    self.prefix_index.record(w.rank, hashes)
                    self.prefill[w.rank].last_pick = time.monotonic()
                return w
            except ray.exceptions.RayActorError:
                self._mark_dead(w)
            except _Retry:  # hung: marked dead, nothing reserved there that outlives it
                pass
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
            free, admitted = await self._watched(w, w.actor.load.remote(), "decode_unresponsive")
            return free, admitted, w
        except ray.exceptions.RayActorError:
            self._mark_dead(w)
            return None
        except _Retry:  # hung (marked dead)
            return None

    def dead_workers(self) -> list[tuple[str, int]]:
        return [(w.role, w.rank) for w in self.prefill + self.decode if w.dead]

    async def gauges(self) -> dict:
        """What /metrics reads at scrape time (router/metrics.refresh): the admission line's length and
        each live decode worker's share of KV pages in use."""
        live = [w for w in self.decode if not w.dead]
        stats = await asyncio.gather(*(asyncio.wait_for(w.actor.status.remote(), self.worker_timeout_s) for w in live),
                                     return_exceptions=True)  # a hung worker must not hang the scrape
        usage = {}
        for w, st in zip(live, stats):
            if not isinstance(st, BaseException) and sum(st.pages_total.values()):
                usage[f"decode-{w.rank}"] = sum(st.pages_in_use.values()) / sum(st.pages_total.values())
        return {"waiting": self.admission.waiting, "kv_cache_usage": usage}
