"""gRPC front-end (grpc.aio): kvrelay.v1.Router over `RouterCore`.

Only translation lives here. Cancellation needs no code of its own: grpc.aio cancels the handler task
when the client goes away, the CancelledError unwinds `RouterCore.stream`, and its `finally` aborts
the request in the engine.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from kvrelay.router import harmony, health
from kvrelay.router.engine_client import EngineOverloaded, EngineUnavailable
from kvrelay.router.service import RouterCore, encode_prompt_text
from kvrelay.router.types import (
    ChatMessage,
    ChatRequest,
    ResponseFormat,
    ContentDelta,
    GenerateRequest,
    ReasoningDelta,
    SamplingOptions,
    TokenStep,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallStart,
    ToolSpec,
    Usage,
)
from kvrelay.router.validation import ValidationError, check_token_ids
from kvrelay.v1 import router_pb2 as pb
from kvrelay.v1 import router_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_EFFORTS = {
    pb.REASONING_EFFORT_UNSPECIFIED: "medium",
    pb.REASONING_EFFORT_LOW: "low",
    pb.REASONING_EFFORT_MEDIUM: "medium",
    pb.REASONING_EFFORT_HIGH: "high",
}
_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}


def sampling_from_proto(s: pb.SamplingParams) -> SamplingOptions:
    return SamplingOptions(
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        stop_token_ids=tuple(s.stop_token_ids),
        logprobs=s.logprobs,
        stop=tuple(s.stop),
        min_tokens=s.min_tokens if s.HasField("min_tokens") else None,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else None,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else None,
        min_p=s.min_p if s.HasField("min_p") else None,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
    )


def chat_from_proto(req: pb.ChatRequest) -> ChatRequest:
    if req.reasoning_effort not in _EFFORTS:  # proto3 enums are open: any int can arrive
        raise ValidationError("reasoning_effort", f"unknown value {req.reasoning_effort}; expected LOW, MEDIUM or HIGH")
    messages = tuple(
        ChatMessage(
            role=m.role,
            content=m.content,
            channel=m.channel,
            recipient=m.recipient,
            name=m.name,
            tool_call_id=m.tool_call_id,
            tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
            reasoning=m.reasoning,
        )
        for m in req.messages
    )
    tools = tuple(ToolSpec(t.name, t.description, t.parameters_json_schema) for t in req.tools)
    if req.tool_choice == "none":  # as HTTP: the model is not told about the tools
        tools = ()
    if req.tool_choice_function and req.tool_choice_function not in {t.name for t in tools}:
        raise ValidationError("tool_choice_function", f"{req.tool_choice_function!r} is not one of the request's tools")
    return ChatRequest(
        messages=messages,
        tools=tools,
        reasoning_effort=_EFFORTS[req.reasoning_effort],
        sampling=sampling_from_proto(req.sampling),
        conversation_start_date=req.conversation_start_date,
        knowledge_cutoff=req.knowledge_cutoff,
        request_id=req.request_id,
        response_format=_response_format(req),
        tool_choice=req.tool_choice or "auto",
        tool_choice_function=req.tool_choice_function,
        max_reasoning_tokens=req.max_reasoning_tokens if req.HasField("max_reasoning_tokens") else None,
    )


_FORMATS = {pb.ResponseFormat.TEXT: "text", pb.ResponseFormat.JSON_OBJECT: "json_object",
            pb.ResponseFormat.JSON_SCHEMA: "json_schema"}


def _response_format(req: pb.ChatRequest) -> ResponseFormat | None:
    if not req.HasField("response_format"):
        return None
    rf = req.response_format
    if rf.type not in _FORMATS:  # proto3 enums are open
        raise ValidationError("response_format.type", f"unknown value {rf.type}; expected TEXT, JSON_OBJECT or JSON_SCHEMA")
    if _FORMATS[rf.type] == "text":
        return None
    return ResponseFormat(_FORMATS[rf.type], rf.schema_json, rf.name, rf.description,
                          field="response_format.schema_json")


def usage_to_proto(u: Usage | None) -> pb.Usage | None:
    if u is None:
        return None
    return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, total_tokens=u.total_tokens,
                    cached_tokens=u.cached_tokens)


def chat_step_to_proto(request_id: str, step: TokenStep) -> pb.ChatResponse:
    resp = pb.ChatResponse(request_id=request_id, finish_reason=_FINISH[step.finish_reason])
    for d in step.deltas:
        if isinstance(d, ReasoningDelta):
            resp.reasoning += d.text
        elif isinstance(d, ContentDelta):
            resp.content += d.text
        elif isinstance(d, ToolCallStart):
            resp.tool_calls.append(pb.ToolCallDelta(index=d.index, id=d.id, name=d.name))
        elif isinstance(d, ToolCallArgumentsDelta):
            resp.tool_calls.append(pb.ToolCallDelta(index=d.index, arguments=d.text))
    if step.token_id is not None:
        resp.token_ids.append(step.token_id)
        if step.logprob is not None:
            resp.logprobs.append(step.logprob)
    if step.usage is not None:
        resp.usage.CopyFrom(usage_to_proto(step.usage))
    return resp


@contextlib.asynccontextmanager
async def _engine_errors(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """An engine failure mid-stream ends the RPC with INTERNAL and the cause, not a bare UNKNOWN."""
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except EngineOverloaded as exc:  # refused in the engine's own admission line: the client may retry
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc} (retry after {exc.retry_after_s} s)")
    except EngineUnavailable as exc:  # no worker took it up within the resume bound: the client may retry
        log.warning("stream ended: %s", exc)
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc} (retry after {exc.retry_after_s} s)")
    except Exception as exc:
        log.exception("engine failed during a stream")
        await context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {exc}")


class _Undecodable:
    """A request whose bytes protobuf refused (a string field that is not UTF-8: the wire's bad text)."""

    def __init__(self, error: Exception) -> None:
        self.message = f"request: {error} (protobuf strings must be UTF-8 text)"


def _lenient(message_cls):
    def deserialize(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as exc:
            return _Undecodable(exc)
    return deserialize


def _refusing_undecodable(method, streaming: bool):
    if streaming:
        async def stream(request, context: grpc.aio.ServicerContext):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in method(request, context):
                yield response
        return stream

    async def unary(request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await method(request, context)
    return unary


def add_to_server(servicer: "RouterServicer", server: grpc.aio.Server) -> None:
    """pb_grpc.add_RouterServicer_to_server, but a request protobuf cannot decode is INVALID_ARGUMENT saying
    why: grpc's own deserializer failure is UNKNOWN, with a traceback in the log, for a client's error."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Router"].methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(_refusing_undecodable(getattr(servicer, method.name), method.server_streaming),
                                     request_deserializer=_lenient(getattr(pb, method.input_type.name)),
                                     response_serializer=getattr(pb, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvrelay.v1.Router", handlers),))
    server.add_registered_method_handlers("kvrelay.v1.Router", handlers)


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            prep = self.core.prepare_generate(
                GenerateRequest(tuple(request.prompt_token_ids), sampling_from_proto(request.sampling), request.request_id)
            )
            self.core.check_admission()
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineOverloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc} (retry after {exc.retry_after_s} s)")
        async with _engine_errors(context), contextlib.aclosing(self.core.stream(prep)) as steps:
            async for step in steps:
                resp = pb.GenerateResponse(request_id=prep.request_id, finish_reason=_FINISH[step.finish_reason])
                if step.token_id is not None:
                    resp.token_ids.append(step.token_id)
                    if step.logprob is not None:
                        resp.logprobs.append(step.logprob)
                if step.usage is not None:
                    resp.usage.CopyFrom(usage_to_proto(step.usage))
                yield resp

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ChatResponse]:
        try:
            prep = await self.core.off_loop(self.core.prepare_chat, chat_from_proto(request))
            self.core.check_admission()
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineOverloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc} (retry after {exc.retry_after_s} s)")
        async with _engine_errors(context), contextlib.aclosing(self.core.stream(prep)) as steps:
            async for step in steps:
                yield chat_step_to_proto(prep.request_id, step)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        # serving: ready for requests (router/health.py), as /health/ready and grpc.health.v1 answer.
        return pb.HealthResponse(serving=health.readiness(self.core.engine).ready, model=self.core.model_name)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        chat = request.HasField("chat") and len(request.chat.messages) > 0
        try:
            if chat == bool(request.prompt):
                raise ValidationError("prompt", "set exactly one of prompt and chat.messages")
            if chat:
                prep = await self.core.off_loop(self.core.prepare_chat, chat_from_proto(request.chat))
                ids = list(prep.prompt_ids)
            else:
                ids = await self.core.off_loop(encode_prompt_text, request.prompt)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        strs = [harmony.decode_tokens([t]) for t in ids] if request.return_token_strs else []
        return pb.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.core.max_context, token_strs=strs)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        try:
            check_token_ids(list(request.tokens), "tokens", self.core.vocab_size)
            try:
                text = harmony.decode_tokens(list(request.tokens))
            except Exception as e:  # ids the vocabulary has no text for
                raise ValidationError("tokens", f"cannot be decoded: {e}") from None
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.DetokenizeResponse(prompt=text)

    async def Version(self, request: pb.VersionRequest, context: grpc.aio.ServicerContext) -> pb.VersionResponse:
        info = self.core.server_info
        if info is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server was started without its version information")
        body = info.body()
        return pb.VersionResponse(version=body["version"], git_commit=body["git_commit"], git_dirty=body["git_dirty"],
                                  topology_json=json.dumps(body["topology"]) if body["topology"] else "",
                                  topology_source=body["topology_source"] or "", device=body["device"],
                                  gpus=body["gpus"])

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.Model(id=name, max_context=self.core.max_context, owned_by="kvrelay")
                                             for name in self.core.model_names])
