"""The Triton kernels under TRITON_INTERPRET=1 on CPU tensors, against float32 torch references.

The interpreter flag must be set before triton is imported, so these tests run in a subprocess-free way
only when the whole session was started with TRITON_INTERPRET=1; otherwise each test re-runs itself in a
child interpreter with the flag set (CI runs `pytest tests/cpu` plainly; tests/cpu/interp_helpers.py).
The decode-attention kernel choice (Triton split-KV vs FlashInfer) is in test_triton_decode_interpret.py.
"""

from __future__ import annotations

import pytest
import torch
from interp_helpers import interpreted, refs

_interpreted = interpreted(__file__)

@_interpreted
def test_sink_prefill_interpreted():
    from kvrelay.kernels import triton_attention as ta
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, page = 8, 2, 64, 16
    # Ragged: a 1-key sequence, a chunked prefill (5 new of 37), and a long one crossing window and pages.
    b = refs.make_paged_batch([1, 37, 70], [1, 5, 70], kv_heads, d, page, "cpu", gen=g)
    q = torch.randn(sum(b.q_lens), heads, d, generator=g).bfloat16()
    sinks = (torch.randn(heads, generator=g) + 4).bfloat16()  # large sinks: dropping them must fail
    for window in (None, 8):
        out = torch.full_like(q, float("nan"))
        ta.sink_prefill(q, b.pool, sinks, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_last_page_len,
                        sm_scale=0.125, window=window, out=out, block_q=4, block_n=16)
        ref = refs.sink_attention_ref(q, b, sinks, 0.125, window)
        no_sink = refs.sink_attention_ref(q, b, sinks, 0.125, window, use_sink=False)
        assert refs.rel_err(out, ref) < 1e-2, window
        assert refs.rel_err(out, no_sink) > 0.1, "sink not applied"


@_interpreted
def test_sink_decode_split_interpreted():
    from kvrelay.kernels import triton_attention as ta
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, d, page = 8, 2, 64, 16
    b = refs.make_paged_batch([1, 9, 40, 129], [1, 1, 1, 1], kv_heads, d, page, "cpu", gen=g)
    q = torch.randn(4, heads, d, generator=g).bfloat16()
    sinks = (torch.randn(heads, generator=g) + 4).bfloat16()
    for window, splits in ((None, 1), (None, 3), (8, 2)):
        out = torch.full_like(q, float("nan"))
        ta.sink_decode(q, b.pool, sinks, b.kv_indptr, b.kv_indices, b.kv_last_page_len, sm_scale=0.125,
                       window=window, out=out, num_splits=splits, block_n=16)
        ref = refs.sink_attention_ref(q, b, sinks, 0.125, window)
        assert refs.rel_err(out, ref) < 1e-2, (window, splits)
        no_sink = refs.sink_attention_ref(q, b, sinks, 0.125, window, use_sink=False)
        assert refs.rel_err(out, no_sink) > 0.1


@_interpreted
def test_reference_dropin_matches_engine_reference():
    """The Triton backend is a drop-in for kernels.reference.paged_attention (same arguments)."""
    from kvrelay.kernels import reference as R
    from kvrelay.kernels import triton_attention as ta
    g = torch.Generator().manual_seed(3)
    b = refs.make_paged_batch([20, 33], [20, 2], 1, 64, 16, "cpu", gen=g)
    q = torch.randn(22, 4, 64, generator=g).bfloat16()
    sinks = torch.randn(4, generator=g).bfloat16()
    kv = R.PagedKV(b.kv_indptr, b.kv_indices, b.kv_last_page_len)
    for window in (None, 4):
        ours = ta.paged_attention(q, b.pool, b.qo_indptr, kv, sinks, 0.125, window)
        theirs = R.paged_attention(q, b.pool, b.qo_indptr, kv, sinks, 0.125, window)
        assert refs.rel_err(ours, theirs) < 1e-2


