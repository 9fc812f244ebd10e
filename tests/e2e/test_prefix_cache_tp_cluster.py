"""The prefix cache on a TP2 prefill worker of the CPU tiny cluster (prefill.tp 2, prefix_cache, a small
host tier): both ranks run the same cache over their own KV head (prefill_worker/ranks.py).
Prompts that share a system prompt, diverge after it or inside the sliding window before a cached page
boundary, or repeat, stream the tokens single-process `LLM.generate` (no cache, bf16: up to bf16 rounding
judged in float32, as every TP test: greedy_judge.py) does; the hits skip their prefill by exactly the
expected tokens, once per group in the counters, usage.prompt_tokens_details.cached_tokens, /metrics and
`kvrelay status`; rank 1's cache equals rank 0's (summary and decision digest); prompts that push a prefix out to the host tier bring it back
on both ranks (a host hit, the same stream); afterwards no rank holds a page for a request. Last, rank 1
loses its cache behind rank 0's back: the next hit is a miss there, which rank 1 finds before the
forward, and the worker goes down as a whole instead of streaming from KV the ranks disagree on."""

from __future__ import annotations

import asyncio
import glob
import time

import httpx
import pytest

from test_cluster import assert_no_pages_left, grpc_tokens, prompt_of
from greedy_judge import assert_same_greedy
from test_prefix_cache_cluster import PROMPTS, SYSTEM

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# 50 pages of 16 positions in each rank's pool (4 x max_prompt_tokens); ~1 MiB of host tier for the
# group, half of it on each rank, holds ~85 blocks.
TP2 = """
model: {name: tiny, dummy: true, seed: 0, max_context: 256}
prefill: {workers: 1, tp: 2, max_prompt_tokens: 200, chunk_tokens: 256, prefix_cache: true,
          prefix_cache_host_gib: 0.001}
decode: {workers: 1, max_batch: 4, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
kv_transfer: {lease_seconds: 30}
device: cpu
"""


def reference_of(llm, prompt: list[int], k: int) -> list[int]:
    from kvrelay.engine.sampling import SamplingParams

    return [o.token_id for o in llm.generate(prompt, SamplingParams(max_tokens=k, temperature=0))]


