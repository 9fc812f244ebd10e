"""Continuous batching over a Runner: requests join and leave at every decode step.

Admission is by page budget, never by current usage. A request reserves, up front, the most pages it can
ever hold (prompt + max_tokens, with the sliding group capped at one window), and the sum of reservations
never exceeds the pool. So a step can never run out of pages half-way, no running request is ever
preempted, and "free pages" as seen by the router is simply capacity minus reservations.

A request's pages exist before its KV does: they are allocated on import, then filled by a NIXL READ
that the worker runs outside this class. While that READ may still be writing (`begin_pull` ..
`end_pull`), releasing the request only marks it: the pages, and the budget they stand for, are given
back once the READ has ended, so they are never handed to another request mid-write.

This class is plain bookkeeping plus `step()`; it starts no threads, so it is tested directly. The decode
actor (worker.py) serialises calls to it on its step thread, except admission: `reserve` and
`admission_load` touch only the reservations, under one small lock, so the actor answers them at once
instead of at the next step boundary (a burst of requests, each waiting for its own step to be admitted,
queued for seconds behind 20-60 ms steps).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvrelay.engine.kv_geometry import FULL, GROUPS, worst_case_pages
from kvrelay.engine.runner import Runner
from kvrelay.engine.sampling import SamplingParams, TokenOutput, context_full, finish_reason_at, top_logprobs
from kvrelay.workers.messages import AdmissionRefused
from kvrelay.engine import grammar
from kvrelay.engine.structured import ConstraintBatch, apply_bitmask, open_constraint, sample_constrained


@dataclass(frozen=True)
class SchedulerStats:
    running: int  # joined the batch
    reserved: int  # holding a reservation (running or about to join)
    pages_in_use: dict[str, int]  # actually allocated in the pool
    pages_reserved: dict[str, int]  # committed to reservations
    pages_total: dict[str, int]
    headroom: dict[str, int] = field(default_factory=dict)  # kept out of reservations (see Scheduler)

    @property
    def free_budget(self) -> int:
        """Pages a new request could still reserve (the scarcer group decides)."""
        return min(self.pages_total[g] - self.headroom.get(g, 0) - self.pages_reserved[g] for g in GROUPS)


@dataclass(eq=False)
class _Running:
    request_id: str
    params: SamplingParams
    last_token: int
    generated: int  # tokens already produced for this request (incl. the prefill's first token)
    emit: Callable[[TokenOutput], None]
    aborted: bool = False
    output: list[int] | None = None  # tokens generated so far, kept only when penalties read them
    prompt: object = ()  # the prompt's distinct tokens (a device tensor), kept only for repetition_penalty
    constraint: object | None = None  # engine.structured.Constraint of a structured-output request
    # Tokens emitted and not yet fed to `constraint`: the next mask job feeds them on the grammar thread
    # (stopping reads only the token; nothing on the step thread reads the constraint's state).
    unfed: list[int] = field(default_factory=list)


@dataclass
class _InFlight:
    """An overlapped step launched and not read back: its requests, each one's cache length after the
    step, and the runner's pending step."""

    batch: list[_Running]
    lengths: list[int]
    pending: object  # engine.runner.PendingStep
    ids: frozenset[str] = frozenset()  # the batch's request ids (release asks for each finishing request)

    def __post_init__(self) -> None:
        self.ids = frozenset(r.request_id for r in self.batch)


@dataclass(eq=False)
class _ForkBudget:
    """The choices of one n > 1 request reserved together (`Scheduler.reserve` with siblings): the prompt
    pages they share are in the holder's budget only."""

    members: set[str]
    shared: dict[str, int]
    holder: str


