"""The FP8 grouped expert GEMMs (kernels/moe.py, the prefill path) and the dense block-scaled Triton GEMM
(kernels/fp8_gemm.py) under TRITON_INTERPRET=1 on CPU, against float32 math (tests/gpu/kernel_refs.py).

Only the FP8 kernel runs here: the interpreter (triton 3.9) multiplies bf16 tiles as their raw 16-bit
patterns (numpy has no bf16), so a bf16 tl.dot gives garbage on CPU while fp8 tiles are widened to fp16
first (checked 2026-12-05: `tl.dot` of two bf16 tiles off by 1e11, fp8 right). The bf16 experts stay covered
by tests/gpu/test_moe.py. Shapes are small but keep what matters at gpt-oss's: K padded to 128 (inter 192 ->
256), a partial N tile in GEMM2 (hidden 192 with 128-wide tiles), skewed routing (several M blocks for some
experts, none for others), and tiles both inside one 128-row weight-scale block (the row-scale promotion)
and spanning two (block_n 256).
"""

from __future__ import annotations

import os

import pytest
import torch
from interp_helpers import interpreted, refs

_interpreted = interpreted(__file__)


def _setup(e=6, hid=192, inter=192, tokens=24, seed=5):
    from kvrelay.kernels.fp8 import dequantize_weight_block128, quantize_weight_block128
    from kvrelay.kernels.moe import MoEWeights, route_topk
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(e, 2 * inter, hid, generator=g) * hid ** -0.5
    b1 = (torch.randn(e, 2 * inter, generator=g) * 0.5).bfloat16()
    w2 = torch.randn(e, hid, inter, generator=g) * inter ** -0.5
    b2 = (torch.randn(e, hid, generator=g) * 0.5).bfloat16()
    # different weight scales per 128-row block, so a tile that took the wrong block's scale is off
    w1[:, 128:] *= 3.0
    w2[:, 128:] *= 0.25
    q1, s1 = quantize_weight_block128(w1)
    q2, s2 = quantize_weight_block128(w2)
    ex = MoEWeights.from_fp8(q1, s1, b1, q2, s2, b2)
    x = torch.randn(tokens, hid, generator=g).bfloat16()
    logits = torch.randn(tokens, e, generator=g) + 1.5 * torch.randn(e, generator=g)
    rw, ids = route_topk(logits.bfloat16(), 4)
    w1f = dequantize_weight_block128(ex.w1, ex.s1, torch.float32)  # K-padded, as the kernel reads them
    w2f = dequantize_weight_block128(ex.w2, ex.s2, torch.float32)
    return ex, x, ids, rw, w1f, w2f


def _dequant(q, s):
    return (q.float().view(q.shape[0], -1, 128) * s.float()[:, :, None]).view(q.shape[0], -1)


