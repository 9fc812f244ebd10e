"""Admission of requests to decode workers: first come, first served, with a bounded waiting line.

While workers have room, every request reserves at once (concurrently). When a reservation is refused
for lack of room (pages or batch slots), the request joins a waiting line; from then on only the oldest
waiter asks the workers again (every `poll_s`), and each later arrival queues behind it, so admission
keeps arrival order and a full cluster is not hammered by hundreds of retries. The line is bounded:
an arrival that finds `max_waiting` requests already waiting is refused at once with `EngineOverloaded`
(HTTP 429 / gRPC RESOURCE_EXHAUSTED with a retry hint), and a waiter that is not admitted within its
deadline fails with `EngineUnavailable`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvrelay.router.engine_client import EngineOverloaded

T = TypeVar("T")


class AdmissionTimeout(Exception):
    """Not admitted before the deadline (the caller words the error)."""


class AdmissionQueue:
    def __init__(self, max_waiting: int, poll_s: float = 0.02):
        if max_waiting < 1:
            raise ValueError(f"router.max_waiting_requests must be >= 1, got {max_waiting}")
        self.max_waiting = max_waiting
        self.poll_s = poll_s
        self._line: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._line)

    def full(self) -> bool:
        return len(self._line) >= self.max_waiting

    def check(self) -> None:
        """Refuse now if the line is full (before a response is started)."""
        if self.full():
            raise EngineOverloaded(
                f"{len(self._line)} requests are already waiting for a decode worker "
                f"(router.max_waiting_requests = {self.max_waiting}); retry later", retry_after_s=1)

    async def admit(self, try_once: Callable[[], Awaitable[T | None]], timeout_s: float) -> T:
        """`try_once()` returns the admission (e.g. the chosen worker) or None when there is no room now.
        Raises EngineOverloaded (line full) or AdmissionTimeout."""
        deadline = time.monotonic() + timeout_s
        if not self._line:  # nobody waits: no order to keep, try at once
            got = await try_once()
            if got is not None:
                return got
        self.check()
        turn = asyncio.get_running_loop().create_future()
        self._line.append(turn)
        if self._line[0] is turn:
            turn.set_result(None)
        try:
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(asyncio.shield(turn), timeout=max(0.0, left))
            except asyncio.TimeoutError:
                raise AdmissionTimeout() from None
            while True:  # the oldest waiter: ask until there is room or time is up
                got = await try_once()
                if got is not None:
                    return got
                if time.monotonic() >= deadline:
                    raise AdmissionTimeout()
                await asyncio.sleep(self.poll_s)
        finally:
            was_head = self._line and self._line[0] is turn
            self._line.remove(turn)
            if was_head and self._line and not self._line[0].done():
                self._line[0].set_result(None)  # the next in line asks now
