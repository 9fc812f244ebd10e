"""A small typed, synchronous gRPC client for the router (demos, scripts, tests).

Streams are plain iterators of the generated response messages; `collect_chat` folds a Chat stream
into one `ChatResult`. Closing an iterator early (or `cancel()` on it) cancels the RPC, which aborts
the request on the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import grpc

from kvrelay.router.types import ChatMessage, SamplingOptions, ToolCall, ToolSpec
from kvrelay.v1 import router_pb2 as pb
from kvrelay.v1 import router_pb2_grpc as pb_grpc

_EFFORTS = {"low": pb.REASONING_EFFORT_LOW, "medium": pb.REASONING_EFFORT_MEDIUM, "high": pb.REASONING_EFFORT_HIGH}
_FINISH = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


def sampling_to_proto(s: SamplingOptions) -> pb.SamplingParams:
    out = pb.SamplingParams(stop_token_ids=list(s.stop_token_ids), logprobs=s.logprobs, stop=list(s.stop))
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens", "presence_penalty",
                 "frequency_penalty", "min_p", "repetition_penalty"):
        value = getattr(s, name)
        if value is not None:
            setattr(out, name, value)
    return out


def message_to_proto(m: ChatMessage) -> pb.ChatMessage:
    return pb.ChatMessage(
        role=m.role, content=m.content, channel=m.channel, recipient=m.recipient, name=m.name,
        tool_call_id=m.tool_call_id, reasoning=m.reasoning,
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls],
    )


@dataclass
class ChatResult:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, what the prefix cache supplied

    def as_assistant_message(self) -> ChatMessage:
        """The turn as history for the next request (the reasoning is kept; harmony drops it when due)."""
        return ChatMessage("assistant", self.content, tool_calls=tuple(self.tool_calls), reasoning=self.reasoning)


def collect_chat(stream: Iterable[pb.ChatResponse]) -> ChatResult:
    result = ChatResult()
    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
    for resp in stream:
        result.reasoning += resp.reasoning
        result.content += resp.content
        result.token_ids.extend(resp.token_ids)
        for d in resp.tool_calls:
            call = calls.setdefault(d.index, ["", "", ""])
            call[0] = d.id or call[0]
            call[1] = d.name or call[1]
            call[2] += d.arguments
        if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            result.finish_reason = _FINISH[resp.finish_reason]
            result.prompt_tokens = resp.usage.prompt_tokens
            result.completion_tokens = resp.usage.completion_tokens
            result.cached_tokens = resp.usage.cached_tokens
    result.tool_calls = [ToolCall(*calls[i]) for i in sorted(calls)]
    return result


def _effort(name: str) -> "pb.ReasoningEffort.ValueType":
    if name not in _EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(_EFFORTS)}, got {name!r}")
    return _EFFORTS[name]


class RouterClient:
    def __init__(self, target: str, *, timeout_s: float | None = None, api_key: str | None = None,
                 tls_ca: bytes | str | None = None) -> None:
        """`tls_ca`: PEM bytes, or a file path, of the CA (or self-signed certificate) that signed a TLS
        router's certificate; without it the channel is plaintext."""
        if tls_ca is None:
            self._channel = grpc.insecure_channel(target)
        else:
            pem = tls_ca if isinstance(tls_ca, bytes) else open(tls_ca, "rb").read()
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=pem))
        self._stub = pb_grpc.RouterStub(self._channel)
        self._timeout = timeout_s
        # Sent with every call: a router started with API keys wants `authorization: Bearer KEY`.
        self._md = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "RouterClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> pb.HealthResponse:
        return self._stub.Health(pb.HealthRequest(), timeout=self._timeout, metadata=self._md)

    def tokenize(self, prompt: str = "", *, messages: Sequence[ChatMessage] = (), tools: Sequence[ToolSpec] = (),
                 reasoning_effort: str = "medium", return_token_strs: bool = False) -> pb.TokenizeResponse:
        """Text, or a conversation rendered exactly as `chat` renders it; one of the two."""
        req = pb.TokenizeRequest(prompt=prompt, return_token_strs=return_token_strs)
        if messages:
            req.chat.CopyFrom(pb.ChatRequest(
                messages=[message_to_proto(m) for m in messages], reasoning_effort=_effort(reasoning_effort),
                tools=[pb.Tool(name=t.name, description=t.description, parameters_json_schema=t.parameters_json)
                       for t in tools]))
        return self._stub.Tokenize(req, timeout=self._timeout, metadata=self._md)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._stub.Detokenize(pb.DetokenizeRequest(tokens=list(token_ids)), timeout=self._timeout,
                                     metadata=self._md).prompt

    def version(self) -> pb.VersionResponse:
        """What the server runs (commit, dirty flag, topology as JSON, GPUs), as HTTP GET /version."""
        return self._stub.Version(pb.VersionRequest(), timeout=self._timeout, metadata=self._md)

    def list_models(self) -> list[pb.Model]:
        return list(self._stub.ListModels(pb.ListModelsRequest(), timeout=self._timeout, metadata=self._md).models)

    def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingOptions = SamplingOptions(), *, request_id: str = ""
    ) -> Iterator[pb.GenerateResponse]:
        req = pb.GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt_ids),
                                 sampling=sampling_to_proto(sampling))
        return self._stub.Generate(req, timeout=self._timeout, metadata=self._md)

    def chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        reasoning_effort: str = "medium",
        sampling: SamplingOptions = SamplingOptions(),
        conversation_start_date: str = "",
        request_id: str = "",
        response_format: pb.ResponseFormat | None = None,
        tool_choice: str = "",
        tool_choice_function: str = "",
        max_reasoning_tokens: int | None = None,
    ) -> Iterator[pb.ChatResponse]:
        req = pb.ChatRequest(
            request_id=request_id,
            messages=[message_to_proto(m) for m in messages],
            tools=[pb.Tool(name=t.name, description=t.description, parameters_json_schema=t.parameters_json) for t in tools],
            reasoning_effort=_effort(reasoning_effort),
            sampling=sampling_to_proto(sampling),
            conversation_start_date=conversation_start_date,
            response_format=response_format,
            tool_choice=tool_choice,
            tool_choice_function=tool_choice_function,
            max_reasoning_tokens=max_reasoning_tokens,
        )
        return self._stub.Chat(req, timeout=self._timeout, metadata=self._md)
