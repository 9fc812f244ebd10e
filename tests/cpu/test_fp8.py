"""FP8 e4m3 block quantisation reference (kernels/fp8.py)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import fp8

E4M3_MIN_NORMAL = 2.0 ** -6
# e4m3 has 3 mantissa bits: round-to-nearest is off by at most half an ulp, 2^-4 of the value's power of
# two for normals, and 2^-10 absolute (in quantised units) in the subnormal range.
HALF_ULP_REL = 2.0 ** -4
HALF_ULP_SUBNORMAL = 2.0 ** -10


def _random_blocks(shape, seed) -> torch.Tensor:
    """Non-zero values whose magnitude varies by orders of magnitude from row to row and column to column."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    rows = torch.exp2(torch.randint(-12, 12, (*shape[:-1], 1), generator=g).float())
    cols = torch.exp2(torch.randint(-4, 4, (shape[-1],), generator=g).float())
    x = x * rows * cols
    return torch.where(x == 0, torch.full_like(x, 1e-3), x)


def _check_rounding(w: torch.Tensor, deq: torch.Tensor, scale_per_elem: torch.Tensor) -> None:
    err = (deq.double() - w.double()).abs()
    bound = torch.maximum(HALF_ULP_REL * w.double().abs(), HALF_ULP_SUBNORMAL * scale_per_elem.double())
    assert (err <= bound * (1 + 1e-6)).all(), float((err / bound).max())


@pytest.mark.parametrize("shape", [(300, 257), (1, 1), (129, 128), (128, 384), (3, 130, 200)])
def test_weight_block128_roundtrip_within_half_ulp(shape):
    w = _random_blocks(shape, seed=sum(shape))
    q, s = fp8.quantize_weight_block128(w)
    n, k = shape[-2:]
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (*shape[:-2], -(-n // 128), -(-k // 128))
    # scale = amax / 448 of every (possibly ragged) block, computed independently here.
    for bi in range(s.shape[-2]):
        for bj in range(s.shape[-1]):
            blk = w[..., bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            amax = blk.abs().amax(dim=(-2, -1))
            torch.testing.assert_close(s[..., bi, bj], amax / 448.0, rtol=0, atol=0)
    deq = fp8.dequantize_weight_block128(q, s, torch.float32)
    per_elem = s.repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k]
    _check_rounding(w, deq, per_elem)
    # The block maximum lands exactly on +-448.
    assert q.float().abs().amax().item() == 448.0


def test_stacked_helper_matches_per_expert(monkeypatch):
    w = _random_blocks((4, 200, 140), seed=7)
    q, s = fp8.quantize_experts_block128(w)
    for e in range(4):
        qe, se = fp8.quantize_weight_block128(w[e])
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(s[e], se)
    monkeypatch.setattr(fp8, "_STACK_CHUNK_ELEMENTS", 10)  # quantize_weight_block128 routes through it
    q2, s2 = fp8.quantize_weight_block128(w)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    deq = fp8.dequantize_experts_block128(q, s, torch.float32)
    assert torch.equal(deq, fp8.dequantize_weight_block128(q, s, torch.float32))


def test_zero_blocks_stay_zero_with_finite_scales():
    w = torch.zeros(256, 300)
    w[128:, 128:256] = torch.randn(128, 128)
    q, s = fp8.quantize_weight_block128(w)
    assert torch.isfinite(s).all() and (s > 0).all()
    deq = fp8.dequantize_weight_block128(q, s, torch.float32)
    assert torch.equal(deq[:128], torch.zeros(128, 300)) and torch.equal(deq[:, 256:], torch.zeros(256, 44))
    x_q, x_s = fp8.quantize_act_1x128(torch.zeros(3, 200))
    assert torch.equal(x_q.float(), torch.zeros(3, 200)) and torch.isfinite(x_s).all()


def test_dequant_rejects_mismatched_scale():
    q, s = fp8.quantize_weight_block128(torch.randn(200, 200))
    with pytest.raises(ValueError, match=r"block scale shape \[2, 1\] does not match weight \[200, 200\]"):
        fp8.dequantize_weight_block128(q, s[:, :1])


@pytest.mark.parametrize("shape", [(5, 300), (1, 128), (17, 1), (2, 3, 260)])
def test_act_1x128_roundtrip_within_half_ulp(shape):
    x = _random_blocks(shape, seed=3 + shape[-1])
    q, s = fp8.quantize_act_1x128(x)
    k = shape[-1]
    assert q.shape == x.shape and s.shape == (*shape[:-1], -(-k // 128))
    for j in range(s.shape[-1]):
        torch.testing.assert_close(s[..., j], x[..., j * 128:(j + 1) * 128].abs().amax(-1) / 448.0, rtol=0, atol=0)
    deq = fp8.dequantize_act_1x128(q, s)
    _check_rounding(x, deq, s.repeat_interleave(128, -1)[..., :k])


def test_block_linear_ref_is_the_block_scaled_product_and_close_to_bf16():
    g = torch.Generator().manual_seed(11)
    m, n, k = 37, 260, 300
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    bias = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)
    w_q, w_s = fp8.quantize_weight_block128(w)
    y = fp8.fp8_block_linear_ref(x, w_q, w_s, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # Exact construction in float64 from the dequantised operands: only bf16 output rounding remains.
    x_q, x_s = fp8.quantize_act_1x128(x)
    exact = (fp8.dequantize_act_1x128(x_q, x_s, torch.float64)
             @ fp8.dequantize_weight_block128(w_q, w_s, torch.float64).T) + bias.double()
    torch.testing.assert_close(y.double(), exact, rtol=2 ** -8, atol=1e-6)
    # Against the plain bf16 product the FP8 error is a few percent of the output scale, no more.
    ref = x.float() @ w.float().T + bias.float()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel
    # Leading batch dims and no bias.
    y3 = fp8.fp8_block_linear_ref(x.reshape(1, m, k), w_q, w_s)
    torch.testing.assert_close(y3[0].float(), (y.float() - bias.float()), rtol=2 ** -7, atol=2e-2)
    with pytest.raises(ValueError, match="x has K=299"):
        fp8.fp8_block_linear_ref(x[:, :299], w_q, w_s)