@_interpreted
def test_moe_routing_interpreted():
    from kvrelay.kernels import moe
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(37, 32, generator=g).bfloat16()
    bias = torch.randn(32, generator=g).bfloat16()
    w, ids = moe.route_topk(logits, 4, bias=bias)
    full = (logits.float() + bias.float()).bfloat16()
    rv, rids = torch.topk(full, 4, dim=-1)
    # The same top-k values (ids may differ only where bf16 rounding made two logits tie); ties go to
    # the lower expert id, deterministically.
    assert torch.equal(full.gather(-1, ids.long()), rv)
    assert len(set(ids[0].tolist())) == 4
    rw = torch.softmax(rv.float(), -1)
    # weights are bf16 like the reference's; compare in the order of the returned ids
    picked = torch.gather(torch.softmax(full.float().gather(-1, ids.long()), -1), -1, torch.arange(4).expand(37, 4))
    assert torch.allclose(w.float(), picked, atol=1e-2)
    assert torch.allclose(w.float().sum(-1), torch.ones(37), atol=1e-2)
    assert torch.allclose(w.float().sort(-1).values, rw.sort(-1).values, atol=1e-2)


@_interpreted
def test_moe_decode_gemv_interpreted():
    from kvrelay.kernels import moe
    g = torch.Generator().manual_seed(5)
    t, hid, inter, e, k = 3, 256, 128, 8, 2
    x = torch.randn(t, hid, generator=g).bfloat16()
    w1 = (torch.randn(e, 2 * inter, hid, generator=g) * 0.05).bfloat16()
    b1 = torch.randn(e, 2 * inter, generator=g).bfloat16()
    w2 = (torch.randn(e, hid, inter, generator=g) * 0.05).bfloat16()
    b2 = torch.randn(e, hid, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k, generator=g), -1).bfloat16()
    experts = moe.MoEWeights.from_bf16(w1, b1, w2, b2)
    out = moe.moe_experts(x, ids, wts, experts, path="gemv")
    ref = refs.moe_ref(x, ids, wts, w1, b1, w2, b2, round_pairs=True)
    assert refs.rel_err(out, ref) < 2e-2
    # uncombined, a bf16 model's pairs are bf16 (as the grouped path's), and combine sums those: within one bf16
    # step of the final rounding (the interpreter's fp32 -> bf16 casts truncate, torch's round to nearest)
    pairs = moe.moe_experts(x, ids, wts, experts, path="gemv", combine=False)
    assert pairs.dtype == torch.bfloat16 and pairs.shape == (t, k, hid)
    summed = pairs.float().sum(1)
    assert ((summed - out.float()).abs() <= out.float().abs() * 2 ** -7 + 1e-6).all()
    assert refs.rel_err(pairs.float().sum(1), ref) < 2e-2
    # the LATE reduction variant and narrower K steps (several K iterations), as bench/sweep_gemv.py
    # times them: the same result up to the fp32 summation order
    from kvrelay.kernels.moe_gemv import GemvConfig, GemvLaunch, moe_gemv
    for late in (False, True):
        cfg = GemvConfig(GemvLaunch(16, 64, num_warps=2, num_stages=1, late=late),
                         GemvLaunch(32, 32, num_warps=1, num_stages=2, late=late))
        alt = moe_gemv(x, ids, wts, experts, 1.702, 7.0, config=cfg)
        assert refs.rel_err(alt, ref) < 2e-2
        assert refs.rel_err(alt, out) < 1e-2, late
        # GEMV2's first K step peeled ahead of the PDL wait (EARLY, the default) or not: the same bits
        import os
        os.environ["KVRELAY_MOE_EARLY"] = "0"
        try:
            waits_first = moe_gemv(x, ids, wts, experts, 1.702, 7.0, config=cfg, combine=False)
        finally:
            del os.environ["KVRELAY_MOE_EARLY"]
        assert torch.equal(moe_gemv(x, ids, wts, experts, 1.702, 7.0, config=cfg, combine=False), waits_first), late


