"""The Responses API (`/v1/responses`) over real sockets, driven by the official `openai` client
(`responses.create`, `responses.stream`) against the scripted engine, so the model's harmony output is
ours to choose (analysis + final, preambles, tool calls). Every prompt the router renders is compared
token for token with openai-harmony's own rendering of the conversation we expect."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from kvrelay.router import harmony
from kvrelay.router.responses_models import seal
from kvrelay.router.responses_store import ResponseStore
from kvrelay.router.types import ChatMessage

from responses_helpers import DATE, FINAL, MODEL, PARAMS, PREAMBLE_CALL, TOOL_CALL, TOOLS, _ids, _post
from scripted_router import reset, scripted_router_fixtures

engine, server = scripted_router_fixtures([FINAL], model_name=MODEL, max_context=4096, router={"today": lambda: DATE})


@pytest.fixture()
def client(server, engine):
    reset(engine)
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


# ---- openai-harmony's rendering of what we expect -------------------------------------------------


def _system(effort: ReasoningEffort = ReasoningEffort.MEDIUM) -> Message:
    content = (SystemContent.new().with_reasoning_effort(effort).with_knowledge_cutoff("2024-06")
               .with_conversation_start_date(DATE))
    return Message.from_role_and_content(Role.SYSTEM, content)


def _developer(instructions: str | None = None, tools: bool = False) -> Message:
    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if tools:
        content = content.with_function_tools([ToolDescription.new("get_weather", "Weather for a city.",
                                                                   parameters=PARAMS)])
    return Message.from_role_and_content(Role.DEVELOPER, content)


def _user(text: str) -> Message:
    return Message.from_role_and_content(Role.USER, text)


def _assistant(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def _call(args: str = '{"city":"Paris"}') -> Message:
    return (Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
            .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"))


def _result(text: str) -> Message:
    return (Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), text)
            .with_recipient("assistant").with_channel("commentary"))


def _render(*messages: Message) -> list[int]:
    return harmony.load_encoding().render_conversation_for_completion(Conversation.from_messages(list(messages)),
                                                                      Role.ASSISTANT)


def _norm(value):
    """A response without what differs between two runs of the same request: ids (kept as their prefix,
    so each item still says what it is), timestamps, and the SDK's parse-only fields."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in ("created_at", "completed_at", "parsed", "parsed_arguments"):
                continue
            out[k] = v.split("_")[0] if k in ("id", "call_id", "item_id") and isinstance(v, str) else _norm(v)
        return out
    if isinstance(value, list):
        return [_norm(v) for v in value]
    return value


# ---- the tool loop ---------------------------------------------------------------------------------


def test_function_call_then_output_with_previous_response_id(client, engine) -> None:
    engine.scripts = [TOOL_CALL, FINAL]
    first = client.responses.create(model=MODEL, input="Weather in Paris?", instructions="Be brief.", tools=TOOLS)
    assert engine.prompts[-1] == _render(_system(), _developer("Be brief.", tools=True), _user("Weather in Paris?"))
    assert first.status == "completed" and first.error is None and first.incomplete_details is None
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == ["Need the weather."]
    assert reasoning.summary == [] and reasoning.encrypted_content is None
    assert (call.type, call.name, call.arguments, call.status) == ("function_call", "get_weather",
                                                                   '{"city":"Paris"}', "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert first.output_text == ""
    assert first.usage.input_tokens == len(engine.prompts[-1]) and first.usage.output_tokens == len(TOOL_CALL)
    # <|channel|>analysis<|message|> Need the weather . <|end|>
    assert first.usage.output_tokens_details.reasoning_tokens == 8
    assert first.usage.total_tokens == first.usage.input_tokens + len(TOOL_CALL)
    assert first.instructions == "Be brief." and first.store is True and first.model == MODEL
    assert first.tools[0].name == "get_weather" and first.reasoning.effort == "medium"

    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}])
    # The earlier turn's analysis and call come back before the result; its instructions do not (OpenAI's rule).
    expected = _render(_system(), _developer(tools=True), _user("Weather in Paris?"),
                       _assistant("Need the weather.", "analysis"), _call(), _result('{"temp_c": 21}'))
    assert engine.prompts[-1] == expected
    assert second.output_text == "It is 21 °C in Paris." and second.previous_response_id == first.id
    assert [item.type for item in second.output] == ["reasoning", "message"]
    message = second.output[1]
    assert (message.role, message.status, message.phase) == ("assistant", "completed", "final_answer")

    # The same turn sent without the store (the client replays the items, as the SDK serialises them) renders
    # the same prompt.
    items = [{"role": "user", "content": "Weather in Paris?"}] + list(first.output)
    client.responses.create(model=MODEL, tools=TOOLS, store=False, input=items + [
        {"type": "function_call_output", "call_id": call.call_id, "output": [{"type": "input_text",
                                                                              "text": '{"temp_c": 21}'}]}])
    assert engine.prompts[-1] == expected

    # A third turn after the final answer: harmony drops the finished turn's analysis.
    engine.scripts = [FINAL]
    client.responses.create(model=MODEL, previous_response_id=second.id, input="And tomorrow?",
                            reasoning={"effort": "low"})
    assert engine.prompts[-1] == _render(
        _system(ReasoningEffort.LOW), _user("Weather in Paris?"), _call(), _result('{"temp_c": 21}'),
        _assistant("It is 21 °C in Paris.", "final"), _user("And tomorrow?"))


