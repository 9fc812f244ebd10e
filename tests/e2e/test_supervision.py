"""Supervision on the single-pair topology (one prefill + one decode worker, as configs/cpu-tiny.yaml):
a SIGKILLed worker is replaced in its placement group, `kvrelay status` shows it restarting then healthy,
and the requests in flight on it wait for the replacement and resume there by re-prefilling prompt +
tokens already sent, so every stream equals its undisturbed greedy run (no token missing or repeated), up to
bf16 rounding judged in float32 where the shapes differ (a re-prefill of tokens decoded one by one, batches
of other requests): greedy_judge.py.
After each test no KV page is left on any worker.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import pytest

from greedy_judge import assert_same_greedy
from kvrelay.engine.sampling import SamplingParams

from supervised_cluster import supervised_running
from test_cluster import assert_no_pages_left, prompt_of

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

TOPOLOGY = """
model: {name: tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 1, max_prompt_tokens: 1024}
decode: {workers: 1, max_batch: 32, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0, resume_timeout_s: 60}
device: cpu
"""


running = supervised_running(TOPOLOGY, check_every_s=0.5, health_timeout_s=5.0)


def many(reference, jobs: list[tuple[list[int], int]]) -> list[list[int]]:
    return reference.generate_many([p for p, _ in jobs], [SamplingParams(max_tokens=k, temperature=0) for _, k in jobs])


def undisturbed(url: str, reference, jobs: list[tuple[list[int], int]]) -> list[list[int]]:
    """The jobs' greedy outputs from the cluster with nothing killed, run together (seconds, where the
    single-process reference takes ~2 s a request on a loaded CI box); the first one's start is also
    checked against the single-process reference (test_cluster.py checks every stream against it)."""
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: completion(url, j[0], j[1], stream=False), jobs))
    assert all(o["status"] == 200 for o in outs), outs
    if reference is not None:  # greedy: the first 16 tokens are the 16-token run's (5x cheaper here)
        assert_same_greedy(outs[0]["tokens"][:16], many(reference, [(jobs[0][0], 16)])[0], jobs[0][0],
                           "undisturbed run 0 (batched) vs one process")
    return [o["tokens"] for o in outs]


def completion(url: str, prompt: list[int], max_tokens: int, *, stream: bool, progress: list | None = None) -> dict:
    """One greedy /v1/completions request: {"status", "tokens", "finish", "error"}; `progress` gets the
    streamed token count as it grows."""
    import httpx

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "return_token_ids": True}
    out = {"status": None, "tokens": [], "finish": None, "error": None, "retry_after": None}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        out["status"], out["retry_after"] = r.status_code, r.headers.get("retry-after")
        data = r.json()
        if r.status_code == 200:
            out["tokens"], out["finish"] = data["choices"][0]["token_ids"], data["choices"][0]["finish_reason"]
        else:
            out["error"] = data["error"]
        return out
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        out["status"], out["retry_after"] = r.status_code, r.headers.get("retry-after")
        if r.status_code != 200:  # refused before the stream started: a JSON error body
            out["error"] = json.loads(r.read())["error"]
            return out
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                out["error"] = data["error"]
                continue
            choice = data["choices"][0]
            out["tokens"] += choice["token_ids"]
            out["finish"] = choice["finish_reason"] or out["finish"]
            if progress is not None:
                progress.append(len(out["tokens"]))
    return out


def worker_row(run, role: str, timeout_s: float = 10.0) -> dict:
    """Its rank-0 row of `kvrelay status` (asking each worker for at most `timeout_s`)."""
    return next(r for r in run.cluster.statuses(timeout_s) if r["role"] == role and r["tp_rank"] == 0)


def kill_by_pid(run, role: str) -> int:
    """SIGKILL the worker's process, found as an operator finds it (`kvrelay status --json`'s pid)."""
    row = worker_row(run, role)
    os.kill(row["pid"], signal.SIGKILL)
    return row["pid"]


def wait_states(run, role: str, restarts: int, timeout_s: float = 90.0) -> list[str]:
    """The states `kvrelay status` shows for the worker until it is healthy again after `restarts`."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        row = worker_row(run, role)
        if not seen or seen[-1] != row["state"]:
            seen.append(row["state"])
        if row["state"] == "healthy" and row["restarts"] == restarts:
            return seen
        assert time.monotonic() < deadline, f"{role} worker not back after {timeout_s} s: {seen} {row}"
        time.sleep(0.1)


