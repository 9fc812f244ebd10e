"""The Responses API (`/v1/responses`) refusing what it does not serve, naming the field, and its routes
shared with chat (structured outputs, vLLM's sampling extensions, rate limits, bad bodies), over real
sockets with the official `openai` client against the scripted engine (split from test_http_responses)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvrelay.router import harmony
from kvrelay.router.server import BackgroundRouter

from responses_helpers import DATE, FINAL, MODEL, TOOL_CALL, TOOLS, _ids, _post
from scripted_router import reset, scripted_router_fixtures

engine, server = scripted_router_fixtures([FINAL], model_name=MODEL, max_context=4096, router={"today": lambda: DATE})


@pytest.fixture()
def client(server, engine):
    reset(engine)
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


# ---- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [dict(TOOLS[0], strict=True)]}, "tools[0].strict"),
    ({"tools": [dict(TOOLS[0], name="bad name")]}, "tools[0].name"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice.name"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"tool_choice": "any"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_object", "schema": {}}}}, "text.format.schema"),
    ({"max_reasoning_tokens": 5}, "max_reasoning_tokens"),  # only with a constrained reply
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"reasoning": {"effort": "minimal"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"max_output_tokens": 10_000}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"input": None}, "input"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "input_file", "file_id": "f"}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "no good", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB-openai"}]},
     "input[0].encrypted_content"),
    ({"input": "x" * 20_000}, "input"),
])
def test_unsupported_or_bad_fields_are_refused_by_name(server, extra, param) -> None:
    r = _post(server, {"model": MODEL, "input": "hi", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err


def test_vllm_sampling_extensions_reach_the_engine(client, engine) -> None:
    engine.scripts = [FINAL]
    client.responses.create(model=MODEL, input="hi", temperature=0.5, top_p=0.9, max_output_tokens=30, extra_body={
        "seed": 7, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5})
    p = engine.params[-1]
    assert (p.temperature, p.top_p, p.max_tokens, p.seed, p.top_k, p.min_p) == (0.5, 0.9, 30, 7, 5, 0.1)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert set(harmony.CHAT_STOP_TOKEN_IDS) <= set(p.stop_token_ids)


JSON_FINAL = _ids('<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>'
                  '{"temp_c": 21}<|return|>')
SCHEMA = {"type": "object", "properties": {"temp_c": {"type": "number"}}, "required": ["temp_c"],
          "additionalProperties": False}


def _last_request(engine):
    return engine.prompts[-1], engine.params[-1].structured


def test_structured_outputs_are_the_chat_routes(client, engine) -> None:
    """text.format and tool_choice constrain the reply exactly as chat's response_format and tool_choice do:
    the same prompt (harmony's # Response Formats section) and the same engine constraint."""
    engine.scripts = [JSON_FINAL]
    r = client.responses.create(model=MODEL, input="Weather?", extra_body={"max_reasoning_tokens": 64}, text={"format": {
        "type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}})
    responses = _last_request(engine)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                   extra_body={"max_reasoning_tokens": 64}, response_format={
                                       "type": "json_schema",
                                       "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}})
    assert responses[1] is not None and responses == _last_request(engine)
    assert "# Response Formats" in harmony.decode_tokens(responses[0])
    assert json.loads(r.output_text) == {"temp_c": 21}
    assert (r.text.format.type, r.text.format.name) == ("json_schema", "weather")

    client.responses.create(model=MODEL, input="Weather?", text={"format": {"type": "json_object"}})
    responses = _last_request(engine)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                   response_format={"type": "json_object"})
    assert responses[1] is not None and responses == _last_request(engine)

    engine.scripts = [TOOL_CALL]
    strict = [dict(TOOLS[0], strict=True)]
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k not in ("type", "strict")}}]
    for choice, chat_choice in (("required", "required"), ({"type": "function", "name": "get_weather"},
                                                          {"type": "function", "function": {"name": "get_weather"}})):
        r = client.responses.create(model=MODEL, input="Weather?", tools=strict, tool_choice=choice)
        responses = _last_request(engine)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                       tools=chat_tools, tool_choice=chat_choice)
        assert responses[1] is not None and responses == _last_request(engine)
        assert r.output[-1].type == "function_call" and r.tool_choice == (
            choice if isinstance(choice, str) else openai.types.responses.ToolChoiceFunction(**choice))


def test_responses_parse_with_a_pydantic_format(client, engine) -> None:
    from pydantic import BaseModel

    class Weather(BaseModel):
        temp_c: float

    engine.scripts = [JSON_FINAL]
    parsed = client.responses.parse(model=MODEL, input="Weather?", text_format=Weather)
    assert parsed.output_parsed == Weather(temp_c=21)
    assert engine.params[-1].structured is not None
    with client.responses.stream(model=MODEL, input="Weather?", text_format=Weather) as stream:
        assert stream.get_final_response().output_parsed == Weather(temp_c=21)


def test_unknown_model_is_404(server) -> None:
    r = _post(server, {"model": "nope", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_responses_are_rate_limited_like_chat(engine) -> None:
    from kvrelay.router.limits import RateLimiter

    engine.scripts = [FINAL]
    with BackgroundRouter(engine, today=lambda: DATE, rate_limit=RateLimiter(rpm=60, burst=1)) as srv:
        codes = [_post(srv, {"model": MODEL, "input": "hi"}).status_code for _ in range(2)]
    assert codes == [200, 429]


def test_non_json_and_garbage_bodies_are_400(server) -> None:
    for content in (b"{", b"[]", b'"x"', json.dumps({"input": [1, [2], None]}).encode()):
        r = httpx.post(f"{server.http_url}/v1/responses", content=content, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code in (400, 422) and r.json()["error"]["message"], (content, r.text)
