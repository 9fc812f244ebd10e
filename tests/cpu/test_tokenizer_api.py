"""vLLM-compatible /tokenize, /detokenize and /tokenizer_info, checked against openai-harmony's own
encoding and rendering (what /v1/completions and /v1/chat/completions feed the model)."""

from __future__ import annotations


import httpx
import pytest

from kvrelay.router import harmony
from kvrelay.router.scripted_engine import ScriptedEngineClient
from kvrelay.router.server import BackgroundRouter

DATE = "2025-06-28"


@pytest.fixture(scope="module")
def server():
    engine = ScriptedEngineClient([[200002]], model_name="gpt-oss-test", max_context=4096)
    with BackgroundRouter(engine, today=lambda: DATE) as srv:
        yield srv, engine


@pytest.fixture(scope="module")
def url(server):
    srv, engine = server
    return srv.http_url, engine


def test_grpc_tokenize_and_detokenize_equal_the_http_endpoints(server):
    import grpc

    from kvrelay.router.client import RouterClient
    from kvrelay.router.types import ChatMessage, SamplingOptions

    srv, engine = server
    with RouterClient(srv.grpc_target, timeout_s=30) as c:
        text = c.tokenize("Hello, world!", return_token_strs=True)
        http = httpx.post(f"{srv.http_url}/tokenize", json={"prompt": "Hello, world!"}).json()
        assert list(text.tokens) == http["tokens"] and text.count == http["count"] and text.max_model_len == 4096
        assert "".join(text.token_strs) == "Hello, world!"
        chat = c.tokenize(messages=[ChatMessage("user", "What is 2+2?")])
        http = httpx.post(f"{srv.http_url}/tokenize",
                          json={"messages": [{"role": "user", "content": "What is 2+2?"}]}).json()
        assert list(chat.tokens) == http["tokens"]
        assert c.detokenize(list(text.tokens)) == "Hello, world!"
        for bad in (lambda: c.tokenize(), lambda: c.tokenize("x", messages=[ChatMessage("user", "y")]),
                    lambda: c.tokenize("a <|end|> b"), lambda: c.detokenize([1, 10**9])):
            with pytest.raises(grpc.RpcError) as e:
                bad()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # min_tokens over gRPC reaches the engine (as over HTTP).
        engine.params.clear()
        list(c.generate([1, 2, 3], SamplingOptions(max_tokens=4, min_tokens=2)))
        assert engine.params[-1].min_tokens == 2


def test_tokenize_text_is_what_completions_feed_the_model(url):
    base, engine = url
    r = httpx.post(f"{base}/tokenize", json={"model": "gpt-oss-test", "prompt": "Hello, world!",
                                             "return_token_strs": True})
    assert r.status_code == 200, r.text
    want = harmony.load_encoding().encode("Hello, world!", allowed_special=set())
    body = r.json()
    assert body["tokens"] == want and body["count"] == len(want) and body["max_model_len"] == 4096
    assert "".join(body["token_strs"]) == "Hello, world!"
    engine.prompts.clear()
    httpx.post(f"{base}/v1/completions", json={"prompt": "Hello, world!", "max_tokens": 1})
    assert list(engine.prompts[-1]) == want


def test_tokenize_chat_is_the_harmony_rendering(url):
    base, engine = url
    messages = [{"role": "user", "content": "What is 2+2?"}]
    r = httpx.post(f"{base}/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    engine.prompts.clear()
    httpx.post(f"{base}/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.json()["tokens"] == list(engine.prompts[-1])
    text = harmony.decode_tokens(r.json()["tokens"])
    assert text.endswith("<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant")


def test_detokenize_round_trips_and_bad_input_is_a_400(url):
    base, _ = url
    ids = harmony.load_encoding().encode("round trip", allowed_special=set())
    assert httpx.post(f"{base}/detokenize", json={"tokens": ids}).json() == {"prompt": "round trip"}
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [1, 10**9]})
    assert bad.status_code == 400 and "tokens[1]" in bad.text
    other = httpx.post(f"{base}/tokenize", json={"model": "nope", "prompt": "x"})
    assert other.status_code == 404
    special = httpx.post(f"{base}/tokenize", json={"prompt": "a <|end|> b"})
    assert special.status_code == 400 and "special token" in special.text


def test_tokenizer_info(url):
    base, _ = url
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert info["encoding"] == "o200k_harmony" and info["model_max_length"] == 4096
    assert 200002 in info["eos_token_ids"] and "<|start|>" in info["special_tokens"]


def test_health_probes_and_vllm_style_counters(url):
    base, _ = url
    assert httpx.get(f"{base}/health/live").json() == {"status": "live"}
    assert httpx.get(f"{base}/health/ready").json()["status"] == "ready"

    def sample(name: str) -> float:
        line = next(ln for ln in httpx.get(f"{base}/metrics").text.splitlines() if ln.startswith(name + " "))
        return float(line.split()[1])

    before = (sample("kvrelay_prompt_tokens_total"), sample("kvrelay_generation_tokens_total"))
    r = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert sample("kvrelay_prompt_tokens_total") - before[0] == 3
    assert sample("kvrelay_generation_tokens_total") - before[1] == r.json()["usage"]["completion_tokens"]
    assert sample("kvrelay_num_requests_running") == 0


def test_ready_probe_is_503_while_a_worker_is_dead():
    engine = ScriptedEngineClient([[200002]], model_name="gpt-oss-test", max_context=4096)
    engine.dead_workers = lambda: [("decode", 0)]
    with BackgroundRouter(engine, today=lambda: DATE) as srv:
        r = httpx.get(f"{srv.http_url}/health/ready")
        assert r.status_code == 503 and r.json() == {"status": "not ready", "dead_workers": ["decode 0"]}
        assert httpx.get(f"{srv.http_url}/health/live").status_code == 200


def test_invalid_json_is_named_as_such(url):
    base, _ = url
    r = httpx.post(f"{base}/v1/completions", content=b'{"prompt": [1, 2,, 3]}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert msg == "body: not valid JSON at character 17: Expecting value", msg
