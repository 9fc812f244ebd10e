"""Stop strings end to end: a scripted engine emits known text token by token, and the router must cut
the text before the first stop string to complete, never stream part of one, report finish_reason
"stop", count the tokens up to and including the one that completed it, and abort the engine request
before the final chunk goes out. Completions and chat, streamed and not, HTTP and gRPC."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest

from kvrelay.router import harmony
from kvrelay.router.client import RouterClient, collect_chat
from kvrelay.router.scripted_engine import ScriptedEngineClient
from kvrelay.router.server import BackgroundRouter
from kvrelay.router.stop import StopStrings
from kvrelay.router.types import ChatMessage, SamplingOptions
from kvrelay.v1 import router_pb2 as pb
from kvrelay.v1 import router_pb2_grpc as pb_grpc

from scripted_router import reset, scripted_router_fixtures


DATE = "2025-06-28"
MODEL = "gpt-oss-test"
TEXT = "Hello world, this is a test."


def _ids(text: str) -> list[int]:
    return harmony.load_encoding().encode(text, allowed_special="all")


TEXT_IDS = _ids(TEXT)  # Hello | world | , | this | is | a | test | .
# The reasoning mentions "this" and "about": stop strings must only look at the content.
CHAT_HEAD = _ids("<|channel|>analysis<|message|>Thinking about this.<|end|><|start|>assistant<|channel|>final<|message|>")
CHAT_IDS = CHAT_HEAD + TEXT_IDS + [harmony.RETURN]
COMPLETION_IDS = TEXT_IDS + [harmony.ENDOFTEXT]


@dataclass(frozen=True)
class Case:
    name: str
    stop: tuple[str, ...]
    text: str  # the text the client must get
    tokens: int | None  # text tokens generated up to the one that completed the stop string; None: no match


CASES = [
    Case("inside_a_token", ("orl",), "Hello w", 2),
    Case("spanning_tokens", ("world, th",), "Hello ", 4),
    Case("at_the_start", ("Hel",), "", 1),
    Case("never_occurs", ("xyz",), TEXT, None),
    Case("prefix_at_the_end_flushed", ("a test. And",), TEXT, None),
    Case("several_first_completed_wins", ("is", "lo w", "test"), "Hel", 2),
    Case("same_token_shorter_end_wins", ("lo world", "wor"), "Hello ", 2),
]


def ids_of(case: Case) -> str:
    return case.name


engine, server = scripted_router_fixtures([COMPLETION_IDS], model_name=MODEL, max_context=4096,
                                          router={"today": lambda: DATE})


@pytest.fixture()
def oai(server, engine):
    reset(engine)
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def _expected_tokens(case: Case, chat: bool) -> int:
    if case.tokens is None:  # the engine ran to its own stop token
        return len(CHAT_IDS if chat else COMPLETION_IDS)
    return (len(CHAT_HEAD) if chat else 0) + case.tokens


def _check_abort(engine: ScriptedEngineClient, case: Case, rid: str) -> None:
    # Only a stop string the router acted on aborts; an engine that finished by itself is never aborted.
    assert (rid in engine.aborted) == (case.tokens is not None)


# ---- the matcher on its own -------------------------------------------------------------------------


def _reference(text: str, stops: list[str]) -> str:
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return text[: min(hits)[1]] if hits else text


def test_matcher_is_independent_of_chunking() -> None:
    """Random texts, stop strings and token splits: the streamed text is always a prefix of the final
    text (nothing is ever taken back) and the final text is the character-by-character answer."""
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        want = _reference(text, stops)
        m, sent, i = StopStrings(stops), "", 0
        while i < len(text):
            j = i + rng.randint(1, 4)
            sent += m.feed(text[i:j])
            assert want.startswith(sent), (text, stops, sent)
            i = j
        sent += m.flush()
        assert sent == want, (text, stops)
        assert (m.matched is not None) == any(s in text for s in stops)


def test_matcher_holds_back_only_possible_prefixes() -> None:
    m = StopStrings(["</end>"])
    assert m.feed("a <") == "a " and m.held == "<"
    assert m.feed("/e") == "" and m.held == "</e"
    assert m.feed("x") == "</ex" and m.held == ""
    assert m.feed("</end> tail") == "" and m.matched == "</end>"
    assert m.feed("more") == "" and m.flush() == ""


# ---- HTTP /v1/completions ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=ids_of)
def test_completions_non_streamed(oai, engine, case: Case) -> None:
    engine.scripts = [COMPLETION_IDS]
    rid = f"cmpl-{case.name}"
    resp = oai.completions.create(model=MODEL, prompt=[1, 2], max_tokens=50, stop=list(case.stop),
                                  extra_body={"return_token_ids": True, "stop_token_ids": [harmony.ENDOFTEXT],
                                              "request_id": rid})
    choice = resp.choices[0]
    n = _expected_tokens(case, chat=False)
    assert (choice.text, choice.finish_reason) == (case.text, "stop")
    assert choice.model_extra["token_ids"] == COMPLETION_IDS[:n]
    assert resp.usage.completion_tokens == n
    _check_abort(engine, case, rid)


@pytest.mark.parametrize("case", CASES, ids=ids_of)
def test_completions_streamed(oai, engine, case: Case) -> None:
    engine.scripts = [COMPLETION_IDS]
    rid = f"cmpl-stream-{case.name}"
    stream = oai.completions.create(model=MODEL, prompt=[1, 2], max_tokens=50, stop=list(case.stop), stream=True,
                                    stream_options={"include_usage": True},
                                    extra_body={"return_token_ids": True, "stop_token_ids": [harmony.ENDOFTEXT],
                                                "request_id": rid})
    pieces, token_ids, finish, usage, aborted_at_finish = [], [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            token_ids += choice.model_extra["token_ids"]
            if choice.finish_reason is not None:
                finish, aborted_at_finish = choice.finish_reason, rid in engine.aborted
    n = _expected_tokens(case, chat=False)
    assert ("".join(pieces), finish) == (case.text, "stop")
    assert token_ids == COMPLETION_IDS[:n] and usage.completion_tokens == n
    assert aborted_at_finish == (case.tokens is not None)  # aborted before the last chunk was written
    _check_abort(engine, case, rid)


def test_completions_stream_holds_back_a_possible_stop() -> None:
    """Chunk by chunk: " world" waits while "world, th" is still possible, "," too, then all is cut."""
    engine = ScriptedEngineClient([COMPLETION_IDS], model_name=MODEL)
    with BackgroundRouter(engine) as srv:
        body = {"prompt": [1], "stop": ["world, th"], "stream": True, "max_tokens": 50}
        resp = httpx.post(f"{srv.http_url}/v1/completions", json=body, timeout=30)
    texts = [json.loads(line[6:])["choices"][0]["text"]
             for line in resp.text.splitlines() if line.startswith("data: {")]
    assert texts == ["Hello", " ", "", ""]  # "world" held from the 2nd token on, dropped at the 4th


def test_completions_stop_on_the_last_allowed_token_and_offsets(oai, engine) -> None:
    """The engine's own "length" finish on the completing token: still "stop", and no abort is needed."""
    engine.scripts = [COMPLETION_IDS]
    resp = oai.completions.create(model=MODEL, prompt=[1], max_tokens=2, stop="orl", logprobs=1,
                                  extra_body={"request_id": "last-token"})
    choice = resp.choices[0]
    assert (choice.text, choice.finish_reason, resp.usage.completion_tokens) == ("Hello w", "stop", 2)
    assert choice.logprobs.text_offset == [0, 5]  # offsets of the tokens in the decoded text
    assert "last-token" not in engine.aborted


