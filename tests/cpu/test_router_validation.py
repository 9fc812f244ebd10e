"""Every validation rule, through both front-ends: gRPC INVALID_ARGUMENT and HTTP 400 with the same
message (field, then what is wrong and the limit). Nothing reaches the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest

from kvrelay.router import harmony
from kvrelay.router.scripted_engine import ScriptedEngineClient
from kvrelay.router.server import BackgroundRouter
from kvrelay.router.types import ChatMessage, ChatRequest
from kvrelay.v1 import router_pb2 as pb
from kvrelay.v1 import router_pb2_grpc as pb_grpc

from scripted_router import scripted_router_fixtures


CONTEXT = 512
DATE = "2025-06-28"
USER = {"role": "user", "content": "hi"}
HI_PROMPT_LEN = len(harmony.render_chat(ChatRequest(messages=(ChatMessage("user", "hi"),)), DATE))


@dataclass(frozen=True)
class Case:
    """One bad request, as a chat (gRPC Chat + HTTP chat) or a generate (gRPC Generate + HTTP completions)."""

    name: str
    kind: str  # "chat" | "generate"
    message: str
    messages: list[dict[str, Any]] = field(default_factory=lambda: [USER])
    tools: list[dict[str, Any]] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    prompt: list[int] = field(default_factory=lambda: [1, 2, 3])


def _tool(params: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "description": "d", "parameters": params}}


CASES = [
    Case("empty_messages", "chat", "messages: must not be empty", messages=[]),
    Case("unknown_role", "chat", "messages[1].role: unknown role 'wizard'; expected one of system, developer, "
         "user, assistant, tool", messages=[USER, {"role": "wizard", "content": "x"}]),
    Case("tool_schema_not_object", "chat", "tools[0].parameters: must be a JSON Schema object, got array",
         tools=[_tool([1, 2])]),
    Case("tool_schema_top_type", "chat", "tools[0].parameters.type: function parameters must be 'object', got 'string'",
         tools=[_tool({"type": "string"})]),
    Case("tool_schema_bad_type", "chat", "tools[0].parameters.properties.x.type: 'strng' is not a JSON Schema type "
         "(expected one of array, boolean, integer, null, number, object, string)",
         tools=[_tool({"type": "object", "properties": {"x": {"type": "strng"}}})]),
    Case("tool_schema_nested_items", "chat", "tools[0].parameters.properties.xs.items.type: 'list' is not a JSON "
         "Schema type (expected one of array, boolean, integer, null, number, object, string)",
         tools=[_tool({"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "list"}}}})]),
    Case("tool_bad_name", "chat", "tools[0].name: 'my tool' is not a valid function name (1-64 of A-Z a-z 0-9 _ -)",
         tools=[{"type": "function", "function": {"name": "my tool", "parameters": {"type": "object"}}}]),
    Case("unknown_tool_call_id", "chat", "messages[1].tool_call_id: no earlier assistant tool call has id 'call_9'",
         messages=[USER, {"role": "tool", "content": "42", "tool_call_id": "call_9"}]),
    Case("chat_max_tokens_zero", "chat", "max_tokens: must be >= 1, got 0", sampling={"max_tokens": 0}),
    Case("chat_max_tokens_beyond_context", "chat",
         f"max_tokens: prompt ({HI_PROMPT_LEN} tokens) + max_tokens (500) = {HI_PROMPT_LEN + 500} exceeds the model "
         f"context of {CONTEXT} tokens", sampling={"max_tokens": 500}),
    Case("chat_temperature_negative", "chat", "temperature: must be >= 0, got -0.5", sampling={"temperature": -0.5}),
    Case("chat_top_p_zero", "chat", "top_p: must be in (0, 1], got 0.0", sampling={"top_p": 0.0}),
    Case("chat_top_p_above_one", "chat", "top_p: must be in (0, 1], got 1.5", sampling={"top_p": 1.5}),
    Case("chat_prompt_beyond_context", "chat", "messages: the rendered prompt is {n} tokens but the model context is "
         f"{CONTEXT} tokens (at least one token must remain for generation)",
         messages=[{"role": "user", "content": "word " * 600}]),
    Case("generate_max_tokens_negative", "generate", "max_tokens: must be >= 1, got -3", sampling={"max_tokens": -3}),
    Case("generate_max_tokens_beyond_context", "generate", "max_tokens: prompt (3 tokens) + max_tokens (510) = 513 "
         f"exceeds the model context of {CONTEXT} tokens", sampling={"max_tokens": 510}),
    Case("generate_temperature_negative", "generate", "temperature: must be >= 0, got -1.0",
         sampling={"temperature": -1.0}),
    Case("generate_top_p_above_one", "generate", "top_p: must be in (0, 1], got 2.0", sampling={"top_p": 2.0}),
    Case("generate_top_k_negative", "generate", "top_k: must be >= 0 (0 disables top-k), got -1",
         sampling={"top_k": -1}),
    Case("generate_prompt_beyond_context", "generate", "{field}: prompt is 512 tokens but the model context is "
         f"{CONTEXT} tokens (at least one token must remain for generation)", prompt=[7] * 512),
    Case("generate_empty_prompt", "generate", "{field}: must not be empty", prompt=[]),
    Case("generate_token_outside_vocab", "generate", "{field}[1]: token id 300000 is outside the vocabulary "
         "[0, 201088)", prompt=[1, 300000]),
    Case("generate_stop_id_outside_vocab", "generate", "stop_token_ids[0]: token id 201088 is outside the "
         "vocabulary [0, 201088)", sampling={"stop_token_ids": [201088]}),
]


engine, server = scripted_router_fixtures([[1]], model_name="m", max_context=CONTEXT, router={"today": lambda: DATE})


def _expected(case: Case, field_name: str) -> str:
    n = 0
    if case.name == "chat_prompt_beyond_context":
        msgs = tuple(ChatMessage(m["role"], m["content"]) for m in case.messages)
        n = len(harmony.render_chat(ChatRequest(messages=msgs), DATE))
    return case.message.format(field=field_name, n=n)


def _proto_sampling(s: dict[str, Any]) -> pb.SamplingParams:
    return pb.SamplingParams(**s)


def _proto_chat(case: Case) -> pb.ChatRequest:
    msgs = [pb.ChatMessage(**{k: v for k, v in m.items()}) for m in case.messages]
    tools = [pb.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                     parameters_json_schema=json.dumps(t["function"]["parameters"])) for t in case.tools]
    return pb.ChatRequest(messages=msgs, tools=tools, sampling=_proto_sampling(case.sampling))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_grpc_invalid_argument(server, engine, case: Case) -> None:
    before = len(engine.prompts)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.RouterStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            if case.kind == "chat":
                list(stub.Chat(_proto_chat(case), timeout=30))
            else:
                req = pb.GenerateRequest(prompt_token_ids=case.prompt, sampling=_proto_sampling(case.sampling))
                list(stub.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == _expected(case, "prompt_token_ids")
    assert len(engine.prompts) == before


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_http_400(server, engine, case: Case) -> None:
    before = len(engine.prompts)
    if case.kind == "chat":
        body = {"model": "m", "messages": case.messages, **case.sampling}
        if case.tools:
            body["tools"] = case.tools
        resp = httpx.post(f"{server.http_url}/v1/chat/completions", json=body, timeout=30)
    else:
        body = {"model": "m", "prompt": case.prompt, **case.sampling}
        resp = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    expected = _expected(case, "prompt")
    assert error["message"] == expected
    assert error["type"] == "invalid_request_error"
    assert error["param"] == expected.split(":")[0]
    assert len(engine.prompts) == before


@pytest.mark.parametrize("path,body,message", [
    ("/v1/chat/completions", {"messages": [USER], "n": 0}, "n: must be in [1, 16], got 0"),
    ("/v1/chat/completions", {"messages": [USER], "stop": ""}, "stop: stop strings must not be empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]: only text parts are supported, got type 'image_url'"),
    ("/v1/chat/completions", {"messages": [USER], "temperature": "hot"},
     "temperature: Input should be a valid number, unable to parse string as a number"),
    ("/v1/chat/completions", {"messages": [USER], "reasoning_effort": "max"},
     "reasoning_effort: unknown value 'max'; expected one of low, medium, high"),
    ("/v1/chat/completions", {}, "messages: Field required"),
    ("/v1/completions", {"prompt": "a <|start|> b"},
     "prompt: text contains the special token '<|start|>'; send token ids to use special tokens"),
    ("/v1/completions", {"prompt": ["a"] * 257}, "prompt: at most 256 prompts per request, got 257"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt[1]: must not be empty"),
    ("/v1/completions", {"prompt": [1], "logprobs": 21},
     "logprobs: must be in [0, 20] (the most likely tokens to list), got 21"),
    ("/v1/chat/completions", {"messages": [USER], "top_logprobs": 3}, "top_logprobs: needs logprobs: true"),
    ("/v1/chat/completions", {"messages": [USER], "logprobs": True, "top_logprobs": 21},
     "top_logprobs: must be in [0, 20], got 21"),
])
def test_http_only_rules(server, path: str, body: dict[str, Any], message: str) -> None:
    resp = httpx.post(f"{server.http_url}{path}", json={"model": "m", **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == message


def test_unknown_model_is_404(server) -> None:
    resp = httpx.post(f"{server.http_url}/v1/chat/completions", json={"model": "gpt-5", "messages": [USER]}, timeout=30)
    assert resp.status_code == 404
    assert resp.json()["error"] == {"message": "The model 'gpt-5' does not exist; this server serves 'm'",
                                    "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


def test_small_vocab_engine_rejects_harmony_chat() -> None:
    engine = ScriptedEngineClient([[1]], model_name="tiny", max_context=CONTEXT, vocab_size=1024)
    with BackgroundRouter(engine, today=lambda: DATE) as srv:
        resp = httpx.post(f"{srv.http_url}/v1/chat/completions", json={"messages": [USER]}, timeout=30)
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == (
            "messages: the rendered prompt uses token id 200006 but the model's vocabulary has 1024 ids; "
            "this model cannot serve harmony chat (use Generate with token ids)")
        resp = httpx.post(f"{srv.http_url}/v1/completions", json={"prompt": [5, 2000]}, timeout=30)
        assert resp.json()["error"]["message"] == "prompt[1]: token id 2000 is outside the vocabulary [0, 1024)"
