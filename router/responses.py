"""The OpenAI Responses API: `POST /v1/responses` (plain and streamed), `GET` and `DELETE /v1/responses/{id}`.

A request becomes the same harmony chat as `/v1/chat/completions` (`responses_models`), runs through
`RouterCore` like any chat, and its tokens become output items and stream events (`responses_output`).
With `store` (on by default, as OpenAI's) the finished response and its whole conversation are kept in a
bounded in-memory store (`responses_store`), so that `previous_response_id` continues it: the earlier
turns' messages (input and output; not their instructions or tools, which OpenAI does not carry over
either) come before the new input. That is how a function call loops: turn 1 returns a `function_call`,
turn 2 sends its `function_call_output` with `previous_response_id`, and the model sees its own analysis
and call before the result.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvrelay.router.engine_client import EngineUnavailable
from kvrelay.router.http_models import warn_unknown
from kvrelay.router.http_streams import sse_json
from kvrelay.router.responses_models import (
    ResponsesOptions,
    ResponsesRequest,
    Sourced,
    check_options,
    input_messages,
    responses_field,
    wire_items,
)
from kvrelay.router.responses_output import OutputBuilder
from kvrelay.router.responses_store import ResponseStore
from kvrelay.router.service import Prepared, RouterCore, first_batch
from kvrelay.router.types import ChatMessage, ChatRequest, TokenStep, Usage
from kvrelay.router.validation import ValidationError

log = logging.getLogger(__name__)


def _error(message: str, *, param: str | None, code: str | None = None, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": code}}, status_code=status)


def add_routes(app: FastAPI, core: RouterCore, check_model, store: ResponseStore | None = None) -> ResponseStore:
    store = store if store is not None else ResponseStore()

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest) -> Any:
        if (bad := check_model(body.model)) is not None:
            return bad
        warn_unknown(body, "/v1/responses")
        opts = check_options(body)
        history: tuple[ChatMessage, ...] = ()
        if body.previous_response_id:
            entry = store.get(body.previous_response_id)
            if entry is None:
                return _error(f"Previous response with id '{body.previous_response_id}' not found (unknown, "
                              "stored with store: false, expired or evicted).", param="previous_response_id",
                              code="previous_response_not_found")
            history = entry.history
        run = ResponseRun(core, store, body, opts, f"resp_{uuid.uuid4().hex}")
        await core.off_loop(run.prepare, history)
        core.check_admission()
        if opts.stream:
            await run.prime()  # no worker to take it (503) or a full waiting line (429): said before a 200
            return StreamingResponse(run.sse(), media_type="text/event-stream")
        return await run.complete()

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> Any:
        for name in request.query_params:  # stream=true (resuming a stream), include, starting_after
            raise ValidationError(name, "not supported when retrieving a response")
        entry = store.get(response_id)
        if entry is None:
            return _error(f"No response found with id '{response_id}'.", param="response_id", status=404)
        return entry.body

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request) -> Any:
        q = request.query_params
        for name in q:
            if name not in ("after", "limit", "order"):
                raise ValidationError(name, "not supported when listing input items (after, limit, order are)")
        entry = store.get(response_id)
        if entry is None:
            return _error(f"No response found with id '{response_id}'.", param="response_id", status=404)
        order, limit = q.get("order", "desc"), q.get("limit", "20")
        if order not in ("asc", "desc"):
            raise ValidationError("order", f"expected asc or desc, got {order!r}")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise ValidationError("limit", f"must be an integer in [1, 100], got {limit!r}")
        items = list(entry.input_items if order == "asc" else reversed(entry.input_items))
        if "after" in q:
            ids = [item["id"] for item in items]
            if q["after"] not in ids:
                raise ValidationError("after", f"no input item {q['after']!r} in response {response_id!r}")
            items = items[ids.index(q["after"]) + 1:]
        page = items[: int(limit)]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Any:
        if not store.delete(response_id):
            return _error(f"No response found with id '{response_id}'.", param="response_id", status=404)
        return {"id": response_id, "object": "response", "deleted": True}

    return store


class ResponseRun:
    """One response: prepared (validated, rendered) once, then run plain or streamed."""

    def __init__(self, core: RouterCore, store: ResponseStore, body: ResponsesRequest, opts: ResponsesOptions,
                 response_id: str) -> None:
        self.core = core
        self.store = store
        self.body = body
        self.opts = opts
        self.id = response_id
        self.created = int(time.time())
        self.builder = OutputBuilder(summary=opts.summary is not None, encrypted=opts.encrypted,
                                     logprobs=opts.logprobs)
        self.prep: Prepared | None = None
        self.conversation: tuple[ChatMessage, ...] = ()  # history + this input, without instructions
        self._seq = 0
        self._source: AsyncIterator[list[TokenStep]] | None = None  # the core's stream, once primed
        self._first: list[TokenStep] | None = None

    def prepare(self, history: tuple[ChatMessage, ...]) -> None:
        """Validate and render (on the preparation threads). Errors name the Responses field."""
        sources = [Sourced(m, "previous_response_id", "message") for m in history]
        sources += input_messages(self.body.input)  # type: ignore[arg-type]  # check_options: not None
        self.conversation = tuple(s.message for s in sources)
        if self.body.instructions:
            sources.insert(0, Sourced(ChatMessage("developer", self.body.instructions), "instructions", "message"))
        chat = ChatRequest(messages=tuple(s.message for s in sources), tools=self.opts.tools,
                           reasoning_effort=self.opts.effort, sampling=self.opts.sampling, request_id=self.id,
                           response_format=self.opts.response_format, tool_choice=self.opts.tool_choice,
                           tool_choice_function=self.opts.tool_choice_function,
                           max_reasoning_tokens=self.body.max_reasoning_tokens)
        try:
            self.prep = self.core.prepare_chat(chat)
        except ValidationError as exc:
            raise ValidationError(responses_field(exc.field, sources), exc.message) from None

    # ---- the response object ----------------------------------------------------------------------

    def response(self, status: str, usage: Usage | None = None, error: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        b, params = self.body, self.prep.params if self.prep is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": b.max_tool_calls,
            "metadata": b.metadata or {},
            "model": self.core.model_name,
            "output": list(self.builder.output) if status != "in_progress" else [],
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "prompt_cache_key": b.prompt_cache_key,
            "reasoning": {"effort": self.opts.effort, "summary": self.opts.summary},
            "safety_identifier": b.safety_identifier,
            "service_tier": "default",
            "store": self.opts.store,
            "temperature": params.temperature if params is not None else b.temperature,
            "text": self.opts.text_echo,
            "tool_choice": self.opts.tool_choice_echo,
            "tools": list(self.opts.tools_echo),
            "top_logprobs": b.top_logprobs or 0,
            "top_p": params.top_p if params is not None else b.top_p,
            "truncation": "disabled",
            "usage": None if usage is None else self._usage(usage),
            "user": b.user,
        }

    def _usage(self, u: Usage) -> dict[str, Any]:
        # cached_tokens: input tokens the prefix cache supplied (prefill.prefix_cache).
        return {"input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.builder.reasoning_tokens},
                "total_tokens": u.total_tokens}

    # ---- running ----------------------------------------------------------------------------------

    def _numbered(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for e in events:
            e["sequence_number"] = self._seq
            self._seq += 1
        return events

    async def prime(self) -> None:
        """Wait for the engine's first tokens before a streamed response starts (as the chat route does), so
        that EngineUnavailable / EngineOverloaded are answered with their status code, not an event."""
        assert self.prep is not None
        self._first, self._source = await first_batch(self.core.stream_batches(self.prep))

    async def _batches(self) -> AsyncIterator[list[TokenStep]]:
        if self._first is not None:
            yield self._first
            self._first = None
        if self._source is None:
            assert self.prep is not None
            self._source = self.core.stream_batches(self.prep)
        async with contextlib.aclosing(self._source):  # type: ignore[type-var]
            async for steps in self._source:
                yield steps

    async def events(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The stream's events, one list per engine hand-over; the last list ends with
        response.completed (or response.incomplete, at max_output_tokens)."""
        assert self.prep is not None
        yield self._numbered([{"type": "response.created", "response": self.response("in_progress")},
                              {"type": "response.in_progress", "response": self.response("in_progress")}])
        finish, usage = None, None
        async with contextlib.aclosing(self._batches()) as batches:
            async for steps in batches:
                for step in steps:
                    self.builder.feed(step)
                    finish, usage = step.finish_reason or finish, step.usage or usage
                self.builder.flush()
                if events := self.builder.take_events():
                    yield self._numbered(events)
        status = "incomplete" if finish == "length" else "completed"
        self.builder.finish(status)
        final = self.response(status, usage)
        if self.opts.store:
            self.store.put(self.id, self.conversation + tuple(self.builder.conversation()), final,
                           wire_items(self.body.input, _new_id))  # type: ignore[arg-type]  # validated
        yield self._numbered(self.builder.take_events() + [{"type": f"response.{status}", "response": final}])

    async def complete(self) -> dict[str, Any]:
        final: dict[str, Any] = {}
        async with contextlib.aclosing(self.events()) as events:
            async for batch in events:
                final = batch[-1].get("response", final)
        return final

    async def sse(self) -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(self.events()) as events:
                async for batch in events:
                    yield b"".join(_sse(e) for e in batch)
        except Exception as exc:  # headers are already sent: report in-band, as OpenAI's response.failed
            if isinstance(exc, EngineUnavailable):  # the workers went away: what a 503 would have said
                log.warning("response %s ended: %s", self.id, exc)
                error = {"code": "service_unavailable", "message": f"{exc} (retry after {exc.retry_after_s} s)"}
            else:
                log.exception("response %s failed", self.id)
                error = {"code": "server_error", "message": f"internal error: {exc}"}
            self.builder.finish("incomplete")
            failed = self.response("failed", error=error)
            yield b"".join(_sse(e) for e in self._numbered(self.builder.take_events() +
                                                          [{"type": "response.failed", "response": failed}]))


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {sse_json(event)}\n\n".encode()