@_interpreted
def test_expert_sort_kernel_equals_torch_sort_interpreted():
    """The one-program counting sort (decode batches) gives exactly the torch ops' stable order, padding
    and block experts, including experts nobody picked and more experts than pairs."""
    from kvrelay.kernels.moe import sort_by_expert
    g = torch.Generator().manual_seed(3)
    for num_experts, tokens, k, block_m in [(32, 1, 4, 16), (32, 300, 4, 64), (128, 257, 4, 64), (8, 5, 2, 16)]:
        # Skewed choices: a few experts take most pairs, others none.
        ids = torch.multinomial(torch.rand(num_experts, generator=g) ** 4, tokens * k, replacement=True,
                                generator=g).view(tokens, k)
        got = sort_by_expert(ids, num_experts, block_m, path="kernel")
        want = sort_by_expert(ids, num_experts, block_m, path="torch")
        for a, b, name in zip(got, want, ("sorted_ids", "block_expert", "counts")):
            assert torch.equal(a.long(), b.long()), (num_experts, tokens, name)



@_interpreted
def test_chunked_expert_sort_equals_torch_sort_interpreted():
    """The prefill path's chunked sort (a count launch and a place launch, one program per chunk of pairs)
    gives exactly the torch ops' stable order, padding sentinels and block experts: chunks that split an
    expert's pairs, more pairs than SORT_CHUNK_PROGRAMS x BLOCK (chunks of several blocks), experts nobody
    picked, a non-power-of-two expert count, a batch that leaves whole empty blocks."""
    from kvrelay.kernels import moe
    g = torch.Generator().manual_seed(5)
    cases = [(32, 9000, 4, 64), (128, 2100, 4, 64), (8, 700, 2, 16), (32, 3, 4, 64), (20, 40000, 4, 128)]
    for num_experts, tokens, k, block_m in cases:
        ids = torch.multinomial(torch.rand(num_experts, generator=g) ** 4, tokens * k, replacement=True,
                                generator=g).view(tokens, k)
        got = moe.sort_by_expert(ids, num_experts, block_m, path="chunked")
        want = moe.sort_by_expert(ids, num_experts, block_m, path="torch")
        for a, b, name in zip(got, want, ("sorted_ids", "block_expert", "counts")):
            assert a.dtype == (torch.int32), name
            assert torch.equal(a.long(), b.long()), (num_experts, tokens, name)
    with pytest.raises(ValueError, match="sort path"):
        moe.sort_by_expert(ids, 20, 64, path="radix")


