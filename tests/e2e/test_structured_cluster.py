"""Structured outputs on real CPU clusters serving gpt-oss-tiny with random weights, split (Ray actors,
prefill -> NIXL -> decode) and colocated (prompt chunks in the decode loop's forwards): every json_schema
reply parses and matches its schema, and tool_choice "required" always yields a call whose arguments
match the tool's parameters. The first token is sampled under the constraint where the prompt ends
(prefill worker / colocated chunk) and decode continues it after the handoff (its state replayed)."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.timeout(240)

TOPOLOGY = """
model: {name: gpt-oss-tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 1, max_prompt_tokens: 1024, chunk_tokens: 256}
decode: {workers: 1, max_batch: 8, page_size: 16, overlap_steps: true}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
device: cpu
"""
SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no", "maybe"]}, "score": {"type": "integer", "minimum": 0, "maximum": 100},
    "why": {"type": "string", "maxLength": 12}}, "required": ["answer", "score", "why"],
    "additionalProperties": False}
TOOL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Will it rain in Paris?"}]


@pytest.mark.parametrize("colocate", [False, True], ids=["split", "colocated"])
def test_random_weights_answer_valid_json_and_tool_calls_on_the_cluster(colocate):
    from conftest import serving

    with serving(TOPOLOGY + ("colocate: true\n" if colocate else "")) as (run, server):
        client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = run.client.model_name
        rf = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}

        def ask_json(seed: int):
            # A few analysis tokens, so the handoff lands mid-analysis and decode carries the state on.
            return client.chat.completions.create(
                model=model, messages=MESSAGES, response_format=rf, max_tokens=80, seed=seed,
                temperature=0 if seed == 0 else 1.0, logprobs=True, extra_body={"max_reasoning_tokens": 6})

        def ask_tool(seed: int):
            return client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=80, seed=seed, tool_choice="required",
                tools=[{"type": "function", "function": {"name": "forecast", "parameters": TOOL}}],
                extra_body={"max_reasoning_tokens": 3})

        def plain():
            return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            jsons = [pool.submit(ask_json, s) for s in range(4)]
            tools = [pool.submit(ask_tool, s) for s in range(2)]
            free = pool.submit(plain)  # shares the decode batch, unconstrained
            for f in jsons:
                r = f.result()
                assert r.choices[0].finish_reason == "stop"
                jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
                assert r.choices[0].logprobs.content  # the model's own logprobs came along
            for f in tools:
                r = f.result()
                assert r.choices[0].finish_reason == "tool_calls"
                (call,) = r.choices[0].message.tool_calls
                assert call.function.name == "forecast"
                jsonschema.validate(json.loads(call.function.arguments), TOOL)
            assert free.result().usage.completion_tokens == 12  # random weights: no JSON, no stop
        # n choices from one prefill: each first token sampled under its own constraint, each decode
        # row forked from the prompt's KV with its own grammar state.
        r = client.chat.completions.create(model=model, messages=MESSAGES, response_format=rf, max_tokens=80, n=3,
                                           seed=7, temperature=1.0, extra_body={"max_reasoning_tokens": 6})
        assert [c.index for c in r.choices] == [0, 1, 2]
        for c in r.choices:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
