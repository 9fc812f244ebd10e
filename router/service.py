"""The protocol-independent router: validate, render, stream from the engine, parse, clean up.

Front-ends call `prepare_*` (raises `ValidationError` before any byte is streamed) and then iterate
`stream(...)`. However the stream ends -- finished, client cancelled, front-end error, or the router
itself stopping it (harmony `<|return|>`/`<|call|>` the engine did not stop on, a stop string) --
`stream` closes the engine iterator and, unless the engine itself reported a finish, calls
`engine.abort`. When the router stops a request, that happens before the last step is yielded, so the
KV pages are freed while the final chunk is still being written to the client.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import dataclasses
import datetime as _dt
import logging
import re
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence, TypeVar

from openai_harmony import HarmonyError

from kvrelay.engine.sampling_params import SamplingParams, TokenOutput
from kvrelay.router import harmony, render_pool, structured, validation
from kvrelay.router.engine_client import EngineClient, engine_prompt, flatten, token_batches
from kvrelay.router.metrics import RequestTimer
from kvrelay.router.parser import Detokenizer, HarmonyStreamParser, new_call_id
from kvrelay.router.stop import StopStrings
from kvrelay.router.types import ChatRequest, ContentDelta, Delta, FinishReason, GenerateRequest, TokenStep, Usage
from kvrelay.router.validation import ValidationError
from kvrelay.router.version import ServerInfo

log = logging.getLogger(__name__)
T = TypeVar("T")


def utc_today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).date().isoformat()


def _frozen_ids(ids: Sequence[int]) -> Sequence[int]:
    """Prompt ids as a request keeps them: a tuple, or the array('i') a big body's ids came as (no 40k
    int objects per prompt; router/engine_client.engine_prompt)."""
    return ids if isinstance(ids, (tuple, array.array)) else tuple(ids)


def new_request_id(prefix: str = "req") -> str:
    """A router-assigned request id; HTTP uses its response's prefix (chatcmpl-, cmpl-), so the `id` a
    client gets back is the id every log line about the request carries (workers/logs.py)."""
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for the engine."""

    request_id: str
    prompt_ids: Sequence[int]  # a tuple, or array('i') for ids that came compact (router/body.py)
    params: SamplingParams
    chat: bool
    stop: tuple[str, ...] = ()  # stop strings; the engine only knows ids, so the router matches them
    text: bool = False  # Generate: decode the output into ContentDeltas (chat always has text)


