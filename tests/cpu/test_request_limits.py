"""Limits on what one request may carry, on a real router on 127.0.0.1: the HTTP body (413 before it is
parsed, declared or not), and tools per chat (400 / INVALID_ARGUMENT naming `tools`)."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from kvrelay.router import limits
from kvrelay.router.client import RouterClient
from kvrelay.router.types import ChatMessage, ToolSpec
from kvrelay.router.validation import MAX_TOOLS

from scripted_router import scripted_router_fixtures


engine, srv = scripted_router_fixtures([[200002]], model_name="gpt-oss-limits", max_context=4096, server_name="srv")


def _too_large(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "body" and err["message"] == f"body: larger than {limits.MAX_BODY_BYTES} bytes"


def test_a_body_over_the_limit_is_refused_before_it_is_read(srv):
    big = json.dumps({"prompt": "a " * (limits.MAX_BODY_BYTES // 2 + 10), "max_tokens": 1}).encode()
    _too_large(httpx.post(f"{srv.http_url}/v1/completions", content=big,
                          headers={"content-type": "application/json"}, timeout=60))


def test_a_chunked_body_that_grows_past_the_limit(srv):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(limits.MAX_BODY_BYTES // (1 << 20) + 1):
            yield b"a " * (1 << 19)
        yield b'", "max_tokens": 1}'

    _too_large(httpx.post(f"{srv.http_url}/v1/completions", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=60))
    # The router keeps serving.
    assert httpx.post(f"{srv.http_url}/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 200


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(n)]


def test_at_most_128_tools(srv):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tools": _tools(MAX_TOOLS + 1)}
    r = httpx.post(f"{srv.http_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert f"at most {MAX_TOOLS} tools" in r.json()["error"]["message"]
    body["tools"] = _tools(MAX_TOOLS)
    assert httpx.post(f"{srv.http_url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    with RouterClient(srv.grpc_target, timeout_s=30) as c, pytest.raises(grpc.RpcError) as e:
        list(c.chat([ChatMessage(role="user", content="hi")],
                    tools=[ToolSpec(name=f"f{i}", parameters_json='{"type": "object"}') for i in range(MAX_TOOLS + 1)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("tools: ")
