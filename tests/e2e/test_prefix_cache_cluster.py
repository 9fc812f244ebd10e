"""The prefix cache on the CPU tiny cluster (prefill.prefix_cache: true), colocated and split: prompts
that share a system prompt, diverge after it or inside the sliding window before a cached page boundary,
or repeat, stream the tokens single-process `LLM.generate` (no cache) does (a hit prefills only the rest
of the prompt, bf16 of other shapes: judged in float32, greedy_judge.py); the hits skip the cached
tokens' prefill (the worker's counters), show in the response's
usage.prompt_tokens_details.cached_tokens, in /metrics and in `kvrelay status`; a colocated worker also
keeps what it generated (the next turn of a conversation resumes inside the previous answer); no page is
left held by a request afterwards (only cache-held, evictable pages remain)."""

from __future__ import annotations

import httpx
import pytest

from greedy_judge import assert_same_greedy
from test_cluster import assert_no_pages_left, grpc_tokens, prompt_of, solo

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

MODEL = "model: {name: tiny, dummy: true, seed: 0, max_context: 2048}\n"
COLOCATED = MODEL + """
prefill: {workers: 1, max_prompt_tokens: 1024, chunk_tokens: 64, prefix_cache: true}
decode: {workers: 1, max_batch: 32, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
device: cpu
colocate: true
"""
SPLIT = MODEL + """
prefill: {workers: 1, max_prompt_tokens: 1024, chunk_tokens: 512, prefix_cache: true}
decode: {workers: 1, max_batch: 32, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
kv_transfer: {lease_seconds: 30}
device: cpu
"""

SYSTEM = prompt_of(100, 7)  # blocks 0..5 whole (96 tokens) with page_size 16; tiny's window is 8
PROMPTS = [
    (SYSTEM + prompt_of(20, 1), 0),  # cold: its 7 whole blocks (112 tokens) are cached as it runs
    (SYSTEM + prompt_of(15, 2), 96),  # shares the system prompt's whole blocks
    (SYSTEM[:85] + prompt_of(30, 3), 80),  # diverges at 85: 5 tokens past the boundary, inside the window
    (SYSTEM + prompt_of(20, 1), 112),  # the first prompt again: all but its last partial block
]


def http_usage(server, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def grpc_usage(target: str, prompt: list[int]):
    from kvrelay.router.client import RouterClient
    from kvrelay.router.types import SamplingOptions

    with RouterClient(target, timeout_s=120) as c:
        last = list(c.generate(prompt, SamplingOptions(temperature=0.0, max_tokens=4)))[-1]
    assert last.usage.prompt_tokens == len(prompt)
    return last.usage


def check_cluster(run, server, reference, role: str) -> None:
    from kvrelay.cluster.status import _table

    def hit_tokens() -> int:
        return next(r for r in run.cluster.statuses() if r["role"] == role)["prefix_cache"]["hit_tokens"]

    for i, (prompt, cached) in enumerate(PROMPTS):
        before = hit_tokens()
        tokens, _ = grpc_tokens(run.grpc_target, prompt, 16)
        assert_same_greedy(tokens, solo(reference, prompt, 16), prompt, f"prompt {i}")
        assert hit_tokens() - before == cached, f"prompt {i}"
    usage = http_usage(server, run.client.model_name, PROMPTS[1][0])
    assert usage["prompt_tokens"] == len(PROMPTS[1][0])
    assert usage["prompt_tokens_details"]["cached_tokens"] == 112  # its own 7 whole blocks, cached as it ran
    assert grpc_usage(run.grpc_target, PROMPTS[1][0]).cached_tokens == 112  # gRPC's Usage says the same
    metrics = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    def counter(name: str) -> float:
        return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " "))

    assert counter("kvrelay_prefix_cache_hits_total") >= 96 + 80 + 112 + 112
    assert counter("kvrelay_prefix_cache_queries_total") >= sum(len(p) for p, _ in PROMPTS) + len(PROMPTS[1][0])
    assert_no_pages_left(run)
    rows = run.cluster.statuses()
    row = next(r for r in rows if r["role"] == role)
    pc = row["prefix_cache"]
    assert pc["hits"] >= 4 and pc["cached_pages"]["full"] > 0
    assert pc["evictable_pages"] == pc["cached_pages"]  # nothing holds a cached page but the cache
    assert "prefix cache" in _table(rows) and "tokens saved" in _table(rows)


