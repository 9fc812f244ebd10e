"""The OpenAI Responses API request (`POST /v1/responses`) and its translation to a harmony chat.

A Responses request maps onto the same `ChatRequest` the chat completions route renders (harmony spec
10.4): `instructions` -> developer instructions, input items -> chat messages (a `message` by role, a
`reasoning` item -> the assistant's analysis, a `function_call` -> an assistant tool call, a
`function_call_output` -> the tool's answer, matched by `call_id`), function tools -> the developer
message's `functions` namespace, `reasoning.effort` -> the system message's `Reasoning:`. Every field
OpenAI defines is read; one we do not honour is refused with a 400 naming it (unless it holds its neutral
value); a field neither OpenAI nor vLLM (its sampling extensions) defines is ignored with a warning, the
rule of every HTTP endpoint (http_models.BodyModel).

Each chat message remembers where it came from (`input[3]`, `instructions`, `previous_response_id`), so a
problem the shared chat validation finds is reported under the Responses field name.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

from kvrelay.router.http_models import BodyModel
from kvrelay.router.types import ChatMessage, ResponseFormat, SamplingOptions, ToolCall, ToolSpec
from kvrelay.router.validation import ValidationError

INCLUDE_ENCRYPTED = "reasoning.encrypted_content"
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# Our reasoning items' `encrypted_content` is the analysis text itself, base64url-encoded behind this
# prefix (it is not encrypted: the client owns the conversation either way). A stateless client
# (store: false) sends it back and the model sees its own chain of thought again.
ENCRYPTED_PREFIX = "kvrelay.analysis.v1:"
_EFFORTS = ("low", "medium", "high")
_SUMMARIES = ("auto", "concise", "detailed")
_TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA_KEYS = 16

# OpenAI fields we do not support: refused unless null (or the neutral value after the colon).
_UNSUPPORTED = {
    "background": "background responses are not supported (the request streams or waits)",
    "background_options": "background responses are not supported",
    "conversation": "the Conversations API is not supported; use previous_response_id or send the input items",
    "prompt": "prompt templates are not supported; send instructions and input",
    "context_management": "server-side context compaction is not supported",
    "moderation": "moderation is not supported",
    "image": "image inputs are not supported",
    "access_programs": "access programs are not supported",
    "prompt_cache_options": "prompt caching options are not supported (there is no prefix cache yet)",
    "prompt_cache_retention": "prompt caching options are not supported (there is no prefix cache yet)",
}


class _Strict(BodyModel):
    """Every field OpenAI defines is declared (honoured, or refused by name unless neutral: `_UNSUPPORTED`);
    one neither OpenAI nor vLLM defines follows the rule of every HTTP endpoint (http_models.BodyModel):
    ignored, and named in a warning."""


class ReasoningIn(_Strict):
    effort: Optional[str] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None  # the deprecated name of `summary`
    context: Optional[str] = None
    mode: Optional[str] = None


class TextIn(_Strict):
    format: Optional[dict[str, Any]] = None
    verbosity: Optional[str] = None


class StreamOptionsIn(_Strict):
    include_obfuscation: Optional[bool] = None


class ResponsesRequest(_Strict):
    model: Optional[str] = None
    input: Union[str, list[Any], None] = None
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptionsIn] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    max_tool_calls: Optional[int] = None
    reasoning: Optional[ReasoningIn] = None
    text: Optional[TextIn] = None
    include: Optional[list[str]] = None
    metadata: Optional[dict[str, str]] = None
    truncation: Optional[str] = None
    service_tier: Optional[str] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    background: Optional[bool] = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Optional[str] = None
    # vLLM's sampling extensions (extra_body), honoured as on /v1/chat/completions.
    seed: Optional[int] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    max_reasoning_tokens: Optional[int] = None  # kvrelay's (as on chat): with structured outputs, caps analysis


@dataclass(frozen=True)
class ResponsesOptions:
    """What the request asks for beyond the conversation (checked; defaults filled in)."""

    effort: str
    summary: str | None  # OpenAI's reasoning.summary; None = no summary
    encrypted: bool  # include reasoning.encrypted_content
    logprobs: bool  # include message.output_text.logprobs (or top_logprobs > 0)
    store: bool
    stream: bool
    tools: tuple[ToolSpec, ...]
    tools_echo: tuple[dict[str, Any], ...]  # the tools as the response object lists them
    tool_choice: str  # auto | none | required
    tool_choice_function: str  # a named function ("" = none named)
    tool_choice_echo: Any  # as the response object shows it
    response_format: ResponseFormat | None  # text.format json_object / json_schema (structured outputs)
    text_echo: dict[str, Any]
    sampling: SamplingOptions


@dataclass(frozen=True)
class Sourced:
    """A chat message and the Responses field it came from (for error messages)."""

    message: ChatMessage
    source: str  # "input[2]", "input", "instructions", "previous_response_id"
    kind: str  # "message", "reasoning", "function_call", "function_call_output"


def check_options(body: ResponsesRequest) -> ResponsesOptions:
    for name, why in _UNSUPPORTED.items():
        value = getattr(body, name)
        if value is not None and value is not False:
            raise ValidationError(name, why)
    if body.input is None:
        raise ValidationError("input", "required (a string or a list of input items)")
    if body.max_tool_calls is not None and body.max_tool_calls < 1:
        raise ValidationError("max_tool_calls", f"must be >= 1, got {body.max_tool_calls}")
    if body.truncation not in (None, "disabled"):
        raise ValidationError("truncation", f"only 'disabled' is supported (a prompt that does not fit is "
                                            f"refused), got {body.truncation!r}")
    if body.service_tier not in (None, "auto", "default"):
        raise ValidationError("service_tier", f"only 'auto' and 'default' are supported, got {body.service_tier!r}")
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise ValidationError("stream_options.include_obfuscation", "stream obfuscation is not supported "
                              "(send false)")
    for i, name in enumerate(body.include or ()):
        if name not in (INCLUDE_ENCRYPTED, INCLUDE_LOGPROBS):
            raise ValidationError(f"include[{i}]", f"only {INCLUDE_ENCRYPTED!r} and {INCLUDE_LOGPROBS!r} are "
                                                   f"supported, got {name!r}")
    encrypted = INCLUDE_ENCRYPTED in (body.include or ())
    logprobs = INCLUDE_LOGPROBS in (body.include or ()) or bool(body.top_logprobs)
    _check_metadata(body.metadata)
    effort, summary = _reasoning(body.reasoning)
    response_format, text_echo = _text_format(body.text)
    choice, function = _tool_choice(body.tool_choice)
    # strict: the arguments must match the schema. The grammar enforces it only where it constrains the
    # reply: a required or named call, or a JSON final answer (its tools' calls are constrained too).
    constrained = choice == "required" or bool(function) or response_format is not None
    tools, echo = _tools(body.tools, strict_ok=constrained)
    if body.repetition_penalty is not None and not math.isfinite(body.repetition_penalty):
        raise ValidationError("repetition_penalty", f"must be a finite number, got {body.repetition_penalty}")
    if body.repetition_penalty not in (None, 1.0):
        raise ValidationError("repetition_penalty", f"not supported yet (only 1, the neutral value; presence_penalty "
                                                    f"and frequency_penalty are), got {body.repetition_penalty:g}")
    sampling = SamplingOptions(temperature=body.temperature, top_p=body.top_p, max_tokens=body.max_output_tokens,
                               logprobs=logprobs, top_logprobs=body.top_logprobs, seed=body.seed, top_k=body.top_k,
                               min_p=body.min_p, presence_penalty=body.presence_penalty,
                               frequency_penalty=body.frequency_penalty)
    return ResponsesOptions(effort=effort, summary=summary, encrypted=encrypted, logprobs=logprobs,
                            store=body.store is not False, stream=bool(body.stream),
                            tools=tools if choice != "none" else (), tools_echo=echo, tool_choice=choice,
                            tool_choice_function=function,
                            tool_choice_echo=body.tool_choice if body.tool_choice is not None else "auto",
                            response_format=response_format, text_echo=text_echo, sampling=sampling)


def _tool_choice(value: str | dict[str, Any] | None) -> tuple[str, str]:
    """Responses' tool_choice -> (auto | none | required, named function or "")."""
    if value is None:
        return "auto", ""
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise ValidationError("tool_choice", f"expected auto, none, required or "
                                                 f'{{"type": "function", "name": ...}}, got {value!r}')
        return value, ""
    if value.get("type") != "function":
        raise ValidationError("tool_choice.type", f"only 'function' is supported (no built-in tools or "
                                                  f"allowed_tools), got {value.get('type')!r}")
    unknown = sorted(set(value) - {"type", "name"})
    if unknown:
        raise ValidationError(f"tool_choice.{unknown[0]}", "not a field of a function tool choice")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise ValidationError("tool_choice.name", "a function name is required")
    return "auto", name


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise ValidationError("metadata", f"at most {MAX_METADATA_KEYS} keys, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > 64:
            raise ValidationError("metadata", f"keys are at most 64 characters, got {len(key)}")
        if len(value) > 512:
            raise ValidationError(f"metadata.{key}", f"values are at most 512 characters, got {len(value)}")


def _reasoning(r: ReasoningIn | None) -> tuple[str, str | None]:
    if r is None:
        return "medium", None
    effort = "medium" if r.effort is None else r.effort
    if effort not in _EFFORTS:
        raise ValidationError("reasoning.effort", f"gpt-oss takes one of {', '.join(_EFFORTS)}, got {effort!r}")
    summary = r.summary if r.summary is not None else r.generate_summary
    where = "reasoning.summary" if r.summary is not None else "reasoning.generate_summary"
    if summary is not None and summary not in _SUMMARIES:
        raise ValidationError(where, f"expected one of {', '.join(_SUMMARIES)}, got {summary!r}")
    if r.context not in (None, "auto"):
        raise ValidationError("reasoning.context", f"only 'auto' is supported (harmony's rule: earlier turns' "
                                                   f"analysis is dropped once a final answer follows), got {r.context!r}")
    if r.mode not in (None, "standard"):
        raise ValidationError("reasoning.mode", f"only 'standard' is supported, got {r.mode!r}")
    return effort, summary


def _text_format(text: TextIn | None) -> tuple[ResponseFormat | None, dict[str, Any]]:
    """text.format: text, json_object, or json_schema ({name, schema, description, strict}, flat as the
    Responses API has it) -> the chat route's ResponseFormat; and text as the response echoes it."""
    echo: dict[str, Any] = {"format": {"type": "text"}, "verbosity": "medium"}
    if text is None:
        return None, echo
    if text.verbosity not in (None, "medium"):
        raise ValidationError("text.verbosity", f"gpt-oss has no verbosity control (only 'medium'), "
                                                f"got {text.verbosity!r}")
    fmt = text.format or {"type": "text"}
    kind = fmt.get("type", "text")
    allowed = {"text": {"type"}, "json_object": {"type"},
               "json_schema": {"type", "name", "schema", "description", "strict"}}
    if kind not in allowed:
        raise ValidationError("text.format.type", f"expected text, json_object or json_schema, got {kind!r}")
    unknown = sorted(set(fmt) - allowed[kind])
    if unknown:
        raise ValidationError(f"text.format.{unknown[0]}", f"not a field of a {kind} format")
    echo["format"] = dict(fmt)
    if kind == "text":
        return None, echo
    if kind == "json_object":
        return ResponseFormat("json_object"), echo
    name = fmt.get("name")
    if not isinstance(name, str) or not name:
        raise ValidationError("text.format.name", "a name is required (OpenAI's rule)")
    schema = fmt.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise ValidationError("text.format.schema", "required (a JSON Schema object)")
    desc = fmt.get("description")
    strict = fmt.get("strict")
    return ResponseFormat("json_schema", json.dumps(schema), name, desc if isinstance(desc, str) else "",
                          strict if isinstance(strict, bool) else None, field="text.format.schema"), echo


def _tools(tools: list[Any] | None, *, strict_ok: bool) -> tuple[tuple[ToolSpec, ...], tuple[dict[str, Any], ...]]:
    specs, echo = [], []
    for i, t in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ValidationError(where, f"must be an object, got {_kind(t)}")
        if t.get("type") != "function":
            raise ValidationError(f"{where}.type", f"only 'function' tools are supported (no built-in tools), "
                                                  f"got {t.get('type')!r}")
        unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise ValidationError(f"{where}.{unknown[0]}", "not a field of a function tool")
        name = _field(t, "name", where)
        description = _field(t, "description", where, required=False)
        params = t.get("parameters")
        if t.get("strict") and not strict_ok:
            raise ValidationError(f"{where}.strict", "strict: true is enforced only where the reply is constrained "
                                                     "(tool_choice required or a named function, or text.format "
                                                     "json_object/json_schema); send strict: false with "
                                                     "tool_choice auto")
        specs.append(ToolSpec(name, description, "" if params is None else json.dumps(params)))
        echo.append({"type": "function", "name": name, "description": description or None,
                     "parameters": params, "strict": bool(t.get("strict"))})
    return tuple(specs), tuple(echo)


# ---- input items -> chat messages --------------------------------------------------------------


def input_messages(input_: str | list[Any]) -> list[Sourced]:
    if isinstance(input_, str):
        return [Sourced(ChatMessage("user", input_), "input", "message")]
    out: list[Sourced] = []
    for i, raw in enumerate(input_):
        where = f"input[{i}]"
        if not isinstance(raw, dict):
            raise ValidationError(where, f"an input item must be an object, got {_kind(raw)}")
        kind = raw.get("type", "message" if "role" in raw else None)
        if kind == "message":
            msg = _message(raw, where)
        elif kind == "reasoning":
            msg = _reasoning_item(raw, where)
        elif kind == "function_call":
            call = ToolCall(_field(raw, "call_id", where), _field(raw, "name", where),
                            _field(raw, "arguments", where, empty_ok=True))
            msg = ChatMessage("assistant", tool_calls=(call,))
        elif kind == "function_call_output":
            output = raw.get("output")
            text = output if isinstance(output, str) else _text_parts(output, f"{where}.output")
            msg = ChatMessage("tool", text, tool_call_id=_field(raw, "call_id", where))
        elif kind is None:
            raise ValidationError(f"{where}.type", "an input item needs a type (or a role, for a message)")
        else:
            raise ValidationError(f"{where}.type", f"input items of type {kind!r} are not supported (message, "
                                                  "reasoning, function_call, function_call_output are)")
        if msg is not None:
            out.append(Sourced(msg, where, kind))
    return out


_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc", "function_call_output": "fco"}


def wire_items(input_: str | list[Any], new_id) -> tuple[dict[str, Any], ...]:
    """The (validated) input as `GET /v1/responses/{id}/input_items` lists it: every item typed, with an
    id (`new_id(prefix)` where the client gave none) and text content as parts."""
    if isinstance(input_, str):
        input_ = [{"role": "user", "content": input_}]
    out = []
    for raw in input_:
        item = {"type": "message", **raw} if "type" not in raw else dict(raw)
        item.setdefault("id", new_id(_ID_PREFIX[item["type"]]))
        if item["type"] == "message":
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        out.append(item)
    return tuple(out)


def _message(raw: dict[str, Any], where: str) -> ChatMessage | None:
    role = raw.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise ValidationError(f"{where}.role", f"expected one of user, system, developer, assistant, got {role!r}")
    content = raw.get("content")
    text = content if isinstance(content, str) else _text_parts(content, f"{where}.content")
    if role != "assistant":
        return ChatMessage(role, text)
    if not text:
        return None  # an empty assistant message (a turn cut off at once) renders nothing
    phase = raw.get("phase")
    if phase not in (None, "final_answer", "commentary"):
        raise ValidationError(f"{where}.phase", f"expected final_answer or commentary, got {phase!r}")
    # A commentary message without recipient is a preamble: user-visible text written before a tool call.
    return ChatMessage("assistant", text, channel="commentary" if phase == "commentary" else "final")


def _reasoning_item(raw: dict[str, Any], where: str) -> ChatMessage | None:
    """The analysis text: the item's content (reasoning_text), else its summary, else our own
    encrypted_content. Another server's encrypted_content cannot be read: refused."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = raw.get(key)
        if parts:
            text = _text_parts(parts, f"{where}.{key}", (part_type,))
            if text:
                return ChatMessage("assistant", reasoning=text)
    sealed = raw.get("encrypted_content")
    if sealed:
        return ChatMessage("assistant", reasoning=open_encrypted(sealed, f"{where}.encrypted_content"))
    return None  # nothing to render (a reasoning item without text)


def seal(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.urlsafe_b64encode(text.encode()).decode()


def open_encrypted(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.startswith(ENCRYPTED_PREFIX):
        raise ValidationError(where, "not reasoning content this server produced (only its own "
                                     "encrypted_content can be read back; send the item's content instead)")
    try:
        return base64.urlsafe_b64decode(value[len(ENCRYPTED_PREFIX):].encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ValidationError(where, "corrupted encrypted_content") from None


def _text_parts(parts: Any, where: str, types: tuple[str, ...] = _TEXT_PARTS) -> str:
    if parts is None:
        return ""
    if not isinstance(parts, list):
        raise ValidationError(where, f"must be a string or a list of text parts, got {_kind(parts)}")
    texts = []
    for j, part in enumerate(parts):
        w = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ValidationError(w, f"must be an object, got {_kind(part)}")
        if part.get("type") == "refusal" and types is _TEXT_PARTS:  # an assistant's refusal is its text
            texts.append(_field(part, "refusal", w, empty_ok=True))
            continue
        if part.get("type") not in types:
            raise ValidationError(f"{w}.type", f"only text parts ({', '.join(types)}) are supported, "
                                               f"got {part.get('type')!r}")
        texts.append(_field(part, "text", w, empty_ok=True))
    return "".join(texts)


def _field(raw: dict[str, Any], key: str, where: str, *, required: bool = True, empty_ok: bool = False) -> str:
    value = raw.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise ValidationError(f"{where}.{key}", "required (a string)" if value is None else
                              f"must be a string, got {_kind(value)}")
    if not value and not empty_ok and required:
        raise ValidationError(f"{where}.{key}", "must not be empty")
    return value


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


# ---- error names --------------------------------------------------------------------------------

_MESSAGE_FIELD = re.compile(r"^messages\[(\d+)\](.*)$")
_SUFFIXES = {
    "function_call": {".tool_calls[0].function.name": ".name", ".tool_calls[0].function.arguments": ".arguments"},
    "function_call_output": {".content": ".output", ".tool_call_id": ".call_id"},
    "reasoning": {".reasoning": ".content"},
    "message": {".channel": ".phase"},
}
_TOP_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort",
               "response_format.type": "text.format.type", "tool_choice.function.name": "tool_choice.name"}
_TOOL_FIELD = re.compile(r"^tools\[(\d+)\]\.function\.(.*)$")


def responses_field(field: str, sources: list[Sourced]) -> str:
    """The shared chat validation's field name (`messages[3].content`) as the Responses field."""
    m = _MESSAGE_FIELD.match(field)
    if m is None:
        tool = _TOOL_FIELD.match(field)  # the chat route's nesting; Responses tools are flat
        return f"tools[{tool.group(1)}].{tool.group(2)}" if tool else _TOP_FIELDS.get(field, field)
    index, suffix = int(m.group(1)), m.group(2)
    if index >= len(sources):
        return "input"
    src = sources[index]
    if src.source in ("previous_response_id", "instructions"):
        return src.source
    if src.source == "input":
        return "input"
    return src.source + _SUFFIXES.get(src.kind, {}).get(suffix, suffix)
