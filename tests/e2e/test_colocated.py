"""The colocated worker on CPU: one actor holds both roles over one model and one KV pool (what
`kvrelay serve` runs for `colocate: true`, e.g. configs/h200-1gpu-*.yaml). Prompts are prefilled in
chunks inside the decode loop's forwards, several per forward when a queue forms; the handoff to decode
is in place. Every stream must equal single-process `LLM.generate` (up to bf16 rounding judged in float32,
greedy_judge.py, where it shared forwards with others), each prompt token must be computed exactly once,
and no page may be left behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json

import pytest

from greedy_judge import assert_same_greedy
from kvrelay.engine.sampling import SamplingParams

from test_cluster import assert_no_pages_left, grpc_tokens, prompt_of, solo

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

# chunk_tokens 64: a 300-token prompt takes five forwards, and short queued prompts share one.
TOPOLOGY = """
model: {name: tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 1, max_prompt_tokens: 1024, chunk_tokens: 64}
decode: {workers: 1, max_batch: 32, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0, policy: round-robin}
device: cpu
colocate: true
"""


@pytest.fixture(scope="module")
def running():
    from conftest import serving

    with serving(TOPOLOGY) as (run, server):
        yield run, server


def counters(cluster) -> dict:
    import ray

    return ray.get(cluster.decode[0].counters.remote(), timeout=30)


def test_one_actor_serves_both_roles(running):
    run, _ = running
    assert run.cluster.prefill[0] is run.cluster.decode[0]
    assert len(run.cluster.actors()) == 1
    rows = run.cluster.statuses()
    assert [(r["role"], r["healthy"]) for r in rows] == [("colocated", True)]


@pytest.mark.parametrize("n", [1, 9, 64, 65, 300])
def test_greedy_stream_equals_llm_generate(running, reference, n):
    run, _ = running
    before = counters(run.cluster)
    tokens, finish = grpc_tokens(run.grpc_target, prompt_of(n, 3), 20)
    assert tokens == solo(reference, prompt_of(n, 3), 20)
    assert finish == 2
    after = counters(run.cluster)
    # The prompt is computed once (in ceil(n / 64) forwards); decode computes only the 19 new tokens.
    assert after["prompt_tokens"] - before["prompt_tokens"] == n
    assert after["prefill_forwards"] - before["prefill_forwards"] == -(-n // 64)
    assert after["decode_tokens"] - before["decode_tokens"] == 19
    assert_no_pages_left(run)


def test_metrics_show_an_in_place_handoff(running):
    run, _ = running

    async def go():
        return [o async for o in run.client.generate("colo-metrics", prompt_of(40),
                                                      SamplingParams(max_tokens=5, temperature=0))]

    m = asyncio.run(go())[-1].metrics
    assert (m.prompt_tokens, m.output_tokens, m.kv_bytes, m.kv_transfer_s) == (40, 5, 0, 0.0)
    t = m.timings()
    assert t["ttft_s"] >= t["queue_s"] + t["prefill_compute_s"] - 1e-9
    assert abs(t["queue_s"] + t["prefill_compute_s"] + t["delivery_s"] - t["ttft_s"]) < 1e-6


def test_concurrent_streams_share_forwards_and_equal_solo_runs(running, reference):
    run, _ = running
    lengths = [1, 2, 7, 8, 9, 15, 16, 17, 33, 64, 100, 150, 200, 260, 300, 5] * 2
    jobs = [(prompt_of(n, i), 8 + (i * 7) % 33) for i, n in enumerate(lengths)]
    before = counters(run.cluster)
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futs = [pool.submit(grpc_tokens, run.grpc_target, p, k, f"colo-{i}") for i, (p, k) in enumerate(jobs)]
        results = [f.result(timeout=200) for f in futs]
    for i, ((prompt, k), (tokens, _)) in enumerate(zip(jobs, results)):
        assert_same_greedy(tokens, solo(reference, prompt, k), prompt, f"stream {i} (prompt {len(prompt)}, {k} tokens)")
    after = counters(run.cluster)
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(lengths)
    assert after["decode_tokens"] - before["decode_tokens"] == sum(k - 1 for _, k in jobs)
    # 32 prompts of 3,070 tokens at 64 per forward: no more forwards than whole chunks need plus one
    # per prompt boundary, i.e. short prompts did share forwards.
    assert after["prefill_forwards"] - before["prefill_forwards"] < len(jobs) + sum(lengths) // 64
    assert_no_pages_left(run)


def test_http_stream_reports_the_ttft_breakdown(running):
    import httpx

    run, server = running
    body = {"model": run.client.model_name, "prompt": prompt_of(30), "max_tokens": 6, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", f"{server.http_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk
    assert usage["usage"]["completion_tokens"] == 6
    t = usage["kvrelay_timings"]
    assert set(t) >= {"queue_s", "prefill_compute_s", "kv_handoff_s", "kv_bytes", "ttft_s", "delivery_s"}
    assert t["kv_bytes"] == 0 and t["prefill_compute_s"] > 0


def test_batched_prompts_equal_solo_runs(running, reference):
    """A list of prompts in one /v1/completions request (lm-eval batches this way): one choice per prompt,
    each equal to the single-process run, queued prompts sharing forwards."""
    import httpx

    run, server = running
    prompts = [prompt_of(n, 40 + n) for n in (3, 70, 11, 130)]
    body = {"model": run.client.model_name, "prompt": prompts, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for i, (c, p) in enumerate(zip(choices, prompts)):  # queued prompts share forwards: other shapes
        assert c["prompt_token_ids"] == p
        assert_same_greedy(c["token_ids"], solo(reference, p, 12), p, f"prompt {i} of the list")
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert_no_pages_left(run)


def test_min_tokens_on_the_cluster_equals_llm_generate(running, reference):
    """HTTP min_tokens with a stop token greedy decoding would emit early: the served stream equals
    single-process LLM.generate with the same parameters (both mask the stop token for 8 tokens)."""
    import httpx

    run, server = running
    prompt = prompt_of(21, 5)
    stop = solo(reference, prompt, 4)[1]
    params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(stop,), min_tokens=8)
    want = [o.token_id for o in reference.generate(prompt, params)]
    body = {"model": run.client.model_name, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "stop_token_ids": [stop], "min_tokens": 8, "return_token_ids": True}
    r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want and len(want) > 8 and stop not in want[:8]
    assert_no_pages_left(run)


def test_penalties_and_min_p_on_the_cluster_equal_llm_generate(running, reference):
    """HTTP presence/frequency penalties (greedy, so every step depends on the tokens so far) and min_p
    with a seed: the served stream equals single-process LLM.generate with the same parameters."""
    import httpx

    run, server = running
    prompt = prompt_of(19, 8)
    for extra in ({"temperature": 0, "frequency_penalty": 1.2, "presence_penalty": 0.6},
                  {"temperature": 0.9, "seed": 5, "min_p": 0.05, "frequency_penalty": 0.5}):
        params = SamplingParams(max_tokens=40, **extra)
        want = [o.token_id for o in reference.generate(prompt, params)]
        body = {"model": run.client.model_name, "prompt": prompt, "max_tokens": 40, "ignore_eos": True,
                "return_token_ids": True, **extra}
        r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
    assert want != solo(reference, prompt, 40)
    assert_no_pages_left(run)


def check_top_logprobs(server, model: str, reference, prompt: list[int]) -> None:
    """Completions logprobs=3, streamed, greedy: each token's three alternatives equal single-process
    LLM.generate's (the sampled token first, its logprob the token's own)."""
    import httpx

    params = SamplingParams(max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    want = list(reference.generate(prompt, params))
    body = {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 3,
            "stream": True, "return_token_ids": True}
    ids, tops, lps = [], [], []
    with httpx.stream("POST", f"{server.http_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                ids += choice["token_ids"]
                lps += choice["logprobs"]["token_logprobs"]
                tops += choice["logprobs"]["top_logprobs"]
    assert ids == [o.token_id for o in want]
    assert lps == pytest.approx([o.logprob for o in want], abs=1e-4)
    from kvrelay.router import harmony

    for top, o in zip(tops, want):
        assert list(top) == [harmony.decode_tokens([t]) for t, _ in o.top_logprobs]
        assert list(top.values()) == pytest.approx([lp for _, lp in o.top_logprobs], abs=1e-4)
        assert o.top_logprobs[0][0] == o.token_id


def test_top_logprobs_on_the_cluster_equal_llm_generate(running, reference):
    run, server = running
    check_top_logprobs(server, run.client.model_name, reference, prompt_of(17, 4))
    assert_no_pages_left(run)


def test_n_choices_equal_llm_generate_with_consecutive_seeds(running, reference):
    import httpx

    run, server = running
    prompt = prompt_of(15, 6)
    body = {"model": run.client.model_name, "prompt": prompt, "max_tokens": 12, "temperature": 0.9, "seed": 11,
            "n": 3, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = {c["index"]: c["token_ids"] for c in r.json()["choices"]}
    want = {j: [o.token_id for o in reference.generate(prompt, SamplingParams(max_tokens=12, temperature=0.9,
                                                                               seed=11 + j))] for j in range(3)}
    assert got == want and len({tuple(v) for v in want.values()}) > 1
    assert r.json()["usage"]["prompt_tokens"] == len(prompt) and r.json()["usage"]["completion_tokens"] == 36
    assert_no_pages_left(run)


def test_abort_mid_stream_frees_the_pages(running):
    run, _ = running

    async def go():
        agen = run.client.generate("colo-abort", prompt_of(200), SamplingParams(max_tokens=400, temperature=0))
        got = 0
        async for _ in agen:
            got += 1
            if got == 3:
                break
        await agen.aclose()
        await run.client.abort("colo-abort")

    asyncio.run(go())
    assert_no_pages_left(run)


def test_echo_prompt_logprobs_and_repetition_penalty(running, reference):
    """Prompt logprobs from the colocated worker's chunked prefill (a 150-token prompt: three 64-token
    chunks, side by side with a short one) equal a float64 reference; repetition_penalty equals LLM."""
    from scoring_checks import check_echo_scoring, check_repetition_penalty

    run, server = running
    check_echo_scoring(server, run.client.model_name, reference, [prompt_of(150, 9), prompt_of(7, 2)])
    check_repetition_penalty(server, run.client.model_name, reference, prompt_of(23, 5))
    assert_no_pages_left(run)
