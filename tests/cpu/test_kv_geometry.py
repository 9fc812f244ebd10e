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
