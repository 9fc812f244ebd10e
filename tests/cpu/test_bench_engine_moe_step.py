"""bench/kernels.engine_moe_step (the decode MoE layer launched as the engine launches it, which
`python -m kvrelay.bench.kernels --only moe` times against issue 11's 35 us) under TRITON_INTERPRET=1 on CPU,
against a float32 torch reference of the layer: residual add, RMSNorm, router, top-k softmax, the experts'
clamped SwiGLU MLPs, the weighted sum added to the residual, the next RMSNorm and
its 1x128 FP8 quantisation."""

from __future__ import annotations

import torch
from interp_helpers import interpreted, refs

_interpreted = interpreted(__file__)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()


@_interpreted
def test_engine_moe_step_matches_a_float32_layer():
    from kvrelay.bench.kernels import _fp8_experts, engine_moe_step
    from kvrelay.kernels import fp8, router

    torch.manual_seed(3)  # _fp8_experts draws from the global generator
    e, h, i, k = 8, 256, 256, 2
    ex = _fp8_experts(e, h, i, "cpu")
    g = torch.Generator().manual_seed(4)
    res = (0.05 * torch.randn(1, h, generator=g)).bfloat16()
    delta = (0.05 * torch.randn(1, h, generator=g)).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    gate_w = (torch.randn(e, h, generator=g) * h ** -0.5).bfloat16()
    gate_b = torch.randn(e, generator=g).bfloat16()
    counters = router.new_counters("cpu")

    from kvrelay.kernels import moe_gemv

    x_new, (q8, sc) = engine_moe_step(res, delta, norm_w, gate_w, gate_b, ex, k, counters)
    # KVRELAY_MOE_NORM_FUSE=1's launches (the next add + norm inside GEMV2's): the same bits under the interpreter
    norm_counters = moe_gemv.new_norm_counters("cpu")
    fx, (fq, fs) = engine_moe_step(res, delta, norm_w, gate_w, gate_b, ex, k, counters, norm_counters=norm_counters)
    assert torch.equal(fx, x_new) and torch.equal(fq.view(torch.uint8), q8.view(torch.uint8)) and torch.equal(fs, sc)
    assert not norm_counters.any()
    # KVRELAY_MOE_FUSED_GEMV=1's launches (both GEMVs in one): the float32 bounds below, other tiles
    from kvrelay.kernels import moe_fused

    assert moe_fused.DEFAULT_LAUNCH.rows1(h, i) is not None  # the default launch tiles these experts
    fused_counters = moe_fused.new_fused_counters("cpu")
    ux, (uq, us) = engine_moe_step(res, delta, norm_w, gate_w, gate_b, ex, k, counters, fused_counters=fused_counters)
    assert not fused_counters.any() and refs.rel_err(ux, x_new) < 2e-3

    x1 = (res.float() + delta.float()).bfloat16()
    hn = _rms(x1, norm_w).bfloat16()
    logits = hn.float() @ gate_w.float().T + gate_b.float()
    top, ids = logits.topk(k, -1)
    weights = torch.softmax(top, -1).bfloat16()  # routing weights are bf16, as in transformers' bf16 model
    w1 = fp8.dequantize_experts_block128(ex.w1, ex.s1, torch.float32)
    w2 = fp8.dequantize_experts_block128(ex.w2, ex.s2, torch.float32)
    # the GEMV path multiplies bf16 activations (weight scales folded in) and rounds each pair to bf16
    mix = refs.moe_ref(hn, ids, weights, w1, ex.b1, w2, ex.b2, round_pairs=True)
    x2 = x1.float() + mix
    assert refs.rel_err(x_new, x2) < 1e-2
    assert refs.rel_err(x2, x1) > 0.1  # the experts' share is not lost in the tolerance
    out = fp8.dequantize_act_1x128(q8[:1, :h], sc[:1, : h // 128])
    assert refs.rel_err(out, _rms(x2, norm_w)) < 8e-2  # e4m3 keeps 3 mantissa bits: ~5% from the rounding
    assert not counters.any()
