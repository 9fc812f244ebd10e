"""The router's one seam to the model: `EngineClient`, and an in-process implementation over `LLM`.

The router only ever streams tokens for a request and aborts it; everything else (batching, KV,
prefill/decode placement) is behind this protocol. The disaggregated client lives in cluster/.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import queue
import threading
from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol, Sequence, runtime_checkable

from kvrelay.engine.sampling_params import SamplingParams, TokenOutput

if TYPE_CHECKING:
    from kvrelay.engine.llm import LLM

log = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The engine refuses a request for now (its waiting line is full): HTTP 429 / gRPC
    RESOURCE_EXHAUSTED, with `retry_after_s` as the hint."""

    def __init__(self, reason: str, retry_after_s: int = 1):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class EngineUnavailable(RuntimeError):
    """No worker can serve the request now: its workers died and none (healthy or a replacement) took it
    up within the engine's resume bound, or the engine is shutting down. HTTP 503 with Retry-After before
    a response starts, an in-band error event on a started stream, gRPC UNAVAILABLE; `retry_after_s` is
    the hint."""

    def __init__(self, reason: str, retry_after_s: int = 5):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


@runtime_checkable
class EngineClient(Protocol):
    """Async token streaming. `generate` yields TokenOutputs until one carries a finish_reason.

    `abort(request_id)` must be safe to call for unknown or finished requests (the router calls it on
    every early exit without knowing how far the engine got). An implementation may also expose
    `vocab_size: int`; the router then rejects prompt ids the model cannot embed, and
    `check_admission()`, which raises EngineOverloaded before a response starts when it would refuse.
    It may also expose `generate_batches` (same arguments): lists of the tokens that are ready at once,
    several when the consumer runs behind the engine; the router then writes each list as one chunk.
    And `fork_batches(request_ids, prompt_ids, params_list)`: one such stream per choice of an n > 1
    request, the prompt prefilled once (RouterCore.fork); without it each choice is its own request.
    """

    @property
    def model_name(self) -> str: ...

    @property
    def max_context(self) -> int: ...

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenOutput]: ...

    async def abort(self, request_id: str) -> None: ...


_DONE = object()
Sink = Callable[[object], None]


def engine_prompt(ids: Sequence[int]) -> Sequence[int]:
    """A prompt as the router hands it to an engine: a list, except that an array('i') stays one. A big
    body's token ids arrive as arrays (router/body.py) and stay compact up to the worker call: 40k ids
    are one 160 KB buffer that Ray pickles as bytes (the workers take any sequence), where a list is 40k
    int objects made on the event loop and walked by every garbage collection while the request lives
    (a 96 x 40k batch: ~40 ms collections that held /health up). Arrays are not tracked by the GC."""
    return ids if isinstance(ids, array.array) else list(ids)


def token_batches(engine: EngineClient, request_id: str, prompt_ids: list[int],
                  params: SamplingParams) -> AsyncIterator[list[TokenOutput]]:
    """The engine's tokens for one request as lists of what is ready at once.

    Under load the router, not the GPU, is what runs behind: one step's token per request per chunk
    costs a JSON encode, an HTTP write and a client parse each (measured on the H200 at 512 streams:
    router and client at 100% of a core, the GPU idle for the last third of the run). Tokens that are
    already waiting go out together, as vLLM's output collector merges them; an engine without
    `generate_batches` gives one token per list."""
    batches = getattr(engine, "generate_batches", None)
    if batches is not None:
        return batches(request_id, prompt_ids, params)
    return _singles(engine.generate(request_id, prompt_ids, params))


async def _singles(tokens: AsyncIterator[TokenOutput]) -> AsyncIterator[list[TokenOutput]]:
    async with contextlib.aclosing(tokens) as outs:  # type: ignore[type-var]
        async for out in outs:
            yield [out]


async def flatten(batches: AsyncIterator[list]) -> AsyncIterator:
    """One item at a time from an iterator of lists (closing it closes the source)."""
    async with contextlib.aclosing(batches) as lists:  # type: ignore[type-var]
        async for items in lists:
            for item in items:
                yield item


class InProcessEngineClient:
    """Drives `LLM`'s engine loop (add_request / step / abort) on one dedicated thread.

    One thread, because the LLM is not thread-safe; that thread owns it and everything else talks to
    it through a command queue. Each `step()` serves every running request at once (continuous
    batching), and its outputs are routed to the waiting asyncio requests by request id. An abort,
    or a consumer that stops listening, drops the request from the LLM, which frees its KV pages.
    """

    def __init__(self, llm: "LLM", model_name: str | None = None) -> None:
        self._llm = llm
        self._name = model_name or llm.config.name
        self._commands: queue.Queue[tuple] = queue.Queue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="kvrelay-llm", daemon=True)
        self._thread.start()

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def max_context(self) -> int:
        return int(self._llm.max_context)

    @property
    def vocab_size(self) -> int:
        return int(self._llm.config.vocab_size)

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenOutput]:
        return flatten(self.generate_batches(request_id, prompt_ids, params))

    async def generate_batches(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[TokenOutput]]:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[object] = asyncio.Queue()

        def sink(item: object) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, item)
            except RuntimeError:  # the requester's loop is gone; nobody is listening any more
                pass

        self._commands.put(("add", request_id, list(prompt_ids), params, sink))
        done = False
        try:
            while not done:
                items = [await inbox.get()]
                while not inbox.empty():
                    items.append(inbox.get_nowait())
                ready: list[TokenOutput] = []
                for item in items:
                    if item is _DONE:
                        done = True
                        break
                    if isinstance(item, BaseException):
                        done = True
                        if ready:
                            yield ready
                        raise item
                    assert isinstance(item, TokenOutput)
                    ready.append(item)
                    if item.finish_reason is not None:
                        done = True
                        break
                if ready:
                    yield ready
        finally:
            if not done:  # cancelled or abandoned mid-stream: free the sequence
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def close(self) -> None:
        self._commands.put(("stop",))
        self._thread.join(timeout=30)

    # ---- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            busy = self._llm.has_unfinished()
            try:
                # Idle: sleep until a command arrives. Busy: take what is queued and keep stepping.
                commands = [self._commands.get(block=not busy)]
            except queue.Empty:
                commands = []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if cmd[0] == "stop":
                    self._fail_all(RuntimeError("engine client closed"))
                    return
                self._command(cmd)
            if self._llm.has_unfinished():
                self._step()

    def _command(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, sink = cmd
            try:
                self._llm.add_request(rid, prompt, params)
            except Exception as exc:  # e.g. not enough KV pages: fail this request, not the engine
                sink(exc)
                return
            self._sinks[rid] = sink
        elif cmd[0] == "abort":
            sink = self._sinks.pop(cmd[1], None)
            if sink is not None:
                self._llm.abort(cmd[1])
                sink(_DONE)

    def _step(self) -> None:
        try:
            outputs = self._llm.step()
        except Exception as exc:
            log.exception("engine step failed; failing its %d requests", len(self._sinks))
            self._fail_all(exc)
            return
        for rid, out in outputs:
            sink = self._sinks.get(rid)
            if sink is None:
                continue
            sink(out)
            if out.finish_reason is not None:
                del self._sinks[rid]

    def _fail_all(self, exc: BaseException) -> None:
        for rid, sink in list(self._sinks.items()):
            self._llm.abort(rid)
            sink(exc)
        self._sinks.clear()
