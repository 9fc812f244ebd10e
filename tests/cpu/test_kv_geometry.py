"""KV page geometry (engine/kv_geometry.py) agrees with what the cache actually holds, step by step."""

from __future__ import annotations

from kvrelay.engine.config import PRESETS
from kvrelay.engine.kv_cache import KVCache
from kvrelay.engine.kv_geometry import (FULL, GROUPS, SLIDING, live_pages, pages_spanned, window_pages,
                                        worst_case_pages)


def test_the_cache_holds_exactly_the_live_pages_and_never_more_than_the_worst_case():
    cfg = PRESETS["tiny"]  # sliding window 8
    for ps in (1, 4, 16):
        kv = KVCache(cfg, num_pages=4096, page_size=ps, device="meta")
        kv.import_sequence("s", 3)
        peak = {g: 0 for g in GROUPS}
        for length in range(3, 120):
            held = kv.export_sequence("s")
            for g in GROUPS:
                want = live_pages(g, length, ps, cfg.sliding_window)
                assert held.first_page[g] == want.start and len(held.pages[g]) == len(want), (ps, length, g)
            kv.reserve("s", 1)
            peak = {g: max(peak[g], len(kv.seqs["s"].pages[g])) for g in GROUPS}  # during the step
            kv.commit("s", 1)
        worst = worst_case_pages(120, ps, cfg.sliding_window)
        assert all(peak[g] <= worst[g] for g in GROUPS), (ps, peak, worst)
        assert worst[FULL] == pages_spanned(120, ps) and worst[SLIDING] == min(worst[FULL],
                                                                               window_pages(cfg.sliding_window, ps))


def test_one_spelling_of_the_groups_and_one_layout_hash():
    """The config's layer types map to the page groups in one place, and the cache's layout hash is the
    handoff's (KVLayout): two pools agree on pages in-process exactly when they would over NIXL."""
    import dataclasses

    import pytest
    import torch

    from kvrelay.engine.config import FULL_ATTENTION, SLIDING_ATTENTION
    from kvrelay.engine.kv_geometry import bytes_per_token, group_layers, layer_groups, page_bytes
    from kvrelay.transfer.handle import layout_of

    cfg = PRESETS["tiny"]
    groups = layer_groups(cfg.layer_types)
    assert cfg.layer_types == (SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION)
    assert groups == (SLIDING, FULL, SLIDING) and group_layers(groups, SLIDING) == cfg.sliding_layers
    with pytest.raises(ValueError, match="'chunked_attention' has no KV page group"):
        layer_groups(("chunked_attention",))
    kv = KVCache(cfg, num_pages=8, page_size=4)
    layout, pools = layout_of(kv)
    assert kv.layout_hash() == layout.layout_hash
    assert kv.layout_hash() != KVCache(cfg, num_pages=8, page_size=8).layout_hash()
    assert kv.layout_hash() != KVCache(cfg, num_pages=8, page_size=4, dtype=torch.float32).layout_hash()
    assert layout.layout_hash != dataclasses.replace(layout, sliding_window=16).layout_hash
    # Bytes: one page of one layer is one pool slice; a position over every layer is what the pools hold.
    assert pools[FULL][0][0].nbytes == page_bytes(4, cfg.num_key_value_heads, cfg.head_dim, 2)
    total = sum(t.nbytes for ts in pools.values() for t in ts)
    assert total == 8 * 4 * bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 2)


def test_the_context_rule_is_one_function():
    from kvrelay.engine.sampling import SamplingParams, context_full, finish_reason_at

    p = SamplingParams(max_tokens=10, stop_token_ids=(7,))
    assert finish_reason_at(3, 1, p, total_tokens=99, max_context=100) is None
    assert finish_reason_at(3, 1, p, total_tokens=100, max_context=100) == "length"
    assert finish_reason_at(7, 1, p, total_tokens=100, max_context=100) == "stop"  # a stop token wins
    assert finish_reason_at(3, 10, p, total_tokens=5, max_context=100) == "length"
    assert context_full(100, 100) and not context_full(99, 100)
