"""FP8 (e4m3) block-scaled GEMV for decode batch sizes (1..8 rows): y = quant_1x128(x) @ w^T * scales + bias.

The same numbers as kernels.fp8.fp8_block_linear_ref within the fp8 tests' tolerances (activations 1x128,
weights 128x128, fp32 accumulation, + bias in fp32, one bf16 rounding). At batch 1 the QKV (2880 -> 5120)
and O (4096 -> 2880) projections are a pure weight stream (15 / 12 MB): cuBLAS blockwise reached about half
of the 4.19 TB/s copy ceiling there (issue #11), a tensor-core tile wastes 15 of its 16 rows. Here:
- one program per narrow N tile (BLOCK_N 16..64 rows of W, always inside one 128-row scale block), so
  N=2880..5120 gives 45..320 programs, several per SM on 132 SMs, and no split-K: each output is summed by
  one program in a fixed order (no atomics, CUDA-graph replay is bit-exact);
- every program reads its weight rows once, BLOCK_K (256/512) fp8 bytes per row per step: 16 contiguous
  bytes per thread, several loads in flight;
- the activation rows (all of them, BLOCK_M <= 8) are loaded once per program and step and shared by the
  weight tile; the 1x128 and 128x128 scales are folded into the activation per K element
  (x * sa[m, k // 128] * sb[n // 128, k // 128]) before the CUDA-core multiply-add, the way
  kernels/moe_gemv.py `_gemv_tile` does.
The fold sums scaled products instead of scaling each 128-wide block sum (the reference's order): both are
fp32 to ~1e-6 relative, far below the bf16 output rounding (tests/gpu/test_fp8_gemm.py bounds the gap).
The activation arrives quantised (kernels.fused.add_rms_norm / sink_correct_quantize write it on the
decode path), so no quantisation is fused here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_M = 8  # rows per program; more rows run as more row groups (weights re-read per group)


@triton.jit
def _fp8_gemv_kernel(a, b, sa, sb, bias, c, M, N, KP,
                     s_am, s_bn, s_sam, s_sak, s_sbn, s_sbk, s_cm,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    # Program (N tile, row group). Tensors are [BLOCK_M, BLOCK_N, BLOCK_K]-shaped: the weight tile
    # broadcasts over the rows, each activation row over the tile's weight rows; the sum is over K.
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m3 = offs_m[:, None, None]
    n3 = offs_n[None, :, None]
    k3 = offs_k[None, None, :]
    m_ok = m3 < M
    n_ok = n3 < N
    a_ptr = a + m3.to(tl.int64) * s_am + k3
    b_ptr = b + n3.to(tl.int64) * s_bn + k3
    sa_ptr = sa + m3 * s_sam
    # BLOCK_N divides 128 and tiles start at multiples of BLOCK_N: the whole tile has one row block.
    sb_ptr = sb + (n0 // 128) * s_sbn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, KP, BLOCK_K):
        k_ok = k0 + k3 < KP
        kb = (k0 + k3) // 128
        w = tl.load(b_ptr + k0, mask=n_ok & k_ok, other=0.0).to(tl.float32)
        x = tl.load(a_ptr + k0, mask=m_ok & k_ok, other=0.0).to(tl.float32)
        s_a = tl.load(sa_ptr + kb * s_sak, mask=m_ok & k_ok, other=0.0)
        s_b = tl.load(sb_ptr + kb * s_sbk, mask=k_ok, other=0.0)
        acc += tl.sum(w * (x * (s_a * s_b)), 2)
    m2 = offs_m[:, None]
    n2 = offs_n[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + n2, mask=n2 < N, other=0.0).to(tl.float32)
    tl.store(c + m2.to(tl.int64) * s_cm + n2, acc.to(c.dtype.element_ty), mask=(m2 < M) & (n2 < N))


def triton_fp8_gemv(a_fp8, sa, w_fp8, w_scale, bias=None, out=None, *, m: int | None = None, block_n: int = 16,
                    block_k: int = 512, num_warps: int = 4, num_stages: int = 2):
    """The first m rows (default all) of a_fp8 [Mp, Kp] with scales sa [Mp, Kp/128] (any strides, e.g. the
    M-major layout of kernels.fp8_gemm.quantize_act_1x128) times w_fp8 [N, Kp] with block scales
    w_scale [ceil(N/128), Kp/128] (+ bias [N]) -> [m, N] bf16 (or into `out`)."""
    rows, kp = a_fp8.shape
    m = rows if m is None else m
    if m > rows:
        raise ValueError(f"triton_fp8_gemv: m={m} but the activation has {rows} rows")
    n = w_fp8.shape[0]
    if w_fp8.shape[1] != kp or kp % 128:
        raise ValueError(f"triton_fp8_gemv: weight {list(w_fp8.shape)} vs activation K {kp} (a multiple of 128)")
    if 128 % block_n or block_k % 128:
        raise ValueError("triton_fp8_gemv: block_n must divide 128 and block_k be a multiple of 128")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a_fp8.device)
    if m == 0:
        return out
    block_m = min(MAX_BLOCK_M, triton.next_power_of_2(m))
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _fp8_gemv_kernel[grid](a_fp8, w_fp8, sa, w_scale, bias if bias is not None else out, out, m, n, kp,
                           a_fp8.stride(0), w_fp8.stride(0), sa.stride(0), sa.stride(1),
                           w_scale.stride(0), w_scale.stride(1), out.stride(0),
                           HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                           num_warps=num_warps, num_stages=num_stages)
    return out