@pytest.mark.parametrize("script", [FINAL, TOOL_CALL, PREAMBLE_CALL], ids=["final", "call", "preamble"])
@pytest.mark.parametrize("batch", [1, 1000])
def test_stream_final_response_equals_create(client, engine, script, batch) -> None:
    engine.scripts, engine.batch = [script], batch
    request = dict(model=MODEL, input="Weather in Paris?", tools=TOOLS, temperature=0,
                   reasoning={"effort": "high", "summary": "detailed"}, metadata={"k": "v"})
    created = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _norm(final) == _norm(created)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type == "response.completed" and _norm(events[-1].response) == _norm(created)
    # What the deltas spell is what the items hold.
    for index, item in enumerate(created.output):
        deltas = "".join(e.delta for e in events if getattr(e, "output_index", None) == index and e.type in (
            "response.output_text.delta", "response.reasoning_text.delta", "response.function_call_arguments.delta"))
        text = item.arguments if item.type == "function_call" else item.content[0].text
        assert deltas == text
        if batch > 1:  # everything arrived at once: one delta event per item (two for a summarised reasoning)
            assert sum(e.type.endswith(".delta") and e.output_index == index for e in events) == (
                2 if item.type == "reasoning" else 1)
    if script is PREAMBLE_CALL:
        assert [(o.type, getattr(o, "phase", None)) for o in created.output] == [
            ("reasoning", None), ("message", "commentary"), ("function_call", None)]
        assert created.output[1].content[0].text == "Looking it up."


def test_event_sequence_is_the_documented_one(client, engine) -> None:
    engine.scripts = [TOOL_CALL]
    with client.responses.stream(model=MODEL, input="Weather?", tools=TOOLS,
                                 reasoning={"summary": "auto"}) as stream:
        kinds = [e.type for e in stream]
    reasoning = ["response.output_item.added", "response.content_part.added", "response.reasoning_summary_part.added"]
    reasoning += ["response.reasoning_text.delta", "response.reasoning_summary_text.delta"] * 4  # Need the weather .
    reasoning += ["response.reasoning_text.done", "response.content_part.done", "response.reasoning_summary_text.done",
                  "response.reasoning_summary_part.done", "response.output_item.done"]
    call = ["response.output_item.added"] + ["response.function_call_arguments.delta"] * len(_ids('{"city":"Paris"}'))
    call += ["response.function_call_arguments.done", "response.output_item.done"]
    assert kinds == ["response.created", "response.in_progress"] + reasoning + call + ["response.completed"]

    engine.scripts = [FINAL]
    with client.responses.stream(model=MODEL, input="hi") as stream:
        kinds = [e.type for e in stream]
    message = ["response.output_item.added", "response.content_part.added"]
    message += ["response.output_text.delta"] * len(_ids("It is 21 °C in Paris."))
    message += ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-len(message) - 1:] == message + ["response.completed"]


