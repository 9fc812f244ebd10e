"""KV pool sizing after the weights (engine/memory.py) and the Runner's pool swap it relies on."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.config import load_model_config
from kvrelay.engine.kv_geometry import window_pages
from kvrelay.engine.memory import (GIB, GRAPH_RESERVE_BYTES, KVDoesNotFit, chunk_headroom, decode_activation_bytes,
                                   kv_budget, page_bytes, plan_cuda_pool, split_pages)


def test_page_bytes_of_the_real_models():
    # 20b: 12 full + 12 sliding layers, 8 KV heads x 64 dims, bf16, K and V, 16 positions a page.
    cfg = load_model_config("gpt-oss-20b")
    assert page_bytes(cfg, page_size=16, kv_heads=8) == {"full": 12 * 2 * 16 * 8 * 64 * 2,
                                                          "sliding": 12 * 2 * 16 * 8 * 64 * 2}
    cfg = load_model_config("gpt-oss-120b")
    assert page_bytes(cfg, page_size=16, kv_heads=8)["full"] == 18 * 2 * 16 * 8 * 64 * 2


def test_sliding_group_gets_windows_plus_one_chunk_and_the_rest_goes_to_full():
    cfg = load_model_config("gpt-oss-20b")
    assert window_pages(cfg.sliding_window, 16) == 9  # 128 positions can straddle one more page boundary
    pb = page_bytes(cfg, page_size=16, kv_heads=8)
    pages = split_pages(cfg, budget_bytes=20 * GIB, page_size=16, kv_heads=8, max_seqs=128, chunk_tokens=8192,
                        max_tokens=10**9)
    headroom = chunk_headroom(chunk_tokens=8192, page_size=16, max_seqs=128)
    assert headroom == 8192 // 16 + 1 + 128
    sliding = 128 * 9 + headroom
    assert pages["sliding"] == sliding
    # What a colocated worker may reserve (pool minus the chunk headroom) fits max_seqs full windows: a
    # 120b run at 256 streams ran out of sliding pages when the headroom was taken from the windows.
    assert pages["sliding"] - headroom >= 128 * window_pages(cfg.sliding_window, 16)
    assert pages["full"] == (20 * GIB - sliding * pb["sliding"]) // pb["full"]
    # More could never be used: capped at max_tokens positions.
    capped = split_pages(cfg, budget_bytes=20 * GIB, page_size=16, kv_heads=8, max_seqs=128, chunk_tokens=8192,
                         max_tokens=4096)
    assert capped == {"full": 256, "sliding": 256}


def test_cuda_plan_refuses_a_pool_too_small_for_one_request_naming_the_key(monkeypatch):
    """plan_cuda_pool with torch.cuda's memory queries stubbed: 1 GiB left after weights cannot hold one
    131072-token request of 20b (6 GiB of full-attention KV)."""
    from kvrelay.engine.runner import Runner

    class FakeRunner:
        cfg = load_model_config("gpt-oss-20b")
        device = torch.device("cpu")
        page_size = 16

        class kv:  # noqa: N801 - stands in for the KVCache attribute
            kv_heads = 8

        def profile_forward(self, n):
            pass

        def drop_kv(self):
            pass

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: GIB // 2)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(3.5 * GIB), 140 * GIB))
    with pytest.raises(KVDoesNotFit) as e:
        plan_cuda_pool(FakeRunner(), fraction=0.9, max_seqs=64, chunk_tokens=8192, max_tokens=10**9,
                       need_tokens=131072, key="decode.kv_memory_fraction")
    msg = str(e.value)
    assert msg.startswith("decode.kv_memory_fraction: 0.9 of the 1.00 GiB left after weights (136.50 GiB in use)")
    assert "fewer than the 131072 one request may need" in msg
    plan = plan_cuda_pool(FakeRunner(), fraction=0.9, max_seqs=64, chunk_tokens=8192, max_tokens=10**9,
                          need_tokens=1000, key="decode.kv_memory_fraction")
    assert plan.activation_bytes == GIB // 2 and plan.reserve_bytes == GIB // 2 + 2 * GIB
    assert plan.kv_bytes <= 0.9 * GIB
    assert Runner  # the real Runner's side is tested below


def test_kv_memory_fraction_is_a_share_of_what_weights_activations_and_graphs_leave():
    assert GRAPH_RESERVE_BYTES == 2 * GIB
    assert kv_budget(12 * GIB, activation=2 * GIB, fraction=0.5) == 4 * GIB
    assert kv_budget(3 * GIB, activation=2 * GIB, fraction=0.9) == 0  # nothing left: none, not negative


def _decode_spec(*, tp: int, fraction: float, max_batch: int = 128):
    from kvrelay.transfer.ucx import UcxSettings
    from kvrelay.workers.specs import DecodeSpec, ModelSpec

    model = ModelSpec(name="gpt-oss-120b", dummy=True, quant="fp8-block128", seed=0, max_context=131072)
    return DecodeSpec(model=model, device="cuda", tp=tp, ep=tp, page_size=16, max_batch=max_batch,
                      graph_sizes=(1,), kv_memory_fraction=fraction, overlap_steps=True, need_tokens=131072,
                      ucx=UcxSettings(tls="tcp"))


def test_tensor_parallel_decode_gives_the_fraction_the_one_gpu_meaning():
    """decode_worker/ranks.pool_tokens (a TP rank, sized before loading) takes off the estimated weights per
    rank, the estimated activations and the graph reserve before applying the fraction, as plan_cuda_pool
    does on one GPU with measured activations: the same key, the same meaning (it used to be the share of
    what the weights alone left)."""
    from kvrelay.decode_worker.ranks import pool_tokens
    from kvrelay.engine.kv_geometry import bytes_per_token

    cfg = load_model_config("gpt-oss-120b")
    spec = _decode_spec(tp=4, fraction=0.5)
    free = 140 * GIB
    weights = cfg.weight_bytes("fp8-block128") // 4
    activation = decode_activation_bytes(cfg, batch=128)
    assert 0 < activation < GIB  # 128 sequences' fp32 logits twice, doubled: ~0.8 GiB
    per_token = bytes_per_token(cfg.num_hidden_layers, 2, cfg.head_dim, 2)  # 8 KV heads over 4 ranks
    expected = int((free - weights - activation - 2 * GIB) * 0.5) // per_token
    assert pool_tokens(spec, free_bytes=free) == expected
    # A fraction that would cover the weights' leftovers alone now leaves the activations and graphs room.
    assert pool_tokens(spec, free_bytes=free) < int((free - weights) * 0.5) // per_token


def test_runner_pool_swap_keeps_the_model_and_serves_the_new_pool():
    from kvrelay.engine.runner import Runner

    r = Runner.load("tiny", dummy=True, seed=0, num_pages=40)
    before = r.prefill("a", list(range(1, 30)))
    r.free("a")
    r.profile_forward(300)  # the throwaway sequence is gone afterwards
    assert not r.kv.seqs and r.free_pages() == {"full": 40, "sliding": 40}
    r.drop_kv()
    assert all(p.numel() == 0 for p in r.kv.pools.values())
    r.resize_kv({"full": 64, "sliding": 12})
    assert {g: a.num_pages for g, a in r.kv.allocators.items()} == {"full": 64, "sliding": 12}
    after = r.prefill("a", list(range(1, 30)))
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="sequences are alive"):
        r.resize_kv(80)
