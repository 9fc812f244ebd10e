"""OpenAI-compatible request bodies and their translation to the router's typed requests.

Field types are deliberately loose (role is a str, tool parameters any JSON) so that a bad value is
reported by our shared validation, with the same message the gRPC front-end gives, instead of a
generic schema error.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from kvrelay.router.types import ChatMessage, ChatRequest, ResponseFormat, SamplingOptions, ToolCall, ToolSpec
from kvrelay.router.validation import MAX_MESSAGES, ValidationError


MAX_N = 16  # choices per request (n); one prefill, its KV forked per choice (cluster/fork_group.py)


log = logging.getLogger("kvrelay.router.http_api")


class BodyModel(BaseModel):
    """The one rule for body fields an endpoint does not know, on every HTTP endpoint (chat completions,
    completions, Responses, the tokenizer's): accepted, ignored, and named in a warning (`warn_unknown`), as
    vLLM does by default, because benchmark and eval clients (lm-eval, aiperf, guidellm, `extra_body`) send
    other servers' vendor fields. A parameter OpenAI or vLLM defines is never ignored that way: it is a
    declared field (honoured, or refused by name unless neutral) or listed in `REFUSED_EXTRAS`."""

    model_config = ConfigDict(extra="allow")


# OpenAI's and vLLM's parameters that change the output and that kvrelay does not serve, sent as extras:
# name -> (its neutral values, why it is refused otherwise). The chat-only ones are refused on chat.
REFUSED_EXTRAS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False, None), "beam search is not supported"),
    "include_stop_str_in_output": ((False, None), "not supported: a matched stop string is left out of the text"),
    "bad_words": ((None, []), "not supported"),
    "allowed_token_ids": ((None,), "not supported"),
    "truncate_prompt_tokens": ((None,), "not supported: a prompt that does not fit is refused"),
    "logits_processors": ((None, []), "not supported"),
}
CHAT_REFUSED_EXTRAS: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "the deprecated functions API is not supported; send tools"),
    "function_call": ((None,), "the deprecated functions API is not supported; send tool_choice"),
    "add_generation_prompt": ((True, None), "the prompt always ends with the assistant's turn opening"),
    "continue_final_message": ((False, None), "not supported: the reply is a new assistant turn"),
    "chat_template": ((None,), "gpt-oss prompts are rendered by harmony, not a chat template"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "audio": ((None,), "audio output is not supported"),
}
_warned: set[tuple[str, str]] = set()


def unknown_fields(model: BaseModel, where: str = "") -> list[str]:
    """The body's fields (nested objects' too, by path) that its model does not declare."""
    out = [f"{where}{name}" for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out += unknown_fields(value, f"{where}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    out += unknown_fields(item, f"{where}{name}[{i}].")
    return out


def warn_unknown(model: BaseModel, route: str, known: tuple[str, ...] = ()) -> None:
    """Log the fields `BodyModel`'s rule ignores: once per route and field (a benchmark sends the same extras on
    every request; the first says it all), at debug level after that. `known`: extras read elsewhere."""
    for name in unknown_fields(model):
        if name in known or name in REFUSED_EXTRAS or name in CHAT_REFUSED_EXTRAS:  # neutral: checked
            continue
        key = (route, re.sub(r"\[\d+\]", "[]", name))
        level = logging.DEBUG if key in _warned else logging.WARNING
        if len(_warned) < 4096:
            _warned.add(key)
        log.log(level, "%s: ignored the body field %r, which this endpoint does not know", route, name)


def check_refused_extras(model: BaseModel, table: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    for name, value in (model.model_extra or {}).items():
        if name in table and value not in table[name][0]:
            raise ValidationError(name, table[name][1])


class FunctionCallIn(BodyModel):
    name: str
    arguments: str = ""


class ToolCallIn(BodyModel):
    id: str = ""
    type: str = "function"
    function: FunctionCallIn


class ContentPart(BodyModel):
    type: str
    text: Optional[str] = None


class MessageIn(BodyModel):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    # What the API's own assistant messages carry, sent back as history: known, nothing to render.
    refusal: Optional[str] = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None


class FunctionDefIn(BodyModel):
    name: str
    description: str = ""
    parameters: Any = None


class ToolIn(BodyModel):
    type: str = "function"
    function: FunctionDefIn


class StreamOptions(BodyModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk


class _Sampling(BodyModel):
    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    max_tokens: Optional[int] = None
    stop: Union[str, list[str], None] = None  # OpenAI: one string or a list; matched by the router
    stop_token_ids: Optional[list[int]] = None  # vLLM's extension
    n: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    request_id: Optional[str] = None
    ignore_eos: bool = False  # vLLM's extension: benchmarks use it to hold output lengths fixed
    min_tokens: Optional[int] = None  # vLLM's extension: no stop before this many tokens
    # The ones not honoured yet are accepted so that a request using them is refused by name (below)
    # rather than served as if they were not there; at their neutral values they change nothing and pass.
    presence_penalty: Optional[float] = None  # honoured: passed to the sampler
    frequency_penalty: Optional[float] = None
    min_p: Optional[float] = None  # vLLM's, honoured
    repetition_penalty: Optional[float] = None  # vLLM's, honoured (over prompt + output tokens)
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[dict[str, Any]] = None
    guided_json: Any = None  # vLLM's structured-output extensions
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    prompt_logprobs: Optional[int] = None  # vLLM's: honoured on /v1/completions
    structured_outputs: Optional[dict[str, Any]] = None  # vLLM's newer spelling of guided_*

    def common_checks(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise ValidationError("n", f"must be in [1, {MAX_N}], got {self.n}")
        check_refused_extras(self, REFUSED_EXTRAS)
        if self.logit_bias:
            raise ValidationError("logit_bias", "not supported yet (only an empty map)")
        for name in ("guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                raise ValidationError(name, "not supported (structured outputs take a JSON schema: response_format "
                                      "json_schema, guided_json or structured_outputs.json)")

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple; the limits are checked by the shared validation (same message as gRPC)."""
        if isinstance(self.stop, str):
            if not self.stop:
                raise ValidationError("stop", "stop strings must not be empty")
            return (self.stop,)
        return tuple(self.stop or ())


