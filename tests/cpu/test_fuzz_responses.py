"""Property-based fuzzing (hypothesis) of `/v1/responses` over a real socket: bodies from the Responses API's
field names with values of any JSON type, and input items of every kind with any field values. The router
must never answer 5xx: a refusal is a 400 (404 for a model or stored response it does not have) with a
message, a stream ends in response.completed or response.incomplete, and the router keeps serving."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvrelay.router import harmony
from kvrelay.router.responses_models import ResponsesRequest

from scripted_router import scripted_router_fixtures

MODEL = "gpt-oss-fuzz"
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
FIELDS = sorted(ResponsesRequest.model_fields)
SCRIPT = ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary to=functions.f "
          '<|constrain|>json<|message|>{"a":1}<|call|>')

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
text_parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "refusal",
                                                                      "input_image", "reasoning_text", "x"]),
                                             "text": st.one_of(st.text(max_size=20), json_values)}), max_size=3)
items = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool", "x"]),
                           "content": st.one_of(st.text(max_size=20), text_parts, json_values)},
                          optional={"type": st.just("message"), "phase": st.sampled_from(["commentary", "x", None])}),
    st.fixed_dictionaries({"type": st.just("reasoning")},
                          optional={"content": st.one_of(text_parts, json_values),
                                    "summary": st.one_of(text_parts, json_values),
                                    "encrypted_content": st.one_of(st.text(max_size=30), json_values)}),
    st.fixed_dictionaries({"type": st.just("function_call"),
                           "call_id": st.one_of(st.sampled_from(["c1", "c2"]), json_values),
                           "name": st.one_of(st.sampled_from(["f", "bad name", ""]), json_values),
                           "arguments": st.one_of(st.just('{"a":1}'), json_values)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"),
                           "call_id": st.one_of(st.sampled_from(["c1", "c2"]), json_values),
                           "output": st.one_of(st.text(max_size=20), text_parts, json_values)}),
    json_values)
plausible = {
    "model": st.just(MODEL),
    "input": st.one_of(st.text(max_size=30), st.lists(items, max_size=5)),
    "stream": st.booleans(),
    "max_output_tokens": st.integers(-2, 5000),
    "temperature": st.floats(-1, 3),
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]),
                                             "name": st.sampled_from(["f", "g", "bad name"])},
                                            optional={"parameters": json_values, "strict": st.booleans()}),
                      max_size=2),
    "text": st.fixed_dictionaries({"format": st.one_of(
        st.just({"type": "json_object"}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "name": st.just("x"), "schema": json_values}))}),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), st.fixed_dictionaries(
        {"type": st.just("function"), "name": st.sampled_from(["f", "g"])})),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "high", "minimal"]),
                                                     "summary": st.sampled_from(["auto", "x"])}),
    "include": st.lists(st.sampled_from(["reasoning.encrypted_content", "file_search_call.results"]), max_size=2),
    "previous_response_id": st.sampled_from(["resp_missing", ""]),
}


def _bodies():
    def value(name: str):
        return st.one_of(plausible[name], json_values) if name in plausible else json_values
    return st.lists(st.sampled_from(FIELDS), unique=True, max_size=8).flatmap(
        lambda names: st.fixed_dictionaries({n: value(n) for n in names}))


engine, server = scripted_router_fixtures([harmony.load_encoding().encode(SCRIPT, allowed_special="all")],
                                          model_name=MODEL, max_context=4096)


@FUZZ
@given(body=_bodies())
def test_responses_bodies_never_5xx(server, body) -> None:
    with httpx.Client(timeout=30) as c:
        r = c.post(f"{server.http_url}/v1/responses", content=json.dumps(body),
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.status_code, r.text[:500])
    event(f"HTTP {r.status_code}")
    if r.status_code >= 400:
        assert r.json()["error"]["message"], (body, r.text)
    elif body.get("stream") is True:
        last = [line for line in r.text.splitlines() if line.startswith("event: ")][-1]
        assert last in ("event: response.completed", "event: response.incomplete"), (body, r.text[-500:])
    else:
        assert r.json()["status"] in ("completed", "incomplete"), (body, r.text[:500])


valid_items = st.lists(st.sampled_from([
    {"role": "user", "content": "Hi"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
    {"type": "message", "role": "assistant", "phase": "commentary", "content": "Checking."},
    {"role": "developer", "content": "Be brief."},
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Think."}]},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Thought."}]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a":1}'},
    {"type": "function_call_output", "call_id": "c1", "output": "1"},
]), min_size=1, max_size=6)
options = st.fixed_dictionaries({"model": st.just(MODEL), "input": st.one_of(st.just("Hi"), valid_items)}, optional={
    "stream": st.booleans(), "store": st.booleans(), "instructions": st.text(max_size=20),
    "max_output_tokens": st.integers(1, 40), "temperature": st.sampled_from([0, 0.7, 1.0]),
    "top_p": st.sampled_from([0.5, 1.0]), "tool_choice": st.sampled_from(["auto", "none"]),
    "tools": st.just([{"type": "function", "name": "f", "parameters": {"type": "object"}}]),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "medium", "high"]),
                                                     "summary": st.sampled_from(["auto", "concise", "detailed"])}),
    "include": st.just(["reasoning.encrypted_content"]), "metadata": st.just({"k": "v"}),
    "parallel_tool_calls": st.booleans(), "truncation": st.just("disabled"), "user": st.text(max_size=8),
})


@settings(FUZZ, max_examples=40)
@given(body=options)
def test_mostly_valid_responses_are_served_or_refused_by_name(server, body) -> None:
    with httpx.Client(timeout=30) as c:
        r = c.post(f"{server.http_url}/v1/responses", json=body)
    event(f"HTTP {r.status_code}")
    if r.status_code == 400:
        # The only refusal left: a function_call_output before its function_call.
        assert r.json()["error"]["param"].endswith(".call_id"), (body, r.text)
        return
    assert r.status_code == 200, (body, r.text[:500])
    if body.get("stream"):
        assert r.text.rstrip().splitlines()[-2] in ("event: response.completed", "event: response.incomplete")
    else:
        assert r.json()["status"] in ("completed", "incomplete")