@dataclass
class StepTimes:
    """Seconds the step loop spent per phase, summed (what `kvrelay status` shows): where a served step's
    time goes besides the GPU."""

    launch_s: float = 0.0  # decode steps, host: planning the step and queueing its kernels
    wait_s: float = 0.0  # decode steps: blocked on the device for a step's tokens
    emit_s: float = 0.0  # host: per-request token bookkeeping and hand-off
    mixed_s: float = 0.0  # steps that carried prompt chunks too (colocated): the whole forward + sampling
    steps: int = 0
    overlapped: int = 0  # steps launched while the one before was still on the device
    mixed: int = 0  # steps that also carried prompt chunks

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class Scheduler:
    runner: Runner
    max_batch: int
    _budget: dict[str, dict[str, int]] = field(default_factory=dict)  # request -> pages per group
    _running: dict[str, _Running] = field(default_factory=dict)  # insertion order = join order
    _pulling: set[str] = field(default_factory=set)  # a READ may be writing into these requests' pages
    _release_after_pull: set[str] = field(default_factory=set)  # released while pulling
    # Pages kept out of the reservable budget: a colocated worker's prompt chunks hold all their sliding
    # pages until their forward ends, beyond the one window a reservation counts.
    headroom: dict[str, int] = field(default_factory=dict)
    # Overlapped decode (greedy batches on a runner that can launch without waiting): step N+1 is
    # planned and queued while step N runs on the device, its input tokens taken from N's device output;
    # N's tokens are read back and emitted after. A request that stops at N (a stop token) has ridden
    # along in N+1 for nothing; its result is dropped, its pages freed once N+1 has been read back.
    # Structured rows too: forward N+1 is queued first, then N's tokens are read back and fed to the
    # constraints, and N+1's masks filled while that forward runs; the masked argmax is queued behind it.
    overlap: bool = False
    times: StepTimes = field(default_factory=StepTimes)
    _inflight: _InFlight | None = None
    _deferred: set[str] = field(default_factory=set)  # released while a launched step still uses them
    _budget_lock: threading.Lock = field(default_factory=threading.Lock)  # guards _budget (see module doc)
    _forks: dict[str, "_ForkBudget"] = field(default_factory=dict)  # a fork group's choices -> their budget
    _grammar: ConstraintBatch | None = None  # structured outputs' mask thread, made on first use

    def __post_init__(self) -> None:
        grammar.warm_up()  # structured outputs' vocabulary (~1 s), built off the step thread

    @property
    def capacity(self) -> dict[str, int]:
        return {g: max(0, self.runner.kv.allocators[g].num_pages - self.headroom.get(g, 0)) for g in GROUPS}

    def pages_for(self, total_tokens: int) -> dict[str, int]:
        """Most pages a sequence growing to `total_tokens` positions ever holds at once, per group."""
        return worst_case_pages(total_tokens, self.runner.page_size, self.runner.cfg.sliding_window)

    def reserve(self, request_id: str, prompt_tokens: int, max_tokens: int,
                siblings: Sequence[str] = ()) -> dict[str, int]:
        """Commit the request's worst-case pages or raise AdmissionRefused with the reason. `siblings`:
        the other choices of an n > 1 request, reserved with it, all or none (they decode here, forked
        from its KV, KVCache.fork). The prompt's whole pages of the full group are shared by every
        choice, so they are counted once, in one choice's budget (the holder's; `release` hands them to
        a choice still running when the holder ends first). The sliding group's shared pages leave the
        window as the choices grow and are counted in each choice's window-capped worst case."""
        total = min(prompt_tokens + max_tokens, self.runner.max_context)
        need = self.pages_for(total)
        ids = [request_id, *siblings]
        k = len(ids)
        shared = {g: 0 for g in GROUPS}
        if siblings:
            shared[FULL] = min(prompt_tokens, total) // self.runner.page_size
        rest = {g: need[g] - shared[g] for g in GROUPS}  # a sibling's budget
        group = {g: need[g] + (k - 1) * rest[g] for g in GROUPS}
        cap = self.capacity
        for g in GROUPS:
            if group[g] > cap[g]:
                raise AdmissionRefused(
                    f"request {request_id}: {k} x {total} tokens need {group[g]} {g} KV pages but this "
                    f"decode worker's pool has only {cap[g]}", retryable=False)
        if k > self.max_batch:
            raise AdmissionRefused(f"request {request_id}: {k} choices, more than this decode worker's batch "
                                   f"of {self.max_batch}", retryable=False)
        with self._budget_lock:
            if any(rid in self._budget for rid in ids) or len(set(ids)) != k:
                raise ValueError(f"request {request_id!r} already holds a reservation")
            if len(self._budget) + k > self.max_batch:
                raise AdmissionRefused(f"request {request_id}: decode batch is full ({self.max_batch} "
                                       f"requests admitted)", retryable=True)
            used = self._reserved()
            for g in GROUPS:
                if used[g] + group[g] > cap[g]:
                    raise AdmissionRefused(
                        f"request {request_id}: out of KV pages, needs {group[g]} {g} pages and "
                        f"{cap[g] - used[g]} of {cap[g]} are free", retryable=True)
            self._budget[request_id] = dict(need)
            for rid in siblings:
                self._budget[rid] = dict(rest)
            if siblings:
                fork = _ForkBudget(set(ids), shared, request_id)
                for rid in ids:
                    self._forks[rid] = fork
        return need

    def admission_load(self) -> tuple[int, int]:
        """(pages a new request could still reserve, requests holding a reservation): what a router ranks
        workers by. Reads only the reservations, so any thread may call it at any time."""
        cap = self.capacity
        with self._budget_lock:
            used = self._reserved()
            return min(cap[g] - used[g] for g in GROUPS), len(self._budget)

    def release(self, request_id: str) -> None:
        """Drop a reservation and whatever the request holds (idempotent). During a pull this is only
        recorded, and `end_pull` does it."""
        if request_id in self._pulling:
            self._release_after_pull.add(request_id)
            return
        if self._inflight is not None and request_id in self._inflight.ids:
            # A launched step still writes this request's KV: its pages may go to no one before that step
            # is read back (a NIXL READ into a reused page would not wait for the device).
            self._running.pop(request_id, None)
            self._deferred.add(request_id)
            return
        self._deferred.discard(request_id)
        with self._budget_lock:
            self._budget.pop(request_id, None)
            fork = self._forks.pop(request_id, None)
            if fork is not None:
                fork.members.discard(request_id)
                if fork.holder == request_id and fork.members:
                    # The shared prompt pages stay while any choice holds them: so does their budget.
                    fork.holder = min(fork.members)
                    for g, n in fork.shared.items():
                        self._budget[fork.holder][g] += n
        self._running.pop(request_id, None)
        if self.runner.has_sequence(request_id):
            self.runner.free(request_id)

    def begin_pull(self, request_id: str) -> None:
        """The request's imported pages are about to be written by a READ this class cannot see."""
        if not self.runner.has_sequence(request_id):
            raise ValueError(f"request {request_id!r} pulls without imported KV")
        self._pulling.add(request_id)

    def end_pull(self, request_id: str) -> bool:
        """Every READ into the request's pages has ended (completed, failed, or cancelled and confirmed
        dead). True when the request was released meanwhile: its pages are freed now, and it must not
        join."""
        self._pulling.discard(request_id)
        if request_id not in self._release_after_pull:
            return False
        self._release_after_pull.discard(request_id)
        self.release(request_id)
        return True

    def is_pulling(self, request_id: str) -> bool:
        return request_id in self._pulling

    def join(self, request_id: str, params: SamplingParams, last_token: int, generated: int,
             emit: Callable[[TokenOutput], None], history: Sequence[int] = (),
             prompt_tokens: Sequence[int] = ()) -> None:
        """Add an imported sequence (KV already in its pages) to the batch from the next step on.
        `history`: the tokens it generated before `last_token` (presence/frequency penalties count them);
        `prompt_tokens`: its prompt's distinct tokens (the repetition penalty counts them too)."""
        if request_id not in self._budget:
            raise ValueError(f"request {request_id!r} joins without a reservation")
        if not self.runner.has_sequence(request_id):
            raise ValueError(f"request {request_id!r} joins without imported KV")
        if request_id in self._pulling:
            raise ValueError(f"request {request_id!r} joins while its KV pull may still be running")
        output = [*history, last_token] if params.penalized else None
        prompt: object = ()
        if params.needs_prompt_tokens:  # on the device once, not converted at every step
            prompt = torch.as_tensor(list(prompt_tokens), dtype=torch.long).to(self.runner.device)
        # A structured request's state follows every token it generated (replayed here after a handoff).
        constraint = open_constraint(params.structured, [*history, last_token]) if params.structured else None
        self._running[request_id] = _Running(request_id, params, last_token, generated, emit, output=output,
                                             prompt=prompt, constraint=constraint)

    def abort(self, request_id: str) -> bool:
        """Stop a request at the next step boundary (its pages are freed there)."""
        r = self._running.get(request_id)
        if r is None:
            had = request_id in self._budget
            self.release(request_id)
            return had
        r.aborted = True
        return True

    def has_work(self) -> bool:
        return bool(self._running) or self._inflight is not None

    def has_reservation(self, request_id: str) -> bool:
        return request_id in self._budget

    def running_ids(self) -> list[str]:
        return list(self._running)

    def request_ids(self) -> list[str]:
        """Every request holding a reservation or running."""
        with self._budget_lock:
            return sorted(set(self._budget) | set(self._running))

    def step(self) -> int:
        """One decode step over every running request; emits one token each, retires the finished.
        Returns how many requests the step computed (overlapped: the step it launched)."""
        if self.overlap and getattr(self.runner, "overlap_capable", False):
            self._drop_aborted()
            batch = list(self._running.values())
            # Overlapped steps take argmax on the device: greedy, no logprobs, min_tokens already behind
            # (a step may run one token ahead of the host's count).
            if batch and all(r.params.greedy and not r.params.logprobs and not r.params.masks_stops(r.generated)
                             and not r.params.masks_stops(r.generated + 1) and not r.params.penalized
                             for r in batch):
                return self._step_overlapped(batch)
        return self._step(())[0]

    def step_with(self, extra: Sequence[tuple[str, Sequence[int]]] = (), all_positions: Sequence[int] = ()):
        """A decode step whose forward also carries `extra` (sequence id, new tokens) items: prompt
        chunks of a colocated worker, computed in the same ragged forward as the running batch's tokens.
        Returns (requests decoded, the extra items' logits or None): one row per item (its last
        position), a row per token for the items whose index in `extra` is in `all_positions`."""
        return self._step(extra, all_positions)

    def drain(self) -> None:
        """Read back and emit the launched step, if any (before a step that needs the host's tokens)."""
        if self._inflight is not None:
            flight, self._inflight = self._inflight, None
            self._finish_flight(flight)

    def _drop_aborted(self) -> None:
        for r in [r for r in self._running.values() if r.aborted]:
            self.release(r.request_id)

    def _step(self, extra, all_positions: Sequence[int] = ()) -> tuple[int, object]:
        self.drain()
        self._drop_aborted()
        batch = list(self._running.values())
        if not batch and not extra:
            return 0, None
        ids = [r.request_id for r in batch]
        rest = None
        t0 = time.perf_counter()
        # Structured rows: their masks are computed on the grammar thread while the forward runs.
        masks = self._submit_masks(batch) if any(r.constraint is not None for r in batch) else None
        if extra:
            logits = self.runner.forward_mixed([(rid, [r.last_token]) for rid, r in zip(ids, batch)]
                                               + list(extra), all_positions={len(batch) + i for i in all_positions})
            logits, rest = logits[: len(batch)], logits[len(batch):]
            self.times.mixed += 1
        else:
            logits = self.runner.decode(ids, [r.last_token for r in batch])
        t1 = time.perf_counter()
        self.times.steps += 1
        sampled = None
        if batch:
            sampled = sample_constrained(self.runner.sample, logits, [r.params for r in batch],
                                         [r.generated for r in batch], [r.output or () for r in batch],
                                         [r.prompt for r in batch], masks=masks.result() if masks is not None else None)
            tops = top_logprobs(logits, [r.params for r in batch])
        t2 = time.perf_counter()
        if extra:
            self.times.mixed_s += t2 - t0
        else:
            self.times.launch_s += t1 - t0
            self.times.wait_s += t2 - t1
        if batch:
            self._note(batch, [t for t, _ in sampled])
            self._emit(batch, sampled, [self.runner.length(rid) for rid in ids], tops)
            self.times.emit_s += time.perf_counter() - t2
        return len(batch), rest

    def _submit_masks(self, rows: list[_Running]):
        """The mask job of `rows` on the grammar thread: their unfed tokens first, then the masks."""
        if self._grammar is None:
            self._grammar = ConstraintBatch(pin=self.runner.device.type == "cuda")
        feeds = []
        for r in rows:
            feeds.append(r.unfed)
            r.unfed = []
        return self._grammar.submit([r.constraint for r in rows], feeds)

    @staticmethod
    def _note(rows: Sequence[_Running], tokens: Sequence[int]) -> None:
        for r, t in zip(rows, tokens):
            if r.constraint is not None:
                r.unfed.append(t)

    def _step_overlapped(self, batch: list[_Running]) -> int:
        """Launch the next step, then read back and emit the one before it (see `overlap`)."""
        t0 = time.perf_counter()
        flight = self._inflight
        prev = {}
        if flight is not None:
            prev = {r.request_id: n for r, n in zip(flight.batch, flight.lengths)}
        rows, last = [], []
        max_context = self.runner.max_context
        for r in batch:
            n = prev.get(r.request_id)
            if n is None:
                rows.append(r)
                last.append(r.last_token)
                continue
            # In the launched step: its token is still on the device. Leave out a request that step ends
            # for sure (its last allowed token, or a full context); only a stop token is unknown yet.
            if r.generated + 1 < r.params.max_tokens and not context_full(n + 1, max_context):
                rows.append(r)
                last.append(None)
        launched = None
        constrained = any(r.constraint is not None for r in rows)
        if rows:
            try:
                pending = self.runner.decode_launch([r.request_id for r in rows], last,
                                                    flight.pending if flight is not None else None,
                                                    select_later=constrained)
            except BaseException:
                self._fail_flight()
                raise
            launched = _InFlight(rows, [self.runner.length(r.request_id) for r in rows], pending)
            if flight is not None:
                self.times.overlapped += 1
            self.times.steps += 1
        self._inflight = launched
        self.times.launch_s += time.perf_counter() - t0
        if not constrained:
            if flight is not None:
                self._finish_flight(flight)
            return len(rows)
        # The forward runs; the tokens of the step before are read back, fed with the masks of this one
        # (grammar thread) while the step thread emits them; then the masked argmax is queued.
        try:
            live = self._collect(flight) if flight is not None else []
            job = self._submit_masks(rows)
            if flight is not None:
                self._emit_flight(live)
            t1 = time.perf_counter()
            rows_mask = job.result()
            self.times.wait_s += time.perf_counter() - t1
            self.runner.decode_select(pending, lambda logits: apply_bitmask(logits.float(), *rows_mask))
        except BaseException:
            self._fail_flight()
            raise
        return len(rows)

    def _fail_flight(self) -> None:
        self._inflight = None  # the caller fails these requests; nothing is read back
        for rid in list(self._deferred):
            self.release(rid)

    def _finish_flight(self, flight: _InFlight) -> None:
        self._emit_flight(self._collect(flight))

    def _collect(self, flight: _InFlight) -> list:
        """A launched step's tokens, read back (waits for the device): (request, token, length) of the
        requests still running, their tokens noted for their constraints."""
        t0 = time.perf_counter()
        tokens = self.runner.decode_collect(flight.pending)
        self.times.wait_s += time.perf_counter() - t0
        live = [(r, t, n) for r, t, n in zip(flight.batch, tokens, flight.lengths)
                if self._running.get(r.request_id) is r]  # released meanwhile: its token is dropped
        self._note([r for r, _, _ in live], [t for _, t, _ in live])
        return live

    def _emit_flight(self, live: list) -> None:
        t1 = time.perf_counter()
        self._emit([r for r, _, _ in live], [(t, None) for _, t, _ in live], [n for _, _, n in live])
        # Pages of requests released while this step ran (and that the next launched step does not use).
        busy = self._inflight.ids if self._inflight is not None else set()
        for rid in [rid for rid in self._deferred if rid not in busy]:
            self.release(rid)
        self.times.emit_s += time.perf_counter() - t1

    def _emit(self, batch: list[_Running], sampled, lengths: list[int], tops=None) -> None:
        """Each request's new token; `lengths`: its cache length after the step that made it; `tops`:
        each one's top logprobs (None: nobody asked)."""
        kv = self.runner.kv
        follow = getattr(kv, "prefix", None) is not None  # the prefix cache also keeps what requests generate
        for i, (r, (token, logprob), n) in enumerate(zip(batch, sampled, lengths)):
            r.generated += 1
            r.last_token = token
            if follow:
                kv.extend_tokens(r.request_id, (token,))
            if r.output is not None:
                r.output.append(token)
            # `n` positions are in the cache; with this token the sequence holds n + 1.
            reason = finish_reason_at(token, r.generated, r.params, n + 1, self.runner.max_context)
            r.emit(TokenOutput(token, logprob, reason, tops[i] if tops is not None else None))
            if reason is not None:
                self.release(r.request_id)

    def _reserved(self) -> dict[str, int]:
        """Pages committed to reservations, per group (callers hold _budget_lock)."""
        return {g: sum(b[g] for b in self._budget.values()) for g in GROUPS}

    def stats(self) -> SchedulerStats:
        own = self.runner.internal_pages()  # not the requests': left out of "in use" and of the total
        pool = {g: self.runner.kv.allocators[g].num_pages - own[g] for g in GROUPS}
        free = self.runner.free_pages()
        with self._budget_lock:
            reserved, n_reserved = self._reserved(), len(self._budget)
        return SchedulerStats(running=len(self._running), reserved=n_reserved,
                              pages_in_use={g: pool[g] - free[g] for g in GROUPS},
                              pages_reserved=reserved, pages_total=pool, headroom=dict(self.headroom))
