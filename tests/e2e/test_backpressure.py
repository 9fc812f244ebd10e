"""Back-pressure on the real cluster (Ray, colocated tiny worker, HTTP router on 127.0.0.1): with one decode
slot and room for one waiting request, a burst gets its first request served, one queued and served after
it, and the rest an immediate HTTP 429 with Retry-After; every served stream equals the single-process
run and no page is left behind."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from greedy_judge import assert_same_greedy
from test_cluster import assert_no_pages_left, prompt_of, solo

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

TOPOLOGY = """
model: {name: tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 1, max_prompt_tokens: 1024}
decode: {workers: 1, max_batch: 1, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0, max_waiting_requests: 1}
device: cpu
colocate: true
"""


@pytest.fixture(scope="module")
def running():
    from conftest import serving

    with serving(TOPOLOGY) as (run, server):
        assert run.client.admission.max_waiting == 1
        yield run, server


def test_a_burst_beyond_slot_and_line_gets_429(running, reference):
    run, server = running
    n = 6

    def post(i: int) -> httpx.Response:
        body = {"model": run.client.model_name, "prompt": prompt_of(20, i), "max_tokens": 96,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        return httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(post, range(n)))
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 429}, [(r.status_code, r.text[:200]) for r in answers]
    assert 1 <= codes.count(200) < n and codes.count(429) >= 1, codes
    for i, r in enumerate(answers):
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert "router.max_waiting_requests = 1" in r.json()["error"]["message"]
        else:
            prompt = prompt_of(20, i)
            assert_same_greedy(r.json()["choices"][0]["token_ids"], solo(reference, prompt, 96), prompt,
                               f"request {i} (served beside the others)")
    assert run.client.admission.waiting == 0
    assert_no_pages_left(run)
