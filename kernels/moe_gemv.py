"""The decode path of the gpt-oss MoE (kernels/moe.py picks it for few (token, expert) pairs): GEMVs.

One program per (pair, N tile) streams that expert's weight rows once and never sorts tokens. GEMM1 fuses
bias + clamped SwiGLU (`swiglu`, which the grouped GEMM's epilogue in kernels/moe.py uses too); GEMM2
fuses bias and routing weight; `combine_kernel` sums the k experts in a fixed order (no atomics: replay is
bit-exact). Memory-bound: its floor is the bytes of the active experts. (A first version looped over the
k experts inside GEMM2 with 128-wide K steps: 105 us for 120b batch 1, latency-bound; measured 2026-11-29.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .pdl import enter, pdl_kwargs


@triton.jit
def swiglu(acc, BLOCK_N: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    # acc [..., BLOCK_N] with interleaved (gate, up) columns -> [..., BLOCK_N // 2]
    g, u = tl.split(tl.reshape(acc, acc.shape[:-1] + [BLOCK_N // 2, 2]))
    g = tl.minimum(g, LIMIT)
    u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    return g * tl.sigmoid(ALPHA * g) * (u + 1.0)


@triton.jit
def _gemv_tile(x_row, w_ptr, s_ptr, Kdim, n_ok, FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               LATE: tl.constexpr = False, EARLY: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    # sum_k W[n, k] * x[k] for one N tile; fp8 block scales are folded into x per 128-wide K block
    # (the tile lies in one 128-row block), so a wide BLOCK_K keeps many bytes in flight per step.
    # LATE: keep a [BLOCK_N, BLOCK_K] fp32 accumulator and reduce over K once after the loop, so the loop
    # body has no cross-thread reduction between one K step's loads and the next (bench/sweep_gemv.py
    # times both; the fp32 summation order differs, the math does not).
    # EARLY: the first K step's weight tile and scales are loaded, then the PDL wait (kernels/pdl.py) runs
    # here, then x: the caller passes weight addresses it could form before the wait. The step is peeled
    # out of the loop because the wait must stay outside loops; its sum is the loop's first (0 + s = s).
    offs_k = tl.arange(0, BLOCK_K)
    start = 0
    if EARLY:
        k_ok = offs_k < Kdim
        w0 = tl.load(w_ptr + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if FP8:
            s0 = tl.load(s_ptr + offs_k // 128, mask=k_ok, other=0.0)
        enter(USE_PDL)
        xv = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if FP8:
            xv *= s0
        first = w0.to(tl.float32) * xv[None, :]
        start = BLOCK_K
        if LATE:
            acc2 = first
        else:
            acc = tl.sum(first, 1)
    else:
        if LATE:
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        else:
            acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(start, Kdim, BLOCK_K):
        k_ok = k0 + offs_k < Kdim
        xv = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if FP8:
            xv *= tl.load(s_ptr + (k0 + offs_k) // 128, mask=k_ok, other=0.0)
        wt = tl.load(w_ptr + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if LATE:
            acc2 += wt * xv[None, :]
        else:
            acc += tl.sum(wt * xv[None, :], 1)
    if LATE:
        acc = tl.sum(acc2, 1)
    return acc


@triton.jit
def _gemv1_kernel(x, ids, w, s, b, act, K_TOP, Kdim, s_xt, s_we, s_wn, s_se, s_sn, s_be, s_at,
                  FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ALPHA: tl.constexpr, LIMIT: tl.constexpr, LATE: tl.constexpr = False,
                  USE_PDL: tl.constexpr = False):
    # kernels/pdl.py: before any load. Even the weights' address needs the expert id, which the router
    # kernel just before writes, so nothing is fetched ahead of the wait; PDL still hides this launch and
    # the ramp of its ~700 programs under the router's tail. The wait stays outside _gemv_tile's pipelined
    # K loop (triton#11905).
    enter(USE_PDL)
    pair = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    tok = pair // K_TOP
    e = tl.load(ids + pair).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    w_ptr = w + e * s_we + offs_n.to(tl.int64)[:, None] * s_wn
    acc = _gemv_tile(x + tok * s_xt, w_ptr, s + e * s_se + (n0 // 128) * s_sn, Kdim, offs_n >= 0,
                     FP8, BLOCK_N, BLOCK_K, LATE)
    acc += tl.load(b + e * s_be + offs_n).to(tl.float32)
    a = swiglu(acc, BLOCK_N, ALPHA, LIMIT)
    offs_a = n0 // 2 + tl.arange(0, BLOCK_N // 2)
    tl.store(act + pair.to(tl.int64) * s_at + offs_a, a.to(act.dtype.element_ty))


@triton.jit
def _gemv2_kernel(act, ids, route_w, w, s, b, y, Kdim, Ndim, s_at, s_we, s_wn, s_se, s_sn, s_be, s_yt,
                  FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LATE: tl.constexpr = False,
                  EARLY: tl.constexpr = True, USE_PDL: tl.constexpr = False):
    # One program per (pair, N tile): every expert of every token in parallel; y = w_route * (W2 act + b2)
    # computed in fp32 and stored in y's dtype (bf16 for a bf16 model, as the grouped path stores its pairs),
    # summed in fp32 over the k experts afterwards in a fixed order (no atomics).
    # EARLY (kernels/pdl.py): ids and route_w, the router's outputs TWO kernels back, are read before this
    # kernel's wait, and with them the expert's bias and first weight tile (_gemv_tile), so under PDL the
    # programs resident while GEMV1 still runs already stream W2. Safe: this kernel launches only once every
    # GEMV1 program has passed ITS wait, i.e. once the router has completed and its writes are visible; no
    # kernel writes ids/route_w again before this one completes (PDL overlaps two kernels at most). .cg:
    # from L2, never an L1 line of an earlier step. act (GEMV1's output) is read after the wait.
    pair = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < Ndim
    if not EARLY:
        enter(USE_PDL)  # before any load (ids, route_w, act) or store, as in _gemv1_kernel
    e = tl.load(ids + pair, cache_modifier=".cg").to(tl.int64)
    rw = tl.load(route_w + pair, cache_modifier=".cg").to(tl.float32)
    bias = tl.load(b + e * s_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    w_ptr = w + e * s_we + offs_n.to(tl.int64)[:, None] * s_wn
    acc = _gemv_tile(act + pair.to(tl.int64) * s_at, w_ptr, s + e * s_se + (n0 // 128) * s_sn, Kdim, n_ok,
                     FP8, BLOCK_N, BLOCK_K, LATE, EARLY, USE_PDL)
    acc += bias
    acc *= rw
    tl.store(y + pair.to(tl.int64) * s_yt + offs_n, acc.to(y.dtype.element_ty), mask=n_ok)


@triton.jit
def combine_kernel(y, out, Ndim, K_TOP: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load or store
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < Ndim
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K_TOP):
        acc += tl.load(y + (t.to(tl.int64) * K_TOP + j) * Ndim + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + t.to(tl.int64) * Ndim + offs, acc.to(out.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class GemvLaunch:
    """One GEMV's launch: N tile (inside one 128-row scale block), K step, warps, stages, LATE reduction."""

    block_n: int
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    late: bool = False

    def label(self) -> str:
        return f"n{self.block_n}-k{self.block_k}-w{self.num_warps}-s{self.num_stages}" + ("-late" if self.late else "")


