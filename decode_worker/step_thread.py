"""The decode worker's step thread: one thread owns the engine, and every other engine call is an op it runs.

The event loop of a decode (or colocated) worker never touches the Runner or the Scheduler: it queues an op
(`_locked`) and awaits its result, and the step thread runs all pending ops, then one step, then the ops
queued meanwhile, and so on. (A lock taken per op let one op in per step: 64 arriving requests, four ops
each, waited ~256 steps to be admitted.) It also keeps the step progress that `step_stall_s` reports: a
thread stuck in a step or an op answers health() all the same, so the supervisor needs this to see it.

`StepThread` is the base of decode_worker/worker.py's DecodeWorker, which supplies the work: `_has_work`,
`_step`, `_flush` (hand a step's tokens to the event loop), `_running` and `_step_failed`.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time


class StepThread:
    def __init__(self, owner: str):
        self._owner = owner  # names the worker in errors: "decode worker 0"
        self._lock = threading.Lock()  # held while an op or a step runs
        self._wake = threading.Condition()  # guards _pending and _stop; the idle step thread waits here
        self._pending: collections.deque = collections.deque()
        self._stop = False
        self._step_error: BaseException | None = None
        # Step progress (step_stall_s): when the step thread last finished a pass (ops, a step), and whether
        # it is waiting for work.
        self._beat = time.monotonic()
        self._idle = True
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop the ops' callers wait on
        self.steps = 0
        self.ops_s = 0.0  # step thread time in queued ops (admission, joins, releases)
        self._thread = threading.Thread(target=self._step_loop, name="decode-steps", daemon=True)

    # ---- what the worker supplies ---------------------------------------------------------------
    def _has_work(self) -> bool:
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        """Hand what the ops and the step produced to the event loop (step thread)."""

    def _running(self) -> list:
        """The requests in the next step (a failed step ends them)."""
        return []

    def _step_failed(self, running: list, exc: BaseException) -> None:
        """A step raised: end the requests that were in it (the worker carries on)."""

    # ---- engine calls off the event loop --------------------------------------------------------
    async def _locked(self, fn, *args):
        """`fn(*args)` on the step thread, between two steps, in the order the calls were made; the event
        loop only waits for the result (with TP, an op may wait on Ray round trips to the followers)."""
        loop = self._loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._wake:
            if self._stop:
                raise RuntimeError(f"{self._owner} is shutting down")
            self._pending.append((fn, args, fut, loop))
            self._wake.notify()
        return await fut

    def _run_ops(self) -> None:
        """Every queued op, under the engine lock (step thread)."""
        while True:
            with self._wake:
                if not self._pending:
                    return
                fn, args, fut, loop = self._pending.popleft()
            try:
                with self._lock:
                    result, exc = fn(*args), None
            except BaseException as e:  # handed to the caller
                result, exc = None, e
            loop.call_soon_threadsafe(_settle, fut, result, exc)

    def _step_loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._pending and not self._has_work():
                    self._idle = True
                    self._wake.wait()
                self._beat, self._idle = time.monotonic(), False
                if self._stop:
                    return
            t0 = time.perf_counter()
            self._run_ops()
            self.ops_s += time.perf_counter() - t0
            self._flush()
            with self._lock:
                if not self._has_work():
                    continue
                running = self._running()
                try:
                    self._step()
                    self.steps += 1
                except BaseException as e:  # a failed forward ends the requests in it, not the worker
                    self._step_error = e
                    self._step_failed(running, e)
            self._beat = time.monotonic()
            self._flush()

    def _stop_steps(self) -> None:
        """Stop the step thread after its current pass; ops still queued fail with "shut down"."""
        with self._wake:
            self._stop = True
            self._wake.notify()
            dropped, self._pending = list(self._pending), collections.deque()
        for _, _, fut, loop in dropped:
            loop.call_soon_threadsafe(_settle, fut, None, RuntimeError(f"{self._owner} shut down"))

    # ---- progress -------------------------------------------------------------------------------
    async def step_stall_s(self) -> float:
        """Seconds the step thread has been in its current pass (queued ops, then a step) while it has
        work; 0 while it waits for work. The engine client and the supervisor take a worker whose stall
        reaches router.worker_step_timeout_s for hung (a step stuck in a kernel or a collective), as they
        do one that stops answering."""
        return 0.0 if self._idle else time.monotonic() - self._beat

    async def debug_stall_steps(self, seconds: float) -> None:
        """Test only (tests/e2e/test_supervision_hung.py): the real step thread sleeps `seconds` in its
        next op, holding the engine lock, as a step stuck in a kernel would: nothing steps, health() and
        every other call still answer. Returns at once."""
        loop = asyncio.get_running_loop()
        with self._wake:
            self._pending.append((time.sleep, (seconds,), loop.create_future(), loop))
            self._wake.notify()


def _settle(fut: asyncio.Future, result, exc: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
