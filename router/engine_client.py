"""The router's one seam to the model: `EngineClient`, and an in-process implementation over `LLM`.

The router only ever streams tokens for a request and aborts it; everything else (batching, KV,
prefill/decode placement) is behind this protocol. The disaggregated client lives in cluster/.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, AsyncIterator, Protocol, runtime_checkable

from kvrelay.engine.sampling import SamplingParams, TokenOutput

if TYPE_CHECKING:
    from kvrelay.engine.llm import LLM

log = logging.getLogger(__name__)


@runtime_checkable
class EngineClient(Protocol):
    """Async token streaming. `generate` yields TokenOutputs until one carries a finish_reason.

    `abort(request_id)` must be safe to call for unknown or finished requests (the router calls it on
    every early exit without knowing how far the engine got). An implementation may also expose
    `vocab_size: int`; the router then rejects prompt ids the model cannot embed.
    """

    @property
    def model_name(self) -> str: ...

    @property
    def max_context(self) -> int: ...

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenOutput]: ...

    async def abort(self, request_id: str) -> None: ...


_DONE = object()


class InProcessEngineClient:
    """Runs `LLM.generate` (a blocking iterator) on one worker thread and streams into asyncio.

    One thread, because a single-process LLM owns one KV cache and is not safe to enter concurrently;
    requests queue behind each other. Abort sets a flag the worker checks between tokens and then
    closes the engine's iterator, which releases the sequence's KV pages.
    """

    def __init__(self, llm: "LLM", model_name: str | None = None) -> None:
        self._llm = llm
        self._name = model_name or llm.config.name
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrelay-llm")
        self._aborts: dict[str, threading.Event] = {}

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def max_context(self) -> int:
        return int(self._llm.max_context)

    @property
    def vocab_size(self) -> int:
        return int(self._llm.config.vocab_size)

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        stop = self._aborts.setdefault(request_id, threading.Event())

        def put(item: object) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            if stop.is_set():  # aborted while queued behind another request
                put(_DONE)
                return
            it = self._llm.generate(list(prompt_ids), params)
            try:
                for out in it:
                    put(out)
                    if stop.is_set() or out.finish_reason is not None:
                        break
            except BaseException as exc:  # surface engine failures to the awaiting request
                put(exc)
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
                put(_DONE)

        future = loop.run_in_executor(self._pool, work)
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, TokenOutput)
                yield item
                if item.finish_reason is not None:
                    break
        finally:
            # Whatever ended the consumer (finish, cancel, error), the worker must stop producing.
            stop.set()
            self._aborts.pop(request_id, None)
            if not future.done():
                future.add_done_callback(_log_failure)

    async def abort(self, request_id: str) -> None:
        event = self._aborts.get(request_id)
        if event is not None:
            event.set()

    def close(self) -> None:
        for event in self._aborts.values():
            event.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _log_failure(future: "asyncio.Future[None]") -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("engine worker failed after its request ended: %r", future.exception())
