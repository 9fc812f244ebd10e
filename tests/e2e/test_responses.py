"""The Responses API on a real CPU cluster (Ray actors, prefill -> NIXL -> decode) serving gpt-oss-tiny (the
real harmony vocabulary, random weights): with the official client, greedy `responses.create` and
`responses.stream` return the same output, the same text as `/v1/chat/completions` for the same
conversation, and `previous_response_id` continues a stored response on the cluster."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.timeout(240)

TOPOLOGY = """
model: {name: gpt-oss-tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 1, max_prompt_tokens: 1024}
decode: {workers: 1, max_batch: 8, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
device: cpu
"""


def _norm(value):
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: (v.split("_")[0] if k in ("id", "call_id", "item_id") and isinstance(v, str) else _norm(v))
                for k, v in value.items() if k not in ("created_at", "completed_at", "parsed", "parsed_arguments")}
    if isinstance(value, list):
        return [_norm(v) for v in value]
    return value


def test_responses_create_and_stream_agree_on_the_cluster():
    from conftest import serving

    with serving(TOPOLOGY) as (run, server):
        client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
        request = dict(model=run.client.model_name, input="Say hi.", instructions="Be brief.",
                       max_output_tokens=24, temperature=0, reasoning={"effort": "low"})
        created = client.responses.create(**request)
        assert created.usage.output_tokens == 24 and created.output
        with client.responses.stream(**request) as stream:
            events = list(stream)
        last = events[-1]
        # Random weights do not end their turn within 24 tokens: the response is incomplete, as OpenAI's is.
        assert last.type == f"response.{created.status}"
        assert _norm(last.response) == _norm(created)
        assert [e.sequence_number for e in events] == list(range(len(events)))

        chat = client.chat.completions.create(
            model=run.client.model_name, max_tokens=24, temperature=0, reasoning_effort="low",
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}])
        message = chat.choices[0].message
        reasoning = "".join(c.text for o in created.output if o.type == "reasoning" for c in o.content)
        assert created.output_text == (message.content or "")
        assert (reasoning or None) == (message.model_extra or {}).get("reasoning_content")

        follow = client.responses.create(model=run.client.model_name, input="Again.", previous_response_id=created.id,
                                         max_output_tokens=4, temperature=0)
        assert follow.previous_response_id == created.id
        assert follow.usage.input_tokens > created.usage.input_tokens