def _retries(cause: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("kvrelay_request_retries_total", {"cause": cause}) or 0.0


def _restarts(role: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("kvrelay_worker_restarts_total", {"role": role}) or 0.0


def test_killed_decode_worker_is_replaced_and_16_requests_resume(running, reference, errors_logged):
    """The original report: 16 greedy /v1/completions in flight (8 streamed, 8 not) on the one decode
    worker; its pid is SIGKILLed. All 16 finish, each equal to its undisturbed run."""
    from kvrelay.cluster.status import _table

    run, server = running
    jobs = [(prompt_of(20 + 3 * i, i), 80) for i in range(16)]
    want = undisturbed(server.http_url, reference, jobs)
    progress = [[] for _ in jobs]
    before = _retries("decode_died") + _retries("decode_unresponsive")
    restarts_before = _restarts("decode")
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futs = [pool.submit(completion, server.http_url, p, k, stream=i % 2 == 0, progress=progress[i])
                for i, (p, k) in enumerate(jobs)]
        deadline = time.monotonic() + 60
        while not (all(progress[i] for i in range(0, 16, 2)) and worker_row(run, "decode")["running"] == 16):
            assert time.monotonic() < deadline, "the 16 requests never ran together"
            assert not any(f.done() for f in futs), "a request finished before the kill: make them longer"
            time.sleep(0.02)
        old_pid = kill_by_pid(run, "decode")
        states = wait_states(run, "decode", restarts=1)
        results = [f.result(timeout=120) for f in futs]
    assert "restarting" in states and states[-1] == "healthy", states
    for i, ((p, _), res, w) in enumerate(zip(jobs, results, want)):
        assert res["status"] == 200 and res["error"] is None and res["finish"] == "length", (i, res)
        assert_same_greedy(res["tokens"], w, p, f"request {i}")
    assert time.monotonic() - t0 < 60
    # Each request was re-prefilled once, counted by cause in /metrics and against the worker in status.
    assert _retries("decode_died") + _retries("decode_unresponsive") == before + 16
    row = worker_row(run, "decode")
    assert row["pid"] != old_pid and row["restarts"] == 1
    assert sum(row["reprefills"].values()) == 16, row["reprefills"]
    table = _table(run.cluster.statuses())
    assert "re-prefills" in table and "decode_died" in table
    import httpx

    # The counters are this test process's, shared with the clusters of earlier tests: compare to before.
    metrics = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    assert f'kvrelay_worker_restarts_total{{role="decode"}} {restarts_before + 1:.1f}' in metrics
    assert errors_logged() == []
    assert_no_pages_left(run)


def test_killed_prefill_worker_is_replaced_and_its_requests_resume(running, monkeypatch):
    """The prefill worker is SIGKILLed while it prefills (20 ms after the first of 8 long prompts went to
    it, the others queued behind it): each prompt it held waits for the replacement and is prefilled
    there, counted as a prefill_died re-prefill; those already handed to decode go on untouched."""
    import threading

    run, server = running
    client = run.client
    jobs = [(prompt_of(300 + 40 * i, 50 + i), 30) for i in range(8)]
    want = undisturbed(server.http_url, None, jobs)
    pid = worker_row(run, "prefill")["pid"]
    real_pick = client._pick_prefill
    timers = []

    def pick_and_kill_soon(*args, **kwargs):  # whatever the routing policy passes (prompt block hashes)
        w = real_pick(*args, **kwargs)
        if not timers:  # the first prompt is on its way to the worker: kill it mid-prefill
            timers.append(threading.Timer(0.02, os.kill, (pid, signal.SIGKILL)))
            timers[0].start()
        return w

    monkeypatch.setattr(client, "_pick_prefill", pick_and_kill_soon)
    before = _retries("prefill_died")
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futs = [pool.submit(completion, server.http_url, p, k, stream=i % 2 == 1) for i, (p, k) in enumerate(jobs)]
        states = wait_states(run, "prefill", restarts=1)
        results = [f.result(timeout=120) for f in futs]
    assert "restarting" in states, states
    for i, ((p, _), res, w) in enumerate(zip(jobs, results, want)):
        assert res["status"] == 200, (i, res)
        assert_same_greedy(res["tokens"], w, p, f"request {i}")
    died = _retries("prefill_died") - before
    row = worker_row(run, "prefill")
    assert died >= 1 and row["reprefills"].get("prefill_died") == died, (died, row["reprefills"])
    assert row["restarts"] == 1 and row["pid"] != pid
    assert_no_pages_left(run)


def grpc_stream(target: str, prompt: list[int], max_tokens: int, progress: list) -> dict:
    import grpc

    from kvrelay.router.client import RouterClient
    from kvrelay.router.types import SamplingOptions

    out = {"tokens": [], "code": None, "details": None}
    with RouterClient(target, timeout_s=120) as c:
        try:
            for resp in c.generate(prompt, SamplingOptions(temperature=0.0, max_tokens=max_tokens)):
                out["tokens"] += resp.token_ids
                progress.append(len(out["tokens"]))
        except grpc.RpcError as e:
            out["code"], out["details"] = e.code(), e.details()
    return out


@pytest.fixture()
def errors_logged(caplog):
    """Records at ERROR or above (tracebacks: uvicorn's "Exception in ASGI application", the router's
    500 handler) logged while the test runs, uvicorn's own logger included (it does not propagate)."""
    import logging

    uvicorn_error = logging.getLogger("uvicorn.error")
    uvicorn_error.addHandler(caplog.handler)
    try:
        yield lambda: [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    finally:
        uvicorn_error.removeHandler(caplog.handler)


def test_past_the_resume_bound_requests_end_with_clear_errors(running, errors_logged):
    """The decode worker dies and its replacement takes longer than router.resume_timeout_s (0.5 s here):
    a started SSE stream ends with an in-band error event, a gRPC stream with UNAVAILABLE, a request whose
    response had not started (non-streamed, or arriving meanwhile) with 503 + Retry-After; no 500."""
    import grpc

    run, server = running
    restarts = worker_row(run, "decode")["restarts"]
    saved = run.client.resume_timeout_s
    run.client.resume_timeout_s = 0.5
    try:
        progress = [[] for _ in range(4)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            streams = [pool.submit(completion, server.http_url, prompt_of(30, 70 + i), 1500, stream=True,
                                   progress=progress[i]) for i in range(2)]
            rpcs = [pool.submit(grpc_stream, run.grpc_target, prompt_of(30, 80 + i), 1500, progress[2 + i])
                    for i in range(2)]
            plain = [pool.submit(completion, server.http_url, prompt_of(30, 90 + i), 1500, stream=False)
                     for i in range(2)]
            deadline = time.monotonic() + 60
            while not (all(progress) and worker_row(run, "decode")["running"] == 6):
                assert time.monotonic() < deadline, "the 6 requests never ran together"
                time.sleep(0.02)
            kill_by_pid(run, "decode")
            for f in streams:
                res = f.result(timeout=60)
                assert res["status"] == 200 and res["tokens"], res
                assert res["error"]["code"] == "service_unavailable", res["error"]
                assert "no live decode worker within 0.5 s" in res["error"]["message"]
            for f in rpcs:
                res = f.result(timeout=60)
                assert res["code"] == grpc.StatusCode.UNAVAILABLE and res["tokens"], res
                assert "no live decode worker within 0.5 s" in res["details"]
            for f in plain:
                res = f.result(timeout=60)
                assert res["status"] == 503 and int(res["retry_after"]) >= 1, res
                assert res["error"]["code"] == "service_unavailable"
            # While the replacement loads, a new request (streamed or not) is refused before it starts.
            if worker_row(run, "decode")["state"] != "healthy":
                res = completion(server.http_url, prompt_of(10, 99), 5, stream=True)
                assert res["status"] == 503 and res["retry_after"] and res["error"]["code"] == "service_unavailable"
        wait_states(run, "decode", restarts=restarts + 1)
    finally:
        run.client.resume_timeout_s = saved
    res = completion(server.http_url, prompt_of(10, 99), 5, stream=True)
    assert res["status"] == 200 and len(res["tokens"]) == 5 and res["error"] is None
    assert errors_logged() == []  # refused as designed: no traceback, no 500
    assert_no_pages_left(run)


def test_kv_pull_from_a_dead_prefill_worker_resumes_on_its_replacement(running, reference, monkeypatch):
    """The prefill worker dies after prefilling, before the decode worker has pulled (and confirmed) the
    KV: the pull fails, the request waits for the replacement prefill worker and is prefilled again
    there; the stream equals its undisturbed run, counted as a kv_transfer re-prefill."""
    run, server = running
    client = run.client
    restarts = worker_row(run, "prefill")["restarts"]
    pid = worker_row(run, "prefill")["pid"]
    real_start = client._start
    killed = []

    async def start_after_killing_prefill(decode, attempt_id, *args, **kwargs):
        if not killed:  # the first handoff: its KV sits in the prefill worker we now kill
            killed.append(attempt_id)
            os.kill(pid, signal.SIGKILL)
        return await real_start(decode, attempt_id, *args, **kwargs)

    monkeypatch.setattr(client, "_start", start_after_killing_prefill)
    prompt, k = prompt_of(200, 123), 40
    before = _retries("kv_transfer") + _retries("prefill_died")
    t0 = time.monotonic()
    res = completion(server.http_url, prompt, k, stream=True)
    assert res["status"] == 200 and res["error"] is None, res
    assert res["tokens"] == many(reference, [(prompt, k)])[0]
    assert time.monotonic() - t0 < 60 and killed
    assert _retries("kv_transfer") + _retries("prefill_died") == before + 1
    wait_states(run, "prefill", restarts=restarts + 1)
    assert_no_pages_left(run)


def test_hung_prefill_worker_during_the_pull_is_replaced_and_the_request_resumes(running, monkeypatch):
    """The prefill worker hangs (SIGSTOP) after prefilling, before it confirms the decode side's pull: the
    confirmation times out, the client's health call to it fails, the supervisor kills and replaces it
    (a stopped process answers no health check), and the request is prefilled again on the replacement;
    its stream equals the undisturbed run."""
    run, server = running
    client = run.client
    restarts = worker_row(run, "prefill")["restarts"]
    pid = worker_row(run, "prefill")["pid"]
    prompt, k = prompt_of(120, 321), 24
    want = completion(server.http_url, prompt, k, stream=False)["tokens"]
    real_start = client._start
    stopped = []

    async def start_after_stopping_prefill(decode, attempt_id, *args, **kwargs):
        if not stopped:
            stopped.append(attempt_id)
            os.kill(pid, signal.SIGSTOP)
        return await real_start(decode, attempt_id, *args, **kwargs)

    monkeypatch.setattr(client, "_start", start_after_stopping_prefill)
    before = _retries("kv_transfer") + _retries("prefill_died")
    t0 = time.monotonic()
    try:
        res = completion(server.http_url, prompt, k, stream=True)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # if it is still there, let it die normally
        except ProcessLookupError:
            pass
    assert res["status"] == 200 and res["error"] is None, res
    assert res["tokens"] == want and stopped
    assert time.monotonic() - t0 < 60
    assert _retries("kv_transfer") + _retries("prefill_died") == before + 1
    wait_states(run, "prefill", restarts=restarts + 1)
    assert worker_row(run, "prefill")["pid"] != pid
    assert_no_pages_left(run)
