"""A hung worker (alive, but answering nothing: its process SIGSTOPped, found as an operator finds it in
`kvrelay status --json`) on the single-pair topology: detected within router.worker_timeout_s, killed and
replaced by the supervisor, and the requests in flight on it resume on the replacement by re-prefilling
prompt + tokens already sent, so every stream equals its undisturbed greedy run. The stopped process is
continued and killed in teardown whatever happens. And a worker that still answers but whose step loop is
stuck (its real step thread made to sleep inside an op, holding the engine lock: the test-only
`debug_stall_steps` actor method) is taken for hung after router.worker_step_timeout_s the same way.
After each test no KV page is left on any worker.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import pytest

from greedy_judge import assert_same_greedy
from supervised_cluster import supervised_running
from test_cluster import assert_no_pages_left, prompt_of
from test_supervision import _retries, completion, undisturbed, wait_states, worker_row

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

WORKER_TIMEOUT_S = 4.0
STEP_TIMEOUT_S = 3.0
TOPOLOGY = f"""
model: {{name: tiny, dummy: true, seed: 0, max_context: 2048}}
prefill: {{workers: 1, max_prompt_tokens: 1024}}
decode: {{workers: 1, max_batch: 32, page_size: 16}}
router: {{host: 127.0.0.1, grpc_port: 0, http_port: 0, resume_timeout_s: 60, worker_timeout_s: {WORKER_TIMEOUT_S},
         worker_step_timeout_s: {STEP_TIMEOUT_S}}}
