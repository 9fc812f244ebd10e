"""Load on the real cluster (Ray, prefill and decode workers, NIXL over UCX loopback, HTTP router on
127.0.0.1): 256 concurrent streaming clients for 120 s (KVRELAY_LOAD_S overrides), more streams than decode
slots so the admission line is in use the whole time. Every stream that runs to the end equals its solo
greedy run (however its tokens were grouped into chunks; up to bf16 rounding of its batches, judged in
float32: greedy_judge.py); one in eight clients walks away after its first
chunks, and its KV comes back; worker memory stays bounded; the latencies are printed."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from greedy_judge import assert_same_greedy
from test_cluster import assert_no_pages_left, prompt_of, solo

LOAD_S = float(os.environ.get("KVRELAY_LOAD_S", "120"))
pytestmark = [pytest.mark.timeout(int(LOAD_S) + 240), pytest.mark.slow]

CLIENTS = 256
PROMPTS = 48  # distinct prompts, cycled: the oracle runs once per prompt
MAX_TOKENS = 24

TOPOLOGY = """
model: {name: tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 1, max_prompt_tokens: 1024}
decode: {workers: 1, max_batch: 96, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0, max_waiting_requests: 512}
device: cpu
"""


@pytest.fixture(scope="module")
def running():
    from conftest import serving

    with serving(TOPOLOGY) as (run, server):
        yield run, server


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))] if s else float("nan")


async def _client(k: int, url: str, model: str, oracle: dict, deadline: float, stats: dict) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        n = 0
        while time.monotonic() < deadline:
            i = (k + CLIENTS * n) % PROMPTS
            n += 1
            walk_away = (k + n) % 8 == 0
            body = {"model": model, "prompt": prompt_of(12 + i % 20, i), "max_tokens": MAX_TOKENS,
                    "temperature": 0, "stream": True, "return_token_ids": True}
            t0 = time.monotonic()
            got, times = [], []
            async with http.stream("POST", url, json=body) as resp:
                if resp.status_code == 429:  # the line is bounded: back off as a client should
                    stats["refused"] += 1
                    await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                    continue
                assert resp.status_code == 200, (resp.status_code, await resp.aread())
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                    if ids:
                        got += ids
                        times.append((time.monotonic(), len(ids)))
                    if walk_away and len(got) >= 3:
                        break  # closing the stream mid-way: the router aborts the request
            if walk_away:
                stats["walked_away"] += 1
                continue
            if got != oracle[i]:  # served in batches of others: judged in float32 (off the hot path: rare)
                assert_same_greedy(got, oracle[i], prompt_of(12 + i % 20, i), f"client {k} prompt {i}")
            stats["done"] += 1
            stats["tokens"] += len(got)
            stats["ttft"].append(times[0][0] - t0)
            stats["chunks"] += len(times)
            for (a, _), (b, m) in zip(times, times[1:]):
                stats["itl"] += [(b - a) / m] * m


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_idle_workers_use_under_three_percent_of_a_core(running):
    """Nothing to do, nothing burnt: each worker process (its step loop, NIXL/UCX progress, Ray's own
    threads) over 10 s of idling after a request. Measured on the 2-core CI box with Ray 2.60: 1.9-2.1% in
    all, of which Ray's core-worker main loop ~0.9% (~95 wakeups/s) and NIXL's progress thread, paused
    5 ms between polls (transfer/nixl.py), ~0.9%; our step loops sleep on a condition. The bound catches
    a busy poll (the unpaused NIXL thread took 98% of a core) without flaking on Ray's share."""
    run, server = running
    r = httpx.post(f"{server.http_url}/v1/completions", timeout=60,
                   json={"model": run.client.model_name, "prompt": prompt_of(10, 1), "max_tokens": 4})
    assert r.status_code == 200
    time.sleep(1.0)
    pids = [r["pid"] for r in run.cluster.statuses() if "pid" in r]
    before = {p: _cpu_seconds(p) for p in pids}
    time.sleep(10.0)
    used = {p: (_cpu_seconds(p) - before[p]) / 10.0 for p in pids}
    print(f"\nidle CPU share per worker: {used}")
    assert all(u < 0.03 for u in used.values()), used


def test_top_logprobs_across_the_handoff(running, reference):
    """The split path: the prefill worker lists the first token's alternatives, the decode worker the rest."""
    from test_colocated import check_top_logprobs

    run, server = running
    check_top_logprobs(server, run.client.model_name, reference, prompt_of(19, 2))
    assert_no_pages_left(run)


