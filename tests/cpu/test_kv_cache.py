"""Paged KV cache bookkeeping (no model) and a KV export/import round trip through two Runners."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.engine.config import PRESETS
from kvrelay.engine.kv_cache import KVCache, OutOfPages, PageAllocator
from kvrelay.engine.kv_geometry import FULL, SLIDING
from kvrelay.engine.runner import Runner

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "gpt-oss-tiny-original"
CFG = PRESETS["tiny"]  # sliding_window 8
pytestmark = pytest.mark.usefixtures("model_single_thread")


def test_allocator_hands_out_and_takes_back():
    a = PageAllocator(4)
    assert a.allocate(3) == [0, 1, 2]
    with pytest.raises(OutOfPages):
        a.allocate(2)
    a.release([1])
    assert a.num_free == 2
    with pytest.raises(ValueError, match="not allocated"):
        a.release([1])


def test_sliding_group_keeps_only_the_window():
    kv = KVCache(CFG, num_pages=64, page_size=4)
    kv.reserve("s", 30)
    kv.commit("s", 30)
    seq = kv.export_sequence("s")
    # The next query (position 30) sees positions 23..30: logical pages 5..7 cover them.
    assert seq.first_page == {FULL: 0, SLIDING: (30 - 8 + 1) // 4}
    assert len(seq.pages[FULL]) == 8 and len(seq.pages[SLIDING]) == 8 - 5
    assert kv.free_pages() == {FULL: 56, SLIDING: 61}
    for _ in range(10):  # decode steps keep the sliding group bounded
        kv.reserve("s", 1)
        kv.commit("s", 1)
    assert len(kv.export_sequence("s").pages[SLIDING]) <= -(-(CFG.sliding_window - 1) // 4) + 1
    kv.free("s")
    assert kv.free_pages() == {FULL: 64, SLIDING: 64}


def test_plan_is_flashinfer_csr():
    kv = KVCache(CFG, num_pages=64, page_size=4)
    kv.reserve("a", 6)
    kv.commit("a", 6)
    kv.reserve("a", 1)
    kv.reserve("b", 3)
    layout = kv.plan([("a", 1), ("b", 3)])
    assert layout.qo_indptr.tolist() == [0, 1, 4]
    assert layout.positions.tolist() == [6, 0, 1, 2]
    assert layout.logit_rows.tolist() == [0, 3]
    full = layout.kv[FULL]
    assert full.kv_indptr.tolist() == [0, 2, 3]
    assert full.kv_last_page_len.tolist() == [3, 3]
    pa, pb = kv.seqs["a"].pages[FULL], kv.seqs["b"].pages[FULL]
    assert full.kv_indices.tolist() == pa[:2] + pb[:1]
    assert layout.write_pages[FULL].tolist() == [pa[1], pb[0], pb[0], pb[0]]
    assert layout.write_offsets[FULL].tolist() == [2, 0, 1, 2]


def test_reserve_is_all_or_nothing():
    kv = KVCache(CFG, num_pages={FULL: 4, SLIDING: 2}, page_size=4)
    assert kv.pages_needed(12) == {FULL: 3, SLIDING: 3}
    assert not kv.can_allocate(12)
    with pytest.raises(OutOfPages):
        kv.reserve("s", 12)
    assert kv.free_pages() == {FULL: 4, SLIDING: 2} and "s" not in kv.seqs


def test_export_import_continues_identically():
    """Prefill on one runner, copy the pages into a second runner's pool at the ids it allocated, decode
    there: the logits equal decoding on the first runner (what a NIXL handoff must achieve)."""
    from kvrelay.engine.config import load_model_config
    from kvrelay.engine.weights import open_weights

    cfg = load_model_config(FIXTURE)
    w = open_weights(FIXTURE, cfg)
    a = Runner(cfg, w, page_size=4, kv_tokens=256)
    b = Runner(cfg, w, page_size=4, kv_tokens=512)
    b.kv.reserve("other", 9)  # so b's page ids differ from a's
    b.kv.commit("other", 9)
    prompt = list(range(3, 3 + 2 * cfg.sliding_window + 3))
    first = int(a.prefill("s", prompt).argmax())
    src = a.export_sequence("s")
    dst = b.import_sequence("s", src.length)
    assert dst.first_page == src.first_page and dst.pages != src.pages
    b.kv.copy_pages(a.kv, src, dst)
    tok_a, tok_b = first, first
    for _ in range(2 * cfg.sliding_window):
        la, lb = a.decode(["s"], [tok_a])[0], b.decode(["s"], [tok_b])[0]
        assert torch.equal(la, lb)
        tok_a = tok_b = int(la.argmax())
    with pytest.raises(ValueError, match="already exists"):
        b.import_sequence("s", 5)


def test_runner_errors_leave_no_state():
    from kvrelay.engine.config import load_model_config
    from kvrelay.engine.weights import open_weights

    cfg = load_model_config(FIXTURE)
    r = Runner(cfg, open_weights(FIXTURE, cfg), page_size=4, kv_tokens=64)
    with pytest.raises(ValueError, match="outside"):
        r.prefill("x", [1, cfg.vocab_size])
    with pytest.raises(OutOfPages):
        r.prefill("x", list(range(100)))
    assert not r.has_sequence("x") and r.free_pages() == {FULL: 16, SLIDING: 16}
    with pytest.raises(KeyError):
        r.decode(["nope"], [1])


def test_plan_decode_equals_plan_lists():
    """The numpy decode planner gives the same layout as the general one, across page boundaries, a
    sliding window that dropped pages, and sequences of very different lengths."""
    import numpy as np

    kv = KVCache(CFG, num_pages=512, page_size=4, device="meta")
    lengths = [1, 3, 4, 5, 16, 37, 130]
    ids = [f"s{i}" for i in range(len(lengths))]
    for sid, n in zip(ids, lengths):
        kv.import_sequence(sid, n)
    for _ in range(6):  # several steps: pages appear, sliding pages drop out of the window
        for sid in ids:
            kv.reserve(sid, 1)
        want = kv.plan_lists([(sid, 1) for sid in ids])
        got = kv.plan_decode(ids)
        for key in ("qo", "positions", "rows"):
            assert np.array_equal(got[key], np.array(want[key])), key
        for key in ("indptr", "indices", "last_len", "w_pages", "w_offsets"):
            for g in ("full", "sliding"):
                assert np.array_equal(got[key][g], np.array(want[key][g])), (key, g)
        for sid in ids:
            kv.commit(sid, 1)


def test_graph_host_arrays_pad_a_decode_plan():
    """The CUDA-graph step's host buffers: real rows from the decode plan, padding rows on the scratch
    page (one page each, last length 1, offset 0), written where the graph's views read them."""
    from kvrelay.engine.cuda_graph import graph_host_arrays, graph_offsets

    kv = KVCache(CFG, num_pages=512, page_size=4, device="meta")
    ids = ["a", "b", "c"]
    for sid, n in zip(ids, [3, 9, 22]):
        kv.import_sequence(sid, n)
        kv.reserve(sid, 1)
    plan = kv.plan_decode(ids)
    plan["ids"] = [7, 8, 9]
    mx, bs, scratch = 8, 4, {"full": 500, "sliding": 501}
    o, o32, n32 = graph_offsets(mx, {"full": 520, "sliding": 520})
    a64, a32, used = graph_host_arrays(plan, bs, mx, o, o32, n32, scratch)
    assert list(a64[:3]) == [7, 8, 9] and list(a64[o["pos"]: o["pos"] + 3]) == [3, 9, 22]
    assert list(a64[o["rows"]: o["rows"] + mx]) == list(range(mx))
    for g in ("full", "sliding"):
        assert list(a64[o[("wp", g)]: o[("wp", g)] + bs]) == list(plan["w_pages"][g]) + [scratch[g]]
        assert list(a64[o[("wo", g)]: o[("wo", g)] + bs]) == list(plan["w_offsets"][g]) + [0]
        ip = list(a32[o32[("ip", g)]: o32[("ip", g)] + bs + 1])
        assert ip == list(plan["indptr"][g]) + [plan["indptr"][g][-1] + 1]
        assert list(a32[o32[("ll", g)]: o32[("ll", g)] + bs]) == list(plan["last_len"][g]) + [1]
        assert used[g] == len(plan["indices"][g]) + 1
    tail = list(a32[n32:])
    assert tail == list(plan["indices"]["full"]) + [500] + list(plan["indices"]["sliding"]) + [501]
    assert list(a32[: mx + 1]) == list(range(mx + 1))
    capture64, capture32, _ = graph_host_arrays(None, bs, mx, o, o32, n32, scratch)  # capture: all padding
    assert list(capture32[o32[("ip", "full")]: o32[("ip", "full")] + bs + 1]) == list(range(bs + 1))


