"""The response streams of the OpenAI HTTP front-end (router/http_api.py): one engine request's steps
turned into a chat completion (`ChatStream`) or a legacy completion (`CompletionStream`), whole or as
server-sent events, and `ChoiceBatch`, several of them (batched prompts, `n` choices) as one response.

A stream is primed (its first tokens awaited) before the response starts, so a request no worker takes
gets its status code; once the headers are out, errors go in-band as an error event before `[DONE]`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from kvrelay.router import harmony
from kvrelay.router import metrics as router_metrics
from kvrelay.router.completion_logprobs import echoed_prompt, legacy_top, vllm_prompt_logprobs
from kvrelay.router.engine_client import EngineUnavailable
from kvrelay.router.http_errors import error_body
from kvrelay.router.service import Prepared, RouterCore, first_batch
from kvrelay.router.types import (
    ContentDelta,
    ReasoningDelta,
    TokenStep,
    ToolCallArgumentsDelta,
    ToolCallStart,
    Usage,
)

# The logger these streams always wrote to (they were part of http_api.py).
log = logging.getLogger("kvrelay.router.http_api")


def _usage(u: Usage | None) -> dict[str, Any] | None:
    if u is None:
        return None
    # cached_tokens: prompt tokens the prefix cache supplied (prefill.prefix_cache), as OpenAI's field says.
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


# Line breaks to str.splitlines (and so to clients that cut an event stream with it: httpx's aiter_lines,
# guidellm) that JSON leaves raw (the others, \v \f \x1c-\x1e, are control characters it escapes): a data line
# holding one would be cut in two. Escaped, the JSON means the same.
_SPLITLINES_BREAKS = (("\u2028", "\\u2028"), ("\u2029", "\\u2029"), ("\x85", "\\u0085"))


def sse_json(payload: Any) -> str:
    """JSON for an SSE data line: UTF-8 text as it is (not \\u escapes: half the bytes for CJK), but
    for the three characters `_SPLITLINES_BREAKS` escapes."""
    data = json.dumps(payload, ensure_ascii=False)
    for char, escaped in _SPLITLINES_BREAKS:
        if char in data:  # a scan each, in C; rare enough that the replace almost never runs
            data = data.replace(char, escaped)
    return data


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else sse_json(payload)
    return f"data: {data}\n\n".encode()


class ChoiceStream(abc.ABC):
    """One choice of a response (what ChatStream and CompletionStream share): run the core stream, always
    closed (which aborts the engine on early exit)."""

    object_name = ""  # OpenAI's "object" field of a full response
    id_prefix = "cmpl"

    def __init__(self, core: RouterCore, prep: Prepared, *, include_usage: bool, continuous_usage: bool = False,
                 index: int = 0) -> None:
        self.core = core
        self.prep = prep
        self.index = index  # the choice's index (batched prompts, n > 1)
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # usage so far on every chunk (vLLM's continuous_usage_stats)
        self.generated = 0
        self.usage: Usage | None = None  # the final usage, once the stream has ended
        self.timings: dict[str, float] | None = None
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self._source: AsyncIterator[list[TokenStep]] | None = None  # the core's stream, once primed
        self._first: list[TokenStep] | None = None
        self.tokens = None  # the engine's token stream when a fork opened it (RouterCore.fork)

    async def prime(self) -> None:
        """Wait for the engine's first tokens before the response starts: a request that no worker takes
        (EngineUnavailable, EngineOverloaded) is then answered with its status code and Retry-After, not
        with a 200 and an error event. Nothing could be sent before the first token anyway."""
        self._first, self._source = await first_batch(self.core.stream_batches(self.prep, self.tokens))

    async def _primed(self) -> AsyncIterator[list[TokenStep]]:
        if self._first is not None:
            yield self._first
            self._first = None
        assert self._source is not None
        async for steps in self._source:
            yield steps

    async def batches(self) -> AsyncIterator[list[TokenStep]]:
        """The core's steps in the lists it hands over: a streamed response writes one chunk per list."""
        if self._source is not None:
            source = self._source
            stream = self._primed()
        else:
            source = stream = self.core.stream_batches(self.prep, self.tokens)
        async with contextlib.aclosing(source), contextlib.aclosing(stream) as batches:  # type: ignore[type-var]
            async for steps in batches:
                steps = [self.rewrite(s) for s in steps]
                for step in steps:
                    if step.timings is not None:
                        self.timings = step.timings
                    if step.token_id is not None:
                        self.generated += 1
                    if step.usage is not None:
                        self.usage = step.usage
                yield steps

    def rewrite(self, step: TokenStep) -> TokenStep:
        """A step as this response reports it (see CompletionStream)."""
        return step

    async def steps(self) -> AsyncIterator[TokenStep]:
        async with contextlib.aclosing(self.batches()) as batches:
            async for steps in batches:
                for step in steps:
                    yield step

    def envelope(self, choices: list[dict[str, Any]], usage: Usage | None = None, *, chunk: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": self.object_name + (".chunk" if chunk and self.object_name == "chat.completion" else ""),
            "created": self.created,
            "model": self.core.model_name,
            "choices": choices,
        }
        if chunk and usage is None and self.continuous_usage and choices:
            usage = Usage(len(self.prep.prompt_ids), self.generated)
        if usage is not None or not chunk:
            out["usage"] = _usage(usage)
            if self.timings is not None:  # where the time to first token went, per the engine
                out["kvrelay_timings"] = self.timings
        return out

    async def sse(self) -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(self.chunks()) as chunks:
                async for payload in chunks:
                    yield _sse(payload)
        except EngineUnavailable as exc:  # headers are already sent: in-band, as a 503 would have said
            log.warning("stream %s ended: %s", self.prep.request_id, exc)
            yield _sse(_unavailable_body(exc))
        except Exception as exc:  # headers are already sent: report in-band, then end the stream
            log.exception("stream %s failed", self.prep.request_id)
            router_metrics.ERRORS.labels("http", "stream").inc()  # a 200 that failed: counted all the same
            yield _sse(error_body(f"internal error: {exc}", type_="server_error"))
        yield _sse("[DONE]")

    @abc.abstractmethod
    def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The SSE payloads of a streamed response, in order."""


class ChatStream(ChoiceStream):
    object_name = "chat.completion"
    id_prefix = "chatcmpl"

    def _logprob(self, step: TokenStep) -> dict[str, Any] | None:
        if step.token_id is None or step.logprob is None:
            return None
        text = harmony.decode_tokens([step.token_id])
        top = []
        for token, logprob in step.top_logprobs or ():
            t = harmony.decode_tokens([token])
            top.append({"token": t, "logprob": logprob, "bytes": list(t.encode())})
        return {"token": text, "logprob": step.logprob, "bytes": list(text.encode()), "top_logprobs": top}

    async def complete(self) -> dict[str, Any]:
        reasoning, content, calls, logprobs = [], [], {}, []
        finish, usage = None, None
        async for step in self.steps():
            for d in step.deltas:
                if isinstance(d, ReasoningDelta):
                    reasoning.append(d.text)
                elif isinstance(d, ContentDelta):
                    content.append(d.text)
                elif isinstance(d, ToolCallStart):
                    calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
                elif isinstance(d, ToolCallArgumentsDelta):
                    calls[d.index]["function"]["arguments"] += d.text
            if (lp := self._logprob(step)) is not None:
                logprobs.append(lp)
            finish, usage = step.finish_reason or finish, step.usage or usage
        text, thought = "".join(content), "".join(reasoning)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text if text or not calls else None,
            "reasoning_content": thought or None,
            "reasoning": thought or None,
            "tool_calls": [calls[i] for i in sorted(calls)] if calls else None,
        }
        choice = {"index": self.index, "message": message, "finish_reason": finish,
                  "logprobs": {"content": logprobs} if self.prep.params.logprobs else None}
        return self.envelope([choice], usage, chunk=False)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        first = {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}
        yield self.envelope([first], chunk=True)
        async for steps in self.batches():
            delta: dict[str, Any] = {}
            calls: list[dict[str, Any]] = []
            lps = []
            for step in steps:
                for d in step.deltas:
                    if isinstance(d, ReasoningDelta):
                        delta["reasoning_content"] = delta.get("reasoning_content", "") + d.text
                        delta["reasoning"] = delta["reasoning_content"]
                    elif isinstance(d, ContentDelta):
                        delta["content"] = delta.get("content", "") + d.text
                    elif isinstance(d, ToolCallStart):
                        calls.append({"index": d.index, "id": d.id, "type": "function",
                                      "function": {"name": d.name, "arguments": ""}})
                    elif isinstance(d, ToolCallArgumentsDelta):
                        if calls and calls[-1]["index"] == d.index:  # one entry per call within a chunk
                            calls[-1]["function"]["arguments"] += d.text
                        else:
                            calls.append({"index": d.index, "function": {"arguments": d.text}})
                if (lp := self._logprob(step)) is not None:
                    lps.append(lp)
            if calls:
                delta["tool_calls"] = calls
            if delta or lps:
                yield self.envelope([{"index": self.index, "delta": delta, "finish_reason": None,
                                      "logprobs": {"content": lps} if lps else None}], chunk=True)
            last = steps[-1]
            if last.finish_reason is not None:
                yield self.envelope([{"index": self.index, "delta": {}, "logprobs": None,
                                      "finish_reason": last.finish_reason}], chunk=True)
                if self.include_usage:
                    yield self.envelope([], last.usage, chunk=True)


class CompletionStream(ChoiceStream):
    """The completion text comes from the core as ContentDeltas (already cut at a stop string, with
    held-back text released in later steps), so nothing is decoded here.

    `echo` puts the prompt in front, as vLLM does: its text before the completion's, and with logprobs its
    tokens before the generated ones (the first with logprob None, the others with the logprobs the
    prefill computed, each listing itself and the `logprobs` most likely tokens). `echo_only` (echo with
    max_tokens 0, for scoring) leaves the one token the engine ran out of the response and the usage.
    `prompt_logprobs` adds vLLM's `prompt_logprobs` list to the choice."""

    object_name = "text_completion"

    def __init__(self, core: RouterCore, prep: Prepared, *, return_token_ids: bool, include_usage: bool,
                 continuous_usage: bool = False, index: int = 0, echo: bool = False, echo_only: bool = False,
                 prompt_logprobs: bool = False) -> None:
        super().__init__(core, prep, include_usage=include_usage, continuous_usage=continuous_usage, index=index)
        self.return_token_ids = return_token_ids
        self.echo, self.echo_only, self.want_prompt_logprobs = echo, echo_only, prompt_logprobs
        self.prompt_text = harmony.decode_tokens(list(prep.prompt_ids)) if echo else ""

    def rewrite(self, step: TokenStep) -> TokenStep:
        if not self.echo_only:
            return step
        usage = Usage(step.usage.prompt_tokens, 0, step.usage.cached_tokens) if step.usage is not None else None
        return TokenStep(None, None, (), step.finish_reason, usage, prompt_logprobs=step.prompt_logprobs,
                         timings=step.timings)

    def _choice(self, text: str, token_ids: list[int], logprobs: list, offsets: list[int],
                finish: str | None, tops: list | None = None, echoed: list[int] | None = None,
                plp=None, first: bool = True) -> dict[str, Any]:
        """`echoed`: that many of the leading tokens are the prompt's (their `tops` entries already list
        the token itself); `token_ids` (return_token_ids) are the generated ones. Streamed, only the
        `first` chunk carries `prompt_token_ids` (vLLM's documented behaviour: a 32k-token prompt is not
        resent with every chunk)."""
        n_echo = len(echoed or ())
        choice: dict[str, Any] = {"index": self.index, "text": text, "finish_reason": finish, "logprobs": None}
        if self.prep.params.logprobs:
            top = None
            if self.prep.params.top_logprobs:
                top = [None if i == 0 and n_echo else
                       legacy_top(alts if i < n_echo else ((t, logprobs[i]),) + tuple(alts or ()))
                       for i, (t, alts) in enumerate(zip((echoed or []) + token_ids, tops or ()))]
            choice["logprobs"] = {
                "tokens": [harmony.decode_tokens([t]) for t in (echoed or []) + token_ids],
                "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets,
            }
        if self.want_prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.prep.prompt_ids, plp)
        if self.return_token_ids:
            choice["token_ids"] = token_ids
            choice["prompt_token_ids"] = list(self.prep.prompt_ids) if first else None
        return choice

    def _generated(self, steps: list[TokenStep]) -> tuple[list[int], list, list[int], list]:
        with_ids = [s for s in steps if s.token_id is not None]
        shift = len(self.prompt_text)
        return ([s.token_id for s in with_ids], [s.logprob for s in with_ids if s.logprob is not None],
                [shift + (s.text_offset or 0) for s in with_ids], [s.top_logprobs for s in with_ids])

    def _chunk_choice(self, steps: list[TokenStep], first: bool) -> dict[str, Any]:
        ids, lps, offsets, tops = self._generated(steps)
        text = "".join(_content(s) for s in steps)
        plp = next((s.prompt_logprobs for s in steps if s.prompt_logprobs is not None), None)
        echoed = None
        if self.echo and first:
            p_text, p_lps, p_offsets, p_tops = echoed_prompt(self.prep.prompt_ids, plp)
            echoed = list(self.prep.prompt_ids)
            text, lps, offsets, tops = p_text + text, p_lps + lps, p_offsets + offsets, p_tops + tops
        return self._choice(text, ids, lps, offsets, steps[-1].finish_reason, tops, echoed, plp, first)

    async def complete(self) -> dict[str, Any]:
        steps = [s async for s in self.steps()]
        return self.envelope([self._chunk_choice(steps, True)], self.usage, chunk=False)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        first = True
        async for steps in self.batches():
            last = steps[-1]
            yield self.envelope([self._chunk_choice(steps, first)], chunk=True)
            first = False
            if last.finish_reason is not None and self.include_usage:
                yield self.envelope([], last.usage, chunk=True)


