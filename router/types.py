"""Typed requests and stream events shared by the gRPC and HTTP front-ends.

Both front-ends translate their wire format into these frozen dataclasses, so validation, harmony
rendering and streaming live in one place (`service.RouterCore`) and cannot drift between protocols.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence, Union

ROLES = ("system", "developer", "user", "assistant", "tool")
CHANNELS = ("analysis", "commentary", "final")
REASONING_EFFORTS = ("low", "medium", "high")

FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True)
class SamplingOptions:
    """What the caller asked for; None means "server default". Resolved by `validation`."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    stop: tuple[str, ...] = ()  # stop strings, matched by the router on the output text (see router.stop)
    min_tokens: int | None = None  # no stop (token or string) before this many tokens
    presence_penalty: float | None = None  # [-2, 2], over the tokens generated so far (OpenAI's)
    frequency_penalty: float | None = None  # [-2, 2]
    min_p: float | None = None  # [0, 1] (vLLM's)
    top_logprobs: int | None = None  # [0, 20]: with logprobs, the most likely tokens too
    repetition_penalty: float | None = None  # > 0 (vLLM's/HF's), over prompt + generated tokens
    prompt_logprobs: int | None = None  # [0, 20]: the prompt tokens' own logprobs (echo, vLLM's)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str = ""
    channel: str = ""
    recipient: str = ""
    name: str = ""
    tool_call_id: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""  # assistant only: earlier chain of thought, rendered as an analysis message


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters_json: str = ""  # JSON Schema text; "" = no parameters


@dataclass(frozen=True)
class ResponseFormat:
    """OpenAI's response_format: "text", "json_object" or "json_schema" (schema_json: its schema's text)."""

    type: str = "text"
    schema_json: str = ""
    name: str = ""
    description: str = ""
    strict: bool | None = None  # accepted; the grammar always enforces the schema
    field: str = "response_format.json_schema.schema"  # where the schema came from (named in errors)


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...] = ()
    reasoning_effort: str = "medium"
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    conversation_start_date: str = ""  # "" = today (UTC)
    knowledge_cutoff: str = ""  # "" = harmony's default
    request_id: str = ""
    # Structured outputs (router/structured.py): the reply's final message as JSON, or a forced tool call.
    response_format: ResponseFormat | None = None
    tool_choice: str = "auto"  # auto | none | required; a named function is tool_choice_function
    tool_choice_function: str = ""
    max_reasoning_tokens: int | None = None  # kvrelay's: cap on analysis tokens of a constrained reply


@dataclass(frozen=True)
class GenerateRequest:
    prompt_token_ids: Sequence[int]  # a tuple, or array('i') (router/body.py)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    request_id: str = ""


# ---- events streamed out of the router core -------------------------------------------------


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    text: str


Delta = Union[ReasoningDelta, ContentDelta, ToolCallStart, ToolCallArgumentsDelta]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache supplied (not computed)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenStep:
    """One engine token and what it produced. `finish_reason`/`usage` are set on the last step only.

    `token_id` is None only for a closing step that carries no token (the engine ended the stream
    without a finish reason, and the parser flushed what it still held).

    Chat deltas are parsed harmony; a Generate request decoded to text (completions, or any request
    with stop strings) carries its text as `ContentDelta`s, with `text_offset` the number of characters
    of completion text decoded before this token (OpenAI's `logprobs.text_offset`). Text held back by
    stop-string matching arrives in a later step's deltas, so join the deltas, never re-decode ids.
    """

    token_id: int | None
    logprob: float | None
    deltas: tuple[Delta, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    text_offset: int | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # (token, logprob), most likely first
    # The engine's own per-request timings (queue, prefill compute, KV handoff, delivery), on the last
    # step when the engine reports them (the disaggregated client does; HTTP `kvrelay_timings`).
    timings: dict[str, float] | None = None
    # On the first step, when the request asked for them: engine.sampling.PromptLogprobs
    prompt_logprobs: object | None = None