def test_256_streams_for_two_minutes(running, reference):
    run, server = running
    oracle = {i: solo(reference, prompt_of(12 + i % 20, i), MAX_TOKENS) for i in range(PROMPTS)}
    pids = [r["pid"] for r in run.cluster.statuses() if "pid" in r]
    url = f"{server.http_url}/v1/completions"
    stats = {"done": 0, "walked_away": 0, "refused": 0, "tokens": 0, "chunks": 0, "ttft": [], "itl": []}
    rss = {}

    async def main() -> None:
        deadline = time.monotonic() + LOAD_S

        async def sample_memory() -> None:  # every few seconds while the load runs: (streams served, MB per worker)
            while time.monotonic() < deadline:
                rss.setdefault("trace", []).append((stats["done"] + stats["walked_away"],
                                                    [round(_rss_mb(p)) for p in pids]))
                await asyncio.sleep(LOAD_S / 12)

        clients = [_client(k, url, run.client.model_name, oracle, deadline, stats) for k in range(CLIENTS)]
        await asyncio.gather(sample_memory(), *clients)

    t0 = time.monotonic()
    asyncio.run(main())
    wall = time.monotonic() - t0
    rss.setdefault("trace", []).append((stats["done"] + stats["walked_away"], [round(_rss_mb(p)) for p in pids]))
    print(f"\nload: {CLIENTS} clients for {wall:.0f} s: {stats['done']} streams equal to their solo run, "
          f"{stats['walked_away']} walked away, {stats['refused']} refused (429), {stats['tokens'] / wall:.0f} tok/s; "
          f"TTFT p50 {_pct(stats['ttft'], 50):.3f} s p99 {_pct(stats['ttft'], 99):.3f} s; inter-token p50 "
          f"{_pct(stats['itl'], 50) * 1e3:.1f} ms p99 {_pct(stats['itl'], 99) * 1e3:.1f} ms; "
          f"{stats['tokens'] / max(stats['chunks'], 1):.2f} tokens per chunk; (streams, worker RSS MB) {rss['trace']}")
    assert stats["done"] >= CLIENTS and stats["walked_away"] >= CLIENTS // 8
    # Bounded memory. The workers' RSS rises fast over the first seconds and then ever more slowly: over
    # the last third of the run, per request served, at most a third of the first third's rise and at
    # most 128 KB (a leak grows in step with the requests). Measured on 2 cores: the prefill worker adds
    # ~600 KB/request at first and 40-70 KB/request after a minute; the same prefills run in one process
    # without Ray stay flat (4,000 requests at 351 MB), so what remains is in the actor's Ray runtime.
    # 2026-12-03 the rise still tails off after a minute: over 40-60 s 100 KB/request alone and 135 in a full
    # CI run (over the bound), then 27 KB over 80-120 s and 16-25 KB over 120-180 s (KVRELAY_LOAD_S=180):
    # hence two minutes, whose last third is past that tail.
    trace = rss["trace"]
    k = len(trace) // 3
    (n0, first), (n1, a_third), (n2, two_thirds), (n3, end) = trace[1], trace[k], trace[-k - 1], trace[-1]
    for w in range(len(pids)):
        early = (a_third[w] - first[w]) / max(n1 - n0, 1)
        late = (end[w] - two_thirds[w]) / max(n3 - n2, 1)
        assert late * 1024 <= 128 and late <= early / 3 + 16 / 1024, (
            f"worker {pids[w]}: {late * 1024:.0f} KB per request late vs {early * 1024:.0f} early", trace)
    # Nothing per request is left anywhere: pages, leases, reservations, the admission line, the router's
    # and the engine client's in-flight tables.
    assert run.client.admission.waiting == 0
    assert_no_pages_left(run, timeout_s=30)
    assert not server.core._in_flight and not run.client._active


def test_echo_prompt_logprobs_and_repetition_penalty_across_the_handoff(running, reference):
    """The split path: the prefill worker computes the prompt logprobs (a 600-token prompt: two chunks of
    all-position logits) and the repetition penalty's first token, the decode worker the rest from the
    prompt's token set."""
    from scoring_checks import check_echo_scoring, check_repetition_penalty

    run, server = running
    check_echo_scoring(server, run.client.model_name, reference, [prompt_of(600, 9), prompt_of(5, 1)])
    check_repetition_penalty(server, run.client.model_name, reference, prompt_of(23, 5))
    assert_no_pages_left(run)