def test_completions_take_as_many_stop_strings_as_harnesses_send(oai, engine) -> None:
    """lm-eval tasks send 5-10 stop strings; the one that matches may be the last of them."""
    engine.scripts = [COMPLETION_IDS]
    stops = [f"never{i}" for i in range(9)] + ["orl"]
    resp = oai.completions.create(model=MODEL, prompt=[1], max_tokens=16, stop=stops)
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == ("Hello w", "stop")


def test_min_tokens_reaches_the_engine_and_defers_stop_strings(oai, engine) -> None:
    """vLLM's min_tokens: the engine masks its stop tokens for that many tokens, and the router matches stop
    strings only in the text after them ("orl" completes inside the 2nd token: ignored with min_tokens=2)."""
    engine.scripts = [COMPLETION_IDS]
    resp = oai.completions.create(model=MODEL, prompt=[1], max_tokens=4, stop="orl", extra_body={"min_tokens": 2})
    whole = harmony.load_encoding().decode(COMPLETION_IDS[:4])
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (whole, "length")
    assert engine.params[-1].min_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt=[1], max_tokens=4, extra_body={"min_tokens": 5})
    assert e.value.body["message"] == "min_tokens: must be in [0, max_tokens = 4], got 5"


# ---- HTTP /v1/chat/completions ----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=ids_of)
def test_chat_non_streamed(oai, engine, case: Case) -> None:
    engine.scripts = [CHAT_IDS]
    rid = f"chat-{case.name}"
    resp = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       stop=list(case.stop), extra_body={"request_id": rid})
    choice = resp.choices[0]
    assert (choice.message.content, choice.finish_reason) == (case.text, "stop")
    assert choice.message.model_extra["reasoning"] == "Thinking about this."  # reasoning is never cut
    assert resp.usage.completion_tokens == _expected_tokens(case, chat=True)
    _check_abort(engine, case, rid)


