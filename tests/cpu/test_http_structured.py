"""Structured outputs over HTTP with the official `openai` client: response_format json_object /
json_schema, vLLM's guided_json / structured_outputs, tool_choice required and named.

Two engines: a scripted double that samples random tokens among the ones the request's own constraint
allows (a "random model" that honours the mask, so the router's half is tested alone), and the real
in-process engine on gpt-oss-tiny with random weights, whose replies must parse all the same."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch

from kvrelay.engine.structured import compute_masks, open_constraint
from kvrelay.router import harmony
from kvrelay.router.scripted_engine import ScriptedEngineClient
from kvrelay.router.server import BackgroundRouter


MODEL = "gpt-oss-test"
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Is it sunny?"}]
RF = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}


def _allowed(row: torch.Tensor) -> list[int]:
    return np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")).tolist()


class MaskedRandom(ScriptedEngineClient):
    """Plays random allowed tokens of the request's constraint; plain text for unconstrained requests."""

    def _tokens(self, prompt_ids):
        spec = self.params[-1].structured
        if spec is None:
            return harmony.load_encoding().encode("<|channel|>final<|message|>plain<|return|>", allowed_special="all")
        rng = random.Random(len(self.prompts))

        def gen():
            c = open_constraint(spec)
            while not c.done:
                _, mask = compute_masks([c])
                allowed = _allowed(mask[0])
                t = harmony.END if harmony.END in allowed and rng.random() < 0.3 else rng.choice(allowed)
                c.advance(t)
                yield t
        return gen()


@pytest.fixture(scope="module")
def engine():
    return MaskedRandom([()], model_name=MODEL, max_context=4096)


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundRouter(engine, today=lambda: "2025-06-28") as srv:
        yield srv


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_json_schema_reply_parses_and_the_schema_reaches_the_model(client, engine) -> None:
    for _ in range(3):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=RF, max_tokens=200)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    prompt = harmony.decode_tokens(engine.prompts[-1])
    assert "# Response Formats\n\n## verdict\n\n" + json.dumps(SCHEMA, separators=(",", ":")) in prompt


def test_streamed_json_object_and_vllm_spellings(client, engine) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=RF, max_tokens=200,
                                            stream=True, extra_body={"max_reasoning_tokens": 4})
    chunks = [ch for ch in stream if ch.choices]
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks)), SCHEMA)
    assert engine.params[-1].structured.max_reasoning_tokens == 4
    # json_object: any object (random tokens seldom close one in 30 tokens; what came is its start).
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                       max_tokens=30, extra_body={"max_reasoning_tokens": 0})
    assert r.choices[0].message.content.startswith("{")
    assert engine.params[-1].structured.bodies[0].schema == '{"type":"object"}'
    for extra in ({"guided_json": SCHEMA}, {"structured_outputs": {"json": json.dumps(SCHEMA)}}):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, extra_body=extra)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_choice_forces_a_call_whose_arguments_match(client, engine, choice) -> None:
    for _ in range(3):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                           max_tokens=200)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_unconstrained_requests_carry_no_constraint(client, engine) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=20)
    assert r.choices[0].message.content == "plain" and engine.params[-1].structured is None
    client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "text"}, max_tokens=20)
    assert engine.params[-1].structured is None


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                      "properties": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ({"max_reasoning_tokens": 3}, "max_reasoning_tokens"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_structured_requests_are_400_naming_the_field(server, extra, param) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **extra}
    r = httpx.post(f"{server.http_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_completions_refuse_structured_outputs(server) -> None:
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "response_format": {"type": "json_object"}}
    r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_random_weights_in_process_engine_still_answer_valid_json() -> None:
    """The real sampler path (LLM.step -> sample_constrained) on gpt-oss-tiny with random weights."""
    from kvrelay.engine.llm import LLM
    from kvrelay.router.engine_client import InProcessEngineClient

    llm = LLM("gpt-oss-tiny", dummy=True, seed=0, kv_tokens=4096)
    with BackgroundRouter(InProcessEngineClient(llm), model_name=MODEL) as srv, \
            openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        for seed in range(2):
            r = c.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=RF, max_tokens=60,
                                          seed=seed, logprobs=True, extra_body={"max_reasoning_tokens": 3})
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
            assert all(lp.logprob < -5 for lp in r.choices[0].logprobs.content)  # the model's own (flat) ones
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                      max_tokens=60, extra_body={"max_reasoning_tokens": 0})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)


def test_the_clients_parse_helper_gets_its_model_back(client) -> None:
    from typing import Literal

    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        score: int = Field(ge=0, le=9)

    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Verdict, max_tokens=200)
    assert isinstance(r.choices[0].message.parsed, Verdict)


def test_grpc_chat_takes_the_same_constraints(server) -> None:
    import grpc

    from kvrelay.router.client import RouterClient
    from kvrelay.router.types import ChatMessage, SamplingOptions, ToolSpec
    from kvrelay.v1 import router_pb2 as pb

    client = RouterClient(server.grpc_target, timeout_s=60)
    msgs = [ChatMessage("user", "Is it sunny?")]
    rf = pb.ResponseFormat(type=pb.ResponseFormat.JSON_SCHEMA, schema_json=json.dumps(SCHEMA), name="verdict")
    out = list(client.chat(msgs, response_format=rf, max_reasoning_tokens=2, sampling=SamplingOptions(max_tokens=200)))
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads("".join(o.content for o in out)), SCHEMA)
    tools = [ToolSpec(t["function"]["name"], "", json.dumps(t["function"]["parameters"])) for t in TOOLS]
    out = list(client.chat(msgs, tools=tools, tool_choice_function="get_weather", sampling=SamplingOptions(max_tokens=200)))
    assert out[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    calls = [c for o in out for c in o.tool_calls]
    assert calls[0].name == "get_weather"
    jsonschema.validate(json.loads("".join(c.arguments for c in calls)), CITY)
    bad = pb.ResponseFormat(type=pb.ResponseFormat.JSON_SCHEMA, schema_json='{"type": "object", "required": 3}')
    with pytest.raises(grpc.RpcError) as err:
        list(client.chat(msgs, response_format=bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("response_format.schema_json: ")
    with pytest.raises(grpc.RpcError) as err:
        list(client.chat(msgs, tools=tools, tool_choice_function="nope"))
    assert err.value.details().startswith("tool_choice_function: ")
