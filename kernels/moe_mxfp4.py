"""gpt-oss's MoE experts served from the MXFP4 weights OpenAI ships (model.quant mxfp4): Triton kernels.

The expert weights stay as the checkpoint stores them (engine/mxfp4.py): W [E, N, K] as bytes [E, N, K/2]
(two E2M1 codes a byte, element 2j in the low nibble) and one E8M0 scale byte per 32 K values [E, N, K/32].
4.25 bits a weight instead of FP8's 8 + scales: a batch-1 decode step, bound by the bytes it reads, reads
~half of what the FP8 experts cost, and gpt-oss-120b (61 GB) fits one 80 GB H100.

Decoding a code: its sign bit and three magnitude bits, placed at fp16's sign and at the low exponent bits +
the top mantissa bit, ARE an fp16 of value code_value * 2^-14 (code 1, 0.5, is fp16's subnormal 2^-15, which
the fp16 -> fp32 conversion keeps exactly); the block scale 2^(s - 127) times 2^14 is the fp32 whose exponent
field is s + 14. So a weight is two integer ops, one conversion and one multiply, all exact: the product of
an E2M1 value (two significant bits) and a power of two. Scales above 240 (weights beyond 2^113) do not fit
that trick and are refused at load (MoEWeights.from_mxfp4).

Two paths, chosen by the number of (token, expert) pairs as the FP8 experts' (kernels/moe.py):
- GEMV (decode, few pairs): one program per (pair, N tile) streams that expert's bytes once; the 16 products of
  a byte row's half-block are summed before their block scale multiplies them (one multiply per 32 weights);
  GEMM1 fuses bias + clamped SwiGLU, GEMM2 bias + routing weight, as the FP8 GEMVs do.
- Grouped GEMM (prefill, big batches), W4A16: the pairs sorted by expert (kernels/moe_sort.py), each weight tile
  decoded to bf16 in registers (exact: E2M1 x 2^k has two significant bits) and multiplied with the bf16
  activations on the tensor cores, one fp32 accumulator over all of K. Not W4A8 (FP8 activations): the scales
  change every 32 K values, so an FP8 MMA's fp32 result would need its scale applied after every 32-wide K
  step (a wait on each MMA before the next, as the FP8 path's 128-wide promotion already costs), where bf16
  weights take their scale before the MMA.
Both store the weighted pair outputs in moe_gemv.pair_dtype (bf16 for a bf16 model), summed in fp32 afterwards
(combine_kernel, or the next block's fused residual add + norm), exactly as the FP8 experts' paths do.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

# GEMV_MAX_PAIRS: the FP8 experts' threshold too: past it the grouped GEMM reads each expert's bytes once
from .moe_gemv import GEMV_MAX_PAIRS, combine_kernel, pair_dtype, swiglu
from .moe_sort import sort_by_expert, tile_order
from .pdl import enter, interpreting, pdl_kwargs

MX_BLOCK = 32  # weights per scale byte, along K
MAX_SCALE = 240  # the largest E8M0 scale byte the decode trick represents (2^(240-127) = 2^113)


@triton.jit
def e2m1_x2m14(code):
    """E2M1 codes (int32, 0..15) -> their values times 2^-14, fp32 (exact)."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def scale_x2p14(s):
    """E8M0 scale bytes (<= MAX_SCALE) -> 2^(s - 127) * 2^14, fp32 (exact)."""
    return ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_pairs(q, ASM: tl.constexpr):
    """Bytes q (uint8) -> (low nibbles' values, high nibbles' values) times 2^-14, fp32 (e2m1_x2m14 of each).
    ASM (the GPU): four bytes at a time in PTX, each pair of codes placed as one f16x2 word by two shifts, two
    masks and an or, then converted: ~4 instructions a weight against ~9 for the same bits through Triton's
    integer ops, which left the batch-1 GEMVs issue-bound (1.2 TB/s on the H100 at 28d0f5e). The interpreter
    runs the Triton ops."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 z, t0, t1, a, b, m;
            .reg .f16 h0, h1;
            mov.b32 z, 0;
            prmt.b32 t0, $8, z, 0x4140;
            prmt.b32 t1, $8, z, 0x4342;
            shl.b32 a, t0, 9; and.b32 a, a, 0x0E000E00; shl.b32 b, t0, 12; and.b32 b, b, 0x80008000;
            or.b32 m, a, b; mov.b32 {h0, h1}, m; cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1;
            shl.b32 a, t1, 9; and.b32 a, a, 0x0E000E00; shl.b32 b, t1, 12; and.b32 b, b, 0x80008000;
            or.b32 m, a, b; mov.b32 {h0, h1}, m; cvt.f32.f16 $2, h0; cvt.f32.f16 $3, h1;
            shl.b32 a, t0, 5; and.b32 a, a, 0x0E000E00; shl.b32 b, t0, 8; and.b32 b, b, 0x80008000;
            or.b32 m, a, b; mov.b32 {h0, h1}, m; cvt.f32.f16 $4, h0; cvt.f32.f16 $5, h1;
            shl.b32 a, t1, 5; and.b32 a, a, 0x0E000E00; shl.b32 b, t1, 8; and.b32 b, b, 0x80008000;
            or.b32 m, a, b; mov.b32 {h0, h1}, m; cvt.f32.f16 $6, h0; cvt.f32.f16 $7, h1;
            }
            """,
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[q], dtype=(tl.float32, tl.float32), is_pure=True,
            pack=4)
    c = q.to(tl.int32)
    return e2m1_x2m14(c & 15), e2m1_x2m14(c >> 4)