def _unavailable_body(exc: EngineUnavailable) -> dict[str, Any]:
    return error_body(f"{exc} (retry after {exc.retry_after_s} s)", type_="server_error", code="service_unavailable")


def _content(step: TokenStep) -> str:
    return "".join(d.text for d in step.deltas if isinstance(d, ContentDelta))


class ChoiceBatch:
    """Several choices in one response: the prompts of a batched /v1/completions request (lm-eval's
    batches) and/or `n` choices per prompt. Each runs as its own engine request, concurrently; the n
    choices of a prompt share one prefill and its KV where the engine forks (RouterCore.fork); one
    response with a choice per stream (`index` as
    OpenAI numbers them: prompt x n + copy), completion tokens summed, each prompt's tokens counted once.
    Streamed, the choices' chunks interleave as they come; a client that goes away aborts all of them."""

    def __init__(self, streams: list[ChoiceStream], *, include_usage: bool, n: int = 1) -> None:
        self.streams = streams
        self.include_usage = include_usage
        self.n = n
        for s in streams[1:]:
            s.id, s.created = streams[0].id, streams[0].created

    async def prime(self) -> None:
        """Every choice's first tokens before the response starts (see ChoiceStream.prime)."""
        results = await asyncio.gather(*(s.prime() for s in self.streams), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            for s in self.streams:
                if s._source is not None:
                    await s._source.aclose()  # type: ignore[attr-defined]
            raise failed

    def _usage(self) -> Usage:
        done = [s.usage for s in self.streams if s.usage is not None]
        prompts = [s.usage for s in self.streams[:: self.n] if s.usage is not None]
        return Usage(sum(u.prompt_tokens for u in prompts), sum(u.completion_tokens for u in done),
                     sum(u.cached_tokens for u in prompts))

    async def complete(self) -> dict[str, Any]:
        tasks = [asyncio.ensure_future(s.complete()) for s in self.streams]
        try:
            outs = await asyncio.gather(*tasks)
        finally:  # one failed (or the client went away): the others stop too, and free their KV
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        out = self.streams[0].envelope([o["choices"][0] for o in outs], self._usage(), chunk=False)
        out.pop("kvrelay_timings", None)  # per request; a batch is several
        return out

    async def sse(self) -> AsyncIterator[bytes]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(s: ChoiceStream) -> None:
            try:
                async with contextlib.aclosing(s.chunks()) as chunks:
                    async for payload in chunks:
                        await queue.put(("chunk", payload))
                await queue.put(("done", None))
            except EngineUnavailable as exc:
                log.warning("stream %s ended: %s", s.prep.request_id, exc)
                await queue.put(("error", exc))
            except Exception as exc:  # noqa: BLE001 - reported in-band below
                log.exception("stream %s failed", s.prep.request_id)
                router_metrics.ERRORS.labels("http", "stream").inc()
                await queue.put(("error", exc))

        tasks = [asyncio.create_task(pump(s)) for s in self.streams]
        try:
            left = len(tasks)
            while left:
                kind, item = await queue.get()
                if kind == "chunk":
                    yield _sse(item)
                elif kind == "done":
                    left -= 1
                else:
                    yield _sse(_unavailable_body(item) if isinstance(item, EngineUnavailable)
                               else error_body(f"internal error: {item}", type_="server_error"))
                    break
            else:
                if self.include_usage:
                    chunk = self.streams[0].envelope([], self._usage(), chunk=True)
                    chunk.pop("kvrelay_timings", None)
                    yield _sse(chunk)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        yield _sse("[DONE]")
