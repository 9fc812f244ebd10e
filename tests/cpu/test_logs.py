"""JSON log lines (workers/logs.py) and the request id they carry: the router assigns it, the engine gets it,
the HTTP response returns it as `id`."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest

from kvrelay.router.scripted_engine import ScriptedEngineClient
from kvrelay.router.server import BackgroundRouter
from kvrelay.workers import logs


def test_json_formatter_carries_the_request_fields():
    rec = logging.LogRecord("kvrelay.requests", logging.INFO, __file__, 1, "prefilled %d tokens", (7,), None)
    for key, value in logs.request_extra("cmpl-abc#retry1", "prefill-0").items():
        setattr(rec, key, value)
    out = json.loads(logs.JsonFormatter().format(rec))
    assert out["message"] == "prefilled 7 tokens" and out["level"] == "INFO" and out["logger"] == "kvrelay.requests"
    assert (out["request_id"], out["attempt"], out["worker"]) == ("cmpl-abc", "cmpl-abc#retry1", "prefill-0")
    assert out["ts"].endswith("Z") and isinstance(out["pid"], int)
    assert "attempt" not in logs.request_extra("cmpl-abc")


def test_json_lines_wraps_what_is_not_json_and_passes_what_is():
    raw = io.StringIO()
    stream = logs.JsonLines(raw)
    stream.write('{"level": "INFO", "message": "already"}\n\x1b[36m(raylet)\x1b[0m plain text\npartial')
    assert raw.getvalue().count("\n") == 2  # the unterminated line waits for its end
    stream.write(" line\n\n")
    lines = [json.loads(ln) for ln in raw.getvalue().splitlines()]
    assert lines[0] == {"level": "INFO", "message": "already"}
    assert lines[1]["message"] == "(raylet) plain text" and lines[1]["logger"] == "stderr"
    assert lines[2]["message"] == "partial line" and len(lines) == 3


def test_configure_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="log format 'xml'"):
        logs.configure("xml")


@pytest.fixture(scope="module")
def router():
    engine = ScriptedEngineClient([[1, 2, 3]], model_name="gpt-oss-logs", max_context=4096)
    with BackgroundRouter(engine) as srv:
        yield srv, engine


def test_the_response_id_is_the_engine_request_id(router):
    srv, engine = router
    r = httpx.post(f"{srv.http_url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
    rid = r.json()["id"]
    assert rid.startswith("cmpl-") and engine.finished[-1] == rid
    r = httpx.post(f"{srv.http_url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "n": 2}, timeout=30)
    rid = r.json()["id"]
    assert sorted(engine.finished[-2:]) == [f"{rid}-0", f"{rid}-1"]
    r = httpx.post(f"{srv.http_url}/v1/completions", json={"prompt": [5], "max_tokens": 1, "request_id": "mine-1"},
                   timeout=30)
    assert r.json()["id"] == "mine-1" and engine.finished[-1] == "mine-1"
    r = httpx.post(f"{srv.http_url}/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["id"].startswith("chatcmpl-") and engine.finished[-1] == r.json()["id"]