def test_colocated_prefix_cache_equals_llm_generate(reference):
    from conftest import serving

    with serving(COLOCATED) as (run, server):
        import ray

        before = ray.get(run.cluster.decode[0].counters.remote(), timeout=30)
        check_cluster(run, server, reference, "colocated")
        after = ray.get(run.cluster.decode[0].counters.remote(), timeout=30)
        # Cached tokens were not computed: the prompts' tokens minus the hits (the HTTP and gRPC calls hit 112).
        want = sum(len(p) - c for p, c in PROMPTS) + 2 * (len(PROMPTS[1][0]) - 112)
        assert after["prompt_tokens"] - before["prompt_tokens"] == want
        assert after["cached_tokens"] - before["cached_tokens"] == sum(c for _, c in PROMPTS) + 2 * 112
        # The next turn repeats the conversation so far: it resumes inside the previous answer, whose
        # tokens the decode steps wrote into pages the cache kept.
        prompt = prompt_of(60, 11)
        answer, _ = grpc_tokens(run.grpc_target, prompt, 40)
        turn = prompt + answer + prompt_of(10, 12)
        tokens, _ = grpc_tokens(run.grpc_target, turn, 8)
        assert_same_greedy(tokens, solo(reference, turn, 8), turn, "next turn")
        again = ray.get(run.cluster.decode[0].counters.remote(), timeout=30)
        written = len(prompt) + len(answer) - 1  # the last answer token was never fed back
        assert again["cached_tokens"] - after["cached_tokens"] == min(written, len(turn) - 1) // 16 * 16 > 60
        # n choices behind a cached prefix: the forked sequences share pages the cache holds too; each
        # choice is the solo run, and afterwards only the cache holds pages.
        prompt = SYSTEM + prompt_of(9, 13)
        body = {"model": run.client.model_name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "n": 3,
                "return_token_ids": True}
        r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        for j, c in enumerate(r.json()["choices"]):
            assert_same_greedy(c["token_ids"], solo(reference, prompt, 12), prompt, f"choice {j}")
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        assert_no_pages_left(run)
        pc = next(r for r in run.cluster.statuses() if r["role"] == "colocated")["prefix_cache"]
        assert pc["evictable_pages"] == pc["cached_pages"]


def test_split_prefix_cache_equals_llm_generate(reference):
    from conftest import serving

    with serving(SPLIT) as (run, server):
        check_cluster(run, server, reference, "prefill")
        # Concurrent prompts behind a warm system prompt: queued ones share a prefill forward (the batch
        # path), each resuming after its own cached prefix.
        import concurrent.futures

        prompts = [SYSTEM + prompt_of(10 + 7 * i, 30 + i) for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: grpc_tokens(run.grpc_target, p, 12)[0], prompts))
        for i, (p, tokens) in enumerate(zip(prompts, got)):
            assert_same_greedy(tokens, solo(reference, p, 12), p, f"concurrent prompt {i}")
        assert_no_pages_left(run)


KV_AWARE = MODEL + """
prefill: {workers: 2, max_prompt_tokens: 1024, chunk_tokens: 64, prefix_cache: true}
decode: {workers: 2, max_batch: 32, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0, policy: kv-aware}
device: cpu
colocate: true
"""


KV_AWARE_SPLIT = MODEL + """
prefill: {workers: 2, max_prompt_tokens: 1024, chunk_tokens: 512, prefix_cache: true}
decode: {workers: 1, max_batch: 32, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0, policy: kv-aware}
kv_transfer: {lease_seconds: 30}
device: cpu
"""


@pytest.mark.parametrize("topology", [KV_AWARE, KV_AWARE_SPLIT], ids=["colocated", "split"])
def test_kv_aware_routing_sends_a_shared_prefix_where_it_is_cached(reference, topology):
    """Two colocated workers (or two prefill workers before one decode worker), router.policy kv-aware:
    prompts that share the system prompt all go to the worker that computed it first and hit its cache
    there; an unrelated prompt goes to the other one."""
    import asyncio

    from conftest import serving

    from kvrelay.engine.sampling import SamplingParams

    async def one(run, rid: str, prompt: list[int]):
        outs = [o async for o in run.client.generate(rid, prompt, SamplingParams(max_tokens=8, temperature=0))]
        return [o.token_id for o in outs], outs[-1].metrics

    with serving(topology) as (run, _):
        placed = []
        for i, (prompt, _) in enumerate(PROMPTS):
            tokens, m = asyncio.run(one(run, f"kv{i}", prompt))
            assert_same_greedy(tokens, solo(reference, prompt, 8), prompt, f"prompt {i}")
            placed.append((m.prefill_worker, m.cached_tokens))
        home = placed[0][0]
        assert placed == [(home, 0), (home, 96), (home, 80), (home, 112)]
        # Unrelated prompts: no cached prefix anywhere, so the idle worker (used longest ago) gets one.
        _, m = asyncio.run(one(run, "other", prompt_of(50, 9)))
        assert m.prefill_worker != home and m.cached_tokens == 0
        assert_no_pages_left(run)


PRESSURE = """
model: {name: tiny, dummy: true, seed: 0, max_context: 256}
prefill: {workers: 1, max_prompt_tokens: 200, chunk_tokens: 64, prefix_cache: true}
decode: {workers: 1, max_batch: 1, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
device: cpu
colocate: true
"""


def test_a_full_cache_never_costs_an_admission(reference):
    """A 16-page pool (256 positions) that the cache fills after two prompts: every later request is still
    admitted and served (cached pages nobody uses are evicted, least recently used first), a recent prompt
    still hits, an evicted one computes in full, and the streams equal LLM.generate throughout."""
    with serving_pressure() as run:
        prompts = [prompt_of(100, 20 + i) for i in range(5)]
        for i, p in enumerate(prompts + [prompts[-1], prompts[0]]):
            tokens, _ = grpc_tokens(run.grpc_target, p, 8)
            assert_same_greedy(tokens, solo(reference, p, 8), p, f"request {i}")
        pc = run.cluster.statuses()[0]["prefix_cache"]
        assert pc["evicted_pages"]["full"] > 0
        assert pc["hits"] == 1 and pc["hit_tokens"] == 96  # the repeat of the last prompt; the first was evicted
        assert_no_pages_left(run)


def serving_pressure():
    import contextlib

    from conftest import serving

    @contextlib.contextmanager
    def go():
        with serving(PRESSURE) as (run, _):
            yield run

    return go()
