"""Property-based fuzzing of both front-ends over real sockets on 127.0.0.1 (hypothesis): bodies built from
the API's own field names with values of any JSON type (and valid-looking ones), and gRPC requests with
any field values. The server must never answer 5xx / INTERNAL / UNKNOWN: every refusal is a 4xx or
INVALID_ARGUMENT naming a field, and the router keeps serving."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvrelay.router import harmony
from kvrelay.v1 import router_pb2 as pb
from kvrelay.v1 import router_pb2_grpc as pb_grpc

from scripted_router import scripted_router_fixtures

MODEL = "gpt-oss-fuzz"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

SAMPLING_FIELDS = ["model", "temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "n",
                   "stream", "stream_options", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty",
                   "min_p", "repetition_penalty", "logit_bias", "response_format", "logprobs", "request_id"]
CHAT_FIELDS = SAMPLING_FIELDS + ["messages", "tools", "tool_choice", "reasoning_effort", "max_completion_tokens",
                                 "top_logprobs"]
COMPLETION_FIELDS = SAMPLING_FIELDS + ["prompt", "echo", "return_token_ids", "best_of", "suffix"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64) | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20)
plausible = {
    "model": st.just(MODEL), "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
    "max_tokens": st.integers(-5, 10_000), "stop": st.lists(st.text(max_size=8), max_size=70),
    "stop_token_ids": st.lists(st.integers(-3, 300_000), max_size=5), "stream": st.booleans(),
    "prompt": st.one_of(st.text(max_size=50), st.lists(st.integers(-5, 300_000), max_size=20),
                        st.lists(st.lists(st.integers(0, 1000), max_size=5), max_size=3)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool",
                                                                         "developer", "x"]),
                                                "content": st.one_of(st.text(max_size=30), json_values)}),
                         max_size=4),
    "min_tokens": st.integers(-3, 50), "presence_penalty": st.floats(-3, 3), "min_p": st.floats(-1, 2),
}


def _bodies(fields: list[str]):
    def value(name: str):
        return st.one_of(plausible[name], json_values) if name in plausible else json_values
    return st.lists(st.sampled_from(fields), unique=True, max_size=len(fields)).flatmap(
        lambda names: st.fixed_dictionaries({n: value(n) for n in names}))


REPLY = harmony.load_encoding().encode("<|channel|>final<|message|>fuzzed<|return|>", allowed_special="all")
engine, server = scripted_router_fixtures([REPLY], model_name=MODEL, max_context=4096)


def _check_http(server, path: str, body) -> int:
    with httpx.Client(timeout=30) as c:
        r = c.post(f"{server.http_url}{path}", content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code < 500, (body, r.status_code, r.text[:500])
        event(f"HTTP {r.status_code}")
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["message"], (body, r.text)
        elif body.get("stream") is True:
            assert "data: [DONE]" in r.text and '"server_error"' not in r.text, (body, r.text[-500:])
        return r.status_code


@FUZZ
@given(body=_bodies(CHAT_FIELDS))
def test_chat_completions_never_5xx(server, body) -> None:
    _check_http(server, "/v1/chat/completions", body)


@FUZZ
@given(body=_bodies(COMPLETION_FIELDS))
def test_completions_never_5xx(server, body) -> None:
    _check_http(server, "/v1/completions", body)


@FUZZ
@given(body=json_values)
def test_any_json_document_never_5xx(server, body) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        _check_http(server, path, body)


valid = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**63), "max_tokens": st.integers(1, 40), "stop": st.lists(st.text(min_size=1, max_size=6),
                                                                                      max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 200_000), max_size=3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 3), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "min_p": st.floats(0, 1), "logprobs": st.booleans(),
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_mostly_valid_requests_are_served_or_refused_by_name(server, path: str) -> None:
    """Valid bodies with any mix of options at valid or edge values: most are served (streamed or not),
    and a refusal (e.g. ignore_eos on chat, logprobs: true on completions) is a 400 naming the field."""
    seen: dict[int, int] = {}
    chat = path.endswith("chat/completions")
    base = ({"messages": st.just([{"role": "user", "content": "hi"}])} if chat
            else {"prompt": st.one_of(st.lists(st.integers(1, 1000), min_size=1, max_size=20),
                                      st.text(min_size=1, max_size=30))})
    options = st.lists(st.sampled_from(sorted(valid)), unique=True, max_size=6).flatmap(
        lambda names: st.fixed_dictionaries({**base, "model": st.just(MODEL), **{n: valid[n] for n in names}}))

    @FUZZ
    @given(body=options)
    def run(body) -> None:
        code = _check_http(server, path, body)
        seen[code] = seen.get(code, 0) + 1

    run()
    assert seen.get(200, 0) >= 75 and set(seen) <= {200, 400}, seen


def test_invalid_json_is_named(server) -> None:
    r = httpx.post(f"{server.http_url}/v1/completions", content=b'{"prompt": [1, 2', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
sampling = st.builds(
    pb.SamplingParams, temperature=floats, top_p=floats, top_k=st.integers(-2**31, 2**31 - 1),
    seed=st.integers(0, 2**64 - 1), max_tokens=st.integers(-2**31, 2**31 - 1),
    stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=4), logprobs=st.booleans(),
    stop=st.lists(st.text(max_size=6), max_size=70), min_tokens=st.integers(-2**31, 2**31 - 1),
    presence_penalty=floats, frequency_penalty=floats, min_p=floats)
messages = st.lists(st.builds(pb.ChatMessage, role=st.text(max_size=12), content=st.text(max_size=30),
                              channel=st.text(max_size=8), recipient=st.text(max_size=8)), max_size=4)


@FUZZ
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=20), s=sampling, rid=st.text(max_size=20))
def test_grpc_generate_never_internal(server, ids, s, rid) -> None:
    _check_grpc(server, lambda stub: list(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling=s,
                                                                           request_id=rid), timeout=30)))


@FUZZ
@given(msgs=messages, s=sampling, effort=st.integers(-3, 8),
       tools=st.lists(st.builds(pb.Tool, name=st.text(max_size=10), parameters_json_schema=st.text(max_size=30)),
                      max_size=2))
def test_grpc_chat_never_internal(server, msgs, s, effort, tools) -> None:
    req = pb.ChatRequest(messages=msgs, sampling=s, reasoning_effort=effort, tools=tools)
    _check_grpc(server, lambda stub: list(stub.Chat(req, timeout=30)))


def _check_grpc(server, call) -> None:
    with grpc.insecure_channel(server.grpc_target) as ch:
        try:
            call(pb_grpc.RouterStub(ch))
            event("gRPC OK")
        except grpc.RpcError as e:
            event(f"gRPC {e.code().name}")
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (
                e.code(), e.details())
            assert e.details()