def _gemv_operands(m, k, n, g):
    """Random FP8 operands, never zeros: weight row blocks and activation K blocks differ in magnitude by up to
    40x (a GEMV that applied another block's scale, or skipped a K block, is far off), a bias as large as the
    product. The activation is quantised by the torch reference (kernels.fp8.quantize_act_1x128, what
    fp8_block_linear_ref does) and laid out as kernels.fp8_gemm.quantize_act_1x128 lays it out: K padded to
    a multiple of 128, rows padded to 4, the scale M-major."""
    from kvrelay.kernels import fp8
    kblk = 1 + 3 * torch.arange(-(-k // 128)).float().repeat_interleave(128)[:k]  # 1, 4, 7, ... per K block
    nblk = 1 + 13 * (torch.arange(n) // 128).float()  # 1, 14, ... per 128-row block
    x = (torch.randn(m, k, generator=g) * kblk).bfloat16()
    w = torch.randn(n, k, generator=g) * 0.02 * nblk[:, None]
    b = (torch.randn(n, generator=g) * (x.float() @ w.T).std()).bfloat16()
    wq, ws = fp8.quantize_weight_block128(w)
    q, s = fp8.quantize_act_1x128(x)
    kp, mp = s.shape[1] * 128, -(-m // 4) * 4
    xq = torch.zeros(mp, kp).to(torch.float8_e4m3fn)
    xq[:m, :k] = q
    sx = torch.ones(s.shape[1], mp).t()
    sx[:m] = s
    return x, wq, ws, b, xq, sx


@_interpreted
def test_fp8_gemv_interpreted():
    """The FP8 block-scaled GEMV (Fp8BlockLinear's "gemv-*" launches, decode batches) against float64 on the
    same quantised operands and against kernels.fp8.fp8_block_linear_ref: M = 1, 3, 8 (one row group reusing
    each weight tile for every row), K = 2880 (not a multiple of 128: a ragged last block, the weight
    K-padded by Fp8BlockLinear) and 300, N crossing a 128-row scale block and not a multiple of the tile,
    every candidate launch (split-K 1 to 8), with and without bias, and M past 8 (a second row group)."""
    from kvrelay.kernels import fp8, fp8_gemm
    from kvrelay.kernels.fp8_gemv import Fp8GemvLaunch, new_counters, triton_fp8_gemv
    g = torch.Generator().manual_seed(6)
    launches = fp8_gemm.Fp8BlockLinear.GEMV_TILES
    assert any(l.split_k > 1 for l in launches.values()) and any(l.split_k == 1 for l in launches.values())
    for m, k, n in [(1, 2880, 200), (3, 2880, 136), (8, 2880, 72), (2, 300, 96)]:
        x, wq, ws, b, xq, sx = _gemv_operands(m, k, n, g)
        wd = fp8.dequantize_weight_block128(wq, ws, torch.float32).double()
        xd = xq[:m, :k].double() * sx[:m].double().repeat_interleave(128, 1)[:, :k]
        ref = xd @ wd.T + b.double()
        torch_ref = fp8.fp8_block_linear_ref(x, wq, ws, b)
        for name in launches:
            lin = fp8_gemm.Fp8BlockLinear(wq, ws, b, backend=name)
            assert lin.kp == xq.shape[1]
            y = lin.run_quantized(xq, sx, m)
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            # 1e-2: the bound of the other fp8 GEMM tests (under the interpreter the bf16 store truncates)
            assert refs.rel_err(y, ref) < 1e-2, (name, m, k, n, refs.rel_err(y, ref))
            assert refs.rel_err(y, torch_ref) < 1e-2, (name, m, k, n, refs.rel_err(y, torch_ref))
            assert refs.rel_err(y, ref - b.double()) > 5e-2, "bias not added"
            assert not lin._counters.any(), "split-K left its counters set"
        # without bias, split 1 and split > 1 (here 23 K blocks in 3 chunks of 8 and 6 of 4)
        lin = fp8_gemm.Fp8BlockLinear(wq, ws, None, backend="cublas")
        for launch in (Fp8GemvLaunch(16, 256, 1, num_warps=4), Fp8GemvLaunch(32, 512, 3, num_warps=2),
                       Fp8GemvLaunch(8, 128, 6, num_warps=1)):
            y = triton_fp8_gemv(xq, sx, lin.w, lin.w_scale, None, m=m, launch=launch, counters=lin._counters)
            assert refs.rel_err(y, ref - b.double()) < 1e-2, (launch, m, k, n)
            assert refs.rel_err(y, ref) > 5e-2, "a bias appeared"
        # a wrong scale must fail: every weight block scale of row block 0 used for all rows
        if n > 128:
            wrong = ws.clone()
            wrong[1:] = ws[:1]
            for name in ("gemv-n32-k512-s1-w2-st2", "gemv-n32-k256-s4-w4-st2"):
                bad = fp8_gemm.Fp8BlockLinear(wq, wrong, b, backend=name).run_quantized(xq, sx, m)
                assert refs.rel_err(bad, ref) > 0.1, name
    # split-K is deterministic: the last-arriving program sums the partials in split order, so the same
    # inputs give the same bits, run after run (and the counters return to zero every time)
    x, wq, ws, b, xq, sx = _gemv_operands(3, 2880, 136, g)
    lin = fp8_gemm.Fp8BlockLinear(wq, ws, b, backend="gemv-n16-k256-s8-w2-st2")
    first = lin.run_quantized(xq, sx, 3)
    for _ in range(2):
        assert torch.equal(lin.run_quantized(xq, sx, 3), first)
        assert not lin._counters.any()
    # m rows of a padded activation: rows past m are never read into the output, which has m rows; M=11 is
    # two row groups (8 + 3), with split-K too
    x, wq, ws, b, xq, sx = _gemv_operands(11, 256, 64, g)
    wd = fp8.dequantize_weight_block128(wq, ws, torch.float32).double()
    ref = (xq[:11].double() * sx[:11].double().repeat_interleave(128, 1)) @ wd.T + b.double()
    for split in (1, 2):
        y = triton_fp8_gemv(xq, sx, wq, ws, b, m=11, block_n=16, block_k=128, split_k=split,
                            counters=new_counters(64, "cpu", 16))
        assert y.shape == (11, 64) and refs.rel_err(y, ref) < 1e-2, split
    assert triton_fp8_gemv(xq, sx, wq, ws, m=3).shape == (3, 64) and xq.shape[0] == 12
    try:
        triton_fp8_gemv(xq, sx, wq, ws, m=3, split_k=2, counters=torch.zeros(1, dtype=torch.int32))
    except ValueError as exc:
        assert "counters" in str(exc)
    else:
        raise AssertionError("too few split-K counters must be refused")


@_interpreted
def test_fused_router_route_equals_logits_then_route_interpreted():
    # kernels/router.py: logits + top-k + softmax in one launch, the last-arriving program routing; the
    # same weights and ids as router_logits then route_topk, bit for bit, and the counters left at zero.
    from kvrelay.kernels import fused, moe, router
    g = torch.Generator().manual_seed(7)
    cnt = router.new_counters("cpu")
    for t, e, h, k in [(1, 32, 2880, 4), (5, 128, 2880, 4), (3, 8, 100, 2)]:
        x = torch.randn(t, h, generator=g).bfloat16()
        w = (torch.randn(e, h, generator=g) * h ** -0.5).bfloat16()
        bias = torch.randn(e, generator=g).bfloat16()
        for bb in (bias, None):
            gw, gi = router.router_route(x, w, bb, k, cnt)
            rw, ri = moe.route_topk(fused.router_logits(x, w, bb), k)
            assert torch.equal(gi, ri) and torch.equal(gw, rw), (t, e, bb is None)
            assert not cnt.any()
            assert gi.shape == (t, k) and len(set(gi[0].tolist())) == k
    # the route depends on the router's logits, not on which program arrived last
    x = torch.randn(2, 64, generator=g).bfloat16()
    w = (torch.randn(16, 64, generator=g) * 0.1).bfloat16()
    a = router.router_route(x, w, None, 4, cnt)
    b = router.router_route(x, -w, None, 4, cnt)
    assert not torch.equal(a[1], b[1])
    try:
        router.router_route(torch.randn(65, 64).bfloat16(), w, None, 4, cnt)
    except ValueError as exc:
        assert "65 tokens" in str(exc)
    else:
        raise AssertionError("more tokens than counters must be refused")


@_interpreted
def test_add_norm_route_equals_add_rms_norm_and_router_interpreted():
    # kernels/router.add_rms_norm_route: the residual add + MoE norm as add_rms_norm computes them, the
    # router's logits on the normed row within one bf16 step of float32, and the routing exactly
    # route_topk of those logits; counters left at zero.
    from kvrelay.kernels import fused, moe, router
    g = torch.Generator().manual_seed(9)
    cnt = router.new_counters("cpu")
    for t, e, h, k in [(1, 32, 2880, 4), (5, 128, 2880, 4), (3, 8, 100, 2)]:
        x = torch.randn(t, h, generator=g).bfloat16()
        d = torch.randn(t, h, generator=g).bfloat16()
        nw = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
        w = (torch.randn(e, h, generator=g) * h ** -0.5).bfloat16()
        bias = torch.randn(e, generator=g).bfloat16()
        for bb in (bias, None):
            lg = torch.empty(t, e, dtype=torch.bfloat16)
            xn, hn, gw, gi = router.add_rms_norm_route(x, d, nw, 1e-5, w, bb, k, cnt, logits=lg)
            rx, rh = fused.add_rms_norm(x, d, nw, 1e-5)
            assert torch.equal(xn, rx) and torch.equal(hn, rh), (t, e)
            ref = hn.float() @ w.float().T + (0 if bb is None else bb.float())
            assert ((lg.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).all(), (t, e)
            rw, ri = moe.route_topk(lg, k)
            assert torch.equal(gi, ri) and torch.equal(gw, rw), (t, e)
            assert not cnt.any()
