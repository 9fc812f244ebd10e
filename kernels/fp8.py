"""FP8 (e4m3) block-scaled quantisation: the torch reference of the served FP8 GEMM.

Weights use one float32 scale per 128x128 block, activations one per 1x128 group along K, the layout
cuBLAS blockwise `_scaled_mm` and DeepGEMM consume (h200-notes, "FP8 with 128x128 weight blocks").
scale = amax / 448 so the block maximum lands on e4m3's largest finite value; dequant = fp8 * scale.
Everything here is plain torch and runs on CPU; GPU kernels are tested against it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Floor on amax: an all-zero block still gets a finite, positive scale (its values stay 0), and no
# division by zero or overflow to inf happens for denormal-sized blocks.
_AMAX_FLOOR = 1e-12
# Stacks above this many elements are quantised expert by expert, bounding the float32 scratch to one [N, K].
_STACK_CHUNK_ELEMENTS = 1 << 26


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    size = x.shape[dim]
    extra = _ceil_div(size, multiple) * multiple - size
    if not extra:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = extra
    return torch.cat((x, x.new_zeros(pad_shape)), dim=dim)


def _expand_block_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[..., ceil(n/128), ceil(k/128)] -> [..., n, k] (one scale per element)."""
    s = scale.repeat_interleave(BLOCK, dim=-2)[..., :n, :]
    return s.repeat_interleave(BLOCK, dim=-1)[..., :k]