def _run_and_check(ex, x, ids, rw, w1f, w2f, cfg):
    """Both grouped GEMMs of `cfg` on the path's own FP8 inputs, each against float32 math on the same
    inputs: the reference does not depend on how the interpreter rounds to fp8 (not to nearest-even as the
    GPU does: ~3% of its quantised values differ from torch's), only on the GEMM kernels. Outputs start as
    NaN, so a pair row left unstored fails."""
    from kvrelay.kernels import moe
    from kvrelay.kernels.fp8_gemm import quantize_act_1x128
    t, k = ids.shape
    n = t * k
    flat = ids.reshape(-1)
    sorted_ids, block_expert, _ = moe.sort_by_expert(ids, ex.num_experts, cfg.block_m)
    xa, xs = quantize_act_1x128(x, ex.w1.shape[2], m_major=False)
    a1, s1 = xa, xs
    if cfg.w1.sorted_a:  # the same rows, quantised straight into the sort's slots: the same bits
        a1, s1 = moe.quantize_sorted(x, sorted_ids, block_expert, ex.num_experts, n, k, ex.w1.shape[2])
        live = sorted_ids < n
        assert torch.equal(a1[live].view(torch.uint8), xa[sorted_ids[live].long() // k].view(torch.uint8))
        assert torch.equal(s1[live], xs[sorted_ids[live].long() // k])
    # GEMM2 reading sorted rows: GEMM1 stores every slot (the sort's order), compared here by pair
    slot_of = torch.empty(n, dtype=torch.long)
    slot_of[sorted_ids[sorted_ids < n].long()] = (sorted_ids < n).nonzero().flatten()
    out_sorted = cfg.w2.sorted_a
    act = torch.full((sorted_ids.numel() if out_sorted else n, ex.inter), float("nan"), dtype=torch.bfloat16)
    moe._grouped_gemm(a1, s1, ex.w1, ex.s1, ex.b1, None, act, sorted_ids, block_expert, n, k, ex.w1.shape[1],
                      ex.w1.shape[2], True, True, 1.702, 7.0, cfg.block_m, cfg.w1, descs=ex.descs,
                      out_sorted=out_sorted)
    h = torch.einsum("pk,pnk->pn", _dequant(xa, xs)[torch.arange(n) // k], w1f[flat]) + ex.b1[flat].float()
    act_ref = refs.swiglu_ref(h, 1.702, 7.0)
    by_pair = act[slot_of] if out_sorted else act
    assert torch.isfinite(by_pair.float()).all(), cfg.label()
    assert refs.rel_err(by_pair, act_ref) < 1e-2, ("GEMM1", cfg.label(), refs.rel_err(by_pair, act_ref))
    aa, as_ = quantize_act_1x128(act, ex.w2.shape[2], m_major=False)
    if out_sorted:  # as _moe_grouped quantises slot-ordered rows: the used blocks only, the same bits
        sq, ss = moe.quantize_sorted(act, sorted_ids, block_expert, ex.num_experts, n, 1, ex.w2.shape[2],
                                     slot_rows=True)
        live = sorted_ids < n
        assert torch.equal(sq[live].view(torch.uint8), aa[live].view(torch.uint8)) and torch.equal(ss[live], as_[live])
        aa, as_ = sq, ss
    y = torch.full((n, ex.hidden), float("nan"), dtype=torch.bfloat16)
    moe._grouped_gemm(aa, as_, ex.w2, ex.s2, ex.b2, rw.reshape(-1), y, sorted_ids, block_expert, n, 1, ex.hidden,
                      ex.w2.shape[2], True, False, 1.702, 7.0, cfg.block_m, cfg.w2, descs=ex.descs)
    if out_sorted:
        aa, as_ = aa[slot_of], as_[slot_of]  # the reference's inputs by pair
    y_ref = (torch.einsum("pk,pnk->pn", _dequant(aa, as_), w2f[flat]) + ex.b2[flat].float()) \
        * rw.reshape(-1, 1).float()
    assert torch.isfinite(y.float()).all(), cfg.label()
    err = refs.rel_err(y, y_ref)
    assert err < 1e-2, ("GEMM2", cfg.label(), err)
    return err


@_interpreted
def test_grouped_fp8_gemms_match_float32_interpreted():
    from kvrelay.kernels.moe_configs import GemmConfig, GroupedConfig
    case = _setup()
    configs = [
        GroupedConfig(16, GemmConfig(64, 4, 2, group_m=1), GemmConfig(128, 4, 2, group_m=4)),
        GroupedConfig(32, GemmConfig(128, 4, 2, group_m=4, masked=False), GemmConfig(128, 4, 2, masked=False)),
        GroupedConfig(16, GemmConfig(128, 4, 2, group_m=8, masked=False, tma=True),
                      GemmConfig(128, 4, 2, masked=False, tma=True)),
        # 256-wide N tiles span two weight-scale blocks: the per-column promotion
        GroupedConfig(16, GemmConfig(256, 8, 2, tma=True, masked=False), GemmConfig(256, 8, 2)),
        # inputs in the sort's slots (TMA tiles): GEMM1 only, both, and the warp-specialised kernel (moe_ws)
        GroupedConfig(16, GemmConfig(128, 4, 2, tma=True, sorted_a=True), GemmConfig(128, 4, 2)),
        GroupedConfig(32, GemmConfig(64, 4, 2, masked=False, sorted_a=True),
                      GemmConfig(128, 4, 2, tma=True, sorted_a=True)),
        GroupedConfig(16, GemmConfig(128, 4, 2, tma=True, sorted_a=True, ws=True),
                      GemmConfig(128, 4, 2, tma=True, sorted_a=True, ws=True)),
        GroupedConfig(32, GemmConfig(64, 4, 2, group_m=4, tma=True, sorted_a=True, ws=True),
                      GemmConfig(64, 4, 2, tma=True, sorted_a=True, ws=True)),
    ]
    saved = os.environ.get("KVRELAY_MOE_WS")
    os.environ["KVRELAY_MOE_WS"] = "1"  # its math, checked here; on the H200 it hung (kernels/moe.py)
    try:
        for cfg in configs:
            _run_and_check(*case, cfg)
    finally:
        os.environ.pop("KVRELAY_MOE_WS", None)
        if saved is not None:
            os.environ["KVRELAY_MOE_WS"] = saved


@_interpreted
def test_moe_with_sorted_inputs_equals_gathered_interpreted():
    """The whole grouped path (kernels/moe._moe_grouped: sort, quantise, GEMM1, quantise, GEMM2) with both GEMMs
    reading the sort's slots gives the gathered path's bits at the same tiles (the same rows, quantised alike)."""
    from kvrelay.kernels import moe
    from kvrelay.kernels.moe_configs import GemmConfig, GroupedConfig
    ex, x, ids, rw, _, _ = _setup()
    plain = GemmConfig(128, 4, 2, group_m=4, masked=False, tma=True)
    srt = GemmConfig(128, 4, 2, group_m=4, masked=False, tma=True, sorted_a=True)
    a = moe._moe_grouped(x, ids, rw, ex, 1.702, 7.0, config=GroupedConfig(32, plain, plain), combine=False)
    b = moe._moe_grouped(x, ids, rw, ex, 1.702, 7.0, config=GroupedConfig(32, srt, srt), combine=False)
    assert torch.equal(a, b)


@_interpreted
def test_grouped_fp8_wrong_scale_block_is_caught_interpreted():
    """The check can fail: GEMM2 run with the second weight-scale block's scales replaced by the first's
    (what a tile reading the wrong block would compute) is far from the reference of the true scales."""
    from kvrelay.kernels.moe_configs import GemmConfig, GroupedConfig
    ex, x, ids, rw, w1f, w2f = _setup()
    ex.s2[:, 1:] = ex.s2[:, :1]
    with pytest.raises(AssertionError, match="GEMM2"):
        _run_and_check(ex, x, ids, rw, w1f, w2f, GroupedConfig(16, GemmConfig(128, 4, 2), GemmConfig(128, 4, 2)))


@_interpreted
def test_dense_triton_fp8_gemm_matches_float32_interpreted():
    """The dense block-scaled Triton GEMM (kernels/fp8_gemm.py, the "triton" linear backend) at tiles inside
    one weight-scale block (16x32, 128x128: the row-scale promotion) and across two (64x256), N not a
    multiple of 128, with bias; against float32 math on the same fp8 inputs."""
    from kvrelay.kernels.fp8 import dequantize_weight_block128, quantize_weight_block128
    from kvrelay.kernels.fp8_gemm import quantize_act_1x128, triton_fp8_gemm
    g = torch.Generator().manual_seed(9)
    m, n, k = 37, 200, 256
    w = torch.randn(n, k, generator=g) * k ** -0.5
    w[128:] *= 5.0  # the second weight-scale block differs from the first
    wq, ws = quantize_weight_block128(w)
    bias = torch.randn(n, generator=g).bfloat16()
    xq, xs = quantize_act_1x128(torch.randn(m, k, generator=g).bfloat16(), k, m_major=False)
    ref = _dequant(xq, xs) @ dequantize_weight_block128(wq, ws, torch.float32).t() + bias.float()
    for bm, bn in ((16, 32), (128, 128), (64, 256)):
        out = triton_fp8_gemm(xq, xs, wq, ws, bias, block_m=bm, block_n=bn, num_warps=4, num_stages=2)
        assert refs.rel_err(out, ref) < 1e-2, (bm, bn, refs.rel_err(out, ref))


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
