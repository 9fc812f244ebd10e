"""Request validation shared by the gRPC and HTTP front-ends.

Every rule raises `ValidationError(field, message)`; gRPC maps it to INVALID_ARGUMENT and HTTP to a 400
with the field in `param`. Messages name the field and the limit so a client can fix its request
without reading our code. Nothing here talks to the engine: limits come in as arguments.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from kvrelay.router.harmony import VOCAB_SIZE
from kvrelay.router.stop import MAX_STOP_CHARS, MAX_STOP_STRINGS
from kvrelay.router.types import (
    CHANNELS,
    REASONING_EFFORTS,
    ROLES,
    ChatMessage,
    ChatRequest,
    SamplingOptions,
    ToolSpec,
)

# The tokenizer splits text into pieces (a run of letters, of whitespace, of punctuation...) and merges
# each piece in time quadratic in its length: measured with o200k, 8k same-class characters take 30 ms,
# 50k spaces 1 s, 300k letters ~35 s. No real text has such a run; a run longer than this is refused.
MAX_TEXT_RUN = 8192
_SCANS = None  # compiled on first use; `regex` has Unicode classes and releases the GIL while it scans


def _scans():
    global _SCANS
    if _SCANS is None:
        import regex

        n = MAX_TEXT_RUN + 1
        # Each pattern is anchored at the start of a run (lookbehind), so a scan is linear in the text.
        _SCANS = (regex.compile(rf"(?<!\s)\s{{{n}}}"), regex.compile(rf"(?<!\S)\S{{{n}}}"),
                  regex.compile(r"\S+"),
                  regex.compile(rf"(?<![\p{{L}}\p{{M}}])[\p{{L}}\p{{M}}]{{{n}}}"
                                rf"|(?<![^\s\p{{L}}\p{{N}}])[^\s\p{{L}}\p{{N}}]{{{n}}}"))
    return _SCANS


def check_unicode(text: str, field: str) -> None:
    """Refuse a lone surrogate (JSON's "\\ud800" without its pair), the one thing a Python str holds that
    is not Unicode text: harmony's renderer fails on it (an HTTP 500 before this check), the tokenizer
    silently replaces it, and no reply could echo it as UTF-8. Refused rather than replaced (OpenAI
    replaces it): the client learns that its text was not what it meant to send."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(field, f"character {exc.start} is U+{ord(text[exc.start]):04X}, a lone surrogate "
                                     "(a JSON \\ud800-\\udfff escape without its pair): not Unicode text, it "
                                     "cannot be encoded as UTF-8; send valid text") from None


