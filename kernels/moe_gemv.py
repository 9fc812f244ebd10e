"""The decode path of the gpt-oss MoE (kernels/moe.py picks it for few (token, expert) pairs): GEMVs.

One program per (pair, N tile) streams that expert's weight rows once and never sorts tokens. GEMM1 fuses
bias + clamped SwiGLU (`swiglu`, which the grouped GEMM's epilogue in kernels/moe.py uses too); GEMM2
fuses bias and routing weight; `combine_kernel` sums the k experts in a fixed order (no atomics: replay is
bit-exact). Memory-bound: its floor is the bytes of the active experts. (A first version looped over the
k experts inside GEMM2 with 128-wide K steps: 105 us for 120b batch 1, latency-bound; measured 2026-11-29.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def swiglu(acc, BLOCK_N: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    # acc [..., BLOCK_N] with interleaved (gate, up) columns -> [..., BLOCK_N // 2]
    g, u = tl.split(tl.reshape(acc, acc.shape[:-1] + [BLOCK_N // 2, 2]))
    g = tl.minimum(g, LIMIT)
    u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    return g * tl.sigmoid(ALPHA * g) * (u + 1.0)


@triton.jit
def _gemv_tile(x_row, w_ptr, s_ptr, Kdim, n_ok, FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # sum_k W[n, k] * x[k] for one N tile; fp8 block scales are folded into x per 128-wide K block
    # (the tile lies in one 128-row block), so a wide BLOCK_K keeps many bytes in flight per step.
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, Kdim, BLOCK_K):
        k_ok = k0 + offs_k < Kdim
        xv = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if FP8:
            xv *= tl.load(s_ptr + (k0 + offs_k) // 128, mask=k_ok, other=0.0)
        wt = tl.load(w_ptr + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wt * xv[None, :], 1)
    return acc


@triton.jit
def _gemv1_kernel(x, ids, w, s, b, act, K_TOP, Kdim, s_xt, s_we, s_wn, s_se, s_sn, s_be, s_at,
                  FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    pair = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    tok = pair // K_TOP
    e = tl.load(ids + pair).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    w_ptr = w + e * s_we + offs_n.to(tl.int64)[:, None] * s_wn
    acc = _gemv_tile(x + tok * s_xt, w_ptr, s + e * s_se + (n0 // 128) * s_sn, Kdim, offs_n >= 0,
                     FP8, BLOCK_N, BLOCK_K)
    acc += tl.load(b + e * s_be + offs_n).to(tl.float32)
    a = swiglu(acc, BLOCK_N, ALPHA, LIMIT)
    offs_a = n0 // 2 + tl.arange(0, BLOCK_N // 2)
    tl.store(act + pair.to(tl.int64) * s_at + offs_a, a.to(act.dtype.element_ty))


@triton.jit
def _gemv2_kernel(act, ids, route_w, w, s, b, y, Kdim, Ndim, s_at, s_we, s_wn, s_se, s_sn, s_be, s_yt,
                  FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program per (pair, N tile): every expert of every token in parallel; y = w_route * (W2 act + b2)
    # in fp32, summed over the k experts afterwards in a fixed order (no atomics).
    pair = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < Ndim
    e = tl.load(ids + pair).to(tl.int64)
    w_ptr = w + e * s_we + offs_n.to(tl.int64)[:, None] * s_wn
    acc = _gemv_tile(act + pair.to(tl.int64) * s_at, w_ptr, s + e * s_se + (n0 // 128) * s_sn, Kdim, n_ok,
                     FP8, BLOCK_N, BLOCK_K)
    acc += tl.load(b + e * s_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    acc *= tl.load(route_w + pair).to(tl.float32)
    tl.store(y + pair.to(tl.int64) * s_yt + offs_n, acc, mask=n_ok)


@triton.jit
def combine_kernel(y, out, Ndim, K_TOP: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < Ndim
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K_TOP):
        acc += tl.load(y + (t.to(tl.int64) * K_TOP + j) * Ndim + offs, mask=ok, other=0.0)
    tl.store(out + t.to(tl.int64) * Ndim + offs, acc.to(out.dtype.element_ty), mask=ok)


def moe_gemv(x, ids, route_w, ex, alpha, limit, block_n1=32, block_n2=16, block_k=512, num_warps=4, num_stages=3,
             combine=True):
    """Experts `ids` [T, k] of x [T, H] weighted by route_w [T, k] (ex: kernels.moe.MoEWeights, bf16 or fp8),
    -> [T, H] bf16, or with combine=False the weighted outputs fp32 [T, k, H] before their sum."""
    t, k = ids.shape
    two_i, h = ex.w1.shape[1], ex.hidden
    inter = two_i // 2
    if two_i % block_n1 or 128 % min(block_n1, 128) or 128 % min(block_n2, 128):
        raise ValueError("gemv tiles must divide 2I and sit inside one 128-row scale block")
    act = torch.empty(t * k, inter, dtype=torch.bfloat16, device=x.device)
    ids_flat = ids.reshape(-1)
    s1 = ex.s1 if ex.fp8 else ex.w1
    _gemv1_kernel[(t * k, two_i // block_n1)](
        x, ids_flat, ex.w1, s1, ex.b1, act, k, h, x.stride(0), ex.w1.stride(0), ex.w1.stride(1),
        s1.stride(0), s1.stride(1), ex.b1.stride(0), act.stride(0),
        FP8=ex.fp8, BLOCK_N=block_n1, BLOCK_K=block_k, ALPHA=alpha, LIMIT=limit, num_warps=num_warps,
        num_stages=num_stages)
    y = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
    s2 = ex.s2 if ex.fp8 else ex.w2
    _gemv2_kernel[(t * k, triton.cdiv(h, block_n2))](
        act, ids_flat, route_w.reshape(-1), ex.w2, s2, ex.b2, y, inter, h, act.stride(0),
        ex.w2.stride(0), ex.w2.stride(1), s2.stride(0), s2.stride(1), ex.b2.stride(0), y.stride(0),
        FP8=ex.fp8, BLOCK_N=block_n2, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    if not combine:
        return y.view(t, k, h)
    out = torch.empty(t, h, dtype=torch.bfloat16, device=x.device)
    combine_kernel[(t, triton.cdiv(h, 1024))](y, out, h, K_TOP=k, BLOCK=1024, num_warps=4)
    return out
