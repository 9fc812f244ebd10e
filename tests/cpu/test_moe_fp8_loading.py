"""The GPU MoE's FP8 experts are quantised a few experts at a time; the result must equal quantising the
whole stack at once and padding K (what the kernels expect), including a last, shorter chunk."""

from __future__ import annotations

import torch

from kvrelay.engine.layers.moe import _gpu_experts_fp8_chunked
from kvrelay.kernels.fp8 import quantize_experts_block128
from kvrelay.kernels.moe import MoEWeights


def test_chunked_fp8_experts_equal_whole_stack() -> None:
    g = torch.Generator().manual_seed(0)
    e, hidden, inter = 11, 200, 72  # K not a multiple of 128; 11 experts = chunks of 4, 4, 3
    w1 = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 0.05).to(torch.bfloat16)
    b1 = torch.randn(e, 2 * inter, generator=g).to(torch.bfloat16)
    b2 = torch.randn(e, hidden, generator=g).to(torch.bfloat16)
    store = {"mlp1_weight": w1, "mlp2_weight": w2}
    get = lambda name, s: store[name][s]  # noqa: E731
    e0, e1 = 2, 11  # an expert-parallel rank's share
    got = _gpu_experts_fp8_chunked(get, e0, e1, slice(None), slice(None), b1[e0:e1], b2[e0:e1], chunk=4)

    q1, s1 = quantize_experts_block128(w1[e0:e1])
    q2, s2 = quantize_experts_block128(w2[e0:e1])
    want = MoEWeights.from_fp8(q1, s1, b1[e0:e1], q2, s2, b2[e0:e1])
    assert (got.hidden, got.inter) == (want.hidden, want.inter) == (hidden, inter)
    for a, b in [(got.w1, want.w1), (got.w2, want.w2)]:
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(got.s1, want.s1) and torch.equal(got.s2, want.s2)
    assert torch.equal(got.b1, want.b1) and torch.equal(got.b2, want.b2)
