"""The grouped FP8 expert GEMMs as a warp-specialised kernel (a GemmConfig with ws=True; kernels/moe.py launches it).

Why: the grouped kernel (kernels/moe.py) waits for each K step's MMA before promoting its fp32 sum with the
block scales, so a CTA's tensor cores idle through its promotion, and only other CTAs on the SM fill the gap.
That favours 64x128 tiles on one warp group (2-3 CTAs an SM), which move 24 KB through L2 per 1 M MACs.
With triton's warp specialisation (tl.range(warp_specialize=True)) the K loop becomes a TMA producer warp group
and two consumer warp groups, each a 64-row half of a 128-row tile with its own MMAs and promotion (checked in
the sm_90 SASS by tests/cpu/test_grouped_sass.py): 32 KB per 2 M MACs, and one consumer's promotion beside the
other's MMA. Triton (3.6, the H200's) specialises a loop only when every load in it is a TMA descriptor load and
the kernel neither returns before it nor reshapes the accumulator after it (its pass fails to compile
otherwise; 2026-12-05). Hence:
- the input rows are the sort's slots (kernels/moe_sort.quantize_sorted, or GEMM1's output stored so), one TMA
  tile a K step;
- GEMM1 reads the interleaved gate/up weight rows (even = gate, odd = up) through a 3-D view [E*N/2, 2, K] as two
  half tiles, the gates and the ups, and runs two MMAs, so the clamped SwiGLU needs no reshape of the
  accumulator (the gate and up rows of a 128-row block share its weight scale);
- an empty block (past the last expert's) runs no K step and stores nothing.
The math is the grouped kernel's: per 128-wide K block an fp32 MMA sum, promoted with the row's activation
scale times the tile's one weight scale (N tiles of at most 128 columns lie in one weight-scale block).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .moe_gemv import swiglu_parts
from .moe_sort import tile_order
from .pdl import enter


@triton.jit
def _grouped_ws_kernel(a_desc, sa, w_desc, sw, b, rw, out, sorted_ids, block_expert, num_m, n_pairs, E, N, KDIM,
                       s_sam, s_sak, s_swe, s_swn, s_be, s_om,
                       SWIGLU: tl.constexpr, MUL_ROUTE: tl.constexpr, OUT_SORTED: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       ALPHA: tl.constexpr, LIMIT: tl.constexpr, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load or store
    pid_m, pid_n = tile_order(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    e_raw = tl.load(block_expert + pid_m)
    live = e_raw < E
    e32 = tl.where(live, e_raw, 0)
    k_end = tl.where(live, KDIM, 0)
    e = e32.to(tl.int64)
    row0 = pid_m * BLOCK_M
    slots = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    live_rows = (tl.zeros([BLOCK_M], tl.int32) + e_raw) < E  # the block's liveness as a row mask
    pairs = tl.load(sorted_ids + slots)
    m_ok = (pairs < n_pairs) & live_rows
    sw_tile = sw + e * s_swe + ((pid_n * BLOCK_N) // 128) * s_swn
    w_row = e32 * N + pid_n * BLOCK_N  # row of the [E*N, K] weight view (the [E*N/2, 2, K] view: w_row // 2)
    HALF: tl.constexpr = BLOCK_N // 2
    if SWIGLU:
        acc_g = tl.zeros([BLOCK_M, HALF], tl.float32)
        acc_u = tl.zeros([BLOCK_M, HALF], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, k_end, BLOCK_K, warp_specialize=True):
        at = a_desc.load([row0, k0])
        scale = (tl.load(sa + slots * s_sam + (k0 // 128) * s_sak) * tl.load(sw_tile + k0 // 128))[:, None]
        if SWIGLU:
            wg = w_desc.load([w_row // 2, 0, k0]).reshape([HALF, BLOCK_K])
            wu = w_desc.load([w_row // 2, 1, k0]).reshape([HALF, BLOCK_K])
            acc_g += tl.dot(at, tl.trans(wg)) * scale
            acc_u += tl.dot(at, tl.trans(wu)) * scale
        else:
            acc += tl.dot(at, tl.trans(w_desc.load([w_row, k0]))) * scale
    if SWIGLU:
        offs_a = pid_n * HALF + tl.arange(0, HALF)  # act columns; gate row 2j, up row 2j + 1
        a_ok = offs_a < N // 2
        acc_g += tl.load(b + e * s_be + 2 * offs_a, mask=a_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b + e * s_be + 2 * offs_a + 1, mask=a_ok, other=0.0).to(tl.float32)[None, :]
        act = swiglu_parts(acc_g, acc_u, ALPHA, LIMIT)
        if OUT_SORTED:
            tl.store(out + slots[:, None] * s_om + offs_a[None, :], act.to(out.dtype.element_ty),
                     mask=live_rows[:, None] & a_ok[None, :])
        else:
            tl.store(out + pairs.to(tl.int64)[:, None] * s_om + offs_a[None, :], act.to(out.dtype.element_ty),
                     mask=m_ok[:, None] & a_ok[None, :])
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        acc += tl.load(b + e * s_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if MUL_ROUTE:
            acc *= tl.load(rw + pairs, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out + pairs.to(tl.int64)[:, None] * s_om + offs_n[None, :], acc.to(out.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def launch(a_desc, sa, w_desc, sw, b, rw, out, sorted_ids, block_expert, n_pairs, n, kdim, swiglu, out_sorted,
           alpha, limit, block_m, cfg, pdl: dict, *, warmup=False):
    """One grouped GEMM on the warp-specialised kernel (kernels/moe._grouped_gemm checks the config and builds the
    descriptors: a_desc [S, K] tiles [block_m, 128]; w_desc [E*N/2, 2, K] tiles [block_n/2, 1, 128] for GEMM1,
    [E*N, K] tiles [block_n, 128] for GEMM2)."""
    num_m = block_expert.numel()
    grid = (triton.cdiv(n, cfg.block_n) * num_m,)
    args = (a_desc, sa, w_desc, sw, b, rw if rw is not None else b, out, sorted_ids, block_expert, num_m, n_pairs,
            sw.shape[0], n, kdim, sa.stride(0), sa.stride(1), sw.stride(0), sw.stride(1), b.stride(0), out.stride(0))
    meta = dict(SWIGLU=swiglu, MUL_ROUTE=rw is not None, OUT_SORTED=out_sorted, BLOCK_M=block_m,
                BLOCK_N=cfg.block_n, BLOCK_K=128, GROUP_M=cfg.group_m, ALPHA=alpha, LIMIT=limit,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    if warmup:
        return _grouped_ws_kernel.warmup(*args, grid=grid, **meta)
    _grouped_ws_kernel[grid](*args, **meta)