def test_output_text_logprobs(client, engine) -> None:
    engine.scripts = [FINAL]
    request = dict(model=MODEL, input="hi", include=["message.output_text.logprobs"], top_logprobs=2)
    created = client.responses.create(**request)
    reasoning, message = created.output
    final_tokens = _ids("It is 21 °C in Paris.")
    lps = message.content[0].logprobs  # the final answer's tokens only, not the analysis or the headers
    assert [lp.token for lp in lps] == [harmony.decode_tokens([t]) for t in final_tokens]
    assert [lp.logprob for lp in lps] == [-0.5] * len(final_tokens)
    assert [[(a.token, a.logprob) for a in lp.top_logprobs] for lp in lps] == [
        [(harmony.decode_tokens([t]), -0.5), (harmony.decode_tokens([t + 1]), -1.5)] for t in final_tokens]
    assert lps[0].bytes == list(lps[0].token.encode()) and created.top_logprobs == 2
    with client.responses.stream(**request) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert _norm(final) == _norm(created)
    assert [(lp.token, lp.logprob) for e in deltas for lp in e.logprobs] == [(lp.token, lp.logprob) for lp in lps]
    assert client.responses.create(model=MODEL, input="hi").output[1].content[0].logprobs == []


def test_max_output_tokens_makes_an_incomplete_response(client, engine, server) -> None:
    engine.scripts = [FINAL]
    resp = client.responses.create(model=MODEL, input="hi", max_output_tokens=5)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    (item,) = resp.output  # 3 header tokens, then "Tool", " said"
    assert (item.type, item.status, item.content[0].text) == ("reasoning", "incomplete", "Tool said")
    assert resp.usage.output_tokens == 5 and resp.usage.output_tokens_details.reasoning_tokens == 5
    with client.responses.stream(model=MODEL, input="hi", max_output_tokens=5) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and _norm(events[-1].response) == _norm(resp)
    # Its partial output continues with previous_response_id.
    client.responses.create(model=MODEL, input="go on", previous_response_id=resp.id)
    assert engine.prompts[-1] == _render(_system(), _user("hi"), _assistant("Tool said", "analysis"), _user("go on"))


# ---- input shapes ----------------------------------------------------------------------------------


def test_every_input_item_renders_as_harmony(client, engine) -> None:
    engine.scripts = [FINAL]
    client.responses.create(model=MODEL, tools=TOOLS, instructions="Answer in French.", input=[
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "message", "role": "assistant", "phase": "commentary",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Summed up."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": '{"temp_c": 21}'},
        {"type": "reasoning", "summary": [], "encrypted_content": seal("Sealed thought.")},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "21 °C."}]},
        {"role": "developer", "content": "Use metric units."},
        {"role": "user", "content": "Thanks"},
    ])
    # system/developer items join the instructions (harmony spec 10.1); the last assistant message is final, so
    # harmony drops the analysis before it.
    assert engine.prompts[-1] == _render(
        _system(), _developer("Answer in French.\n\nBe brief.\n\nUse metric units.", tools=True),
        _user("Weather in Paris?"), _assistant("Checking.", "commentary"), _call(), _result('{"temp_c": 21}'),
        _assistant("21 °C.", "final"), _user("Thanks"))

    # While the tool loop runs (no final answer yet) every analysis item stays, in order.
    client.responses.create(model=MODEL, tools=TOOLS, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "reasoning", "summary": [], "encrypted_content": seal("Sealed thought.")},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": '{"temp_c": 21}'},
    ])
    assert engine.prompts[-1] == _render(
        _system(), _developer(tools=True), _user("Weather in Paris?"), _assistant("Look.", "analysis"),
        _assistant("Sealed thought.", "analysis"), _call(), _result('{"temp_c": 21}'))


def test_encrypted_reasoning_round_trips_without_the_store(client, engine) -> None:
    engine.scripts = [TOOL_CALL, FINAL]
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, store=False,
                                    include=["reasoning.encrypted_content"])
    reasoning, call = first.output
    assert reasoning.encrypted_content and "Need the weather." not in reasoning.encrypted_content
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id" and err.value.body["code"] == "previous_response_not_found"
    sealed = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    client.responses.create(model=MODEL, tools=TOOLS, input=[
        {"role": "user", "content": "Weather in Paris?"}, sealed, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "21"}])
    assert engine.prompts[-1] == _render(_system(), _developer(tools=True), _user("Weather in Paris?"),
                                         _assistant("Need the weather.", "analysis"), _call(), _result("21"))


def test_engine_failure_mid_stream_is_response_failed(client, engine) -> None:
    def failing(prompt):
        yield from TOOL_CALL[:6]
        raise RuntimeError("decode worker died")

    engine.scripts = [failing]
    with client.responses.stream(model=MODEL, input="hi") as stream:
        events = list(stream)
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error.code == "server_error" and "decode worker died" in last.response.error.message
    (item,) = last.response.output  # what was written before the failure, closed as incomplete
    assert (item.type, item.status, item.content[0].text) == ("reasoning", "incomplete", "Need the weather")
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model=MODEL, input="hi")


