"""The OpenAI-compatible HTTP API, driven by the official `openai` client against a scripted engine
(random weights never produce a harmony tool call)."""

from __future__ import annotations

import itertools
import json
import time

import httpx
import openai
import pytest

from kvrelay.router import harmony

from responses_helpers import DATE, FINAL, MODEL, TOOL_CALL, _ids  # the scripted harmony turns both APIs use
from scripted_router import reset, scripted_router_fixtures

TOOLS = [{"type": "function", "function": {  # the chat API's tool form (the Responses API's is flat)
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_HISTORY_TAIL = (
    "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
    '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp_c": 21}<|end|>'
    "<|start|>assistant"
)


engine, server = scripted_router_fixtures([FINAL], model_name=MODEL, max_context=4096, router={"today": lambda: DATE})


@pytest.fixture()
def client(server, engine):
    reset(engine)
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def _extra(obj, name: str):
    return (obj.model_extra or {}).get(name)


def test_models_and_health(client, server) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{server.http_url}/health").json() == {"status": "ok", "model": MODEL}


def test_metrics_endpoint_serves_prometheus_text(server) -> None:
    from prometheus_client import Counter

    probe = Counter("kvrelay_test_probe", "a counter only this test increments")
    probe.inc(3)
    r = httpx.get(f"{server.http_url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "kvrelay_test_probe_total 3.0" in r.text


def test_tool_call_round_trip_non_streamed(client, engine) -> None:
    engine.scripts = [TOOL_CALL, FINAL]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", '{"city":"Paris"}')
    assert call.id.startswith("call_")
    assert choice.message.content is None
    assert _extra(choice.message, "reasoning_content") == _extra(choice.message, "reasoning") == "Need the weather."
    assert first.usage.completion_tokens == len(TOOL_CALL)
    assert first.usage.total_tokens == first.usage.prompt_tokens + len(TOOL_CALL)

    messages += [
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
         "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "It is 21 °C in Paris."
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None
    assert harmony.decode_tokens(engine.prompts[-1]).endswith(TOOL_HISTORY_TAIL)


def _add_tool_call_deltas(calls: dict, delta) -> None:
    """Assemble streamed tool calls by index, as a client does (id and name once, arguments in pieces)."""
    for tc in delta.tool_calls or ():
        entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
        entry["id"] = tc.id or entry["id"]
        entry["name"] = (tc.function.name if tc.function else None) or entry["name"]
        entry["arguments"] += (tc.function.arguments if tc.function else "") or ""


def test_tool_call_round_trip_streamed(client, engine) -> None:
    engine.scripts = [TOOL_CALL, FINAL]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True,
                                            stream_options={"include_usage": True})
    reasoning, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning += _extra(choice.delta, "reasoning") or ""
            _add_tool_call_deltas(calls, choice.delta)
            finish = choice.finish_reason or finish
    assert reasoning == "Need the weather."
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == '{"city":"Paris"}' and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert finish == "tool_calls"
    assert usage is not None and usage.completion_tokens == len(TOOL_CALL)

    messages += [
        {"role": "assistant", "content": "", "reasoning": reasoning, "tool_calls": [
            {"id": calls[0]["id"], "type": "function",
             "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temp_c": 21}'},
    ]
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True)
    content, reasoning2, finish = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning2 += _extra(choice.delta, "reasoning_content") or ""
            finish = choice.finish_reason or finish
    assert (content, reasoning2, finish) == ("It is 21 °C in Paris.", "Tool said 21.", "stop")
    assert harmony.decode_tokens(engine.prompts[-1]).endswith(TOOL_HISTORY_TAIL)


@pytest.mark.parametrize("batch", [2, 5, 1000])
def test_tokens_ready_together_share_a_chunk(client, engine, batch: int) -> None:
    """An engine that hands over several tokens at once (a router running behind) gets one chunk per
    hand-over, and what the client assembles is what it assembles from one chunk per token."""
    engine.batch = batch
    engine.scripts = [TOOL_CALL]
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                            tools=TOOLS, stream=True, logprobs=True)
    reasoning, calls, finish, lps, deltas = "", {}, None, 0, 0
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += _extra(choice.delta, "reasoning") or ""
            _add_tool_call_deltas(calls, choice.delta)
            lps += len(choice.logprobs.content) if choice.logprobs and choice.logprobs.content else 0
            deltas += bool(choice.logprobs and choice.logprobs.content)
            finish = choice.finish_reason or finish
    assert reasoning == "Need the weather." and finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert calls[0]["arguments"] == '{"city":"Paris"}'
    assert lps == len(TOOL_CALL)  # every token's logprob, however they are grouped
    assert deltas == -(-len(TOOL_CALL) // batch)

    words = _ids("one two three four five six seven")
    engine.scripts = [words]
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=7, stream=True, logprobs=1,
                                            extra_body={"return_token_ids": True}))
    sizes = [len(_extra(c.choices[0], "token_ids")) for c in chunks]
    assert sizes == [min(batch, 7 - i) for i in range(0, 7, batch)]
    assert "".join(c.choices[0].text for c in chunks) == "one two three four five six seven"
    assert [t for c in chunks for t in _extra(c.choices[0], "token_ids")] == words
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    text = "".join(harmony.decode_tokens([t]) for t in words)
    assert offsets == [len(harmony.decode_tokens(words[:i])) for i in range(7)] and len(text) > offsets[-1]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_length_finish_and_logprobs(client, engine) -> None:
    engine.scripts = [FINAL]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=5, logprobs=True, reasoning_effort="high")
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert _extra(choice.message, "reasoning") == "Tool said"  # 3 header tokens, then "Tool", " said"
    assert [lp.logprob for lp in choice.logprobs.content] == [-0.5] * 5
    assert "Reasoning: high" in harmony.decode_tokens(engine.prompts[-1])


def test_completions_text_prompt_and_token_ids(client, engine) -> None:
    engine.scripts = [_ids("Hello there, friend<|endoftext|>")]
    resp = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=20,
                                     extra_body={"return_token_ids": True, "stop_token_ids": [harmony.ENDOFTEXT]})
    choice = resp.choices[0]
    assert choice.text == "Hello there, friend"  # the stop token is not text
    assert choice.finish_reason == "stop"
    assert _extra(choice, "token_ids") == _ids("Hello there, friend<|endoftext|>")
    assert _extra(choice, "prompt_token_ids") == harmony.load_encoding().encode("Say hi")
    assert engine.prompts[-1] == harmony.load_encoding().encode("Say hi")
    assert resp.usage.prompt_tokens == len(engine.prompts[-1])


def test_completions_token_prompt_streamed(client, engine) -> None:
    engine.scripts = [_ids("one two three four")]
    stream = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, stream=True, logprobs=1,
                                       extra_body={"return_token_ids": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == "one two three"
    assert [tid for c in chunks for tid in _extra(c.choices[0], "token_ids")] == _ids("one two three")
    # vLLM's return_token_ids: streamed, the prompt's ids come once, in the first chunk.
    assert [_extra(c.choices[0], "prompt_token_ids") for c in chunks] == [[1, 2, 3]] + [None] * (len(chunks) - 1)
    assert len(chunks) > 1
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs] == [-0.5] * 3
    assert engine.prompts[-1] == [1, 2, 3]


def test_continuous_usage_stats_and_prompt_tokens_details(client, engine) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far; usage says how
    many prompt tokens were cached (none: there is no prefix cache yet)."""
    engine.scripts = [_ids("one two three four")]
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, stream=True,
                                            stream_options={"include_usage": True,
                                                            "continuous_usage_stats": True}))
    with_text = [c for c in chunks if c.choices]
    assert [c.usage.completion_tokens for c in with_text] == [1, 2, 3, 4]
    assert {c.usage.prompt_tokens for c in with_text} == {3}
    assert chunks[-1].usage.total_tokens == 7 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    engine.scripts = [FINAL]
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, stream_options={"continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == len(FINAL)
    resp = client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_batched_prompts_one_choice_each(client, engine) -> None:
    """A list of prompts (lm-eval's --batch_size): one choice per prompt in order, usage summed, the same
    text each prompt gets alone; streamed, the chunks of both arrive under their index, one [DONE]."""
    engine.scripts = [lambda prompt: _ids(f"echo {len(prompt)} tokens")]
    solo = {n: client.completions.create(model=MODEL, prompt=list(range(1, n + 1)), max_tokens=3).choices[0].text
            for n in (2, 3)}
    resp = client.completions.create(model=MODEL, prompt=[[1, 2], [1, 2, 3]], max_tokens=3,
                                     extra_body={"return_token_ids": True})
    assert [(c.index, c.text) for c in resp.choices] == [(0, solo[2]), (1, solo[3])]
    assert [_extra(c, "prompt_token_ids") for c in resp.choices] == [[1, 2], [1, 2, 3]]
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (5, 6)
    chunks = list(client.completions.create(model=MODEL, prompt=["Say hi", "Say hi there"], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True}))
    text = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.text
    n0, n1 = (len(harmony.load_encoding().encode(p)) for p in ("Say hi", "Say hi there"))
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=3).choices[0].text
             for p in ("Say hi", "Say hi there")]
    assert [text[0], text[1]] == alone and alone[0] != alone[1] and len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == n0 + n1
    assert chunks[-1].usage.completion_tokens == 6


def test_completions_default_max_tokens_is_16(client, engine) -> None:
    engine.scripts = [lambda prompt: itertools.repeat(1000)]
    resp = client.completions.create(model=MODEL, prompt=[1])
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"


def test_openai_client_sees_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=1.5)
    assert err.value.status_code == 400
    assert err.value.body["message"] == "top_p: must be in (0, 1], got 1.5"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_http_stream_disconnect_aborts_engine(server, engine, path: str) -> None:
    engine.aborted.clear()
    engine.scripts = [lambda prompt: itertools.cycle(_ids("<|channel|>final<|message|> more"))]
    engine.token_delay_s = 0.01
    body = {"model": MODEL, "stream": True, "request_id": f"http-{path}"}
    body.update({"messages": [{"role": "user", "content": "go"}]} if "chat" in path else {"prompt": [1],
                                                                                        "max_tokens": 4000})
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{server.http_url}{path}", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert any(line.startswith("data: ") for line in got)
        deadline = time.monotonic() + 5
        while f"http-{path}" not in engine.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert f"http-{path}" in engine.aborted
    finally:
        engine.token_delay_s = 0.0


def test_engine_failure_mid_stream_and_non_stream(server, engine) -> None:
    def boom(prompt):
        yield from _ids("<|channel|>final<|message|>partial")
        raise RuntimeError("device lost")

    engine.scripts = [boom]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    resp = httpx.post(f"{server.http_url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 500
    assert resp.json()["error"] == {"message": "internal error: device lost", "type": "server_error",
                                    "param": None, "code": None}
    resp = httpx.post(f"{server.http_url}/v1/chat/completions", json={**body, "stream": True}, timeout=30)
    events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["message"] == "internal error: device lost"
    assert events[-1] == "[DONE]"
    assert "partial" in "".join(events[:-2])


def _unavailable_after(n: int):
    from kvrelay.router.engine_client import EngineUnavailable

    def script(prompt):
        yield from FINAL[:n]
        raise EngineUnavailable("request x: no live decode worker within 1 s", retry_after_s=7)

    return script


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_engine_unavailable_is_503_before_the_stream_and_in_band_after(server, engine, path: str) -> None:
    """Workers gone past the resume bound: 503 + Retry-After (stream or not) while nothing was sent, an
    SSE error event once the stream has started; never a 500."""
    body = {"model": MODEL, **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                               else {"prompt": [1, 2], "max_tokens": 50})}
    engine.scripts = [_unavailable_after(0)]
    for stream in (False, True):
        resp = httpx.post(f"{server.http_url}{path}", json={**body, "stream": stream}, timeout=30)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "7", resp.text
        assert resp.json()["error"] == {"message": "request x: no live decode worker within 1 s",
                                        "type": "server_error", "param": None, "code": "service_unavailable"}
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        with pytest.raises(openai.APIStatusError) as err:
            c.completions.create(model=MODEL, prompt=[1, 2], max_tokens=5)
        assert err.value.status_code == 503
    engine.scripts = [_unavailable_after(12)]
    resp = httpx.post(f"{server.http_url}{path}", json={**body, "stream": True}, timeout=30)
    assert resp.status_code == 200
    events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "service_unavailable" and "no live decode worker" in err["message"]
    assert "retry after 7 s" in err["message"] and len(events) > 3
    engine.scripts = [FINAL]


UNSUPPORTED = [
    ("repetition_penalty", 0.0, 1.0, "repetition_penalty: must be a number > 0 (1 = off), got 0.0"),
    ("presence_penalty", 2.5, 0.5, "presence_penalty: must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -3.0, -1.0, "frequency_penalty: must be in [-2, 2], got -3.0"),
    ("min_p", 1.5, 0.1, "min_p: must be in [0, 1], got 1.5"),
    ("logit_bias", {"1000": -100}, {}, "logit_bias: not supported yet (only an empty map)"),
    ("guided_choice", ["a", "b"], None, "guided_choice: not supported (structured outputs take a JSON schema: "
     "response_format json_schema, guided_json or structured_outputs.json)"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("name,value,neutral,message", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_parameters_not_honoured_are_refused_by_name(server, engine, path, name, value, neutral, message) -> None:
    """No parameter is silently ignored: one we do not honour is a 400 naming it (its neutral value,
    what a client sends when it means nothing, passes); one we honour is checked, and a valid value
    reaches the engine."""
    engine.scripts = [_ids("<|channel|>final<|message|>ok<|return|>")]
    base = ({"messages": [{"role": "user", "content": "hi"}]} if path.endswith("chat/completions")
            else {"prompt": [1, 2, 3]})
    body = {"model": MODEL, "max_tokens": 4, **base, name: value}
    r = httpx.post(f"{server.http_url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == name and r.json()["error"]["message"] == message
    if neutral is not None:
        r = httpx.post(f"{server.http_url}{path}", json={**body, name: neutral}, timeout=30)
        assert r.status_code == 200, r.text
        if name in ("presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
            assert getattr(engine.params[-1], name) == neutral


def test_completion_only_parameters_refused_by_name(server, engine) -> None:
    engine.scripts = [_ids("ok")]
    for name, value, message in (("best_of", 2, "best_of: only best_of=1 is supported, got 2"),
                                 ("suffix", "tail", "suffix: suffix (insertion) is not supported by gpt-oss")):
        r = httpx.post(f"{server.http_url}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name
        assert r.json()["error"]["message"] == message


def test_top_logprobs_chat_and_completions(client, engine) -> None:
    """OpenAI's shapes: chat `logprobs.content[i].top_logprobs` entries, legacy completions
    `logprobs.top_logprobs[i]` as {text: logprob}; the scripted engine lists the sampled token first."""
    engine.scripts = [FINAL]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=6, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 3 for c in content)
    for c, token in zip(content, FINAL[:6]):
        assert c.top_logprobs[0].token == c.token == harmony.decode_tokens([token])
        assert [t.logprob for t in c.top_logprobs] == [-0.5, -1.5, -2.5]
        assert c.top_logprobs[1].token == harmony.decode_tokens([token + 1])

    words = _ids("one two three")
    engine.scripts = [words]
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3, logprobs=2, stream=stream)
        chunks = list(out) if stream else [out]
        tops = [d for c in chunks for d in (c.choices[0].logprobs.top_logprobs or [])]
        assert tops == [{harmony.decode_tokens([t]): -0.5, harmony.decode_tokens([t + 1]): -1.5} for t in words]
    plain = client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3, logprobs=0)
    assert plain.choices[0].logprobs.top_logprobs is None and plain.choices[0].logprobs.token_logprobs == [-0.5] * 3


def test_n_choices_for_completions_and_chat(client, engine) -> None:
    """n > 1: one engine request per choice (seeds seed, seed+1, ...; request ids -0, -1, ...), numbered
    prompt x n + copy; each prompt's tokens counted once in usage."""
    words = _ids("alpha beta gamma")
    engine.scripts = [words]
    engine.params.clear()
    resp = client.completions.create(model=MODEL, prompt=[[1, 2], [3, 4, 5]], max_tokens=3, n=2, seed=7,
                                     temperature=0.8)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert all(c.text == "alpha beta gamma" for c in resp.choices)
    assert sorted(p.seed for p in engine.params[-4:]) == [7, 7, 8, 8]
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (5, 12)

    engine.scripts = [FINAL]
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                            stream=True, stream_options={"include_usage": True})
    content, finish, usage = {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert content == {i: "It is 21 °C in Paris." for i in range(3)} and finish == {i: "stop" for i in range(3)}
    assert usage.completion_tokens == 3 * len(FINAL) and usage.prompt_tokens == len(engine.prompts[-1])
    one = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert [c.index for c in one.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError, match="n: must be in"):
        client.completions.create(model=MODEL, prompt=[1], max_tokens=1, n=17)
