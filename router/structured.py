"""Structured outputs on the router side: a chat request's response_format and tool_choice -> the
engine's `StructuredOutput` (engine/structured.py), with the harmony header tokens rendered here.

- response_format json_object / json_schema: the reply ends with a final message whose body is JSON
  (any object / matching the schema), then `<|return|>`.
- tool_choice "required": it ends with a call to one of the tools, `<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>{args}<|call|>`, the arguments matching that tool's
  parameters; a named function: a call to that one. With response_format and tools under "auto", the
  reply may be either the final JSON or a call to a tool (its arguments constrained too).
- The analysis channel stays free (`max_reasoning_tokens`, a kvrelay extension, bounds it).

Schemas are checked by the grammar engine here, so a bad one is a 400 naming the field before the request
reaches a worker. The schema also goes to the model as harmony's `# Response Formats` section of the
developer message (harmony-spec.md section 5), as gpt-oss was trained to read it.
"""

from __future__ import annotations

import json

from kvrelay.engine import grammar
from kvrelay.engine.sampling_params import Body, StructuredOutput
from kvrelay.router import harmony
from kvrelay.router.types import ChatRequest, ResponseFormat
from kvrelay.router.validation import ValidationError, check_json_text

ANY_OBJECT = '{"type":"object"}'


def check_response_format(rf: ResponseFormat) -> None:
    if rf.type not in ("text", "json_object", "json_schema"):
        raise ValidationError("response_format.type",
                              f"unknown type {rf.type!r}; expected text, json_object or json_schema")
    if rf.type != "json_schema":
        return
    if not rf.schema_json.strip():
        raise ValidationError(rf.field, "json_schema needs a schema")
    check_schema(rf.schema_json, rf.field)


def check_schema(schema_json: str, where: str) -> None:
    try:
        schema = json.loads(schema_json)
    except json.JSONDecodeError as exc:
        raise ValidationError(where, f"not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValidationError(where, "must be a JSON Schema (an object)")
    check_json_text(schema, where)  # an escaped lone surrogate: named, not the grammar's parse error
    try:
        grammar.check_schema(grammar.schema_text(schema))
    except grammar.SchemaError as exc:
        raise ValidationError(where, f"cannot be enforced: {exc}") from None


def _ids(text: str) -> list[int]:
    return harmony.encode_text(text)


def final_header() -> tuple[int, ...]:
    return (harmony.CHANNEL, *_ids("final"), harmony.MESSAGE)


def tool_header(name: str) -> tuple[int, ...]:
    """As the model writes a call (recipient after the channel, spec 2.1): `<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>`."""
    return (harmony.CHANNEL, *_ids(f"commentary to={harmony.TOOL_NAMESPACE}.{name}"), *_ids(" "),
            harmony.CONSTRAIN, *_ids("json"), harmony.MESSAGE)


def build(req: ChatRequest) -> StructuredOutput | None:
    """The engine constraint for `req` (validated), or None when nothing is constrained."""
    rf = req.response_format
    bodies: list[Body] = []
    tools = {t.name: t for t in req.tools}
    if req.tool_choice == "required" or req.tool_choice_function:
        names = [req.tool_choice_function] if req.tool_choice_function else list(tools)
        bodies = [_tool_body(tools[n]) for n in names]
    elif rf is not None and rf.type != "text":
        schema = rf.schema_json if rf.type == "json_schema" else ANY_OBJECT
        bodies = [Body(final_header(), grammar.schema_text(schema), harmony.RETURN)]
        bodies += [_tool_body(t) for t in req.tools]  # "auto": the model may still call a tool
    if not bodies:
        if req.max_reasoning_tokens is not None:
            raise ValidationError("max_reasoning_tokens", "applies only with response_format json_object/"
                                  "json_schema or tool_choice required/named")
        return None
    return StructuredOutput(
        tuple(bodies), allow_analysis=True,
        analysis_header=(harmony.CHANNEL, *_ids("analysis"), harmony.MESSAGE),
        restart=(harmony.START, *_ids("assistant")),
        max_reasoning_tokens=req.max_reasoning_tokens)


def _tool_body(tool) -> Body:
    schema = tool.parameters_json if tool.parameters_json.strip() else ANY_OBJECT
    return Body(tool_header(tool.name), grammar.schema_text(schema), harmony.CALL)


def check_chat_structured(req: ChatRequest) -> None:
    """The structured-output fields of a chat request (after validation.check_chat)."""
    if req.response_format is not None:
        check_response_format(req.response_format)
    if req.tool_choice not in ("auto", "none", "required"):
        raise ValidationError("tool_choice", f"unknown value {req.tool_choice!r}; expected auto, none, required "
                              "or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if req.tool_choice == "required" and not req.tools:
        raise ValidationError("tool_choice", "'required' needs at least one tool in tools")
    if req.tool_choice_function and req.tool_choice_function not in {t.name for t in req.tools}:
        raise ValidationError("tool_choice.function.name",
                              f"{req.tool_choice_function!r} is not one of the request's tools")
    if req.max_reasoning_tokens is not None and req.max_reasoning_tokens < 0:
        raise ValidationError("max_reasoning_tokens", f"must be >= 0, got {req.max_reasoning_tokens}")
    constrained = req.tool_choice == "required" or req.tool_choice_function or (
        req.response_format is not None and req.response_format.type != "text")
    if constrained:
        for i, tool in enumerate(req.tools):
            if tool.parameters_json.strip():
                check_schema(tool.parameters_json, f"tools[{i}].function.parameters")
        if req.sampling.min_tokens:
            raise ValidationError("min_tokens", "cannot be combined with structured outputs (the grammar decides "
                                  "where the reply ends)")

