"""Hostile text and numbers on every front end: a lone surrogate in any field, non-finite sampling numbers,
a /tokenize prompt of the wrong type, bad UTF-8 on the gRPC wire: each a 400 / INVALID_ARGUMENT naming the
field, never a 500 with a traceback in the log. Also the one rule for unknown body fields (ignored with a
warning on every HTTP endpoint) and SSE data lines that survive str.splitlines (U+2028, U+2029, U+0085)."""

from __future__ import annotations

import json
import logging

import grpc
import httpx
import pytest

from kvrelay.router import harmony
from kvrelay.v1 import router_pb2 as pb
from kvrelay.v1 import router_pb2_grpc as pb_grpc

from responses_helpers import DATE, MODEL, _ids  # also points harmony at the vocabulary
from scripted_router import reset, scripted_router_fixtures

BREAKS = "one\u2028two\u2029three\x85four"
CHAT_REPLY = _ids(f"<|channel|>final<|message|>{BREAKS}<|return|>")
TEXT_REPLY = harmony.encode_text(BREAKS)


def _reply(prompt: list[int]) -> list[int]:
    """A harmony final answer for a chat (its prompt opens with <|start|>), the plain text otherwise."""
    return CHAT_REPLY if prompt and prompt[0] == harmony.START else TEXT_REPLY


engine, server = scripted_router_fixtures([_reply], model_name=MODEL, max_context=4096, router={"today": lambda: DATE})
USER = '{"role": "user", "content": "hi"}'
TOOL = '{"type": "function", "function": {"name": "f", "description": %s, "parameters": %s}}'
BAD = '"a \\ud800 b"'  # JSON text: a lone high surrogate between two letters
BAD_SCHEMA_TOOL = TOOL % ('"d"', '{"properties": {"x": {"description": %s}}}' % BAD)


def _post(srv, path: str, raw: str) -> httpx.Response:
    return httpx.post(f"{srv.http_url}{path}", content=raw.encode(), headers={"content-type": "application/json"},
                      timeout=30)


def _no_traceback(caplog) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {BAD}}}]}}', "messages[0].content"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "ok"}}, '
                             f'{{"type": "text", "text": {BAD}}}]}}]}}', "messages[0].content[1].text"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "system", "content": {BAD}}}, {USER}]}}', "messages[0].content"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "name": {BAD}, "content": "hi"}}]}}', "messages[0].name"),
    ("/v1/chat/completions", f'{{"messages": [{USER}], "tools": [{TOOL % (BAD, "{}")}]}}',
     "tools[0].function.description"),
    ("/v1/chat/completions", f'{{"messages": [{USER}], "tools": [{BAD_SCHEMA_TOOL}]}}',
     "tools[0].function.parameters.properties.x.description"),
    ("/v1/chat/completions", f'{{"messages": [{USER}, {{"role": "assistant", "tool_calls": [{{"id": "c", "function": '
                             f'{{"name": "f", "arguments": {BAD}}}}}]}}]}}',
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", f'{{"messages": [{USER}], "stop": [{BAD}]}}', "stop[0]"),
    ("/v1/chat/completions", f'{{"messages": [{USER}], "model": {BAD}}}', "model"),  # echoed in the 404 before
    ("/v1/completions", f'{{"prompt": {BAD}}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", {BAD}]}}', "prompt[1]"),
    ("/v1/completions", f'{{"prompt": "hi", "stop": {BAD}}}', "stop"),
    ("/v1/responses", f'{{"input": {BAD}}}', "input"),
    ("/v1/responses", f'{{"input": "hi", "instructions": {BAD}}}', "instructions"),
    ("/v1/responses", f'{{"input": [{{"role": "user", "content": [{{"type": "input_text", "text": {BAD}}}]}}]}}',
     "input[0].content[0].text"),
    ("/v1/responses", f'{{"input": [{{"type": "function_call", "call_id": "c", "name": "f", "arguments": {BAD}}}]}}',
     "input[0].arguments"),
    ("/v1/responses", f'{{"input": "hi", "metadata": {{"k": {BAD}}}}}', "metadata.k"),  # echoed in the response
    ("/tokenize", f'{{"prompt": {BAD}}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": {BAD}}}]}}', "messages[0].content"),
])
def test_lone_surrogate_is_400_naming_the_field(server, engine, caplog, path, body, param) -> None:
    reset(engine)
    with caplog.at_level(logging.INFO):
        r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "U+D800, a lone surrogate" in err["message"], err
    assert not engine.prompts
    _no_traceback(caplog)


