"""FP8 (e4m3) block-scaled GEMV for decode batch sizes (1..8 rows): y = quant_1x128(x) @ w^T * scales + bias.

The same numbers as kernels.fp8.fp8_block_linear_ref within the fp8 tests' tolerances (activations 1x128,
weights 128x128, fp32 accumulation, + bias in fp32 once, one bf16 rounding). At batch 1 the QKV (2880 -> 5120)
and O (4096 -> 2880) projections are a pure weight stream (15 / 12 MB): cuBLAS blockwise reaches about half
of the 4.19 TB/s copy ceiling there (issue #11), a tensor-core tile wastes 15 of its 16 rows.

Built like kernels/moe_gemv.py's `_gemv_tile` (which streams the same kind of weights at 78-88% of the
ceiling): one program per (N tile, K split, row group) holds a 2-D [BLOCK_N, BLOCK_K] fp8 weight tile per
K step (BLOCK_N rows inside one 128-row scale block, so the tile has one weight scale per 128-wide K block;
contiguous K, 16-byte loads), and both scales are folded into the activation per K element
(x * sa[m, k // 128] * sb[n // 128, k // 128]) before the CUDA-core multiply-add. The activation rows of a
row group (ROWS <= 8, all of a decode batch) are read per K step inside the program and multiply the one
loaded weight tile each, so the weights stream once whatever M. (moe_gemv's helper takes one unit-stride
scale and one row; this one adds the strided 1x128 activation scale and the rows, so it is not reused.)

What the first version lacked (15-30 us at M=1 on the H200, 24% of the ceiling at best): enough bytes in
flight. N=2880..5120 in 16..32-row tiles is 90..320 programs, ~1-2 per SM, each with one tile of loads
outstanding. SPLIT_K cuts K into SPLIT_K contiguous chunks of whole 128-blocks, one program each: the
programs write fp32 partials, count themselves in a per-tile arrival counter, and the last to arrive sums
the partials in split order (0, 1, ...; never in arrival order), adds the bias, rounds once to bf16 and
resets the counter (kernels/router.py's last-block pattern). No float atomics: the sums do not depend on
which program arrives last, so CUDA-graph replay is bit-exact. The counters (int32, zero between launches)
belong to the caller: kernels.fp8_gemm.Fp8BlockLinear allocates them once, before any graph capture.

The fold sums scaled products instead of scaling each 128-wide block sum (the reference's order): both are
fp32 to ~1e-6 relative, far below the bf16 output rounding (tests/gpu/test_fp8_gemm.py bounds the gap).
The activation arrives quantised (kernels.fused.add_rms_norm / sink_correct_quantize write it on the
decode path), so no quantisation is fused here.

Launched with Programmatic Dependent Launch where it is on (kernels/pdl.py): each program loads its first
weight tile and weight scales, then waits for the previous kernel, then reads the activations; the first
tile of the weight stream thus overlaps the previous kernel's tail (tests/cpu/test_pdl.py checks from the
SASS that nothing else is touched before the wait).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import launch_dependents, late_trigger, pdl_kwargs, wait

MAX_BLOCK_M = 8  # rows per program; more rows run as more row groups (weights re-read per group)
MIN_BLOCK_N = 8


@dataclass(frozen=True)
class Fp8GemvLaunch:
    """One launch of the FP8 GEMV: N tile (divides 128), K step (a multiple of 128), K splits, warps, stages."""

    block_n: int = 32
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def label(self) -> str:
        return f"n{self.block_n}-k{self.block_k}-s{self.split_k}-w{self.num_warps}-st{self.num_stages}"

    @classmethod
    def parse(cls, label: str) -> Fp8GemvLaunch:
        """The launch `label()` names (e.g. "n16-k512-s8-w2-st2"); ValueError naming the label otherwise."""
        m = re.fullmatch(r"n(\d+)-k(\d+)-s(\d+)-w(\d+)-st(\d+)", label)
        if m is None:
            raise ValueError(f"not an FP8 GEMV launch label: {label!r} (expected e.g. n16-k512-s8-w2-st2)")
        return cls(*(int(g) for g in m.groups()))


@triton.jit
def _rows_step(acc, wt, s_b, a_ptr, s_am, sa_ptr, s_sam, s_sak, k, k_ok, rows_left, ROWS: tl.constexpr,
               BLOCK_K: tl.constexpr):
    # acc[r, n] += sum_k wt[n, k] * x[r, k] * sa[r, k // 128] * s_b[k] for the one K step at columns k: the
    # [BLOCK_N, BLOCK_K] weight tile multiplies every row of the group.
    kb = k // 128
    rid = tl.arange(0, ROWS)
    for r in tl.static_range(ROWS):
        r_ok = k_ok & (tl.arange(0, BLOCK_K) * 0 + r < rows_left)
        xv = tl.load(a_ptr + r * s_am + k, mask=r_ok, other=0.0).to(tl.float32)
        xv *= tl.load(sa_ptr + r * s_sam + kb * s_sak, mask=r_ok, other=0.0) * s_b
        part = tl.sum(wt * xv[None, :], 1)
        if ROWS == 1:
            acc += part[None, :]
        else:
            acc += tl.where(rid[:, None] == r, part[None, :], 0.0)
    return acc


@triton.jit
def _rows_tile(a_ptr, s_am, sa_ptr, s_sam, s_sak, w_ptr, sb_ptr, s_sbk, klen, rows_left, n_ok,
               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
               LATE_TRIGGER: tl.constexpr):
    # acc[r, n] = sum_{k < klen} W[n, k] * x[r, k] * sa[r, k // 128] * sb[k // 128] over one K chunk (klen > 0).
    # The first K step's weight tile and weight scales are loaded before the PDL wait (kernels/pdl.py): their
    # addresses need only the program ids, and no decode kernel writes weights, so under PDL the first tile
    # streams while the previous kernel finishes. The step is peeled out of the loop because the wait must
    # stay outside loops; activations, their scales and the later tiles are all read after it.
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < klen
    s_b = tl.load(sb_ptr + (offs_k // 128) * s_sbk, mask=k_ok, other=0.0)
    w0 = tl.load(w_ptr + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    wait(USE_PDL)
    if not LATE_TRIGGER:  # else the caller triggers after the loop (kernels/pdl.py, KVRELAY_PDL_LATE_TRIGGER)
        launch_dependents(USE_PDL)
    acc = _rows_step(tl.zeros([ROWS, BLOCK_N], tl.float32), w0.to(tl.float32), s_b, a_ptr, s_am, sa_ptr, s_sam, s_sak,
                     offs_k, k_ok, rows_left, ROWS, BLOCK_K)
    for k0 in range(BLOCK_K, klen, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < klen
        s_b = tl.load(sb_ptr + (k // 128) * s_sbk, mask=k_ok, other=0.0)
        wt = tl.load(w_ptr + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc = _rows_step(acc, wt, s_b, a_ptr, s_am, sa_ptr, s_sam, s_sak, k, k_ok, rows_left, ROWS, BLOCK_K)
    return acc


# s_sbn (the weight scales' row stride, Kp/128: 23 for K=2880, 32 for K=4096) is not specialised, so the QKV
# and O projections share one compile per launch and row count (a cold start compiles half as many).
@triton.jit(do_not_specialize=["s_sbn"])
def _fp8_gemv_kernel(a, b, sa, sb, bias, c, part, cnt, M, N, KP, K_SPLIT,
                     s_am, s_bn, s_sam, s_sak, s_sbn, s_sbk, s_cm,
                     HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, LATE_TRIGGER: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    # Program (N tile, K split, row group): rows m0 .. m0 + ROWS of outputs n0 .. n0 + BLOCK_N over the
    # K chunk [k_lo, k_lo + K_SPLIT) (K_SPLIT a multiple of 128: whole scale blocks). Under PDL
    # (kernels/pdl.py) _rows_tile waits after its first weight tile; every store and counter atomic below
    # follows that wait, so a launch's counter increments start only after the previous kernel (and, the
    # chain being transitive, the previous launch on these counters, whose last arrival resets them) has
    # COMPLETED: kernels/router.py's argument for its arrival counters.
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    m0 = pid_m * ROWS
    k_lo = pid_s * K_SPLIT
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # BLOCK_N divides 128 and tiles start at multiples of BLOCK_N: the whole tile has one row block.
    acc = _rows_tile(a + m0.to(tl.int64) * s_am + k_lo, s_am, sa + m0 * s_sam + (k_lo // 128) * s_sak, s_sam, s_sak,
                     b + offs_n.to(tl.int64)[:, None] * s_bn + k_lo, sb + (n0 // 128) * s_sbn + (k_lo // 128) * s_sbk,
                     s_sbk, tl.minimum(KP - k_lo, K_SPLIT), M - m0, n_ok, ROWS, BLOCK_N, BLOCK_K, USE_PDL,
                     LATE_TRIGGER)
    if LATE_TRIGGER:
        launch_dependents(USE_PDL)
    rows = m0 + tl.arange(0, ROWS)
    out_ok = (rows[:, None] < M) & n_ok[None, :]
    o_off = rows.to(tl.int64)[:, None] * s_cm + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c + o_off, acc.to(c.dtype.element_ty), mask=out_ok)
    else:
        # partials [SPLIT_K, M, N] fp32; the tile's last arrival sums them in split order
        p_off = rows.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part + pid_s.to(tl.int64) * M * N + p_off, acc, mask=out_ok)
        # every thread's partial store is done before the one release below (barrier, then a gpu-scope
        # acq_rel atomic); the last arrival's acquire then sees every split's partial
        tl.debug_barrier()
        tile = pid_n * tl.num_programs(2) + pid_m
        arrived = tl.atomic_add(cnt + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tot = tl.zeros([ROWS, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: read from L2, never a stale L1 line
                tot += tl.load(part + s * M * N + p_off, mask=out_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(c + o_off, tot.to(c.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(cnt + tile, 0, sem="relaxed", scope="gpu")


def counters_needed(n: int, m: int = MAX_BLOCK_M, block_n: int = MIN_BLOCK_N) -> int:
    """Arrival counters a split-K launch over n outputs and m rows uses (one per N tile and row group)."""
    return triton.cdiv(n, block_n) * triton.cdiv(m, min(MAX_BLOCK_M, triton.next_power_of_2(max(m, 1))))


def new_counters(n: int, device, m: int = MAX_BLOCK_M) -> torch.Tensor:
    """Zeroed arrival counters for every split-K launch of triton_fp8_gemv over n outputs and <= m rows
    (each launch leaves them zero). Allocate before any CUDA-graph capture."""
    return torch.zeros(counters_needed(n, m), dtype=torch.int32, device=device)


def triton_fp8_gemv(a_fp8, sa, w_fp8, w_scale, bias=None, out=None, *, m: int | None = None, block_n: int = 16,
                    block_k: int = 512, num_warps: int = 4, num_stages: int = 2, split_k: int = 1,
                    counters: torch.Tensor | None = None, launch: Fp8GemvLaunch | None = None):
    """The first m rows (default all) of a_fp8 [Mp, Kp] with scales sa [Mp, Kp/128] (any strides, e.g. the
    M-major layout of kernels.fp8_gemm.quantize_act_1x128) times w_fp8 [N, Kp] with block scales
    w_scale [ceil(N/128), Kp/128] (+ bias [N]) -> [m, N] bf16 (or into `out`). `launch` (or the block_*/num_*/
    split_k arguments) sets the tiles; split_k > 1 sums K in that many chunks (capped at Kp/128) and needs
    `counters` (new_counters(N, ...); without them a zeroed set is allocated for this call)."""
    if launch is not None:
        block_n, block_k, split_k = launch.block_n, launch.block_k, launch.split_k
        num_warps, num_stages = launch.num_warps, launch.num_stages
    rows, kp = a_fp8.shape
    m = rows if m is None else m
    if m > rows:
        raise ValueError(f"triton_fp8_gemv: m={m} but the activation has {rows} rows")
    n = w_fp8.shape[0]
    if w_fp8.shape[1] != kp or kp % 128:
        raise ValueError(f"triton_fp8_gemv: weight {list(w_fp8.shape)} vs activation K {kp} (a multiple of 128)")
    if 128 % block_n or block_n < MIN_BLOCK_N or block_k % 128 or split_k < 1:
        raise ValueError(f"triton_fp8_gemv: block_n must divide 128 (>= {MIN_BLOCK_N}), block_k be a multiple "
                         "of 128 and split_k >= 1")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a_fp8.device)
    if m == 0:
        return out
    block_m = min(MAX_BLOCK_M, triton.next_power_of_2(m))
    kb = kp // 128
    split_k = min(split_k, kb)
    k_split = triton.cdiv(kb, split_k) * 128
    split_k = triton.cdiv(kp, k_split)  # no empty chunk (23 blocks in 6 splits of 4 is 6, in 5 of 5 is 5)
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    if split_k > 1:
        if counters is None:
            counters = torch.zeros(grid[0] * grid[2], dtype=torch.int32, device=a_fp8.device)
        elif counters.numel() < grid[0] * grid[2] or counters.dtype != torch.int32:
            raise ValueError(f"triton_fp8_gemv: {grid[0] * grid[2]} int32 counters needed, "
                             f"got {counters.numel()} {counters.dtype}")
        part = torch.empty(split_k, m, n, dtype=torch.float32, device=a_fp8.device)
    else:
        counters = part = out  # unused
    _fp8_gemv_kernel[grid](a_fp8, w_fp8, sa, w_scale, bias if bias is not None else out, out, part, counters,
                           m, n, kp, k_split, a_fp8.stride(0), w_fp8.stride(0), sa.stride(0), sa.stride(1),
                           w_scale.stride(0), w_scale.stride(1), out.stride(0),
                           HAS_BIAS=bias is not None, ROWS=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                           SPLIT_K=split_k, LATE_TRIGGER=late_trigger("fp8_gemv"), num_warps=num_warps,
                           num_stages=num_stages,
                           **pdl_kwargs(a_fp8.device))
    return out