@triton.jit
def mx_gemv_tile(x_row, w_ptr, s_ptr, Kdim, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 ASM: tl.constexpr = False):
    """sum_k W[n, k] x[k] for the N tile whose byte rows start at w_ptr [BLOCK_N, 1] and scale rows at s_ptr
    [BLOCK_N, 1]; x_row: K activations (any float dtype). Kdim a multiple of 32, BLOCK_K of 32."""
    HALF: tl.constexpr = BLOCK_K // 2
    NB: tl.constexpr = BLOCK_K // 32
    offs_b = tl.arange(0, HALF)
    offs_g = tl.arange(0, NB)
    acc = tl.zeros([BLOCK_N, NB], tl.float32)
    for k0 in range(0, Kdim, BLOCK_K):
        b_ok = (k0 // 2 + offs_b) < Kdim // 2
        q = tl.load(w_ptr + k0 // 2 + offs_b[None, :], mask=n_ok[:, None] & b_ok[None, :], other=0)
        x = tl.load(x_row + k0 + tl.arange(0, BLOCK_K), mask=(k0 + tl.arange(0, BLOCK_K)) < Kdim,
                    other=0.0).to(tl.float32)
        xe, xo = tl.split(tl.reshape(x, [HALF, 2]))  # elements 2j (low nibble) and 2j + 1 (high nibble)
        lo, hi = e2m1_pairs(q, ASM)
        p = lo * xe[None, :] + hi * xo[None, :]
        p = tl.sum(tl.reshape(p, [BLOCK_N, NB, 16]), 2)  # one sum per 32-weight block, then its scale
        g_ok = (k0 // 32 + offs_g) < Kdim // 32
        s = tl.load(s_ptr + k0 // 32 + offs_g[None, :], mask=n_ok[:, None] & g_ok[None, :], other=0)
        acc += p * tl.where(g_ok[None, :], scale_x2p14(s), 0.0)
    return tl.sum(acc, 1)


@triton.jit
def _mx_gemv1_kernel(x, ids, w, s, b, act, K_TOP, Kdim, s_xt, s_we, s_wn, s_se, s_sn, s_be, s_at,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                     ASM: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load (the expert id comes from the router just before)
    pair = tl.program_id(0)
    e = tl.load(ids + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = e * s_we + offs_n.to(tl.int64)[:, None] * s_wn
    acc = mx_gemv_tile(x + (pair // K_TOP) * s_xt, w + rows, s + e * s_se + offs_n.to(tl.int64)[:, None] * s_sn,
                       Kdim, offs_n >= 0, BLOCK_N, BLOCK_K, ASM)
    acc += tl.load(b + e * s_be + offs_n).to(tl.float32)
    a = swiglu(acc, BLOCK_N, ALPHA, LIMIT)
    tl.store(act + pair.to(tl.int64) * s_at + tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2),
             a.to(act.dtype.element_ty))


@triton.jit
def _mx_gemv2_kernel(act, ids, route_w, w, s, b, y, Kdim, Ndim, s_at, s_we, s_wn, s_se, s_sn, s_be, s_yt,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr = False,
                     USE_PDL: tl.constexpr = False):
    enter(USE_PDL)
    pair = tl.program_id(0)
    e = tl.load(ids + pair).to(tl.int64)
    rw = tl.load(route_w + pair).to(tl.float32)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < Ndim
    acc = mx_gemv_tile(act + pair.to(tl.int64) * s_at, w + e * s_we + offs_n.to(tl.int64)[:, None] * s_wn,
                       s + e * s_se + offs_n.to(tl.int64)[:, None] * s_sn, Kdim, n_ok, BLOCK_N, BLOCK_K, ASM)
    acc += tl.load(b + e * s_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y + pair.to(tl.int64) * s_yt + offs_n, (acc * rw).to(y.dtype.element_ty), mask=n_ok)


# n_pairs, num_m and E only compared against: one compiled kernel whatever the batch (as kernels/moe.py's)
@triton.jit(do_not_specialize=["num_m", "n_pairs", "E"])
def _mx_grouped_kernel(a, w, sw, b, rw, out, sorted_ids, block_expert, num_m, n_pairs, E, N, KDIM, ROW_DIV,
                       s_am, s_we, s_wn, s_swe, s_swn, s_be, s_om,
                       SWIGLU: tl.constexpr, MUL_ROUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                       DOT_F32: tl.constexpr = False, ASM: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # every program, before its first load (block_expert, sorted_ids come from the sort)
    pid_m, pid_n = tile_order(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    e32 = tl.load(block_expert + pid_m)
    if e32 >= E:  # an empty block past the last expert's
        return
    e = e32.to(tl.int64)
    pairs = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pairs < n_pairs
    rows = (tl.where(m_ok, pairs, 0) // ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    wn = tl.minimum(offs_n, N - 1).to(tl.int64)  # the N tail re-reads row N-1 (never stored): unmasked rows
    HALF: tl.constexpr = BLOCK_K // 2
    NB: tl.constexpr = BLOCK_K // 32
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = a + rows[:, None] * s_am + offs_k[None, :]
    w_ptr = w + e * s_we + wn[:, None] * s_wn + tl.arange(0, HALF)[None, :]
    s_ptr = sw + e * s_swe + wn[:, None] * s_swn + tl.arange(0, NB)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, KDIM, BLOCK_K):
        k_ok = (k0 + offs_k) < KDIM
        at = tl.load(a_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        q = tl.load(w_ptr + k0 // 2, mask=((k0 // 2 + tl.arange(0, HALF)) < KDIM // 2)[None, :], other=0)
        lo, hi = e2m1_pairs(q, ASM)
        # [BLOCK_N, HALF, 2] -> [BLOCK_N, BLOCK_K]: element 2j is byte j's low nibble, 2j + 1 its high one
        v = tl.reshape(tl.join(lo, hi), [BLOCK_N, NB, 32])
        sc = tl.load(s_ptr + k0 // 32, mask=((k0 // 32 + tl.arange(0, NB)) < KDIM // 32)[None, :], other=0)
        wt = tl.reshape(v * scale_x2p14(sc)[:, :, None], [BLOCK_N, BLOCK_K])
        if DOT_F32:
            # the interpreter (triton 3.9) multiplies a bf16 tensor made by a conversion wrongly (1e10s); in fp32
            # the same products, all exact (bf16 values), the same sums
            acc += tl.dot(at.to(tl.float32), tl.trans(wt))
        else:
            acc += tl.dot(at.to(tl.bfloat16), tl.trans(wt.to(tl.bfloat16)))
    acc += tl.load(b + e * s_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        act = swiglu(acc, BLOCK_N, ALPHA, LIMIT)
        offs_a = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out + pairs.to(tl.int64)[:, None] * s_om + offs_a[None, :], act.to(out.dtype.element_ty),
                 mask=m_ok[:, None] & (offs_a < N // 2)[None, :])
    else:
        if MUL_ROUTE:
            acc *= tl.load(rw + pairs, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out + pairs.to(tl.int64)[:, None] * s_om + offs_n[None, :], acc.to(out.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class MxLaunch:
    """One MXFP4 kernel's launch: tiles, warps, stages (GEMV: block_m unused)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 64
    group_m: int = 8


# Untimed starting points (kernels/configs tables per GPU replace them once measured): the GEMV's N tile of 32
# rows a program keeps ~700 programs in flight at batch 1 (2 x 2880 / 32 x 4 experts), the grouped GEMM's tiles
# are the FP8 kernel's prefill shape with K steps of 64 (the decoded tile lives in registers).
GEMV1 = MxLaunch(32, 256, num_warps=4, num_stages=3)
GEMV2 = MxLaunch(32, 256, num_warps=4, num_stages=3)
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def config_file_name(device_name: str) -> str:
    """kernels/configs/mxfp4_<GPU>.json: a GPU model's measured GEMV launches (bench/sweep_mxfp4.py writes it)."""
    return "mxfp4_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name.strip()) + ".json"


@functools.lru_cache(maxsize=16)
def tuned_gemv(device_name: str) -> tuple[MxLaunch, MxLaunch]:
    """(GEMV1, GEMV2) launches for this GPU model: its table's where it has one, else the defaults above."""
    path = CONFIG_DIR / config_file_name(device_name)
    if not path.is_file():
        return GEMV1, GEMV2
    table = json.loads(path.read_text())
    return (MxLaunch(**table["gemv1"]) if "gemv1" in table else GEMV1,
            MxLaunch(**table["gemv2"]) if "gemv2" in table else GEMV2)


@functools.lru_cache(maxsize=16)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def grouped_launch(n_pairs: int, num_experts: int) -> MxLaunch:
    """Few rows an expert (decode batches): a 16-row M tile wastes less of each weight tile's decode."""
    if n_pairs <= 16 * num_experts:
        return MxLaunch(128, 64, num_warps=4, num_stages=3, block_m=16)
    return MxLaunch(128, 64, num_warps=8, num_stages=3, block_m=64)


def gemv1(x, ids_flat, k, ex, alpha, limit, act, launch: MxLaunch = GEMV1) -> None:
    two_i = ex.w1.shape[1]
    _mx_gemv1_kernel[(ids_flat.numel(), two_i // launch.block_n)](
        x, ids_flat, ex.w1, ex.s1, ex.b1, act, k, ex.hidden, x.stride(0), ex.w1.stride(0), ex.w1.stride(1),
        ex.s1.stride(0), ex.s1.stride(1), ex.b1.stride(0), act.stride(0), BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, ALPHA=alpha, LIMIT=limit, ASM=not interpreting(), num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **pdl_kwargs(x.device))


def gemv2(act, ids_flat, route_w_flat, ex, y, launch: MxLaunch = GEMV2) -> None:
    h = ex.hidden
    _mx_gemv2_kernel[(ids_flat.numel(), triton.cdiv(h, launch.block_n))](
        act, ids_flat, route_w_flat, ex.w2, ex.s2, ex.b2, y, act.shape[1], h, act.stride(0), ex.w2.stride(0),
        ex.w2.stride(1), ex.s2.stride(0), ex.s2.stride(1), ex.b2.stride(0), y.stride(0), BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, ASM=not interpreting(), num_warps=launch.num_warps, num_stages=launch.num_stages,
        **pdl_kwargs(act.device))


def grouped_gemm(a, w, sw, b, rw, out, sorted_ids, block_expert, n_pairs, row_div, n, kdim, swiglu_act, alpha, limit,
                 launch: MxLaunch) -> None:
    """One grouped GEMM over the sorted pairs: GEMM1 (swiglu_act: bias + clamped SwiGLU into out [P, N/2]) or
    GEMM2 (rw: bias, times the routing weight, into out [P, N])."""
    num_m = block_expert.numel()
    _mx_grouped_kernel[(triton.cdiv(n, launch.block_n) * num_m,)](
        a, w, sw, b, rw if rw is not None else b, out, sorted_ids, block_expert, num_m, n_pairs, w.shape[0], n, kdim,
        row_div, a.stride(0), w.stride(0), w.stride(1), sw.stride(0), sw.stride(1), b.stride(0), out.stride(0),
        SWIGLU=swiglu_act, MUL_ROUTE=rw is not None, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, GROUP_M=launch.group_m, ALPHA=alpha, LIMIT=limit, DOT_F32=interpreting(),
        ASM=not interpreting(),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages, **pdl_kwargs(a.device))


def moe_mxfp4(x, ids, route_w, ex, alpha: float = 1.702, limit: float = 7.0, *, combine: bool = True,
              path: str = "auto", gemv: tuple[MxLaunch, MxLaunch] | None = None,
              grouped: MxLaunch | None = None) -> torch.Tensor:
    """The experts `ids` [T, k] of x [T, H] (bf16) weighted by route_w [T, k], MXFP4 weights (ex: kernels.moe.
    MoEWeights.from_mxfp4) -> [T, H] bf16, or combine=False the weighted outputs [T, k, H] in pair_dtype(x).
    path: "gemv", "grouped" or "auto" (by the number of pairs); gemv / grouped: launches (default: this GPU's
    table, tuned_gemv, and grouped_launch)."""
    t, k = ids.shape
    h, inter = ex.hidden, ex.inter
    if path == "auto":
        path = "gemv" if ids.numel() <= GEMV_MAX_PAIRS else "grouped"
    ids_flat, rw_flat = ids.reshape(-1), route_w.reshape(-1)
    n_pairs = t * k
    act = torch.empty(n_pairs, inter, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(n_pairs, h, dtype=pair_dtype(x), device=x.device)
    if n_pairs == 0:
        pass
    elif path == "gemv":
        if gemv is None:
            dev = x.device if x.device.index is not None or x.device.type != "cuda" else \
                torch.device("cuda", torch.cuda.current_device())
            gemv = tuned_gemv(_device_name(dev))
        gemv1(x, ids_flat, k, ex, alpha, limit, act, gemv[0])
        gemv2(act, ids_flat, rw_flat, ex, y, gemv[1])
    elif path == "grouped":
        launch = grouped or grouped_launch(n_pairs, ex.num_experts)
        sorted_ids, block_expert, _ = sort_by_expert(ids, ex.num_experts, launch.block_m)
        grouped_gemm(x, ex.w1, ex.s1, ex.b1, None, act, sorted_ids, block_expert, n_pairs, k, 2 * inter, h, True,
                     alpha, limit, launch)
        grouped_gemm(act, ex.w2, ex.s2, ex.b2, rw_flat, y, sorted_ids, block_expert, n_pairs, 1, h, inter, False,
                     alpha, limit, launch)
    else:
        raise ValueError(f"unknown MXFP4 MoE path {path!r} (gemv, grouped, auto)")
    if not combine:
        return y.view(t, k, h)
    out = torch.empty(t, h, dtype=torch.bfloat16, device=x.device)
    if t:
        combine_kernel[(t, triton.cdiv(h, 1024))](y, out, h, K_TOP=k, BLOCK=1024, num_warps=4, **pdl_kwargs(x.device))
    return out
