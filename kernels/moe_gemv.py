"""The decode path of the gpt-oss MoE (kernels/moe.py picks it for few (token, expert) pairs): GEMVs.

One program per (pair, N tile) streams that expert's weight rows once and never sorts tokens. GEMM1 fuses
bias + clamped SwiGLU (`swiglu`, which the grouped GEMM's epilogue in kernels/moe.py uses too); GEMM2
fuses bias and routing weight; `combine_kernel` sums the k experts in a fixed order (no atomics: replay is
bit-exact), or the next block's residual add + RMSNorm does (kernels.fused.add_rms_norm), at decode batches of
up to NORM_FUSE_MAX_TOKENS tokens inside GEMV2's own launch (MoePending.finish_norm). Memory-bound: its floor
is the bytes of the active experts. (A first version looped over the k experts inside GEMM2 with 128-wide K
steps: 105 us for 120b batch 1, latency-bound; measured 2026-11-29.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .fp8_quant import store_zero_rows
from .fused import add_rms_norm_row, norm_block, quant_buffers
from .pdl import enter, pdl_kwargs
from .switches import fusion_on

# The most (token, expert) pairs the "gemv" path takes (kernels/moe.py picks it up to here): past it the grouped
# GEMM reads each expert's bytes once however many tokens share it.
GEMV_MAX_PAIRS = 32


@triton.jit
def swiglu(acc, BLOCK_N: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    # acc [..., BLOCK_N] with interleaved (gate, up) columns -> [..., BLOCK_N // 2]
    g, u = tl.split(tl.reshape(acc, acc.shape[:-1] + [BLOCK_N // 2, 2]))
    return swiglu_parts(g, u, ALPHA, LIMIT)


@triton.jit
def swiglu_parts(g, u, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    # the clamped SwiGLU of gate and up values already apart (kernels/moe_ws.py computes them as two tiles)
    g = tl.minimum(g, LIMIT)
    u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    return g * tl.sigmoid(ALPHA * g) * (u + 1.0)


@triton.jit
def spin_until(ptr, target):
    """Until the int32 at `ptr` reaches `target`: a gpu-scope acquire poll (a scalar atomic: one thread a program
    issues it, all see its value), so this program's later loads see what the writers released before counting
    (kernels/moe_fused.py)."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _gemv_tile(x_row, w_ptr, s_ptr, Kdim, n_ok, FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               LATE: tl.constexpr = False, EARLY: tl.constexpr = False, USE_PDL: tl.constexpr = False,
               spin_ptr=None, spin_target=0, SPIN: tl.constexpr = False):
    # sum_k W[n, k] * x[k] for one N tile; fp8 block scales are folded into x per 128-wide K block
    # (the tile lies in one 128-row block), so a wide BLOCK_K keeps many bytes in flight per step.
    # LATE: keep a [BLOCK_N, BLOCK_K] fp32 accumulator and reduce over K once after the loop, so the loop
    # body has no cross-thread reduction between one K step's loads and the next (bench/sweep_gemv.py
    # times both; the fp32 summation order differs, the math does not).
    # EARLY: the first K step's weight tile and scales are loaded, then the PDL wait (kernels/pdl.py) runs
    # here, then x: the caller passes weight addresses it could form before the wait. The step is peeled
    # out of the loop because the wait must stay outside loops; its sum is the loop's first (0 + s = s).
    # SPIN (with EARLY; kernels/moe_fused.py): the wait is spin_until(spin_ptr, spin_target) instead, x being
    # written by other programs of the same launch; x is then read from L2 (.cg), never from an SM's L1.
    offs_k = tl.arange(0, BLOCK_K)
    start = 0
    if EARLY:
        k_ok = offs_k < Kdim
        w0 = tl.load(w_ptr + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if FP8:
            s0 = tl.load(s_ptr + offs_k // 128, mask=k_ok, other=0.0)
        if SPIN:
            spin_until(spin_ptr, spin_target)
        else:
            enter(USE_PDL)
        xv = tl.load(x_row + offs_k, mask=k_ok, other=0.0, cache_modifier=".cg" if SPIN else "").to(tl.float32)
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
        xv = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0,
                     cache_modifier=".cg" if SPIN else "").to(tl.float32)
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
    tok = pair // K_TOP
    e = tl.load(ids + pair).to(tl.int64)
    gemv1_tile(x + tok * s_xt, e, tl.program_id(1) * BLOCK_N, act + pair.to(tl.int64) * s_at, w, s, b, Kdim,
               s_we, s_wn, s_se, s_sn, s_be, FP8, BLOCK_N, BLOCK_K, ALPHA, LIMIT, LATE)


@triton.jit
def gemv1_tile(x_row, e, n0, act_row, w, s, b, Kdim, s_we, s_wn, s_se, s_sn, s_be, FP8: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
               LATE: tl.constexpr):
    # GEMV1's rows n0 .. n0 + BLOCK_N of expert e (int64) for the activation row x_row: W1 x + b1, clamped SwiGLU,
    # stored as act_row's BLOCK_N / 2 values from n0 / 2 (kernels/moe_fused.py runs it too)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    w_ptr = w + e * s_we + offs_n.to(tl.int64)[:, None] * s_wn
    acc = _gemv_tile(x_row, w_ptr, s + e * s_se + (n0 // 128) * s_sn, Kdim, offs_n >= 0, FP8, BLOCK_N, BLOCK_K,
                     LATE)
    acc += tl.load(b + e * s_be + offs_n).to(tl.float32)
    a = swiglu(acc, BLOCK_N, ALPHA, LIMIT)
    tl.store(act_row + n0 // 2 + tl.arange(0, BLOCK_N // 2), a.to(act_row.dtype.element_ty))


@triton.jit
def _gemv2_pair(act, ids, route_w, w, s, b, y, Kdim, Ndim, s_at, s_we, s_wn, s_se, s_sn, s_be, s_yt,
                FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LATE: tl.constexpr,
                EARLY: tl.constexpr, USE_PDL: tl.constexpr):
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
    if not EARLY:
        enter(USE_PDL)  # before any load (ids, route_w, act) or store, as in _gemv1_kernel
    e = tl.load(ids + pair, cache_modifier=".cg").to(tl.int64)
    rw = tl.load(route_w + pair, cache_modifier=".cg").to(tl.float32)
    gemv2_tile(act + pair.to(tl.int64) * s_at, e, rw, tl.program_id(1) * BLOCK_N, w, s, b,
               y + pair.to(tl.int64) * s_yt, Kdim, Ndim, s_we, s_wn, s_se, s_sn, s_be, FP8, BLOCK_N, BLOCK_K, LATE,
               EARLY, USE_PDL)


@triton.jit
def gemv2_tile(act_row, e, rw, n0, w, s, b, y_row, Kdim, Ndim, s_we, s_wn, s_se, s_sn, s_be, FP8: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LATE: tl.constexpr, EARLY: tl.constexpr,
               USE_PDL: tl.constexpr, spin_ptr=None, spin_target=0, SPIN: tl.constexpr = False):
    # GEMV2's rows n0 .. n0 + BLOCK_N of expert e (int64) for the pair's act_row: rw * (W2 act + b2) in fp32,
    # stored into y_row in its dtype. EARLY / SPIN: _gemv_tile's wait (kernels/moe_fused.py passes SPIN).
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < Ndim
    bias = tl.load(b + e * s_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    w_ptr = w + e * s_we + offs_n.to(tl.int64)[:, None] * s_wn
    acc = _gemv_tile(act_row, w_ptr, s + e * s_se + (n0 // 128) * s_sn, Kdim, n_ok, FP8, BLOCK_N, BLOCK_K, LATE,
                     EARLY, USE_PDL, spin_ptr, spin_target, SPIN)
    acc += bias
    acc *= rw
    tl.store(y_row + offs_n, acc.to(y_row.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv2_kernel(act, ids, route_w, w, s, b, y, Kdim, Ndim, s_at, s_we, s_wn, s_se, s_sn, s_be, s_yt,
                  FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LATE: tl.constexpr = False,
                  EARLY: tl.constexpr = True, USE_PDL: tl.constexpr = False):
    _gemv2_pair(act, ids, route_w, w, s, b, y, Kdim, Ndim, s_at, s_we, s_wn, s_se, s_sn, s_be, s_yt,
                FP8, BLOCK_N, BLOCK_K, LATE, EARLY, USE_PDL)


@triton.jit
def _gemv2_norm_kernel(act, ids, route_w, w, s, b, y, x, nw, xo, out, q, sq, cnt, Kdim, Ndim, T, MP, eps,
                       s_at, s_we, s_wn, s_se, s_sn, s_be, s_yt, s_x, s_xo, s_o, s_q, s_sm, s_sk,
                       K_TOP: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       QUANT: tl.constexpr, N_GROUPS: tl.constexpr, BLOCK: tl.constexpr, LATE: tl.constexpr = False,
                       EARLY: tl.constexpr = True, USE_PDL: tl.constexpr = False):
    # _gemv2_kernel, then kernels.fused.add_rms_norm(x, y [T, K_TOP, H], nw, eps, quant_k) in the same launch:
    # each program stores its y tile and counts itself in its token's arrival counter; the token's last
    # program (kernels/router.py's last-block pattern) runs add_rms_norm's row body (fused.add_rms_norm_row,
    # the same code, so the same bits) on the token's K_TOP pair rows, read back from L2 (.cg), and zeroes
    # the counter for the next launch; the last program of token T-1 also writes the GEMM's M-padding rows
    # T..MP-1 (zeros, the floor scale). The pairs are summed in their fixed order whichever program arrives
    # last: replay is bit-exact.
    # PDL (kernels/pdl.py): everything after _gemv2_pair follows this program's wait (in _gemv_tile, or at
    # the top without EARLY), so the previous kernel has completed, and, every kernel since waiting for its
    # own predecessor, so has each one before it: x (the residual, written by the router's add + norm two
    # kernels back), the previous launch on these counters (its reset included) and the previous readers of
    # the buffers written here (x_new, out, q, sq are fresh allocations, which a graph's pool may reuse). The
    # next kernel, launched once every program here passed its wait, reads x_new / q / sq only after its own
    # wait, i.e. after this launch (the epilogues included) has completed.
    _gemv2_pair(act, ids, route_w, w, s, b, y, Kdim, Ndim, s_at, s_we, s_wn, s_se, s_sn, s_be, s_yt,
                FP8, BLOCK_N, BLOCK_K, LATE, EARLY, USE_PDL)
    tok = tl.program_id(0) // K_TOP
    # every thread's y store is done before the one release below (barrier, then a gpu-scope acq_rel
    # atomic); the last arrival's acquire then sees the token's every y tile
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt + tok, 1, sem="acq_rel", scope="gpu")
    if arrived == K_TOP * tl.num_programs(1) - 1:
        add_rms_norm_row(x, y, nw, xo, out, q, sq, tok, tok.to(tl.int64), T, Ndim, eps, s_x, K_TOP * s_yt, s_yt,
                         s_xo, s_o, s_q, s_sm, s_sk, 2, K_TOP, True, True, QUANT, N_GROUPS, BLOCK, True)
        if QUANT:
            if tok == T - 1:
                # the M-padding rows T..MP-1: zeros with the floor scale stored directly (the row body would
                # norm and quantise MP - T rows of nothing: ~3 rows of tail at batch 1). add_rms_norm's own pad
                # rows hold the same values, up to the sign of a zero (w * +0 keeps w's sign).
                store_zero_rows(q, sq, T, MP, s_q, s_sm, s_sk, N_GROUPS * 128, BLOCK)
        tl.atomic_xchg(cnt + tok, 0, sem="relaxed", scope="gpu")


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
# The sweeps above timed every call of a point on the same 4 experts: GEMM2's 33 MB fit in the 50 MB L2, so their
# GEMM2 times are partly L2 reads (8.6 us alone vs 12.2 us in the model's PDL-off profile at b5ee1b4); since
# 2026-12-05 bench/sweep_gemv.py rotates disjoint expert sets between calls. Not re-swept yet.
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


# Token counts up to which the engine's decode MoE leaves GEMV2 to the next block, which launches it with its
# residual add + RMSNorm (+ FP8 quantisation) fused (MoePending.finish_norm): one launch fewer a layer, ~1.5-2.5
# us each on the H200 even under PDL, which matters where a step is launch-bound (batch 1-4, the smallest
# decode graphs). The epilogue is one program per token row, so it stays short; larger batches keep the
# separate add_rms_norm launch (16 warps a row, bench/sweep_glue.py), which then weighs less.
NORM_FUSE_MAX_TOKENS = 4


def fused_gemv() -> bool:
    """Whether the engine's decode MoE runs both GEMVs in one launch (kernels/moe_fused.py):
    KVRELAY_MOE_FUSED_GEMV, a decode fusion of kernels.switches.DECODE_FUSIONS."""
    return fusion_on("KVRELAY_MOE_FUSED_GEMV")


def norm_fuse() -> bool:
    """Whether the engine's decode MoE leaves GEMV2 to the next block's fused add + norm (MoePending):
    KVRELAY_MOE_NORM_FUSE, a decode fusion of kernels.switches.DECODE_FUSIONS."""
    return fusion_on("KVRELAY_MOE_NORM_FUSE")


def new_norm_counters(device) -> torch.Tensor:
    """Arrival counters of the norm-fused GEMV2, one per token (zero; each launch leaves them zero). Allocate
    before any CUDA-graph capture (engine/layers/moe.py: one set per layer)."""
    return torch.zeros(NORM_FUSE_MAX_TOKENS, dtype=torch.int32, device=device)


def gemv2_norm(act, ids_flat, route_w_flat, ex, k: int, launch: GemvLaunch, counters: torch.Tensor, y: torch.Tensor,
               x: torch.Tensor, weight: torch.Tensor, eps: float, quant_k: int | None):
    """gemv2 into y [T*k, H], then kernels.fused.add_rms_norm(x, y.view(T, k, H), weight, eps, quant_k=quant_k)
    in the same launch, bit for bit where the norm's launch has the same warps (the RMSNorm's fp32 sum order
    depends on them on a GPU; the interpreter sums in one order): -> (x_new [T, H] in x's dtype, normed [T, H],
    or with quant_k (fp8 [Mp, quant_k], scale f32 [Mp, quant_k/128] M-major, Mp = T rounded up to 4))."""
    t, h = x.shape
    if t * k != ids_flat.numel() or h != ex.hidden or t > counters.numel() or counters.dtype != torch.int32:
        raise ValueError(f"gemv2_norm: x {list(x.shape)} for {ids_flat.numel()} pairs of {k} a token and hidden "
                         f"{ex.hidden}, int32 counters for {t} tokens (got {counters.numel()} {counters.dtype})")
    x_new = torch.empty_like(x)
    if quant_k is None:
        out = torch.empty_like(x)
        q = sq = x
        mp = t
    else:
        out = x
        q, sq = quant_buffers(t, quant_k, x.device)
        mp = q.shape[0]
    inter = act.shape[1]
    s2 = ex.s2 if ex.fp8 else ex.w2
    _gemv2_norm_kernel[(ids_flat.numel(), triton.cdiv(h, launch.block_n))](
        act, ids_flat, route_w_flat, ex.w2, s2, ex.b2, y, x, weight, x_new, out, q, sq, counters, inter, h, t, mp,
        eps, act.stride(0), ex.w2.stride(0), ex.w2.stride(1), s2.stride(0), s2.stride(1), ex.b2.stride(0),
        y.stride(0), x.stride(0), x_new.stride(0), out.stride(0), q.stride(0), sq.stride(0), sq.stride(1),
        K_TOP=k, FP8=ex.fp8, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, QUANT=quant_k is not None,
        N_GROUPS=(quant_k or 128) // 128, BLOCK=norm_block(h, quant_k), LATE=launch.late, EARLY=gemv2_early(),
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_kwargs(act.device))
    return x_new, (out if quant_k is None else (q, sq))


@dataclass(frozen=True)
class MoePending:
    """The decode MoE's experts with GEMV1 run and GEMV2 not yet launched (moe_gemv with norm_counters): whoever
    consumes the weighted expert outputs launches GEMV2, with the next residual add + RMSNorm (+ the QKV GEMM's
    FP8 quantisation) fused into it (finish_norm: engine/model.py's Block.residual_attention_in), or plainly
    (outputs: every other consumer). Launch exactly one of them, once."""

    act: torch.Tensor  # [T*k, I] bf16: GEMV1's clamped SwiGLU
    ids_flat: torch.Tensor  # [T*k] expert ids
    route_w_flat: torch.Tensor  # [T*k] routing weights
    ex: object  # kernels.moe.MoEWeights (not imported: kernels/moe.py imports this module)
    launch: GemvLaunch  # GEMV2's
    tokens: int
    k: int
    y_dtype: torch.dtype  # pair_dtype() of the MoE's input
    counters: torch.Tensor  # new_norm_counters(), owned by the caller

    def _y(self) -> torch.Tensor:
        return torch.empty(self.tokens * self.k, self.ex.hidden, dtype=self.y_dtype, device=self.act.device)

    def outputs(self) -> torch.Tensor:
        """GEMV2 alone: the weighted expert outputs [T, k, H], as moe_gemv(combine=False) returns them."""
        y = self._y()
        gemv2(self.act, self.ids_flat, self.route_w_flat, self.ex, y, self.launch)
        return y.view(self.tokens, self.k, -1)

    def finish_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, quant_k: int | None = None):
        """kernels.fused.add_rms_norm(x, self.outputs(), weight, eps, quant_k=quant_k) in one launch (gemv2_norm):
        (x_new, normed or (fp8, scales)). x [T, H], the residual; x_new is a new tensor."""
        x = x if x.stride(-1) == 1 else x.contiguous()
        return gemv2_norm(self.act, self.ids_flat, self.route_w_flat, self.ex, self.k, self.launch, self.counters,
                          self._y(), x, weight, eps, quant_k)


def pair_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype both MoE paths store the weighted pair outputs in for activations x: bf16 for a bf16 model
    (each pair rounded once, as the reference rounds each expert's output; summed in fp32 afterwards), fp32
    otherwise. One rule for both, so a decode row rounds alike whichever path its batch size picks."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32


def moe_gemv(x, ids, route_w, ex, alpha, limit, block_n1=None, block_n2=None, block_k=None, num_warps=None,
             num_stages=None, combine=True, config: GemvConfig | None = None,
             norm_counters: torch.Tensor | None = None, fused=None):
    """Experts `ids` [T, k] of x [T, H] weighted by route_w [T, k] (ex: kernels.moe.MoEWeights, bf16 or fp8),
    -> [T, H] bf16, or with combine=False the weighted outputs [T, k, H] before their sum (in pair_dtype(x)). `config`
    (default: the shape's entry in TUNED) sets both launches; the block_*/num_* arguments override it.
    norm_counters (new_norm_counters(); combine=False only): up to NORM_FUSE_MAX_TOKENS tokens GEMV2 is left to
    the caller: a MoePending instead of the outputs (the engine passes them where norm_fuse() is on).
    fused (kernels.moe_fused.fused_gemvs(counters); kernels.moe passes it where the engine's fused_gemv() is on):
    fused(x, ids_flat, k, route_w_flat, ex, alpha, limit, act, y) runs both GEMVs in one launch where it can, else
    returns False (a MoePending takes precedence). A hook, so this module needs nothing from kernels/moe_fused.py,
    which is built on its tiles."""
    t, k = ids.shape
    if norm_counters is not None and combine:
        raise ValueError("moe_gemv: norm_counters defer the uncombined outputs; combine must be False")
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
    pending = norm_counters is not None and t <= NORM_FUSE_MAX_TOKENS
    y = None if pending else torch.empty(t * k, h, dtype=pair_dtype(x), device=x.device)
    ran_fused = fused is not None and not pending and fused(x, ids_flat, k, route_w.reshape(-1), ex, alpha, limit,
                                                             act, y)
    if not ran_fused:
        gemv1(x, ids_flat, k, ex, alpha, limit, act, l1)
    if pending:
        return MoePending(act, ids_flat, route_w.reshape(-1), ex, l2, t, k, pair_dtype(x), norm_counters)
    if not ran_fused:
        gemv2(act, ids_flat, route_w.reshape(-1), ex, y, l2)
    if not combine:
        return y.view(t, k, h)
    out = torch.empty(t, h, dtype=torch.bfloat16, device=x.device)
    combine_kernel[(t, triton.cdiv(h, 1024))](y, out, h, K_TOP=k, BLOCK=1024, num_warps=4, **pdl_kwargs(x.device))
    return out