class RouterCore:
    def __init__(
        self,
        engine: EngineClient,
        *,
        model_name: str | None = None,
        today: Callable[[], str] = utc_today,
        call_id_factory: Callable[[], str] = new_call_id,
    ) -> None:
        self.engine = engine
        self.model_name = model_name or engine.model_name
        self.model_names: tuple[str, ...] = (self.model_name,)  # every name requests may use (aliases)
        self.server_info: ServerInfo | None = None  # /version's body (RouterServer sets it; router/version.py)
        self._today = today
        self._call_id = call_id_factory
        self._in_flight: set[str] = set()
        # Tokenizing and rendering can take a while for a big request (the tokenizer is linear in the text,
        # with a bounded constant: validation.check_text): never on the event loop, where it would hold up
        # every other request and /health. The tokenizer releases the GIL, so these threads run in parallel.
        self._prep_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kvrelay-prepare")

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on the preparation threads (tokenizing, rendering, validation)."""
        return await asyncio.get_running_loop().run_in_executor(self._prep_pool, fn, *args)

    @property
    def max_context(self) -> int:
        return int(self.engine.max_context)

    @property
    def vocab_size(self) -> int:
        # Optional on EngineClient: a model with a smaller vocabulary (the tiny test model) cannot
        # embed harmony's special tokens, and the engine would fail on them mid-request.
        return min(harmony.VOCAB_SIZE, int(getattr(self.engine, "vocab_size", harmony.VOCAB_SIZE)))

    # ---- preparation (all validation happens here) ----------------------------------------------

    def _request_id(self, requested: str) -> str:
        if not requested:
            return new_request_id()
        if requested in self._in_flight:
            raise ValidationError("request_id", f"{requested!r} is already in flight")
        return requested

    def prepare_generate(
        self, req: GenerateRequest, *, prompt_field: str = "prompt_token_ids", text: bool = False
    ) -> Prepared:
        """`text`: the caller wants the completion text (HTTP completions). Stop strings imply it."""
        rid = self._request_id(req.request_id)
        validation.check_prompt(req.prompt_token_ids, prompt_field, self.max_context, self.vocab_size)
        resolved = validation.resolve_sampling(
            req.sampling, prompt_len=len(req.prompt_token_ids), max_context=self.max_context,
            vocab_size=self.vocab_size,
        )
        return Prepared(rid, _frozen_ids(req.prompt_token_ids), _engine_params(resolved, ()), chat=False,
                        stop=resolved.stop, text=text or bool(resolved.stop))

    def check_admission(self) -> None:
        """EngineOverloaded (HTTP 429 / RESOURCE_EXHAUSTED) before a response starts, when the engine's
        waiting line is full; a valid request is only refused after validation."""
        check = getattr(self.engine, "check_admission", None)
        if check is not None:
            check()

    def prepare_chat(self, req: ChatRequest) -> Prepared:
        rid = self._request_id(req.request_id)
        validation.check_chat(req)
        structured.check_chat_structured(req)
        spec = structured.build(req)
        # Big conversations render in a helper process: harmony holds the GIL while it renders.
        prompt = render_pool.render_chat(req, req.conversation_start_date or self._today())
        if len(prompt) >= self.max_context:
            raise ValidationError(
                "messages",
                f"the rendered prompt is {len(prompt)} tokens but the model context is {self.max_context} "
                "tokens (at least one token must remain for generation)",
            )
        too_big = next((t for t in prompt if t >= self.vocab_size), None)
        if too_big is not None:
            raise ValidationError(
                "messages",
                f"the rendered prompt uses token id {too_big} but the model's vocabulary has {self.vocab_size} "
                "ids; this model cannot serve harmony chat (use Generate with token ids)",
            )
        resolved = validation.resolve_sampling(
            req.sampling, prompt_len=len(prompt), max_context=self.max_context, vocab_size=self.vocab_size
        )
        params = _engine_params(resolved, harmony.CHAT_STOP_TOKEN_IDS)
        if spec is not None:
            params = dataclasses.replace(params, structured=spec)
        return Prepared(rid, tuple(prompt), params, chat=True, stop=resolved.stop, text=True)

    # ---- streaming ------------------------------------------------------------------------------

    def stream(self, prep: Prepared) -> AsyncIterator[TokenStep]:
        """One TokenStep per engine token; the last carries finish_reason and usage.

        With stop strings, the step of the token that completed one is the last: its usage counts
        every token generated up to and including it, and its deltas end before the stop string.
        """
        return flatten(self.stream_batches(prep))

    def fork(self, preps: Sequence[Prepared]) -> list[AsyncIterator[list[TokenOutput]] | None]:
        """The engine's token streams for the n choices of one prompt (`preps`: one per choice, the same
        prompt, each its own request id and seed), prefilled once and forked by an engine that can
        (`fork_batches`: cluster/engine_client.py); otherwise None each, and every choice is a request
        of its own (`stream_batches` without `tokens`)."""
        fork = getattr(self.engine, "fork_batches", None)
        if fork is None or len(preps) < 2:
            return [None] * len(preps)
        return fork([p.request_id for p in preps], engine_prompt(preps[0].prompt_ids), [p.params for p in preps])

    async def stream_batches(self, prep: Prepared,
                             tokens: AsyncIterator[list[TokenOutput]] | None = None) -> AsyncIterator[list[TokenStep]]:
        """`stream`'s steps in the lists the engine hands over (what was ready at once): a front-end
        writes each list as one chunk, so a router that runs behind catches up instead of falling
        further behind. `tokens`: the engine's stream for this request when it is already open (a
        choice of `fork`), else it is opened here."""
        output = _Output(prep, self._call_id)
        self._in_flight.add(prep.request_id)
        timer = RequestTimer(len(prep.prompt_ids))  # vLLM's request metrics (router/metrics.py)
        engine_done = released = False
        produced = 0
        first = True
        if tokens is None:
            tokens = token_batches(self.engine, prep.request_id, engine_prompt(prep.prompt_ids), prep.params)

        async def release() -> None:
            nonlocal released
            try:
                await tokens.aclose()  # type: ignore[attr-defined]
            except Exception as exc:  # closing must not skip the abort below
                log.warning("closing the engine stream of %s failed: %r", prep.request_id, exc)
            if not engine_done:
                log.info("request %s ended early after %d tokens; aborting it in the engine", prep.request_id, produced,
                         extra={"request_id": prep.request_id})
                await self.engine.abort(prep.request_id)
            released = True

        try:
            async for outs in tokens:
                steps: list[TokenStep] = []
                for out in outs:
                    produced += 1
                    engine_done = out.finish_reason is not None
                    offset = output.offset
                    deltas = output.feed(out.token_id, out.finish_reason)
                    plp, first = (getattr(out, "prompt_logprobs", None) if first else None), False
                    if not engine_done and not output.stopped:
                        steps.append(TokenStep(out.token_id, out.logprob, tuple(deltas), text_offset=offset,
                                               top_logprobs=out.top_logprobs, prompt_logprobs=plp))
                        continue
                    deltas += output.finish()
                    reason = output.finish_reason(out.finish_reason)
                    timer.tokens(len(steps) + 1)
                    timer.finish(reason)
                    if not engine_done:
                        await release()  # the router stopped it: free the KV now, not after the client write
                    metrics = getattr(out, "metrics", None)
                    cached = getattr(metrics, "cached_tokens", 0) if metrics is not None else 0
                    steps.append(TokenStep(out.token_id, out.logprob, tuple(deltas), reason,
                                           Usage(len(prep.prompt_ids), produced, cached), text_offset=offset,
                                           top_logprobs=out.top_logprobs, prompt_logprobs=plp,
                                           timings=metrics.timings() if metrics is not None else None))
                    yield steps
                    return
                if steps:
                    timer.tokens(len(steps))
                    yield steps
            # The engine ran dry without naming a reason; close the stream ourselves.
            engine_done = True
            tail = tuple(output.finish())
            reason = output.finish_reason(None)
            timer.finish(reason)
            yield [TokenStep(None, None, tail, reason, Usage(len(prep.prompt_ids), produced))]
        finally:
            self._in_flight.discard(prep.request_id)
            timer.finish(None)  # failed or abandoned (a no-op after a finish)
            if not released:
                await release()


class _Output:
    """Turns one request's tokens into client deltas: harmony parsing (chat) or plain decoding
    (Generate with text), then stop-string matching over the content."""

    def __init__(self, prep: Prepared, call_id: Callable[[], str]) -> None:
        # Plain Generate without text never needs the tokenizer (a token-ids-only server has none).
        self.parser = HarmonyStreamParser(harmony.load_encoding(), id_factory=call_id) if prep.chat else None
        self.detok = Detokenizer(harmony.load_encoding()) if prep.text and not prep.chat else None
        self.stops = StopStrings(prep.stop) if prep.stop else None
        self.stop_ids = frozenset(prep.params.stop_token_ids)
        # min_tokens: stop strings are matched only in text that comes after the first min_tokens tokens
        # (the engine masks the stop tokens until then), as vLLM skips its stop checks.
        self.unmatched_tokens = prep.params.min_tokens
        self.offset: int | None = 0 if self.detok else None  # characters decoded so far (Generate)

    @property
    def stopped(self) -> bool:
        """The router must end the stream: harmony's stop token, or a stop string."""
        return bool((self.parser and self.parser.stopped) or (self.stops and self.stops.matched is not None))

    def feed(self, token: int, engine_reason: str | None) -> list[Delta]:
        if self.parser is not None:
            deltas = self.parser.feed(token)
        elif self.detok is not None:
            # The stop token that ended a Generate stream is not part of the text (the harmony parser
            # already drops chat's stop tokens).
            hidden = engine_reason == "stop" and token in self.stop_ids
            text = "" if hidden else self.detok.feed([token])
            self.offset = (self.offset or 0) + len(text)
            deltas = [ContentDelta(text)] if text else []
        else:
            return []
        if self.unmatched_tokens > 0:
            self.unmatched_tokens -= 1
            return deltas
        return self.stops.filter(deltas) if self.stops else deltas

    def finish(self) -> list[Delta]:
        """End of output: what the parser/decoder still held, then text held back by stop matching.
        Nothing after a stop string (the parser may hold a header or split bytes past it)."""
        if self.stops is not None and self.stops.matched is not None:
            return []
        if self.parser is not None:
            tail = self.parser.finish()
        elif self.detok is not None:
            text = self.detok.flush()
            tail = [ContentDelta(text)] if text else []
        else:
            tail = []
        if self.stops is None:
            return tail
        tail = self.stops.filter(tail)
        held = self.stops.flush()
        return tail + [ContentDelta(held)] if held else tail

    def finish_reason(self, engine_reason: str | None) -> FinishReason:
        if self.stops is not None and self.stops.matched is not None:
            return "stop"
        return _finish_reason(engine_reason, self.parser)


