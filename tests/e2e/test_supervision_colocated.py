"""Supervision on the colocated CPU topology (one actor holds both roles, `colocate: true`): the SIGKILLed
worker is replaced, and the requests in flight on it resume on the replacement by re-prefilling prompt +
tokens already sent; every stream equals its undisturbed greedy run and no KV page is left behind."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from greedy_judge import assert_same_greedy
from supervised_cluster import supervised_running
from test_cluster import assert_no_pages_left, prompt_of
from test_supervision import completion, grpc_stream, kill_by_pid, undisturbed, wait_states, worker_row

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

TOPOLOGY = """
model: {name: tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 1, max_prompt_tokens: 1024, chunk_tokens: 64}
decode: {workers: 1, max_batch: 32, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0, resume_timeout_s: 60}
device: cpu
colocate: true
"""


running = supervised_running(TOPOLOGY, check_every_s=0.5)


def test_killed_colocated_worker_is_replaced_and_its_requests_resume(running, reference):
    run, server = running
    jobs = [(prompt_of(40 + 25 * i, 200 + i), 100) for i in range(8)]
    want = undisturbed(server.http_url, reference, jobs)
    progress = [[] for _ in jobs]
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futs = [pool.submit(completion, server.http_url, p, k, stream=True, progress=progress[i]) if i % 2 else
                pool.submit(grpc_stream, run.grpc_target, p, k, progress[i]) for i, (p, k) in enumerate(jobs)]
        deadline = time.monotonic() + 60
        while not all(progress):
            assert time.monotonic() < deadline, "the 8 streams never ran together"
            assert not any(f.done() for f in futs), "a stream finished before the kill: make them longer"
            time.sleep(0.02)
        kill_by_pid(run, "colocated")
        states = wait_states(run, "colocated", restarts=1)
        results = [f.result(timeout=120) for f in futs]
    assert "restarting" in states and states[-1] == "healthy", states
    for i, (res, w) in enumerate(zip(results, want)):
        assert res.get("error") is None and res.get("code") is None, (i, res)
        assert_same_greedy(res["tokens"], w, jobs[i][0], f"stream {i}")
    assert time.monotonic() - t0 < 60
    row = worker_row(run, "colocated")
    assert row["restarts"] == 1 and sum(row["reprefills"].values()) == 8, row
    assert run.cluster.prefill[0] is run.cluster.decode[0]  # the replacement holds both roles again
    assert_no_pages_left(run)