def _quantize_2d_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape[-2], w.shape[-1]
    wf = _pad_to(_pad_to(w.to(torch.float32), -2, BLOCK), -1, BLOCK)
    nb, kb = wf.shape[-2] // BLOCK, wf.shape[-1] // BLOCK
    tiles = wf.reshape(*wf.shape[:-2], nb, BLOCK, kb, BLOCK)
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = amax.clamp_min(_AMAX_FLOOR) / FP8_MAX
    q = (w.to(torch.float32) / _expand_block_scale(scale, n, k)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale


def quantize_weight_block128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (or stacked [..., N, K]) -> (w_fp8 e4m3 [..., N, K], scale f32 [..., ceil(N/128), ceil(K/128)]).

    N and K need not be multiples of 128: the ragged edge blocks are scaled by their own (partial) amax.
    """
    if w.dim() < 2:
        raise ValueError(f"quantize_weight_block128 needs a [N, K] (or [..., N, K]) tensor, got {list(w.shape)}")
    if w.dim() == 3 and w.numel() > _STACK_CHUNK_ELEMENTS:
        return quantize_experts_block128(w)
    return _quantize_2d_blocks(w)


def quantize_experts_block128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, N, K] -> (fp8 [E, N, K], scale [E, ceil(N/128), ceil(K/128)]).

    One expert at a time, so the float32 scratch is a single [N, K] matrix.
    """
    if w.dim() != 3:
        raise ValueError(f"quantize_experts_block128 needs [E, N, K], got {list(w.shape)}")
    e, n, k = w.shape
    out = torch.empty((e, n, k), dtype=FP8_DTYPE, device=w.device)
    scales = torch.empty((e, _ceil_div(n, BLOCK), _ceil_div(k, BLOCK)), dtype=torch.float32, device=w.device)
    for i in range(e):
        out[i], scales[i] = _quantize_2d_blocks(w[i])
    return out, scales


def dequantize_weight_block128(w_fp8: torch.Tensor, scale: torch.Tensor,
                               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of quantize_weight_block128 (fp8 * block scale, computed in float32); works on stacked [..., N, K]."""
    n, k = w_fp8.shape[-2], w_fp8.shape[-1]
    expected = (*w_fp8.shape[:-2], _ceil_div(n, BLOCK), _ceil_div(k, BLOCK))
    if tuple(scale.shape) != expected:
        raise ValueError(f"block scale shape {list(scale.shape)} does not match weight {list(w_fp8.shape)} "
                         f"(expected {list(expected)})")
    out = w_fp8.to(torch.float32) * _expand_block_scale(scale.to(torch.float32), n, k)
    return out.to(dtype)


def dequantize_experts_block128(w_fp8: torch.Tensor, scale: torch.Tensor,
                                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Stacked [E, N, K] dequantisation, one expert at a time to bound the float32 scratch."""
    out = torch.empty(w_fp8.shape, dtype=dtype, device=w_fp8.device)
    for i in range(w_fp8.shape[0]):
        out[i] = dequantize_weight_block128(w_fp8[i], scale[i], dtype)
    return out


def quantize_act_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (or [..., K]) -> (x_fp8 [..., K], scale f32 [..., ceil(K/128)]), one scale per 1x128 group."""
    k = x.shape[-1]
    xf = _pad_to(x.to(torch.float32), -1, BLOCK)
    groups = xf.reshape(*xf.shape[:-1], xf.shape[-1] // BLOCK, BLOCK)
    scale = groups.abs().amax(-1).clamp_min(_AMAX_FLOOR) / FP8_MAX
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).flatten(-2)[..., :k]
    return q.to(FP8_DTYPE), scale


def dequantize_act_1x128(x_fp8: torch.Tensor, scale: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    k = x_fp8.shape[-1]
    s = scale.to(torch.float32).repeat_interleave(BLOCK, dim=-1)[..., :k]
    return (x_fp8.to(torch.float32) * s).to(dtype)


def fp8_block_linear_ref(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = quant(x) @ w^T (+ bias) as the FP8 GEMM computes it: x quantised 1x128, w block 128x128.

    Per 128-wide K block the fp8 x fp8 products are summed in float32 (each product is exact there),
    then scaled by sa[m, kb] * sb[n // 128, kb] and accumulated over K blocks in float32; result bf16.
    x: [..., K]; w_fp8: [N, K] e4m3; w_scale: [ceil(N/128), ceil(K/128)]; bias: [N] or None.
    """
    n, k = w_fp8.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]} but the weight is [{n}, {k}]")
    lead = x.shape[:-1]
    x_fp8, x_scale = quantize_act_1x128(x.reshape(-1, k))
    xq = _pad_to(x_fp8.to(torch.float32), -1, BLOCK)
    wq = _pad_to(w_fp8.to(torch.float32), -1, BLOCK)
    # Column scale of output n for K block kb is the weight block scale of row block n // 128.
    sb = w_scale.to(torch.float32).repeat_interleave(BLOCK, dim=0)[:n]  # [N, KB]
    out = torch.zeros((xq.shape[0], n), dtype=torch.float32, device=x.device)
    for kb in range(xq.shape[1] // BLOCK):
        cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
        partial = xq[:, cols] @ wq[:, cols].T
        out += partial * x_scale[:, kb:kb + 1] * sb[:, kb].unsqueeze(0)
    if bias is not None:
        out += bias.to(torch.float32)
    return out.to(torch.bfloat16).reshape(*lead, n)



# Round-off of the reference FP8 GEMM, the constants of fp8_block_linear_bound.
E4M3_UNIT_ROUNDOFF = 2.0 ** -4  # round to nearest, 4 significant bits (3 stored + the implicit one)
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10  # below e4m3's smallest normal (2^-6) the grid is uniform, step 2^-9
FP32_UNIT_ROUNDOFF = 2.0 ** -24
BF16_UNIT_ROUNDOFF = 2.0 ** -8
# a: the relative part of one quantised value's error, |v^ - v| <= a |v| + eta s (fp8_block_linear_bound)
FP8_VALUE_ROUNDOFF = E4M3_UNIT_ROUNDOFF + FP32_UNIT_ROUNDOFF * (1 + E4M3_UNIT_ROUNDOFF)


class Fp8LinearBound(NamedTuple):
    """float64 [M, N]: y the exact product, bound on |fp8 GEMM - y|; y_q the exact product of the quantised
    operands (x^ w^^T + bias), bound_q on |fp8 GEMM - y_q| (the GEMM's own arithmetic only)."""
    y: torch.Tensor
    bound: torch.Tensor
    y_q: torch.Tensor
    bound_q: torch.Tensor


def fp8_block_linear_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8LinearBound:
    """Bounds that provably hold for every element of y8 = fp8_block_linear_ref(x, *quantize_weight_block128(w),
    bias): |y8 - y| <= bound with y = x w^T + bias, and |y8 - y_q| <= bound_q with y_q = x^ w^^T + bias, the
    product of the quantised operands. x [M, K], w [N, K], any float dtype; y, y_q exact enough (float64).

    Quantising a value v with its block's scale s (amax / 448, so |v / s| <= 448: nothing overflows) stores
    q = RN_e4m3(fl32(v / s)) and means v^ = q s. e4m3 rounds to nearest with relative error <= u = 2^-4 in its
    normal range and absolute error <= eta = 2^-10 below 2^-6 (subnormals, step 2^-9); the fp32 division adds
    relative u32. Hence |v^ - v| <= a |v| + eta s, a = u + u32 (1 + u). For one product, with dv = v^ - v,
      |x^ w^ - x w| <= |x||dw| + |dx||w| + |dx||dw|
                    <= (2a + a^2) |x||w| + eta (1 + a)(s_w |x| + s_x |w|) + eta^2 s_x s_w,
    summed over k (with the scales of k's block): Q. The fp32 evaluation (a 128-term sum of exact e4m3
    products per K block, times s_x, times s_w, accumulated over the KB blocks, plus the bias) puts at most
    n = 128 + KB + 3 roundings on any term: G = gamma_n (sum_k |x^||w^| + |bias|), gamma_n = n u32 / (1 - n u32).
    The result is rounded to bf16: |bf16(z) - z| <= u_bf16 |z| with |z| <= |y| + Q + G (|y_q| + G), so
      bound = (1 + u_bf16)(Q + G) + u_bf16 |y|,   bound_q = (1 + u_bf16) G + u_bf16 |y_q|.
    It assumes only that nothing underflows fp32 (scales >= 1e-12 / 448 keep products of two far above it).
    bound is dominated by (2u + u^2) sum_k |x_k||w_nk|, ~13% of the absolute products, reached only when every
    rounding errs the same way; bound_q by the bf16 rounding, 2^-8 relative."""
    k = x.shape[-1]
    if w.shape[-1] != k:
        raise ValueError(f"x has K={k} but the weight is {list(w.shape)}")
    x64, w64 = x.reshape(-1, k).double(), w.double()
    xq, sx = quantize_act_1x128(x.reshape(-1, k))
    wq, sw = quantize_weight_block128(w)
    kb = _ceil_div(k, BLOCK)
    sx64 = sx.double()  # [M, KB]
    sw64 = sw.double().repeat_interleave(BLOCK, dim=0)[: w.shape[0]]  # [N, KB]: output n's scale per K block
    # x^, w^ in float64, where an e4m3 value (4 significant bits) times an fp32 scale (24) is exact
    xh = xq.double() * sx64.repeat_interleave(BLOCK, dim=-1)[:, :k]
    wh = wq.double() * sw64.repeat_interleave(BLOCK, dim=-1)[:, :k]

    def block_sums(t: torch.Tensor) -> torch.Tensor:  # [R, K] -> [R, KB], the sum over each 128-wide K block
        return _pad_to(t, -1, BLOCK).reshape(t.shape[0], kb, BLOCK).sum(-1)

    count = block_sums(torch.ones(1, k, dtype=torch.float64))  # real (unpadded) elements per K block
    a, u32, ub, eta = FP8_VALUE_ROUNDOFF, FP32_UNIT_ROUNDOFF, BF16_UNIT_ROUNDOFF, E4M3_SUBNORMAL_HALF_STEP
    n = BLOCK + kb + 3
    gamma = n * u32 / (1 - n * u32)
    b64 = bias.double() if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    y, y_q = x64 @ w64.T + b64, xh @ wh.T + b64
    q = ((2 * a + a * a) * (x64.abs() @ w64.abs().T)
         + eta * (1 + a) * (block_sums(x64.abs()) @ sw64.T + sx64 @ block_sums(w64.abs()).T)
         + eta * eta * (sx64 * count) @ sw64.T)
    g = gamma * (xh.abs() @ wh.abs().T + b64.abs())
    return Fp8LinearBound(y, (1 + ub) * (q + g) + ub * y.abs(), y_q, (1 + ub) * g + ub * y_q.abs())
