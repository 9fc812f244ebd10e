"""Small fused Triton kernels for the per-layer glue of a decode step.

A batch-1 decode step of gpt-oss-20b launched ~1,300 kernels, and in a CUDA graph the gaps between them
cost more than the kernels (bench/results/profile-decode-*.json): RMSNorm as torch ops is 8 launches,
the half-split rotary of q and k 12. Each becomes one launch here. Both compute in fp32 and round once
(the torch reference rounds after every bf16 op), so results can differ from it by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * (x * inv)).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (any float dtype, unit stride in H), weight [H] -> RMSNorm(x) in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, weight, out, x.stride(0), out.stride(0), x.shape[1], eps,
                                        BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


@triton.jit
def _rotary_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_qkv, stride_cs, n_q,
                      HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)  # 0..n_q-1 are query heads, then the kv heads
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    src = qkv_ptr + t * stride_qkv + head * 2 * HALF
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    if head < n_q:
        dst = q_ptr + (t * n_q + head) * 2 * HALF
    else:
        n_kv = tl.num_programs(1) - n_q
        dst = k_ptr + (t * n_kv + head - n_q) * 2 * HALF
    ty = q_ptr.dtype.element_ty
    tl.store(dst + offs, (x1 * c - x2 * s).to(ty), mask=mask)
    tl.store(dst + HALF + offs, (x2 * c + x1 * s).to(ty), mask=mask)


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (n_q + 2 n_kv) * head_dim] (q heads, then k, then v) and tables [T, head_dim/2] ->
    rotated q [T, n_q, head_dim] and k [T, n_kv, head_dim] (new contiguous tensors; v is untouched)."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    t = qkv.shape[0]
    q = torch.empty((t, n_q, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, n_kv, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t:
        half = head_dim // 2
        _rotary_qk_kernel[(t, n_q + n_kv)](qkv, cos, sin, q, k, qkv.stride(0), cos.stride(0), n_q,
                                           HALF=half, BLOCK=triton.next_power_of_2(half))
    return q, k