def _finish_reason(engine_reason: str | None, parser: HarmonyStreamParser | None) -> FinishReason:
    if parser is not None and parser.called_tool:
        return "tool_calls"
    if engine_reason == "length":
        return "length"
    return "stop"


def _engine_params(resolved: validation.ResolvedSampling, extra_stops: tuple[int, ...]) -> SamplingParams:
    """The engine's SamplingParams: ResolvedSampling's fields of the same names (stop strings stay in the
    router), the stop ids with the front-end's own in front."""
    fields = {f.name: getattr(resolved, f.name) for f in dataclasses.fields(resolved) if f.name != "stop"}
    fields["stop_token_ids"] = tuple(dict.fromkeys(extra_stops + resolved.stop_token_ids))  # de-duplicated
    return SamplingParams(**fields)


_SPECIAL_TEXT = re.compile(r"<\|[A-Za-z0-9_]+\|>")


def encode_prompt_text(text: str, field: str = "prompt") -> list[int]:
    """A text prompt -> ids (HTTP completions and /tokenize, gRPC Tokenize). Text the tokenizer would
    choke on, or text spelling a special token, is a ValidationError naming `field`."""
    validation.check_text(text, field)
    try:
        return harmony.encode_text(text)
    except HarmonyError:
        specials = harmony.load_encoding().special_tokens_set
        found = next((m for m in _SPECIAL_TEXT.findall(text) if m in specials), "a special token")
        raise ValidationError(
            field, f"text contains the special token {found!r}; send token ids to use special tokens"
        ) from None


async def first_batch(source):
    """(the stream's first batch or None when it is empty, the stream): what a route awaits before its
    response starts, so that a request no worker takes (EngineUnavailable, EngineOverloaded) is answered
    with its status code instead of a 200 and an error event. A failure closes the stream."""
    try:
        return await source.__anext__(), source
    except StopAsyncIteration:
        return None, source
    except BaseException:
        await source.aclose()
        raise