# ---- fork: the n choices of one prompt share its pages ---------------------------------------------------

def _filled(kv: KVCache, seq: str, length: int) -> None:
    """A sequence of `length` positions whose pages hold distinct bytes (so a copy can be told apart)."""
    kv.reserve(seq, length)
    kv.commit(seq, length)
    for g in (FULL, SLIDING):
        pool = kv.pools[g]
        pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).reshape(pool.shape).to(pool.dtype))


def test_fork_shares_whole_pages_and_copies_the_partial_one():
    kv = KVCache(CFG, num_pages=32, page_size=4, dtype=torch.float32)
    _filled(kv, "p", 10)  # full: pages for 0-3, 4-7 whole, 8-9 partial; sliding (window 8) from logical page 0
    parent = kv.export_sequence("p")
    used = {g: kv.allocators[g].num_used for g in (FULL, SLIDING)}
    child = kv.fork("p", "c")
    assert child.length == 10 and child.first_page == parent.first_page
    for g in (FULL, SLIDING):
        first = parent.first_page[g]
        whole = [i for i in range(len(parent.pages[g])) if (first + i + 1) * 4 <= 10]
        assert [child.pages[g][i] for i in whole] == [parent.pages[g][i] for i in whole]
        for i in whole:
            assert kv.allocators[g].refs(parent.pages[g][i]) == 2
        last_p, last_c = parent.pages[g][-1], child.pages[g][-1]
        assert last_c != last_p and kv.allocators[g].refs(last_c) == 1 and kv.allocators[g].refs(last_p) == 1
        # The copy, byte for byte, in every layer of the group.
        assert torch.equal(kv.pools[g][:, last_c], kv.pools[g][:, last_p])
        assert kv.allocators[g].num_used == used[g] + 1  # one page more per group, not a second prompt
    # Writing the child's next position leaves the parent's partial page as it was.
    before = kv.pools[FULL][:, parent.pages[FULL][-1]].clone()
    kv.pools[FULL][:, child.pages[FULL][-1], :, 2] = -1.0
    assert torch.equal(kv.pools[FULL][:, parent.pages[FULL][-1]], before)
    with pytest.raises(ValueError, match="already exists"):
        kv.fork("p", "c")


