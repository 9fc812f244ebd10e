"""The MXFP4 expert kernels (kernels/moe_mxfp4.py) under the Triton interpreter, against float32 references.

Weights are random bytes (every E2M1 code, both signs) with scales spread over several binades; activations
random, never zeros. Shapes with K tails (K not a multiple of the K step) and N tails (the grouped GEMM's
128-row tile over 2I = 320 rows).
"""

from __future__ import annotations

import pytest
import torch
from interp_helpers import interpreted, refs

E, H, INTER, K_TOP = 6, 192, 160, 4


def _weights(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    byte = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.int32).to(torch.uint8)  # noqa: E731
    scale = lambda *s: torch.randint(117, 124, s, generator=g, dtype=torch.int32).to(torch.uint8)  # noqa: E731
    w1, s1 = byte(E, 2 * INTER, H // 32, 16), scale(E, 2 * INTER, H // 32)
    w2, s2 = byte(E, H, INTER // 32, 16), scale(E, H, INTER // 32)
    b1 = (torch.randn(E, 2 * INTER, generator=g) * 0.1).bfloat16()
    b2 = (torch.randn(E, H, generator=g) * 0.1).bfloat16()
    return w1, s1, b1, w2, s2, b2


def _routing(t: int, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(t)]) if t else \
        torch.empty(0, K_TOP, dtype=torch.int64)
    rw = torch.softmax(torch.randn(t, K_TOP, generator=g), -1).bfloat16()
    return x, ids, rw


def test_two_references_decode_alike():
    """kernels/reference.py's field decode equals engine/mxfp4.py's table decode, bit for bit (float32)."""
    from kvrelay.engine.mxfp4 import dequantize_mxfp4
    from kvrelay.kernels.reference import mxfp4_dequant

    w1, s1, *_ = _weights()
    assert torch.equal(mxfp4_dequant(w1, s1), dequantize_mxfp4(w1, s1, torch.float32))
    assert torch.equal(mxfp4_dequant(w1.view(E, 2 * INTER, -1), s1), dequantize_mxfp4(w1, s1, torch.float32))


def test_scales_the_kernel_cannot_represent_are_refused():
    from kvrelay.kernels.moe import MoEWeights

    w1, s1, b1, w2, s2, b2 = _weights()
    s2 = s2.clone()
    s2[1, 2, 0] = 250
    with pytest.raises(ValueError, match="mlp2: an MXFP4 scale byte is 250"):
        MoEWeights.from_mxfp4(w1, s1, b1, w2, s2, b2)


def _check(t: int, path: str):
    from kvrelay.kernels.moe import MoEWeights, moe_experts
    from kvrelay.kernels.reference import moe_experts_mxfp4_ref

    w1, s1, b1, w2, s2, b2 = _weights()
    ex = MoEWeights.from_mxfp4(w1, s1, b1, w2, s2, b2)
    assert ex.mx and not ex.fp8 and (ex.hidden, ex.inter) == (H, INTER)
    assert ex.w1.data_ptr() == w1.data_ptr()  # the checkpoint's bytes, viewed, not copied
    x, ids, rw = _routing(t)
    pairs = moe_experts(x, ids, rw, ex, path=path, combine=False)
    assert pairs.shape == (t, K_TOP, H) and pairs.dtype == torch.bfloat16
    # Against float32 throughout: the kernels store GEMM1's output and the pairs in bf16, and the interpreter
    # (triton 3.x) converts fp32 -> bf16 by truncation, not to nearest as the GPU does: each of the two stores
    # is up to one bf16 step (2^-8 relative) off, ~0.3% rms each. A wrong nibble order, scale or tile is O(1).
    full = moe_experts_mxfp4_ref(x, ids, rw, ex.w1, s1, b1, ex.w2, s2, b2)
    assert refs.rel_err(pairs, full) < 1.2e-2, refs.rel_err(pairs, full)
    out = moe_experts(x, ids, rw, ex, path=path)
    assert out.shape == (t, H) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), pairs.float().sum(1), rtol=1e-2, atol=1e-2)
    return pairs


@interpreted(__file__)
def test_gemv_path_matches_float32_interpreted():
    for t in (1, 2, 8):
        _check(t, "gemv")


@interpreted(__file__)
def test_grouped_path_matches_float32_interpreted():
    _check(24, "grouped")
    # the same pairs through both paths: the same math up to fp32 summation order
    g, v = _check(3, "grouped"), _check(3, "gemv")
    assert refs.rel_err(g, v) < 4e-3


@interpreted(__file__)
def test_auto_path_and_empty_batch_interpreted():
    from kvrelay.kernels.moe import MoEWeights, moe_experts

    ex = MoEWeights.from_mxfp4(*_weights())
    x, ids, rw = _routing(0)
    assert moe_experts(x, ids, rw, ex).shape == (0, H)
    assert moe_experts(x, ids, rw, ex, combine=False).shape == (0, K_TOP, H)
