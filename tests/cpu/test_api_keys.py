"""API keys on both front-ends (the real HTTP and gRPC servers on 127.0.0.1, a scripted engine): the
official openai client and our gRPC client with and without a key, open probes, key sources."""

from __future__ import annotations


import grpc
import httpx
import openai
import pytest

from kvrelay.router import harmony
from kvrelay.router.auth import ApiKeyError, ApiKeys, resolve_api_keys
from kvrelay.router.client import RouterClient

from scripted_router import scripted_router_fixtures

MODEL = "gpt-oss-test"
REPLY = harmony.load_encoding().encode("<|channel|>final<|message|>Hi there.<|return|>", allowed_special="all")


engine, server = scripted_router_fixtures([REPLY], model_name=MODEL, max_context=4096,
                                          router={"api_keys": ApiKeys(["sk-one", "sk-two"])})


def _chat(server, key: str):
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=key, max_retries=0, timeout=30) as c:
        return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8)


def test_http_needs_a_configured_bearer_key(server) -> None:
    for key in ("sk-one", "sk-two"):
        assert _chat(server, key).choices[0].message.content == "Hi there."
    with pytest.raises(openai.AuthenticationError) as e:
        _chat(server, "sk-wrong")
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.post(f"{server.http_url}/v1/completions", json={"model": MODEL, "prompt": "x"})  # no header
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.http_url}/v1/models", headers={"Authorization": "Basic c2stb25l"}).status_code == 401
    # Probes and scrapers stay open.
    for path in ("/health", "/metrics"):
        assert httpx.get(f"{server.http_url}{path}").status_code == 200, path


def test_grpc_needs_the_key_in_metadata_except_health(server) -> None:
    with RouterClient(server.grpc_target, timeout_s=30) as anonymous:
        assert anonymous.health() is not None  # open, like /health
        with pytest.raises(grpc.RpcError) as e:
            anonymous.list_models()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(anonymous.generate([1, 2, 3]))  # a streaming method is refused the same way
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
    with RouterClient(server.grpc_target, timeout_s=30, api_key="sk-two") as c:
        assert [m.id for m in c.list_models()] == [MODEL]
        assert list(c.generate([1, 2, 3]))
    with RouterClient(server.grpc_target, timeout_s=30, api_key="sk-nope") as c:
        with pytest.raises(grpc.RpcError) as e:
            c.list_models()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_key_sources() -> None:
    keys = resolve_api_keys(["a"], "KVRELAY_TEST_KEYS", {"KVRELAY_TEST_KEYS": " b, c ,,"})
    assert len(keys) == 3 and keys.allows("Bearer c") and keys.allows("bearer a") and not keys.allows("Bearer d")
    assert not keys.allows(None) and not keys.allows("c")
    with pytest.raises(ApiKeyError, match="router.api_keys_env names KVRELAY_TEST_KEYS, which is not set"):
        resolve_api_keys([], "KVRELAY_TEST_KEYS", {}, source="t.yaml")
    none = resolve_api_keys(None, None, {})
    assert not none and none.allows(None)  # no key configured: open, as before