@dataclass(frozen=True)
class GemvConfig:
    w1: GemvLaunch = GemvLaunch(32)
    w2: GemvLaunch = GemvLaunch(16)

    def label(self) -> str:
        return f"w1:{self.w1.label()} w2:{self.w2.label()}"


DEFAULT_CONFIG = GemvConfig()
# Measured per expert shape (hidden, inter) by bench/sweep_gemv.py (batch 1, CUDA graphs); a shape not listed
# uses DEFAULT_CONFIG. gpt-oss-20b and -120b share one expert shape (they differ in the number of experts).
# H200, 2690a31 (bench/results/sweep-gemv-NVIDIA_H200-20261201-170409.json): GEMM1 23.5-23.9 -> 20.7 us
# (78% of the 4.19 TB/s copy ceiling); GEMM2's default was already the best (9.2 us, 88%).
# H200, 331ca2c (sweep-gemv-NVIDIA_H200-20261204-151518.json, GEMM1 alone, 141 of its 512 launches in 390 s):
# n32-k256-w8-s4 19.6 us against the 2690a31 choice's 20.2 (83% of the ceiling); the next best 20.2-20.9 us,
# so the launch space is worth ~3% at most and the rest of the gap is not a tile choice.
# H200, 5a1bbd0 (sweep-gemv-NVIDIA_H200-20261204-153529.json, GEMM2 alone, 47 launches): n32-k256-w8-s2-late
# 8.6 us against the default n16-k512-w4-s3's 10.8 (timed first; 9.2 in the 2690a31 sweep); kept on the
# in-model A/B in bench/results/ab/README.md.
TUNED: dict[tuple[int, int], GemvConfig] = {
    (2880, 2880): GemvConfig(w1=GemvLaunch(32, 256, num_warps=8, num_stages=4),
                             w2=GemvLaunch(32, 256, num_warps=8, num_stages=2, late=True)),
}