def check_json_text(value: Any, field: str) -> None:
    """`check_unicode` on every string of a decoded JSON value, keys included, naming its path
    (`messages[0].content[1].text`); `field` is the value's own path ("" for a whole body)."""
    stack = [(value, field)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            check_unicode(node, where or "body")
        elif isinstance(node, dict):
            for key, sub in node.items():
                check_unicode(key, f"{where or 'body'} (a key)")
                stack.append((sub, f"{where}.{key}" if where else key))
        elif isinstance(node, list):
            stack.extend((sub, f"{where}[{i}]") for i, sub in enumerate(node))


def check_text(text: str, field: str) -> None:
    """Refuse text that is not Unicode (`check_unicode`) or that the tokenizer would spend seconds to
    minutes on (see MAX_TEXT_RUN)."""
    check_unicode(text, field)
    if len(text) <= MAX_TEXT_RUN:
        return
    space_run, nonspace_run, word, class_run = _scans()
    m = space_run.search(text, concurrent=True)
    if m is not None:
        _long_run(field, "whitespace", m.start())
    for m in nonspace_run.finditer(text, concurrent=True):
        # A long non-space run is fine when it changes class often (base64, code): look inside it.
        inner = class_run.search(word.match(text, m.start()).group(), concurrent=True)
        if inner is not None:
            _long_run(field, "letters" if inner.group()[0].isalpha() else "symbols", m.start() + inner.start())


def _long_run(field: str, kind: str, at: int) -> None:
    raise ValidationError(field, f"a run of more than {MAX_TEXT_RUN} {kind} without a break at character {at}: "
                                 "the tokenizer would take seconds to minutes on it; split it")


MAX_TOOLS = 128  # function tools per request, as OpenAI's API allows
# Messages per chat request: parsing and converting 2048 takes the event loop ~20 ms (11k took 0.3 s
# under load); a real conversation that long has long since outgrown the context.
MAX_MESSAGES = 2048
JSON_SCHEMA_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
# OpenAI's rule for function names; it also keeps names safe inside a harmony header.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_SINGLE = ("items", "additionalProperties", "not", "contains")


class ValidationError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ResolvedSampling:
    """Sampling with defaults filled in; field names match `kvrelay.engine.sampling.SamplingParams`."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: tuple[int, ...]
    logprobs: bool
    stop: tuple[str, ...] = ()  # router-side only: SamplingParams has no stop strings
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    top_logprobs: int = 0
    repetition_penalty: float = 1.0
    prompt_logprobs: int | None = None


FLOAT_SAMPLING = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty")


def check_token_ids(ids: tuple[int, ...] | list[int], field: str, vocab_size: int = VOCAB_SIZE) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # two C loops; the Python one only names the bad id
        return
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValidationError(f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {vocab_size})")


def check_prompt(
    ids: tuple[int, ...] | list[int], field: str, max_context: int, vocab_size: int = VOCAB_SIZE
) -> None:
    if not ids:
        raise ValidationError(field, "must not be empty")
    check_token_ids(ids, field, vocab_size)
    if len(ids) >= max_context:
        raise ValidationError(
            field,
            f"prompt is {len(ids)} tokens but the model context is {max_context} tokens "
            "(at least one token must remain for generation)",
        )


def resolve_sampling(
    s: SamplingOptions, *, prompt_len: int, max_context: int, vocab_size: int = VOCAB_SIZE
) -> ResolvedSampling:
    """Check the caller's sampling options against the prompt and the context; fill defaults."""
    for name in FLOAT_SAMPLING:  # JSON's 1e400 is inf, and Python's json reads NaN: neither is a setting
        value = getattr(s, name)
        if value is not None and not math.isfinite(value):
            raise ValidationError(name, f"must be a finite number, got {value}")
    if s.temperature is not None and not (s.temperature >= 0 and math.isfinite(s.temperature)):
        raise ValidationError("temperature", f"must be >= 0, got {s.temperature}")
    if s.top_p is not None and not 0 < s.top_p <= 1:
        raise ValidationError("top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k is not None and s.top_k < 0:
        raise ValidationError("top_k", f"must be >= 0 (0 disables top-k), got {s.top_k}")
    if s.seed is not None and s.seed < 0:
        raise ValidationError("seed", f"must be >= 0, got {s.seed}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if value is not None and not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise ValidationError(name, f"must be in [-2, 2], got {value}")
    if s.min_p is not None and not (math.isfinite(s.min_p) and 0.0 <= s.min_p <= 1.0):
        raise ValidationError("min_p", f"must be in [0, 1], got {s.min_p}")
    if s.top_logprobs is not None and not 0 <= s.top_logprobs <= 20:
        raise ValidationError("top_logprobs", f"must be in [0, 20], got {s.top_logprobs}")
    if s.top_logprobs and not s.logprobs:
        raise ValidationError("top_logprobs", "needs logprobs: true")
    if s.repetition_penalty is not None and not (math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0):
        raise ValidationError("repetition_penalty", f"must be a number > 0 (1 = off), got {s.repetition_penalty}")
    if s.prompt_logprobs is not None and not 0 <= s.prompt_logprobs <= 20:
        raise ValidationError("prompt_logprobs", f"must be in [0, 20], got {s.prompt_logprobs}")
    check_token_ids(s.stop_token_ids, "stop_token_ids", vocab_size)
    check_stop_strings(s.stop)
    room = max_context - prompt_len
    if s.max_tokens is None:
        max_tokens = room
    elif s.max_tokens <= 0:
        raise ValidationError("max_tokens", f"must be >= 1, got {s.max_tokens}")
    elif s.max_tokens > room:
        raise ValidationError(
            "max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({s.max_tokens}) = {prompt_len + s.max_tokens} "
            f"exceeds the model context of {max_context} tokens",
        )
    else:
        max_tokens = s.max_tokens
    min_tokens = 0 if s.min_tokens is None else s.min_tokens
    if not 0 <= min_tokens <= max_tokens:
        raise ValidationError("min_tokens", f"must be in [0, max_tokens = {max_tokens}], got {min_tokens}")
    return ResolvedSampling(
        max_tokens=max_tokens,
        temperature=1.0 if s.temperature is None else float(s.temperature),
        top_p=1.0 if s.top_p is None else float(s.top_p),
        top_k=0 if s.top_k is None else int(s.top_k),
        seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids),
        logprobs=s.logprobs,
        stop=tuple(s.stop),
        min_tokens=min_tokens,
        presence_penalty=float(s.presence_penalty or 0.0),
        frequency_penalty=float(s.frequency_penalty or 0.0),
        min_p=float(s.min_p or 0.0),
        top_logprobs=int(s.top_logprobs or 0),
        repetition_penalty=1.0 if s.repetition_penalty is None else float(s.repetition_penalty),
        prompt_logprobs=s.prompt_logprobs,
    )


def check_stop_strings(stops: tuple[str, ...] | list[str], field: str = "stop") -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise ValidationError(field, f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
    for i, text in enumerate(stops):
        check_unicode(text, f"{field}[{i}]")
        if not text:
            # An empty string would match before the first character: every request would return "".
            raise ValidationError(f"{field}[{i}]", "stop strings must not be empty")
        if len(text) > MAX_STOP_CHARS:
            raise ValidationError(f"{field}[{i}]", f"at most {MAX_STOP_CHARS} characters per stop string, "
                                                  f"got {len(text)}")


# ---- chat ---------------------------------------------------------------------------------------


def check_chat(request: ChatRequest) -> None:
    """Structural checks that must pass before harmony rendering is attempted."""
    if not request.messages:
        raise ValidationError("messages", "must not be empty")
    if len(request.messages) > MAX_MESSAGES:
        raise ValidationError("messages", f"at most {MAX_MESSAGES} messages per request, got {len(request.messages)}")
    if request.reasoning_effort not in REASONING_EFFORTS:
        raise ValidationError(
            "reasoning_effort", f"unknown value {request.reasoning_effort!r}; expected one of low, medium, high"
        )
    if request.conversation_start_date:
        try:
            _dt.date.fromisoformat(request.conversation_start_date)
        except ValueError:
            raise ValidationError(
                "conversation_start_date", f"expected YYYY-MM-DD, got {request.conversation_start_date!r}"
            ) from None
    if len(request.tools) > MAX_TOOLS:
        raise ValidationError("tools", f"at most {MAX_TOOLS} tools per request (OpenAI's limit), got "
                                       f"{len(request.tools)}")
    rf = request.response_format
    if rf is not None:  # the schema's strings: structured.check_schema
        check_unicode(rf.name, f"{rf.field.rsplit('.', 1)[0]}.name")
        check_unicode(rf.description, f"{rf.field.rsplit('.', 1)[0]}.description")
    names: set[str] = set()
    for i, tool in enumerate(request.tools):
        check_tool(tool, f"tools[{i}]")
        if tool.name in names:
            raise ValidationError(f"tools[{i}].name", f"duplicate tool name {tool.name!r}")
        names.add(tool.name)
    call_ids: set[str] = set()
    for i, msg in enumerate(request.messages):
        check_message(msg, f"messages[{i}]", call_ids)
        call_ids.update(c.id for c in msg.tool_calls if c.id)


def check_message(msg: ChatMessage, where: str, earlier_call_ids: set[str]) -> None:
    check_text(msg.content, f"{where}.content")
    check_text(msg.reasoning, f"{where}.reasoning")
    for attr in ("role", "name", "tool_call_id", "channel", "recipient"):  # header text
        check_unicode(getattr(msg, attr), f"{where}.{attr}")
    for j, call in enumerate(msg.tool_calls):
        check_unicode(call.id, f"{where}.tool_calls[{j}].id")
        check_unicode(call.name, f"{where}.tool_calls[{j}].function.name")
        check_text(call.arguments, f"{where}.tool_calls[{j}].function.arguments")
    if msg.role not in ROLES:
        raise ValidationError(f"{where}.role", f"unknown role {msg.role!r}; expected one of {', '.join(ROLES)}")
    if msg.role != "assistant":
        for attr in ("channel", "recipient", "tool_calls", "reasoning"):
            if getattr(msg, attr):
                raise ValidationError(f"{where}.{attr}", f"only assistant messages may set {attr}")
    if msg.role == "assistant":
        if msg.channel and msg.channel not in CHANNELS:
            raise ValidationError(
                f"{where}.channel", f"unknown channel {msg.channel!r}; expected one of {', '.join(CHANNELS)}"
            )
        if not msg.content and not msg.tool_calls and not msg.reasoning:
            raise ValidationError(where, "an assistant message needs content, reasoning or tool_calls")
        for j, call in enumerate(msg.tool_calls):
            if not _TOOL_NAME.match(call.name):
                raise ValidationError(
                    f"{where}.tool_calls[{j}].function.name",
                    f"{call.name!r} is not a valid function name (1-64 of A-Z a-z 0-9 _ -)",
                )
    if msg.role == "tool":
        if msg.name:
            if not _TOOL_NAME.match(msg.name):
                raise ValidationError(f"{where}.name", f"{msg.name!r} is not a valid function name")
        elif not msg.tool_call_id:
            raise ValidationError(f"{where}.tool_call_id", "a tool message needs tool_call_id (or name)")
        elif msg.tool_call_id not in earlier_call_ids:
            raise ValidationError(
                f"{where}.tool_call_id", f"no earlier assistant tool call has id {msg.tool_call_id!r}"
            )


def check_tool(tool: ToolSpec, where: str) -> None:
    check_text(tool.description, f"{where}.description")
    check_text(tool.parameters_json, f"{where}.parameters")
    check_unicode(tool.name, f"{where}.name")
    if not _TOOL_NAME.match(tool.name):
        raise ValidationError(
            f"{where}.name", f"{tool.name!r} is not a valid function name (1-64 of A-Z a-z 0-9 _ -)"
        )
    if not tool.parameters_json.strip():
        return
    try:
        schema = json.loads(tool.parameters_json)
    except json.JSONDecodeError as exc:
        raise ValidationError(f"{where}.parameters", f"not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(schema, dict):
        raise ValidationError(f"{where}.parameters", f"must be a JSON Schema object, got {json_kind(schema)}")
    # Its text may escape a lone surrogate (a JSON \ud800: how gRPC's parameters_json_schema can carry one).
    check_json_text(schema, f"{where}.parameters")
    if "type" in schema and schema["type"] != "object":
        raise ValidationError(f"{where}.parameters.type", f"function parameters must be 'object', got {schema['type']!r}")
    check_schema(schema, f"{where}.parameters")


def check_schema(node: Any, where: str) -> None:
    """Walk a JSON Schema and reject what the harmony TypeScript renderer could only guess at."""
    if isinstance(node, bool):  # `true`/`false` are valid schemas
        return
    if not isinstance(node, dict):
        raise ValidationError(where, f"a schema must be an object, got {json_kind(node)}")
    if "type" in node:
        kinds = node["type"] if isinstance(node["type"], list) else [node["type"]]
        for kind in kinds:
            if kind not in JSON_SCHEMA_TYPES:
                raise ValidationError(
                    f"{where}.type",
                    f"{kind!r} is not a JSON Schema type (expected one of {', '.join(JSON_SCHEMA_TYPES)})",
                )
    if "required" in node:
        req = node["required"]
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
            raise ValidationError(f"{where}.required", "must be an array of property names")
    for key in _SUBSCHEMA_MAPS:
        if key in node:
            if not isinstance(node[key], dict):
                raise ValidationError(f"{where}.{key}", f"must be an object, got {json_kind(node[key])}")
            for name, sub in node[key].items():
                check_schema(sub, f"{where}.{key}.{name}")
    for key in _SUBSCHEMA_LISTS:
        if key in node:
            if not isinstance(node[key], list):
                raise ValidationError(f"{where}.{key}", f"must be an array, got {json_kind(node[key])}")
            for j, sub in enumerate(node[key]):
                check_schema(sub, f"{where}.{key}[{j}]")
    for key in _SUBSCHEMA_SINGLE:
        if key in node:
            check_schema(node[key], f"{where}.{key}")


def json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