device: cpu
"""


running = supervised_running(TOPOLOGY, stall_check_s=WORKER_TIMEOUT_S / 2, check_every_s=0.5, health_timeout_s=5.0)


@pytest.fixture()
def stopped():
    """SIGSTOP a pid; in teardown SIGCONT and SIGKILL it (the supervisor should have killed it already)."""
    pids: list[int] = []

    def stop(pid: int) -> float:
        pids.append(pid)
        os.kill(pid, signal.SIGSTOP)
        return time.monotonic()

    yield stop
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _restarting_within(run, role: str, since: float, bound_s: float) -> float:
    """Seconds from `since` until `kvrelay status` shows the worker restarting (at most `bound_s`). Each
    poll asks the workers for at most 0.5 s: the hung one never answers, and a poll that started just before
    the supervisor took it for hung would otherwise wait on it until Ray reports its kill (seconds on a
    loaded 2-core machine; seen in CI)."""
    while worker_row(run, role, timeout_s=0.5)["state"] != "restarting":
        assert time.monotonic() - since < bound_s, f"{role} worker not taken for hung within {bound_s} s"
        time.sleep(0.05)
    return time.monotonic() - since


def test_hung_decode_worker_is_replaced_and_its_requests_resume(running, reference, stopped):
    run, server = running
    jobs = [(prompt_of(20 + 3 * i, 200 + i), 120) for i in range(8)]
    want = undisturbed(server.http_url, reference, jobs)
    progress = [[] for _ in jobs]
    before = _retries("decode_unresponsive") + _retries("decode_died")
    with concurrent.futures.ThreadPoolExecutor(len(jobs) + 1) as pool:  # the jobs and one status call
        futs = _submit_running_together(pool, run, server, jobs, progress, "stop")
        old_pid = worker_row(run, "decode")["pid"]
        t_stop = stopped(old_pid)
        # `kvrelay status` started as the worker hangs waits on it until the supervisor kills it, and then
        # shows what the supervisor did meanwhile (restarting), not a dead worker (the replacement cannot
        # be up yet: it starts only once Ray has processed the old one's death).
        waiting = pool.submit(worker_row, run, "decode", 60.0)
        # Detected within the timeout plus one supervision check (0.5 s) and its status round trip.
        detected = _restarting_within(run, "decode", t_stop, WORKER_TIMEOUT_S + 3.0)
        late_row = waiting.result(timeout=60)
        assert late_row["state"] == "restarting" and "hung" in late_row["error"], late_row
        states = wait_states(run, "decode", restarts=1)
        results = [f.result(timeout=120) for f in futs]
    assert states[-1] == "healthy", states
    for i, ((p, _), res, w) in enumerate(zip(jobs, results, want)):
        assert res["status"] == 200 and res["error"] is None and res["finish"] == "length", (i, res)
        assert_same_greedy(res["tokens"], w, p, f"request {i}")
    assert _retries("decode_unresponsive") + _retries("decode_died") == before + 8
    row = worker_row(run, "decode")
    assert row["pid"] != old_pid and row["restarts"] == 1, row
    why = run.supervisor.states[("decode", 0)].last_error
    assert "hung" in why or "unresponsive" in why, why
    print(f"hung decode worker taken for hung {detected:.1f} s after SIGSTOP")
    assert_no_pages_left(run)


def test_hung_prefill_worker_is_replaced_and_its_requests_resume(running, monkeypatch, stopped):
    """SIGSTOP 20 ms after the first of 8 long prompts went to the prefill worker (the others queue behind
    it): each prompt it held is prefilled again on the replacement."""
    run, server = running
    client = run.client
    jobs = [(prompt_of(300 + 40 * i, 250 + i), 30) for i in range(8)]
    want = undisturbed(server.http_url, None, jobs)
    row = worker_row(run, "prefill")
    pid, restarts = row["pid"], row["restarts"]
    real_pick = client._pick_prefill
    timers: list[threading.Timer] = []
    t_stop: list[float] = []

    def pick_and_stop_soon(*args, **kwargs):
        w = real_pick(*args, **kwargs)
        if not timers:
            timers.append(threading.Timer(0.02, lambda: t_stop.append(stopped(pid))))
            timers[0].start()
        return w

    monkeypatch.setattr(client, "_pick_prefill", pick_and_stop_soon)
    before = {c: _retries(c) for c in ("prefill_unresponsive", "prefill_died", "kv_transfer")}
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futs = [pool.submit(completion, server.http_url, p, k, stream=i % 2 == 1) for i, (p, k) in enumerate(jobs)]
        deadline = time.monotonic() + 10
        while not t_stop:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        detected = _restarting_within(run, "prefill", t_stop[0], WORKER_TIMEOUT_S + 3.0)
        wait_states(run, "prefill", restarts=restarts + 1)
        results = [f.result(timeout=120) for f in futs]
    for i, ((p, _), res, w) in enumerate(zip(jobs, results, want)):
        assert res["status"] == 200, (i, res)
        assert_same_greedy(res["tokens"], w, p, f"request {i}")
    counted = {c: _retries(c) - n for c, n in before.items()}
    assert counted["prefill_unresponsive"] + counted["prefill_died"] >= 1, counted
    row = worker_row(run, "prefill")
    assert row["restarts"] == restarts + 1 and row["pid"] != pid, row
    print(f"hung prefill worker taken for hung {detected:.1f} s after SIGSTOP; re-prefills {counted}")
    assert_no_pages_left(run)


def test_stuck_step_loop_is_taken_for_hung_and_its_requests_resume(running, reference):
    """The decode worker answers health() and every call, but its step thread sleeps in an op (a stuck
    kernel): no progress with work for router.worker_step_timeout_s is a hung worker. It is replaced and
    the 6 requests on it resume, each equal to its undisturbed greedy run."""
    import ray

    run, server = running
    jobs = [(prompt_of(24 + 5 * i, 300 + i), 120) for i in range(6)]
    want = undisturbed(server.http_url, reference, jobs)
    progress = [[] for _ in jobs]
    row = worker_row(run, "decode")
    old_pid, restarts = row["pid"], row["restarts"]
    before = _retries("decode_unresponsive") + _retries("decode_died")
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futs = _submit_running_together(pool, run, server, jobs, progress, "stall")
        actor = run.cluster.decode[0]
        t_stall = time.monotonic()
        ray.get(actor.debug_stall_steps.remote(120.0), timeout=10)  # the step thread sleeps; this returns
        assert ray.get(actor.health.remote(), timeout=10) is True  # it still answers: not a stopped process
        detected = _restarting_within(run, "decode", t_stall, STEP_TIMEOUT_S + 4.0)
        assert detected >= STEP_TIMEOUT_S - 0.5, detected  # not taken for hung before the bound
        states = wait_states(run, "decode", restarts=restarts + 1)
        results = [f.result(timeout=120) for f in futs]
    assert states[-1] == "healthy", states
    for i, ((p, _), res, w) in enumerate(zip(jobs, results, want)):
        assert res["status"] == 200 and res["error"] is None and res["finish"] == "length", (i, res)
        assert_same_greedy(res["tokens"], w, p, f"request {i}")
    assert _retries("decode_unresponsive") + _retries("decode_died") == before + 6
    row = worker_row(run, "decode")
    assert row["pid"] != old_pid and row["restarts"] == restarts + 1, row
    why = run.supervisor.states[("decode", 0)].last_error
    assert "step loop" in why and "router.worker_step_timeout_s" in why, why
    print(f"stuck step loop taken for hung {detected:.1f} s after it stalled (bound {STEP_TIMEOUT_S} s)")
    assert_no_pages_left(run)


def test_stuck_prefill_is_taken_for_hung_and_its_requests_resume(running):
    """The prefill worker answers, but its next prefill run sleeps before its forward (a stuck device
    call): taken for hung after router.worker_step_timeout_s, replaced, its prompts prefilled again."""
    import ray

    run, server = running
    jobs = [(prompt_of(200 + 30 * i, 400 + i), 12) for i in range(4)]
    want = undisturbed(server.http_url, None, jobs)
    row = worker_row(run, "prefill")
    pid, restarts = row["pid"], row["restarts"]
    actor = run.cluster.prefill[0]
    ray.get(actor.debug_stall_steps.remote(120.0), timeout=10)
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        t_stall = time.monotonic()
        futs = [pool.submit(completion, server.http_url, p, k, stream=i % 2 == 1) for i, (p, k) in enumerate(jobs)]
        time.sleep(0.5)
        assert ray.get(actor.health.remote(), timeout=10) is True  # it still answers: not a stopped process
        detected = _restarting_within(run, "prefill", t_stall, STEP_TIMEOUT_S + 4.0)
        assert detected >= STEP_TIMEOUT_S - 0.5, detected
        wait_states(run, "prefill", restarts=restarts + 1)
        results = [f.result(timeout=120) for f in futs]
    for i, ((p, _), res, w) in enumerate(zip(jobs, results, want)):
        assert res["status"] == 200, (i, res)
        assert_same_greedy(res["tokens"], w, p, f"request {i}")
    row = worker_row(run, "prefill")
    assert row["restarts"] == restarts + 1 and row["pid"] != pid, row
    why = run.supervisor.states[("prefill", 0)].last_error
    assert "step loop" in why and "router.worker_step_timeout_s" in why, why
    print(f"stuck prefill taken for hung {detected:.1f} s after it stalled (bound {STEP_TIMEOUT_S} s)")
    assert_no_pages_left(run)


def _submit_running_together(pool, run, server, jobs, progress, event: str) -> list:
    """Submit every job (even ones streamed) and wait until all run on the decode worker at once, with
    the streamed ones past their first token, before the `event` is made to happen."""
    futs = [pool.submit(completion, server.http_url, p, k, stream=i % 2 == 0, progress=progress[i])
            for i, (p, k) in enumerate(jobs)]
    n = len(jobs)
    deadline = time.monotonic() + 60
    while not (all(progress[i] for i in range(0, n, 2)) and worker_row(run, "decode")["running"] == n):
        assert time.monotonic() < deadline, f"the {n} requests never ran together"
        assert not any(f.done() for f in futs), f"a request finished before the {event}: make them longer"
        time.sleep(0.02)
    return futs