def test_lone_surrogate_in_a_big_body(server, engine, caplog) -> None:
    # Over router/body.py's SMALL_BODY_BYTES: decoded (and checked) in the helper process.
    words = json.dumps("word " * 60_000)
    with caplog.at_level(logging.INFO):
        r = _post(server, "/v1/chat/completions",
                  f'{{"messages": [{{"role": "user", "content": {words}}}, {{"role": "user", "content": {BAD}}}]}}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content", r.text
    _no_traceback(caplog)


def test_paired_surrogate_escapes_are_text(server, engine) -> None:
    reset(engine)
    r = _post(server, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800"}],'
                                              ' "max_tokens": 3}')
    assert r.status_code == 200, r.text  # an emoji as its escaped pair, and a backslash-u that is text


def _grpc_error(srv, call) -> grpc.RpcError:
    with grpc.insecure_channel(srv.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            call(channel)
    return err.value


@pytest.mark.parametrize("request_, field", [
    (pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")], tools=[pb.Tool(
        name="f", parameters_json_schema='{"properties": {"x": {"description": "\\ud800"}}}')]),
     "tools[0].parameters.properties.x.description"),
    (pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")], response_format=pb.ResponseFormat(
        type=pb.ResponseFormat.JSON_SCHEMA, name="n", schema_json='{"type": "object", "description": "\\udfff"}')),
     "response_format.schema_json.description"),
])
def test_grpc_escaped_lone_surrogate_is_invalid_argument(server, caplog, request_, field) -> None:
    # gRPC strings cannot hold a lone surrogate, but JSON inside them can escape one.
    with caplog.at_level(logging.INFO):
        err = _grpc_error(server, lambda ch: list(pb_grpc.RouterStub(ch).Chat(request_, timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(f"{field}: character 0 is U+D")
    _no_traceback(caplog)


@pytest.mark.parametrize("method, request_", [
    ("Chat", pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="aQQb")])),
    ("Tokenize", pb.TokenizeRequest(prompt="aQQb")),
])
def test_grpc_bad_utf8_on_the_wire_is_invalid_argument(server, caplog, method, request_) -> None:
    raw = request_.SerializeToString().replace(b"aQQb", b"a\xed\xa0\x80b")  # a surrogate as (invalid) UTF-8
    streaming = method == "Chat"
    out = pb.ChatResponse if streaming else pb.TokenizeResponse

    def call(channel):
        make = channel.unary_stream if streaming else channel.unary_unary
        result = make(f"/kvrelay.v1.Router/{method}", request_serializer=lambda b: b,
                      response_deserializer=out.FromString)(raw, timeout=30)
        return list(result) if streaming else result

    with caplog.at_level(logging.INFO):
        err = _grpc_error(server, call)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.details(), err.details()
    _no_traceback(caplog)


FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@pytest.mark.parametrize("value, shown", [("1e400", "inf"), ("-1e400", "-inf"), ("NaN", "nan")])
@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("path, base", [("/v1/chat/completions", f'"messages": [{USER}]'), ("/v1/completions",
                                                                                           '"prompt": "hi"')])
