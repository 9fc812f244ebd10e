"""/v1/completions echo, prompt logprobs and repetition_penalty over HTTP and gRPC, against the scripted
engine (its prompt logprobs are made up so every field's mapping is checked exactly), and the numbers
over the in-process engine against a float64 reference from Runner.score on the tiny model."""

from __future__ import annotations


import httpx
import openai
import pytest
import torch

from kvrelay.router import harmony
from kvrelay.router.client import RouterClient
from kvrelay.router.scripted_engine import made_up_prompt_logprobs
from kvrelay.router.server import BackgroundRouter
from kvrelay.router.types import SamplingOptions

from scripted_router import reset, scripted_router_fixtures

MODEL = "gpt-oss-test"
GEN = [3, 4, 5, 6]


def _ids(text: str) -> list[int]:
    return harmony.load_encoding().encode(text, allowed_special="all")


def _tok(t: int) -> str:
    return harmony.decode_tokens([t])


engine, server = scripted_router_fixtures([GEN], model_name=MODEL, max_context=4096)


@pytest.fixture()
def client(server, engine):
    reset(engine)
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def _expected_prompt_part(prompt: list[int], k: int):
    plp = made_up_prompt_logprobs(prompt, k)
    lps = [None] + list(plp.token_logprobs)
    tops = [None] + [{_tok(t): lp, **{_tok(a): v for a, v in alts if _tok(a) != _tok(t)}}
                     for t, lp, alts in zip(prompt[1:], plp.token_logprobs, plp.top)]
    offsets, at = [], 0
    for t in prompt:
        offsets.append(at)
        at += len(_tok(t))
    return lps, tops, offsets


def test_echo_with_logprobs_covers_prompt_then_completion(client, engine) -> None:
    text = "The quick brown fox"
    prompt = _ids(text)
    out = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=2, max_tokens=3, temperature=0)
    choice = out.choices[0]
    gen_text = "".join(_tok(t) for t in GEN[:3])
    assert choice.text == text + gen_text
    lp = choice.logprobs
    assert lp.tokens == [_tok(t) for t in prompt + GEN[:3]]
    want_lps, want_tops, want_offsets = _expected_prompt_part(prompt, 2)
    assert lp.token_logprobs == want_lps + [-0.5] * 3
    assert lp.top_logprobs[: len(prompt)] == want_tops
    # generated tokens: the token itself first, then the engine's most likely ones
    assert lp.top_logprobs[len(prompt):] == [{_tok(t): -0.5, _tok(t + 1): -1.5} for t in GEN[:3]]
    assert lp.text_offset[: len(prompt)] == want_offsets
    assert lp.text_offset[len(prompt):] == [len(text) + len(gen_text[:i]) for i in (0, 1, 2)]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 3)
    assert engine.params[-1].prompt_logprobs == 2 and engine.params[-1].top_logprobs == 2


