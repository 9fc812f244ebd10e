"""Liveness vs readiness on HTTP and gRPC (the standard grpc.health.v1 service, as grpc_health_probe and
Kubernetes call it), and the vLLM-named Prometheus metrics: request latencies, finish reasons, errors
by front-end and code, and the gauges read from the workers at scrape time. A real router on 127.0.0.1
over the scripted engine client."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.router.auth import ApiKeys
from kvrelay.router.client import RouterClient
from kvrelay.router.scripted_engine import ScriptedEngineClient
from kvrelay.router.server import BackgroundRouter
from kvrelay.router.types import SamplingOptions
from waiting import wait_for

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Engine(ScriptedEngineClient):
    """The scripted engine with the cluster client's health and gauge hooks, set by each test."""

    dead: list = []
    draining: bool = False
    gauge_values: dict | None = None
    gauge_delay_s: float = 0.0

    def dead_workers(self):
        return self.dead

    async def gauges(self) -> dict:
        await asyncio.sleep(self.gauge_delay_s)
        return self.gauge_values or {}


@pytest.fixture()
def served():
    engine = Engine([range(1000, 1010)], model_name="gpt-oss-test", max_context=4096, token_delay_s=0.002)
    with BackgroundRouter(engine, api_keys=ApiKeys(["sk-probe"])) as srv:
        yield srv, engine


def _check(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as ch:  # no API key: probes are open
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_live_and_ready_on_http_and_grpc(served):
    srv, engine = served
    base, target = srv.http_url, srv.grpc_target
    assert httpx.get(f"{base}/health/ready").json() == {"status": "ready", "model": "gpt-oss-test"}
    assert _check(target, "") == SERVING and _check(target, "kvrelay.v1.Router") == SERVING
    with RouterClient(target, timeout_s=10) as c:
        assert c.health().serving

    engine.dead = [("decode", 1)]
    r = httpx.get(f"{base}/health/ready")
    assert r.status_code == 503 and r.json() == {"status": "not ready", "dead_workers": ["decode 1"]}
    assert _check(target, "kvrelay.v1.Router") == NOT_SERVING
    assert _check(target, "") == SERVING and httpx.get(f"{base}/health/live").status_code == 200
    with RouterClient(target, timeout_s=10) as c:
        assert not c.health().serving

    engine.dead, engine.draining = [], True  # shutting down: still live, no longer ready
    r = httpx.get(f"{base}/health/ready")
    assert r.status_code == 503 and r.json() == {"status": "not ready", "draining": True}
    assert _check(target, "kvrelay.v1.Router") == NOT_SERVING and _check(target, "") == SERVING
    with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_watch_sees_readiness_change(served):
    srv, engine = served
    with grpc.insecure_channel(srv.grpc_target) as ch:
        stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="kvrelay.v1.Router"),
                                                      timeout=10)
        assert next(stream).status == SERVING
        t0 = time.monotonic()
        engine.dead = [("prefill", 0)]
        assert next(stream).status == NOT_SERVING and time.monotonic() - t0 < 3
        stream.cancel()


def _value(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_request_latencies_and_finish_reasons(served):
    srv, _ = served
    names = ("kvrelay_time_to_first_token_seconds_count", "kvrelay_inter_token_latency_seconds_count",
             "kvrelay_e2e_request_latency_seconds_count", "kvrelay_generation_tokens_total")
    before = {n: _value(n) for n in names}
    length = _value("kvrelay_request_success_total", {"finished_reason": "length"})
    r = httpx.post(f"{srv.http_url}/v1/completions", headers={"Authorization": "Bearer sk-probe"},
                   json={"prompt": [5, 6, 7], "max_tokens": 6, "stream": True}, timeout=30)
    assert r.status_code == 200
    delta = {n: _value(n) - before[n] for n in names}
    assert delta == {names[0]: 1, names[1]: 5, names[2]: 1, names[3]: 6}, delta
    assert _value("kvrelay_request_success_total", {"finished_reason": "length"}) - length == 1
    # 6 tokens 2 ms apart: every gap is counted in its bucket, none above a second.
    assert _value("kvrelay_inter_token_latency_seconds_sum") > 0
    assert _value("kvrelay_num_requests_running") == 0


def test_errors_counted_by_front_end_and_code(served):
    srv, _ = served
    labels = [("http", "400"), ("http", "401"), ("http", "404"), ("grpc", "INVALID_ARGUMENT"),
              ("grpc", "UNAUTHENTICATED")]
    before = {k: _value("kvrelay_request_errors_total", {"api": k[0], "code": k[1]}) for k in labels}
    auth = {"Authorization": "Bearer sk-probe"}
    assert httpx.post(f"{srv.http_url}/v1/completions", json={"prompt": [5], "max_tokens": -1},
                      headers=auth).status_code == 400
    assert httpx.post(f"{srv.http_url}/v1/completions", json={"prompt": [5]}).status_code == 401
    assert httpx.get(f"{srv.http_url}/v1/nothing-here", headers=auth).status_code == 404
    with RouterClient(srv.grpc_target, timeout_s=10, api_key="sk-probe") as c:
        with pytest.raises(grpc.RpcError):
            list(c.generate([5], SamplingOptions(max_tokens=-1)))
    with RouterClient(srv.grpc_target, timeout_s=10) as anonymous, pytest.raises(grpc.RpcError):
        list(anonymous.generate([5], SamplingOptions(max_tokens=1)))
    # A gRPC error is counted in the server handler's `finally`, which may run after the client already holds
    # the status (seen once under CI load: UNAUTHENTICATED still 0 here), so the counts get a bounded wait.
    def counted() -> dict:
        return {k: _value("kvrelay_request_errors_total", {"api": k[0], "code": k[1]}) - before[k] for k in labels}

    wait_for(lambda: counted() == {k: 1 for k in labels})
    assert counted() == {k: 1 for k in labels}


def _scrape(base: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_worker_gauges_are_read_at_scrape_time(served):
    srv, engine = served
    engine.gauge_values = {"waiting": 7, "kv_cache_usage": {"decode-0": 0.25, "decode-1": 0.5}}
    got = _scrape(srv.http_url)
    assert got[("kvrelay_num_requests_waiting", ())] == 7
    assert got[("kvrelay_kv_cache_usage_perc", (("worker", "decode-0"),))] == 0.25
    assert got[("kvrelay_kv_cache_usage_perc", (("worker", "decode-1"),))] == 0.5
    # A worker that does not answer does not hang the scrape: the last values stay.
    engine.gauge_values, engine.gauge_delay_s = {"waiting": 9}, 30.0
    t0 = time.monotonic()
    got = _scrape(srv.http_url)
    assert time.monotonic() - t0 < 5 and got[("kvrelay_num_requests_waiting", ())] == 7


def test_a_stream_that_fails_after_its_headers_is_counted():
    """An engine failure mid-stream goes out in-band (the status was already 200): counted as code "stream"."""
    def script(prompt):
        yield 1000
        raise RuntimeError("engine fell over")

    with BackgroundRouter(ScriptedEngineClient([script], model_name="gpt-oss-test")) as srv:
        before = _value("kvrelay_request_errors_total", {"api": "http", "code": "stream"})
        r = httpx.post(f"{srv.http_url}/v1/completions", json={"prompt": [5], "max_tokens": 4, "stream": True},
                       timeout=30)
        assert r.status_code == 200 and '"server_error"' in r.text
        assert _value("kvrelay_request_errors_total", {"api": "http", "code": "stream"}) - before == 1
