"""FP8 (e4m3) block-scaled quantisation: the torch reference of the served FP8 GEMM.

Weights use one float32 scale per 128x128 block, activations one per 1x128 group along K, the layout
cuBLAS blockwise `_scaled_mm` and DeepGEMM consume (h200-notes, "FP8 with 128x128 weight blocks").
scale = amax / 448 so the block maximum lands on e4m3's largest finite value; dequant = fp8 * scale.
Everything here is plain torch and runs on CPU; GPU kernels are tested against it.
"""

from __future__ import annotations

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
