"""The prefix cache's host tier on the CPU tiny cluster (colocated and split, prefill.prefix_cache_host_gib):
a device pool small enough that later prompts push an earlier prompt's blocks out to the host tier; that
prompt again is a hit copied back from host (its prefill skipped), its greedy stream equals
`LLM.generate` without any cache (up to bf16 rounding judged in float32: greedy_judge.py),
usage.prompt_tokens_details.cached_tokens counts the host hit, the counters move in the worker, /metrics
and `kvrelay status`, and no page stays held by a request."""

from __future__ import annotations

import httpx
import pytest

from greedy_judge import assert_same_greedy
from test_cluster import assert_no_pages_left, grpc_tokens, prompt_of, solo

pytestmark = [pytest.mark.timeout(240)]

# Colocated: 256 positions of device pool (16 pages of 16) behind one request at a time. Split: the
# prefill worker's pool holds 4 x max_prompt_tokens (50 pages). ~1 MiB of host tier holds ~85 blocks of
# the tiny model (one full page of 4 KiB and one sliding page of 8 KiB each).
COLOCATED = """
model: {name: tiny, dummy: true, seed: 0, max_context: 256}
prefill: {workers: 1, max_prompt_tokens: 200, chunk_tokens: 64, prefix_cache: true, prefix_cache_host_gib: 0.001}
decode: {workers: 1, max_batch: 1, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
device: cpu
colocate: true
"""
SPLIT = """
model: {name: tiny, dummy: true, seed: 0, max_context: 256}
prefill: {workers: 1, max_prompt_tokens: 200, chunk_tokens: 256, prefix_cache: true, prefix_cache_host_gib: 0.001}
decode: {workers: 1, max_batch: 4, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
kv_transfer: {lease_seconds: 30}
device: cpu
"""


@pytest.mark.parametrize("topology, role, fillers", [(COLOCATED, "colocated", 3), (SPLIT, "prefill", 9)],
                         ids=["colocated", "split"])
def test_an_evicted_prefix_comes_back_from_the_host_tier(reference, topology, role, fillers):
    import ray

    from conftest import serving

    from kvrelay.cluster.status import _table

    def cache_row(rows=None) -> dict:
        return next(r for r in rows or run.cluster.statuses() if r["role"] == role)["prefix_cache"]

    with serving(topology) as (run, server):
        prompts = [prompt_of(100, 40 + i) for i in range(1 + fillers)]
        for i, p in enumerate(prompts):  # each one's 6 whole blocks push the oldest ones out, the first's first
            tokens, _ = grpc_tokens(run.grpc_target, p, 8)
            assert_same_greedy(tokens, solo(reference, p, 8), p, f"prompt {i}")
        pc = cache_row()
        assert pc["evicted_pages"]["full"] >= 6 and pc["host"]["pages"]["full"] >= 6
        assert pc["host"]["to_host_bytes"] > 0 and pc["host"]["hits"] == 0
        if role == "colocated":
            before = ray.get(run.cluster.decode[0].counters.remote(), timeout=30)
        scraped = metrics(server)

        again = prompts[0] + prompt_of(5, 99)  # the first prompt's blocks are all in host memory now
        want = solo(reference, again, 8)
        body = {"model": run.client.model_name, "prompt": again, "max_tokens": 8, "temperature": 0,
                "return_token_ids": True}
        r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert_same_greedy(r.json()["choices"][0]["token_ids"], want, again, "host hit")
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        tokens, _ = grpc_tokens(run.grpc_target, again, 8)  # on the device now: a device hit
        assert_same_greedy(tokens, want, again, "device hit")
        if role == "colocated":
            after = ray.get(run.cluster.decode[0].counters.remote(), timeout=30)
            assert after["cached_host_tokens"] - before["cached_host_tokens"] == 96
            assert after["cached_tokens"] - before["cached_tokens"] == 2 * 96
            # Only the uncached tail was computed, both times.
            assert after["prompt_tokens"] - before["prompt_tokens"] == 2 * (len(again) - 96)

        rows = run.cluster.statuses()
        host = cache_row(rows)["host"]
        assert host["hits"] == 1 and host["hit_tokens"] == 96 and host["to_device_bytes"] > 0
        assert cache_row(rows)["hit_tokens"] - pc["hit_tokens"] == 2 * 96
        assert "host tier 1/" in _table(rows) and "MiB back" in _table(rows)
        # The router's counters are the process's (tests in one process share them): what moved.
        moved = {k: v - scraped.get(k, 0.0) for k, v in metrics(server).items()}
        assert moved["kvrelay_prefix_cache_host_hits_total"] == 96
        assert moved['kvrelay_prefix_cache_host_bytes_total{direction="host_to_device"}'] == host["to_device_bytes"]
        assert 'kvrelay_prefix_cache_host_bytes_total{direction="device_to_host"}' in moved
        assert_no_pages_left(run)


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvrelay_prefix_cache_host")}
