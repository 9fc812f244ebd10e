"""The real `kvrelay serve` with the prefix cache on a TP2 prefill worker (GPUs 0 and 1, NCCL between its
ranks; decode on GPU 2, the KV over NIXL) and a host tier split over the two ranks (pinned): prompts that
share a 600-token system prompt, diverge inside the sliding window (128) before a cached page boundary,
or repeat, stream the in-process engine's greedy tokens (no cache, one GPU) up to a near-tie of its top-2
logits; the hits are where the cache puts them, counted once (rank 0's row of `kvrelay status`,
usage.prompt_tokens_details.cached_tokens); no rank holds a page for a request afterwards.
Needs three GPUs (nvidia-h200-x4)."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from test_serve_gpu import COMMON, Server, assert_same_or_tie, greedy, reference  # noqa: F401
from test_serve_prefix_cache_gpu import PROMPTS

pytestmark = pytest.mark.gpu

CONFIG = COMMON + """
prefill: {workers: 1, tp: 2, max_prompt_tokens: 2048, chunk_tokens: 256, prefix_cache: true, prefix_cache_host_gib: 0.5}
decode: {workers: 1, max_batch: 16, page_size: 16, cuda_graph_batch_sizes: [1, 2, 4, 8, 16], kv_memory_fraction: 0.1}
kv_transfer: {ucx_tls: "cuda_ipc,cuda_copy,tcp"}
gpus: 3
"""


def test_serve_prefix_cache_on_a_tp2_prefill_worker(tmp_path, reference):  # noqa: F811
    if torch.cuda.device_count() < 3:
        pytest.skip("needs three GPUs (nvidia-h200-x4): a TP2 prefill worker and a decode worker")
    server = Server(tmp_path, CONFIG)

    def lead(rows=None) -> dict:
        rows = rows or server.status()
        assert all(r.get("prefix_cache") is None for r in rows if r["tp_rank"] > 0)  # counted once per group
        return next(r for r in rows if r["role"] == "prefill" and r["tp_rank"] == 0)["prefix_cache"]

    try:
        for i, (prompt, cached) in enumerate(PROMPTS):
            before = lead()["hit_tokens"]
            got = server.complete(prompt, 24)
            assert_same_or_tie(reference, prompt, got, greedy(reference, prompt, 24))
            assert lead()["hit_tokens"] - before == cached, f"prompt {i}"
        body = {"model": server.ready["model"], "prompt": PROMPTS[1][0], "max_tokens": 4, "temperature": 0}
        usage = httpx.post(f"{server.ready['http']}/v1/completions", json=body, timeout=300).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == (len(PROMPTS[1][0]) - 1) // 16 * 16
        rows = server.status()
        pc = lead(rows)
        assert pc["hits"] == 4 and pc["host"]["pinned"] and pc["host"]["bytes_total"] <= 0.5 * 2**30
        assert pc["evictable_pages"] == pc["cached_pages"]  # only the cache holds its pages now
        assert len([r for r in rows if r["role"] == "prefill"]) == 2
        deadline = time.monotonic() + 20  # the last lease goes once decode has pulled it
        while any(any(r["pages_in_use"].values()) or r.get("leases") or r.get("admitted") for r in rows):
            assert time.monotonic() < deadline, f"KV pages still held: {rows}"
            time.sleep(0.5)
            rows = server.status()
    finally:
        server.stop()
    assert server.proc.returncode == 0, "".join(server.lines[-40:])