def test_non_finite_sampling_numbers_are_400(server, engine, path, base, name, value, shown) -> None:
    r = _post(server, path, f'{{{base}, "{name}": {value}}}')
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f"{name}: must be a finite number, got {shown}"


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"])
def test_non_finite_sampling_numbers_responses_and_grpc(server, name) -> None:
    r = _post(server, "/v1/responses", f'{{"input": "hi", "{name}": 1e400}}')
    assert r.status_code == 400 and r.json()["error"]["message"] == f"{name}: must be a finite number, got inf"
    sampling = pb.SamplingParams(**{name: float("nan")})
    err = _grpc_error(server, lambda ch: list(pb_grpc.RouterStub(ch).Generate(
        pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=sampling), timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == f"{name}: must be a finite number, got nan"


@pytest.mark.parametrize("body, message", [
    ('{"prompt": 5}', "prompt: must be a string (the text to tokenize), got number; a chat is tokenized from "
                      "messages, and token ids need no tokenizing"),
    ('{"prompt": [1, 2]}', "prompt: must be a string (the text to tokenize), got array; a chat is tokenized from "
                           "messages, and token ids need no tokenizing"),
    ("{}", "prompt: required: the text to tokenize (a string), or messages for a chat"),
])
def test_tokenize_names_a_bad_prompt(server, body, message) -> None:
    r = _post(server, "/tokenize", body)
    assert r.status_code == 400 and r.json()["error"] == {"message": message, "type": "invalid_request_error",
                                                          "param": "prompt", "code": None}


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", f'"messages": [{USER}]'),
                                        ("/v1/completions", '"prompt": "hi"'), ("/v1/responses", '"input": "hi"')])
def test_unknown_fields_are_ignored_with_a_warning_on_every_endpoint(server, engine, caplog, path, base) -> None:
    reset(engine)
    with caplog.at_level(logging.WARNING):
        r = _post(server, path, f'{{{base}, "nvext": {{"x": 1}}, "max_tokens_typo": 3, "max_output_tokens": 5,'
                                f' "max_tokens": 5}}' if path != "/v1/responses" else
                                f'{{{base}, "nvext": {{"x": 1}}, "max_tokens_typo": 3, "max_output_tokens": 5}}')
    assert r.status_code == 200, r.text
    warned = " ".join(rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING)
    assert f"{path}: ignored the body field 'nvext'" in warned and "'max_tokens_typo'" in warned, warned


@pytest.mark.parametrize("path, base, extra", [
    ("/v1/chat/completions", f'"messages": [{USER}]', '"use_beam_search": true'),
    ("/v1/chat/completions", f'"messages": [{USER}]', '"functions": [{"name": "f"}]'),
    ("/v1/chat/completions", f'"messages": [{USER}]', '"add_generation_prompt": false'),
    ("/v1/completions", '"prompt": "hi"', '"include_stop_str_in_output": true'),
])
def test_known_parameters_not_served_are_refused_not_ignored(server, engine, path, base, extra) -> None:
    r = _post(server, path, f"{{{base}, {extra}}}")
    assert r.status_code == 400 and r.json()["error"]["param"] == extra.split('"')[1], r.text
    neutral = extra.replace("true", "false").replace('[{"name": "f"}]', "[]").replace("false", "true", 1) \
        if "add_generation_prompt" in extra else extra.replace("true", "false").replace('[{"name": "f"}]', "[]")
    assert _post(server, path, f'{{{base}, {neutral}, "max_tokens": 3}}').status_code == 200


def _data_lines(text: str) -> list[dict]:
    """The stream cut as httpx's aiter_lines and guidellm cut it (str.splitlines): every data line JSON."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


@pytest.mark.parametrize("path, body, text_of", [
    ("/v1/chat/completions", f'{{"messages": [{USER}], "stream": true}}',
     lambda e: (e["choices"] or [{}])[0].get("delta", {}).get("content") or ""),
    ("/v1/completions", '{"prompt": "hi", "stream": true, "max_tokens": 50}',
     lambda e: (e["choices"] or [{}])[0].get("text") or ""),
    ("/v1/responses", '{"input": "hi", "stream": true}',
     lambda e: e["delta"] if e["type"] == "response.output_text.delta" else ""),
])
def test_sse_lines_survive_splitlines(server, engine, path, body, text_of) -> None:
    reset(engine)
    r = _post(server, path, body)
    assert r.status_code == 200
    assert "".join(text_of(e) for e in _data_lines(r.text)) == BREAKS
    assert "\\u2028" in r.text and "\u2028" not in r.text  # escaped, while the rest stays UTF-8