def gemv_config(hidden: int, inter: int) -> GemvConfig:
    return TUNED.get((hidden, inter), DEFAULT_CONFIG)


def gemv1(x, ids_flat, k, ex, alpha, limit, act, launch: GemvLaunch) -> None:
    """act [P, I] bf16 = clamped SwiGLU(W1[e] x[token] + b1[e]) for each pair (token = pair // k)."""
    two_i, h = ex.w1.shape[1], ex.hidden
    s1 = ex.s1 if ex.fp8 else ex.w1
    _gemv1_kernel[(ids_flat.numel(), two_i // launch.block_n)](
        x, ids_flat, ex.w1, s1, ex.b1, act, k, h, x.stride(0), ex.w1.stride(0),
        ex.w1.stride(1), s1.stride(0), s1.stride(1), ex.b1.stride(0), act.stride(0),
        FP8=ex.fp8, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, ALPHA=alpha, LIMIT=limit, LATE=launch.late,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_kwargs(x.device))


def gemv2(act, ids_flat, route_w_flat, ex, y, launch: GemvLaunch) -> None:
    """y [P, H] (fp32 or bf16) = route_w * (W2[e] act + b2[e]) for each pair, computed in fp32."""
    h, inter = ex.hidden, act.shape[1]
    s2 = ex.s2 if ex.fp8 else ex.w2
    _gemv2_kernel[(ids_flat.numel(), triton.cdiv(h, launch.block_n))](
        act, ids_flat, route_w_flat, ex.w2, s2, ex.b2, y, inter, h, act.stride(0),
        ex.w2.stride(0), ex.w2.stride(1), s2.stride(0), s2.stride(1), ex.b2.stride(0), y.stride(0),
        FP8=ex.fp8, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, LATE=launch.late, EARLY=gemv2_early(),
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_kwargs(act.device))


def gemv2_early() -> bool:
    """GEMV2's loads ahead of its PDL wait (_gemv2_kernel's EARLY): on unless KVRELAY_MOE_EARLY=0 (A/B runs;
    read at each launch, so a CUDA graph keeps the setting it was captured with). Same results either way."""
    return os.environ.get("KVRELAY_MOE_EARLY") != "0"


def pair_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype both MoE paths store the weighted pair outputs in for activations x: bf16 for a bf16 model
    (each pair rounded once, as the reference rounds each expert's output; summed in fp32 afterwards), fp32
    otherwise. One rule for both, so a decode row rounds alike whichever path its batch size picks."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32


def moe_gemv(x, ids, route_w, ex, alpha, limit, block_n1=None, block_n2=None, block_k=None, num_warps=None,
             num_stages=None, combine=True, config: GemvConfig | None = None):
    """Experts `ids` [T, k] of x [T, H] weighted by route_w [T, k] (ex: kernels.moe.MoEWeights, bf16 or fp8),
    -> [T, H] bf16, or with combine=False the weighted outputs [T, k, H] before their sum (in pair_dtype(x)). `config`
    (default: the shape's entry in TUNED) sets both launches; the block_*/num_* arguments override it."""
    t, k = ids.shape
    two_i, h = ex.w1.shape[1], ex.hidden
    inter = two_i // 2
    cfg = config or gemv_config(h, inter)
    l1, l2 = cfg.w1, cfg.w2
    over = {kk: v for kk, v in (("block_k", block_k), ("num_warps", num_warps), ("num_stages", num_stages))
            if v is not None}
    l1 = replace(l1, **over, **({"block_n": block_n1} if block_n1 else {}))
    l2 = replace(l2, **over, **({"block_n": block_n2} if block_n2 else {}))
    if two_i % l1.block_n or 128 % min(l1.block_n, 128) or 128 % min(l2.block_n, 128):
        raise ValueError("gemv tiles must divide 2I and sit inside one 128-row scale block")
    ids_flat = ids.reshape(-1)
    act = torch.empty(t * k, inter, dtype=torch.bfloat16, device=x.device)
    gemv1(x, ids_flat, k, ex, alpha, limit, act, l1)
    y = torch.empty(t * k, h, dtype=pair_dtype(x), device=x.device)
    gemv2(act, ids_flat, route_w.reshape(-1), ex, y, l2)
    if not combine:
        return y.view(t, k, h)
    out = torch.empty(t, h, dtype=torch.bfloat16, device=x.device)
    combine_kernel[(t, triton.cdiv(h, 1024))](y, out, h, K_TOP=k, BLOCK=1024, num_warps=4, **pdl_kwargs(x.device))
    return out