@pytest.mark.parametrize("case", CASES, ids=ids_of)
def test_chat_streamed(oai, engine, case: Case) -> None:
    engine.scripts = [CHAT_IDS]
    rid = f"chat-stream-{case.name}"
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         stop=list(case.stop), stream=True, stream_options={"include_usage": True},
                                         extra_body={"request_id": rid})
    content, reasoning, finish, usage, aborted_at_finish = [], [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            reasoning.append((choice.delta.model_extra or {}).get("reasoning") or "")
            if choice.finish_reason is not None:
                finish, aborted_at_finish = choice.finish_reason, rid in engine.aborted
    assert ("".join(content), finish) == (case.text, "stop")
    assert "".join(reasoning) == "Thinking about this."
    assert usage.completion_tokens == _expected_tokens(case, chat=True)
    assert aborted_at_finish == (case.tokens is not None)
    _check_abort(engine, case, rid)


def test_chat_stop_beats_tool_call(oai, engine) -> None:
    """A preamble's content completing a stop string ends the turn before the tool call it announces."""
    engine.scripts = [_ids("<|channel|>commentary<|message|>Let me check. DONE<|end|><|start|>assistant"
                           '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>')]
    resp = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stop=" DONE",
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    choice = resp.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("Let me check.", None, "stop")


# ---- gRPC -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=ids_of)
def test_grpc_generate(server, engine, case: Case) -> None:
    engine.scripts, rid = [COMPLETION_IDS], f"grpc-gen-{case.name}"
    engine.aborted.clear()
    with RouterClient(server.grpc_target, timeout_s=30) as c:
        out = list(c.generate([1, 2], SamplingOptions(stop=case.stop, stop_token_ids=(harmony.ENDOFTEXT,)),
                              request_id=rid))
    n = _expected_tokens(case, chat=False)
    assert [t for r in out for t in r.token_ids] == COMPLETION_IDS[:n]
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP and out[-1].usage.completion_tokens == n
    _check_abort(engine, case, rid)


@pytest.mark.parametrize("case", CASES, ids=ids_of)
def test_grpc_chat(server, engine, case: Case) -> None:
    engine.scripts, rid = [CHAT_IDS], f"grpc-chat-{case.name}"
    engine.aborted.clear()
    with RouterClient(server.grpc_target, timeout_s=30) as c:
        result = collect_chat(c.chat([ChatMessage("user", "hi")], sampling=SamplingOptions(stop=case.stop),
                                     request_id=rid))
    n = _expected_tokens(case, chat=True)
    assert (result.content, result.reasoning, result.finish_reason) == (case.text, "Thinking about this.", "stop")
    assert result.token_ids == CHAT_IDS[:n] and result.completion_tokens == n
    _check_abort(engine, case, rid)


# ---- validation ---------------------------------------------------------------------------------------

BAD = [
    ([f"s{i}" for i in range(65)], "stop: at most 64 stop strings are supported, got 65"),
    (["a", ""], "stop[1]: stop strings must not be empty"),
    (["a", "x" * 1025], "stop[1]: at most 1024 characters per stop string, got 1025"),
]


@pytest.mark.parametrize("stop,message", BAD)
def test_grpc_rejects(server, engine, stop: list[str], message: str) -> None:
    before = len(engine.prompts)
    sampling = pb.SamplingParams(stop=stop)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.RouterStub(channel)
        for call in (lambda: stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], sampling=sampling), timeout=30),
                     lambda: stub.Chat(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")],
                                                      sampling=sampling), timeout=30)):
            with pytest.raises(grpc.RpcError) as err:
                list(call())
            assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert len(engine.prompts) == before


@pytest.mark.parametrize("stop,message", BAD + [("", "stop: stop strings must not be empty")])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_http_rejects(server, engine, path: str, stop, message: str) -> None:
    before = len(engine.prompts)
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": [1]}
    resp = httpx.post(f"{server.http_url}{path}", json={**body, "stop": stop}, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"] == {"message": message, "type": "invalid_request_error",
                                    "param": message.split(":")[0], "code": None}
    assert len(engine.prompts) == before