def test_no_worker_is_a_503_before_the_stream_and_response_failed_after(client, engine) -> None:
    from kvrelay.router.engine_client import EngineUnavailable

    def gone(prompt):
        raise EngineUnavailable("every decode worker is gone", retry_after_s=3)
        yield

    def gone_later(prompt):
        yield from TOOL_CALL[:4]
        raise EngineUnavailable("every decode worker is gone", retry_after_s=3)

    for stream in (False, True):
        engine.scripts = [gone]
        with pytest.raises(openai.InternalServerError) as err:
            if stream:
                with client.responses.stream(model=MODEL, input="hi") as s:
                    list(s)
            else:
                client.responses.create(model=MODEL, input="hi")
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "3"
    engine.scripts = [gone_later]
    with client.responses.stream(model=MODEL, input="hi") as s:
        last = list(s)[-1]
    assert last.type == "response.failed" and last.response.error.code == "service_unavailable"


def test_client_going_away_aborts_the_engine_request(client, engine) -> None:
    engine.scripts, engine.token_delay_s = [FINAL * 50], 0.01
    try:
        with client.responses.stream(model=MODEL, input="hi") as stream:
            response_id = next(iter(stream)).response.id
        deadline = time.monotonic() + 10
        while response_id not in engine.aborted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert response_id in engine.aborted
    finally:
        engine.token_delay_s = 0.0
    with pytest.raises(openai.BadRequestError):  # an aborted response is not stored
        client.responses.create(model=MODEL, input="x", previous_response_id=response_id)


# ---- the store -------------------------------------------------------------------------------------


def test_retrieve_and_delete_stored_responses(client, engine, server) -> None:
    engine.scripts = [FINAL]
    resp = client.responses.create(model=MODEL, input="hi")
    assert _norm(client.responses.retrieve(resp.id)) == _norm(resp)
    client.responses.delete(resp.id)
    for call in (lambda: client.responses.retrieve(resp.id), lambda: client.responses.delete(resp.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    r = _post(server, {"model": MODEL, "input": "x", "previous_response_id": resp.id})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.get(f"{server.http_url}/v1/responses/{resp.id}?stream=true")
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_input_items_of_a_stored_response(client, engine, server) -> None:
    engine.scripts = [FINAL]
    resp = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}", "id": "fc_given"},
        {"type": "function_call_output", "call_id": "c1", "output": "21"},
        {"role": "assistant", "content": "21 °C."}, {"role": "user", "content": "Thanks"}])
    items = list(client.responses.input_items.list(resp.id, order="asc", limit=2))  # the SDK pages by `after`
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"), ("function_call", None), ("function_call_output", None), ("message", "assistant"),
        ("message", "user")]
    assert items[0].content[0].type == "input_text" and items[0].content[0].text == "Weather in Paris?"
    assert items[3].content[0].type == "output_text" and items[1].id == "fc_given"
    assert len({i.id for i in items}) == 5
    newest = client.responses.input_items.list(resp.id)  # desc, as OpenAI's default
    assert [i.id for i in newest.data] == [i.id for i in reversed(items)] and newest.has_more is False
    r = httpx.get(f"{server.http_url}/v1/responses/{resp.id}/input_items?limit=0")
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_missing")


def test_store_bounds_entries_characters_and_age() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=3, max_chars=200, ttl_s=10, clock=lambda: now[0])
    msg = (ChatMessage("user", "x" * 10),)
    for i in range(4):
        store.put(f"r{i}", msg, {"id": f"r{i}"})
    assert len(store) == 3 and store.get("r0") is None and store.get("r3") is not None  # the oldest went first
    store.put("big", (ChatMessage("user", "y" * 80),), {})
    assert store.get("big") is not None and store.get("r1") is None and len(store) == 3  # (80 + 10 + 10) x 2 <= 200
    store.put("huge", (ChatMessage("user", "z" * 101),), {})
    assert store.get("huge") is None and len(store) == 3  # 2 x 101 > 200: larger than the whole store, not kept
    now[0] = 9.9
    assert store.get("r3") is not None
    now[0] = 10.0
    assert store.get("r3") is None and len(store) == 0
    with pytest.raises(ValueError):
        ResponseStore(ttl_s=0)