def test_fork_frees_each_shared_page_once_whoever_ends_first():
    kv = KVCache(CFG, num_pages=32, page_size=4)
    _filled(kv, "p", 12)  # a whole number of pages: nothing to copy
    kv.fork("p", "c1")
    kv.fork("p", "c2")
    assert kv.allocators[FULL].num_used == 3  # three sequences, one prompt's pages
    kv.free("p")
    assert kv.allocators[FULL].num_used == 3  # the children still hold them
    for _ in range(9):  # the children grow apart; the sliding group trims its shared pages away
        for c in ("c1", "c2"):
            kv.reserve(c, 1)
            kv.commit(c, 1)
    kv.free("c1")
    kv.free("c2")
    assert kv.free_pages() == {FULL: 32, SLIDING: 32}
    assert all(a.num_used == 0 for a in kv.allocators.values())
    with pytest.raises(ValueError, match="not allocated"):  # a second free of a shared page is refused
        kv.allocators[FULL].release([0])


def test_fork_is_all_or_nothing():
    kv = KVCache(CFG, num_pages=4, page_size=4)
    _filled(kv, "p", 14)  # 4 full pages held, the last one partial: the fork needs one more
    with pytest.raises(OutOfPages):
        kv.fork("p", "c")
    assert "c" not in kv.seqs and [kv.allocators[FULL].refs(p) for p in kv.seqs["p"].pages[FULL]] == [1] * 4