class ChatCompletionRequest(_Sampling):
    # Bounded before anything else runs: parsing and converting a message list holds the event loop.
    messages: list[MessageIn] = Field(max_length=MAX_MESSAGES)
    tools: Optional[list[ToolIn]] = None
    tool_choice: Union[str, dict, None] = None
    reasoning_effort: Optional[str] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    max_reasoning_tokens: Optional[int] = None  # kvrelay's: with structured outputs, a cap on analysis tokens
    echo: bool = False  # vLLM's (the last message in front of the reply): refused by name, not ignored

    def to_chat(self) -> ChatRequest:
        self.common_checks()
        check_refused_extras(self, CHAT_REFUSED_EXTRAS)
        if self.echo:
            raise ValidationError("echo", "not supported for chat; /v1/completions echoes its prompt")
        if self.prompt_logprobs is not None:
            raise ValidationError("prompt_logprobs", "not supported for chat (the rendered harmony prompt's "
                                  "logprobs); use /v1/completions with echo or prompt_logprobs")
        if self.ignore_eos:
            raise ValidationError("ignore_eos", "not supported for chat: harmony's stop tokens end the "
                                  "assistant message; use /v1/completions, which stops only on max_tokens, "
                                  "stop and stop_token_ids")
        tools = tuple(_tool(i, t) for i, t in enumerate(self.tools or ()))
        choice, function = _tool_choice(self.tool_choice)
        if choice == "none":
            tools = ()
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        sampling = SamplingOptions(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=self.logprobs,
            stop=self.stop_strings(),
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_p=self.min_p,
            top_logprobs=self.top_logprobs,
            repetition_penalty=self.repetition_penalty,
        )
        return ChatRequest(
            messages=tuple(_message(i, m) for i, m in enumerate(self.messages)),
            tools=tools,
            reasoning_effort="medium" if self.reasoning_effort is None else self.reasoning_effort,
            sampling=sampling,
            request_id=self.request_id or "",
            response_format=self.structured_format(),
            tool_choice=choice,
            tool_choice_function=function,
            max_reasoning_tokens=self.max_reasoning_tokens,
        )

    def structured_format(self) -> ResponseFormat | None:
        """response_format, or vLLM's guided_json / structured_outputs {json | json_object} (one of them)."""
        given = [n for n in ("response_format", "guided_json", "structured_outputs") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValidationError(given[1], f"give one of {', '.join(given)}, not both")
        if self.guided_json is not None:
            return _schema_format(self.guided_json, "guided_json", "guided_json")
        if self.structured_outputs is not None:
            so = self.structured_outputs
            for key in so:
                if key not in ("json", "json_object") and so[key] not in (None, False):
                    raise ValidationError(f"structured_outputs.{key}", "not supported (only json and json_object)")
            if so.get("json") is not None:
                return _schema_format(so["json"], "structured_outputs", "structured_outputs.json")
            if so.get("json_object"):
                return ResponseFormat("json_object")
            return None
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return ResponseFormat("json_object")
        if kind != "json_schema":
            raise ValidationError("response_format.type",
                                  f"unknown type {kind!r}; expected text, json_object or json_schema")
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ValidationError("response_format.json_schema", "json_schema must be an object with name and schema")
        name = js.get("name", "")
        if not isinstance(name, str) or not name:
            raise ValidationError("response_format.json_schema.name", "a name is required (OpenAI's rule)")
        if "schema" not in js:
            raise ValidationError("response_format.json_schema.schema", "a schema is required")
        out = _schema_format(js["schema"], name, "response_format.json_schema.schema")
        desc = js.get("description", "")
        return ResponseFormat("json_schema", out.schema_json, name, desc if isinstance(desc, str) else "",
                              js.get("strict") if isinstance(js.get("strict"), bool) else None, out.field)


class CompletionRequest(_Sampling):
    token_id_fields: ClassVar[tuple[str, ...]] = ("prompt",)  # router/body.py may hand these over as array('i')
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    return_token_ids: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: score the prompt, generate nothing (vLLM runs one token and drops it)."""
        return self.echo and self.max_tokens == 0

    def sampling(self) -> SamplingOptions:
        self.common_checks()
        for name in ("response_format", "guided_json", "structured_outputs"):
            value = getattr(self, name)
            if value is not None and not (name == "response_format" and value.get("type", "text") == "text"):
                raise ValidationError(name, "structured outputs apply to chat completions (harmony's final "
                                      "message); not supported on /v1/completions")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValidationError("logprobs", f"must be in [0, 20] (the most likely tokens to list), got {self.logprobs}")
        if self.prompt_logprobs is not None and self.stream:
            raise ValidationError("prompt_logprobs", "not available with stream: true (as in vLLM); "
                                  "use echo with logprobs to stream the prompt's logprobs")
        # vLLM's rule: echo with logprobs lists the prompt's tokens with as many alternatives.
        plp = self.prompt_logprobs
        if plp is None and self.echo and self.logprobs is not None:
            plp = self.logprobs
        if self.best_of not in (None, 1):
            raise ValidationError("best_of", f"only best_of=1 is supported, got {self.best_of}")
        if self.suffix:
            raise ValidationError("suffix", "suffix (insertion) is not supported by gpt-oss")
        return SamplingOptions(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            # OpenAI's default; echo_only runs one token, which the response leaves out
            max_tokens=16 if self.max_tokens is None else (1 if self.echo_only else self.max_tokens),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=self.logprobs is not None,
            stop=self.stop_strings(),
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_p=self.min_p,
            top_logprobs=self.logprobs or None,  # legacy completions: logprobs=N lists the N most likely
            repetition_penalty=self.repetition_penalty,
            prompt_logprobs=plp,
        )


def _tool_choice(value) -> tuple[str, str]:
    """OpenAI's tool_choice -> (auto | none | required, named function or "")."""
    if value is None:
        return "auto", ""
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise ValidationError("tool_choice", f"unknown value {value!r}; expected auto, none, required or "
                                  '{"type": "function", "function": {"name": ...}}')
        return value, ""
    if value.get("type") != "function":
        raise ValidationError("tool_choice.type", f"only 'function' is supported, got {value.get('type')!r}")
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ValidationError("tool_choice.function.name", "a function name is required")
    return "auto", name


def _schema_format(schema, name: str, where: str) -> ResponseFormat:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValidationError(where, f"not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValidationError(where, "must be a JSON Schema (an object)")
    return ResponseFormat("json_schema", json.dumps(schema), name, field=where)


def _text(content: Union[str, list[ContentPart], None], where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise ValidationError(f"{where}.content[{j}]", f"only text parts are supported, got type {part.type!r}")
        parts.append(part.text)
    return "".join(parts)


def _message(i: int, m: MessageIn) -> ChatMessage:
    where = f"messages[{i}]"
    content = _text(m.content, where)
    if m.role != "assistant":
        return ChatMessage(role=m.role, content=content, name=m.name or "", tool_call_id=m.tool_call_id or "")
    calls = []
    for j, c in enumerate(m.tool_calls or ()):
        if c.type != "function":
            raise ValidationError(f"{where}.tool_calls[{j}].type", f"only 'function' is supported, got {c.type!r}")
        calls.append(ToolCall(c.id, c.function.name, c.function.arguments))
    # Chain of thought comes back as reasoning_content (vLLM's name) or reasoning (gpt-oss's).
    reasoning = m.reasoning_content or m.reasoning or ""
    return ChatMessage("assistant", content, name=m.name or "", tool_calls=tuple(calls), reasoning=reasoning)


def _tool(i: int, t: ToolIn) -> ToolSpec:
    if t.type != "function":
        raise ValidationError(f"tools[{i}].type", f"only 'function' tools are supported, got {t.type!r}")
    params = "" if t.function.parameters is None else json.dumps(t.function.parameters)
    return ToolSpec(t.function.name, t.function.description, params)