def test_echo_max_tokens_0_scores_batched_prompts(client, engine) -> None:
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 0, a batch of token-id prompts."""
    prompts = [_ids("Paris is the capital of"), _ids("2 + 2 =")]
    out = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=0, temperature=0)
    assert len(out.choices) == 2
    for choice, prompt in zip(sorted(out.choices, key=lambda c: c.index), prompts):
        assert choice.text == harmony.decode_tokens(prompt)
        want_lps, want_tops, want_offsets = _expected_prompt_part(prompt, 1)
        assert choice.logprobs.tokens == [_tok(t) for t in prompt]
        assert choice.logprobs.token_logprobs == want_lps
        assert choice.logprobs.top_logprobs == want_tops and choice.logprobs.text_offset == want_offsets
        assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (sum(map(len, prompts)), 0)
    assert all(p.max_tokens == 1 and p.prompt_logprobs == 1 for p in engine.params[-2:])


def test_echo_streamed_equals_non_streamed(client) -> None:
    kw = dict(model=MODEL, prompt="Hello there, world", echo=True, logprobs=1, max_tokens=4, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].text.startswith("Hello there, world")
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        joined = [x for c in chunks if c.choices[0].logprobs for x in getattr(c.choices[0].logprobs, field)]
        assert joined == getattr(whole.logprobs, field), field


def test_echo_without_logprobs_and_vllm_prompt_logprobs(client, engine, server) -> None:
    out = client.completions.create(model=MODEL, prompt="abc def", echo=True, max_tokens=2)
    assert out.choices[0].text == "abc def" + _tok(GEN[0]) + _tok(GEN[1]) and out.choices[0].logprobs is None
    assert engine.params[-1].prompt_logprobs is None  # nothing to compute
    prompt = _ids("one two three")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    choice = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    plp = made_up_prompt_logprobs(prompt, 2)
    want = [None] + [{str(t): {"logprob": lp, "rank": r, "decoded_token": _tok(t)},
                      **{str(a): {"logprob": v, "rank": j + 1, "decoded_token": _tok(a)}
                         for j, (a, v) in enumerate(alts)}}
                     for t, lp, r, alts in zip(prompt[1:], plp.token_logprobs, plp.ranks, plp.top)]
    assert choice["prompt_logprobs"] == want
    assert choice["text"] == _tok(GEN[0]) and choice["logprobs"] is None


@pytest.mark.parametrize("body,message", [
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs: not available with stream"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs: must be in [0, 20]"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens: must be >= 1"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty: must be a number > 0"),
    ({"prompt": "x", "repetition_penalty": -1.5}, "repetition_penalty: must be a number > 0"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}, "prompt_logprobs: not supported for chat"),
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo: not supported for chat"),
])
def test_refused_by_name(server, body, message) -> None:
    route = "chat/completions" if "messages" in body else "completions"
    r = httpx.post(f"{server.http_url}/v1/{route}", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message), r.json()
    assert r.json()["error"]["param"] == message.split(":")[0]


def test_repetition_penalty_reaches_the_engine(client, engine, server) -> None:
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"repetition_penalty": 1.3})
    assert engine.params[-1].repetition_penalty == pytest.approx(1.3)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   extra_body={"repetition_penalty": 0.8})
    assert engine.params[-1].repetition_penalty == pytest.approx(0.8)
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert engine.params[-1].repetition_penalty == 1.0
    with RouterClient(server.grpc_target, timeout_s=30) as c:
        list(c.generate([1, 2, 3], SamplingOptions(max_tokens=2, repetition_penalty=1.7)))
        assert engine.params[-1].repetition_penalty == pytest.approx(1.7)
        with pytest.raises(Exception, match="repetition_penalty"):
            list(c.generate([1, 2, 3], SamplingOptions(max_tokens=2, repetition_penalty=-1.0)))


# ---- the numbers, from the in-process engine on the tiny model ---------------------------------------


@pytest.fixture(scope="module")
def tiny_server():
    from kvrelay.engine.llm import LLM
    from kvrelay.router.engine_client import InProcessEngineClient

    llm = LLM("tiny", dummy=True, seed=0, page_size=16, kv_tokens=4096)
    engine = InProcessEngineClient(llm, model_name=MODEL)
    with BackgroundRouter(engine) as srv:
        yield srv, llm
    engine.close()


def test_echo_logprobs_equal_a_float64_reference(tiny_server) -> None:
    srv, llm = tiny_server
    prompts = [[5, 17, 300, 42, 7, 17, 99], [11, 12, 13]]
    body = {"model": MODEL, "prompt": prompts, "echo": True, "logprobs": 3, "max_tokens": 0}
    out = httpx.post(f"{srv.http_url}/v1/completions", json=body, timeout=60).json()
    for choice in out["choices"]:
        prompt = prompts[choice["index"]]
        lp = torch.log_softmax(llm.runner.score(prompt).double(), dim=-1)
        want = [None] + [float(lp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
        got = choice["logprobs"]["token_logprobs"]
        assert got[0] is None and got[1:] == pytest.approx(want[1:], abs=2e-3)
        for i, top in enumerate(choice["logprobs"]["top_logprobs"][1:]):
            ids = torch.topk(lp[i], 3).indices.tolist()
            expect = {_tok(prompt[i + 1]): want[i + 1], **{_tok(t): float(lp[i, t]) for t in ids}}
            assert list(top) == list(expect) and list(top.values()) == pytest.approx(list(expect.values()), abs=2e-3)