def test_tp2_prefill_group_caches_in_lockstep(reference):
    import ray

    from conftest import serving

    from kvrelay.cluster.status import _table
    from kvrelay.engine.sampling import SamplingParams

    def hit_counter(url: str) -> float:
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("kvrelay_prefix_cache_hits_total "))

    with serving(TP2) as (run, server):
        hits_before = hit_counter(server.http_url)  # the counters are this test process's, shared with earlier tests
        follower = ray.get_actor("kvrelay-prefill-0-tp1", namespace=run.topology.ray.namespace)

        def caches() -> tuple[dict, dict]:
            rows = run.cluster.statuses()
            lead = next(r for r in rows if r["role"] == "prefill" and r["tp_rank"] == 0)["prefix_cache"]
            assert all(r.get("prefix_cache") is None for r in rows if r["tp_rank"] > 0)  # counted once
            return lead, ray.get(follower.prefix_cache.remote(), timeout=30)

        for i, (prompt, cached) in enumerate(PROMPTS):
            before = caches()[0]["hit_tokens"]
            tokens, _ = grpc_tokens(run.grpc_target, prompt, 12)
            assert_same_greedy(tokens, reference_of(reference, prompt, 12), prompt, f"prompt {i}")
            lead, rank1 = caches()
            assert lead["hit_tokens"] - before == cached, f"prompt {i}"
            assert rank1 == lead, f"prompt {i}: rank 1's cache is not rank 0's"
        body = {"model": run.client.model_name, "prompt": PROMPTS[1][0], "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 112  # its own 7 blocks, cached as it ran
        hits = hit_counter(server.http_url) - hits_before
        assert hits == 96 + 80 + 112 + 112  # once per group, not per rank
        lead, _ = caches()
        assert lead["hits"] == 4 and lead["queries"] == 5

        # A prompt that wants its own logprobs computes every position (no lookup) on both ranks alike.
        async def with_logprobs():
            params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1)
            return [o async for o in run.client.generate("plp", SYSTEM + prompt_of(9, 5), params)]

        outs = asyncio.run(with_logprobs())
        assert len(outs[0].prompt_logprobs.token_logprobs) == len(SYSTEM) + 9 - 1
        assert outs[-1].metrics.cached_tokens == 0 and caches()[0]["queries"] == 5  # not looked up
        assert_same_greedy([o.token_id for o in outs], reference_of(reference, SYSTEM + prompt_of(9, 5), 4),
                           SYSTEM + prompt_of(9, 5), "plp")

        # Push the first of ten prompts out of both ranks' pools into their host tiers, then hit it there.
        fillers = [prompt_of(100, 40 + i) for i in range(10)]
        for i, p in enumerate(fillers):
            tokens, _ = grpc_tokens(run.grpc_target, p, 6)
            assert_same_greedy(tokens, reference_of(reference, p, 6), p, f"filler {i}")
        lead, rank1 = caches()
        assert lead["evicted_pages"]["full"] >= 6 and lead["host"]["pages"]["full"] >= 6 and lead["host"]["hits"] == 0
        assert rank1 == lead
        again = fillers[0] + prompt_of(5, 99)
        body = {"model": run.client.model_name, "prompt": again, "max_tokens": 8, "temperature": 0,
                "return_token_ids": True}
        r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert_same_greedy(r.json()["choices"][0]["token_ids"], reference_of(reference, again, 8), again, "host hit")
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        lead, rank1 = caches()
        assert rank1 == lead
        host = lead["host"]
        assert host["hits"] == 1 and host["hit_tokens"] == 96 and host["to_device_pages"] >= 6
        # Bytes are the group's: both ranks copied their KV head of each page, a full page 4 KiB and a
        # sliding one 8 KiB for the two (2 KiB and 4 KiB on each rank), so at least 6 full pages came back.
        full, sliding = 4096, 8192
        moved = host["to_device_pages"]
        assert full * moved <= host["to_device_bytes"] <= sliding * moved and host["to_device_bytes"] % full == 0
        assert host["bytes_total"] == (int(0.001 * 2**30) // 2 // ((full + sliding) // 2)) * (full + sliding)
        assert_no_pages_left(run)  # on every rank: only cache-held, evictable pages remain
        lead, rank1 = caches()
        assert lead["evictable_pages"] == lead["cached_pages"] and rank1 == lead
        table = _table(run.cluster.statuses())
        assert table.count("prefix cache") == 1 and "host tier 1/" in table

        # Last (it breaks the group): rank 1 forgets its cache; rank 0 still hits PROMPTS[1]'s blocks.
        def forget() -> None:  # runs in rank 1's process (FollowerRank.op)
            import gc

            from kvrelay.prefill_worker.ranks import PrefillRank

            rank, = [o for o in gc.get_objects() if isinstance(o, PrefillRank)]
            rank.runner.kv.prefix.clear()

        ray.get(follower.op.remote(forget), timeout=30)
        assert ray.get(follower.prefix_cache.remote(), timeout=30)["cached_pages"] == {"full": 0, "sliding": 0}
        from kvrelay.cluster.engine_client import EngineUnavailable

        async def diverged():
            params = SamplingParams(max_tokens=4, temperature=0)
            return [o async for o in run.client.generate("diverged", PROMPTS[1][0], params)]

        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable, match="no live prefill worker"):
            asyncio.run(diverged())
        assert time.monotonic() - t0 < 60
        logs = ray._private.worker.global_worker.node.get_logs_dir_path()
        deadline = time.monotonic() + 20
        while not any("RanksDisagree" in open(f, errors="replace").read() for f in glob.glob(f"{logs}/worker-*.err")):
            assert time.monotonic() < deadline, "rank 1 did not report that it disagrees with rank 0"
            time.sleep(0.5)
        rows = {(r["role"], r["tp_rank"]): r for r in run.cluster.statuses(timeout_s=5)}
        assert "error" in rows[("prefill", 0)] and "error" in rows[("prefill", 1)]