def test_forked_sequences_decode_as_the_original_would():
    """Two children of one prefill decode apart (different tokens, batched together) after the parent is
    freed, each with the logits of a prompt prefilled on a runner of its own and fed its tokens: the
    shared pages and the copied partial one are the prompt's KV, and neither child writes the other's."""
    from kvrelay.engine.config import load_model_config
    from kvrelay.engine.weights import open_weights

    cfg = load_model_config(FIXTURE)
    w = open_weights(FIXTURE, cfg)
    a = Runner(cfg, w, page_size=4, kv_tokens=512)
    ref = Runner(cfg, w, page_size=4, kv_tokens=512)
    prompt = list(range(3, 3 + 2 * cfg.sliding_window + 3))  # 19 positions: a partial last page
    a.prefill("p", prompt)
    ref.prefill("r1", prompt)
    ref.prefill("r2", prompt)
    a.fork_sequence("p", "c1")
    a.fork_sequence("p", "c2")
    a.free("p")
    toks = [5, 9]
    for _ in range(2 * cfg.sliding_window):
        got = a.decode(["c1", "c2"], toks)
        want = torch.stack([ref.decode(["r1"], [toks[0]])[0], ref.decode(["r2"], [toks[1]])[0]])
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
        toks = [int(want[0].argmax()), int(want[1].topk(2).indices[1])]  # the two grow apart
    a.free("c1")
    a.free("c2")
    assert all(al.num_used == 0 for al in a.kv.allocators.values())


def _layout_tensors(b) -> dict:
    out = {"qo_indptr": b.qo_indptr, "positions": b.positions, "logit_rows": b.logit_rows}
    for g in ("full", "sliding"):
        out |= {f"kv_indptr/{g}": b.kv[g].kv_indptr, f"kv_indices/{g}": b.kv[g].kv_indices,
                f"kv_last/{g}": b.kv[g].kv_last_page_len, f"wp/{g}": b.write_pages[g], f"wo/{g}": b.write_offsets[g]}
    for k, v in b.host.items():
        for g, t in (v.items() if isinstance(v, dict) else [(None, v)]):
            out[f"host/{k}/{g}"] = t
    return out


def test_plan_arrays_equals_plan_lists():
    """The numpy prompt planner (no loop over tokens) gives plan_lists' values element for element, and the
    same BatchLayout tensors (values and dtypes): new prompts, chunks appended after a long prefix whose
    sliding pages dropped out of the window, several sequences in one batch, one-token rows among them."""
    import numpy as np

    from kvrelay.engine import batch_plan, staging

    kv = KVCache(CFG, num_pages=4096, page_size=4, device="cpu")
    cases = [[("a", 0, 1)], [("b", 0, 300)], [("c", 130, 57)], [("d", 7, 1), ("e", 0, 33), ("f", 1000, 401)],
             [("g", 3, 5), ("h", 4, 4), ("i", 5, 3)]]
    for case in cases:
        for sid, length, _ in case:
            if length:
                kv.import_sequence(sid, length)
        for sid, _, n in case:
            kv.reserve(sid, n)
        batch = [(sid, n) for sid, _, n in case]
        want = kv.plan_lists(batch)
        got = batch_plan.plan_arrays([(sid, kv.seqs[sid], n) for sid, n in batch], page_size=kv.page_size,
                                     max_context=CFG.max_context)
        for key in ("qo", "positions", "rows"):
            assert got[key].dtype == np.int64 and got[key].tolist() == want[key], key
        for key in ("indptr", "indices", "last_len", "w_pages", "w_offsets"):
            for g in ("full", "sliding"):
                assert got[key][g].tolist() == want[key][g], (key, g)
        a, b = _layout_tensors(batch_plan.layout(want, kv.device)), _layout_tensors(batch_plan.layout(got, kv.device))
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        # the CUDA branch's one host buffer (engine/staging.pack), from lists or from arrays, the same
        for dt in (torch.int64, torch.int32):
            parts, aparts = ([("positions", p["positions"], dt), ("wp", p["w_pages"]["sliding"], dt), ("qo", p["qo"], dt)]
                             for p in (want, got))
            (da, ha), (db, hb) = staging.pack(parts, kv.device), staging.pack(aparts, kv.device)
            for k in ("positions", "wp", "qo"):
                assert ha[k].dtype == hb[k].dtype == da[k].dtype == dt and torch.equal(ha[k], hb[k]), k
                assert torch.equal(da[k], db[k]) and torch.equal(da[k], ha[k]), k
        # KVCache.plan takes the arrays from ARRAYS_MIN_TOKENS new tokens on, with the same layout
        c = _layout_tensors(kv.plan(batch))
        for k in a:
            assert torch.equal(a[k], c[k]), k
        for sid, _, n in case:
            kv.commit(sid, n)
    with pytest.raises(ValueError, match="max_context"):
        kv.reserve("z", 2)
        batch_plan.plan_arrays([("z", kv.seqs["z"], CFG.max_context + 1)], page_size=4, max_context=CFG.max_context)
