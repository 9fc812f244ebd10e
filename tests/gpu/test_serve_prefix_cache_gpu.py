"""The real `kvrelay serve` on one GPU with prefill.prefix_cache and router.policy kv-aware (colocated,
the one-GPU layout): prompts that share a 600-token system prompt, diverge inside the sliding window (128)
before a cached page boundary, or repeat, stream the in-process engine's greedy tokens for the same chunks
(up to a near-tie of its top-2 logits: the served forwards are padded to the piecewise graphs' sizes); the
hits are where the cache puts them (`kvrelay status`, usage.prompt_tokens_details.cached_tokens); no page
is left held by a request.

The reference runs the chunks the worker runs: chunks of `prefill.chunk_tokens` from 0 up to the hit (the
cached pages' KV is what those chunks wrote, bit for bit: tests/gpu/test_prefix_cache_gpu.py), then chunks
from the hit. Against a reference that prefills in one forward (no cut at the hit), 2026-12-03 at f6aeee2 one
stream left it at step 20 of 24, where the dummy model's two favourite tokens cross over slowly: a
margin above 4 bf16 steps, inside the noise of computing the suffix in other chunks."""

from __future__ import annotations

import httpx
import pytest

from test_prefix_cache_gpu import greedy
from test_serve_gpu import COMMON, Server, assert_same_or_tie, prompt_of, reference  # noqa: F401

pytestmark = pytest.mark.gpu
CHUNK = 256  # prefill.chunk_tokens below

CONFIG = COMMON.replace("http_port: 0}", "http_port: 0, policy: kv-aware}") + """
prefill: {workers: 1, max_prompt_tokens: 2048, chunk_tokens: %d, prefix_cache: true}
decode: {workers: 1, max_batch: 16, page_size: 16, cuda_graph_batch_sizes: [1, 2, 4, 8, 16], kv_memory_fraction: 0.1}
gpus: 1
colocate: true
""" % CHUNK
SYSTEM = prompt_of(600, 7)  # 37 whole pages of 16
PROMPTS = [
    (SYSTEM + prompt_of(40, 1), 0),
    (SYSTEM + prompt_of(25, 2), 592),  # the system prompt's whole pages
    (SYSTEM[:500] + prompt_of(60, 3), 496),  # diverges 4 tokens past the boundary at 496
    (SYSTEM + prompt_of(40, 1), 624),  # the first prompt again: all its whole pages but the last token's
]


def chunked_greedy(ref, prompt: list[int], cut: int, k: int) -> list[int]:
    """The reference's greedy tokens when its prompt runs in the chunks a worker with a hit at `cut` runs
    (test_prefix_cache_gpu.greedy: chunks up to `cut`, then from it)."""
    return greedy(ref.runner, ("chunked", cut, tuple(prompt)), prompt, cut, chunk=CHUNK, n_decode=k)[0]


def hit_tokens(server: Server) -> int:
    return next(r for r in server.status() if r["role"] == "colocated")["prefix_cache"]["hit_tokens"]


def test_serve_prefix_cache_one_gpu(tmp_path, reference):  # noqa: F811
    server = Server(tmp_path, CONFIG)
    try:
        for i, (prompt, cached) in enumerate(PROMPTS):
            before = hit_tokens(server)
            got = server.complete(prompt, 24)
            assert_same_or_tie(reference, prompt, got, chunked_greedy(reference, prompt, cached, 24),
                               f"prompt {i}")
            assert hit_tokens(server) - before == cached, f"prompt {i}"
        body = {"model": server.ready["model"], "prompt": PROMPTS[1][0], "max_tokens": 4, "temperature": 0}
        usage = httpx.post(f"{server.ready['http']}/v1/completions", json=body, timeout=300).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == (len(PROMPTS[1][0]) - 1) // 16 * 16
        rows = server.status()
        pc = next(r for r in rows if r["role"] == "colocated")["prefix_cache"]
        assert pc["evictable_pages"] == pc["cached_pages"]  # only the cache holds its pages now
        assert not any(any(r["pages_in_use"].values()) or r.get("admitted") for r in rows), rows
    finally:
        server.stop()
    assert server.proc.returncode == 0, "".join(server.lines[-40:])
