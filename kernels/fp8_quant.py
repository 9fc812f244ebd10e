"""The 1x128 activation quantiser's arithmetic as one Triton function, inlined by every kernel that writes an
FP8 GEMM input (fp8_gemm's quantisers, fused.add_rms_norm, the sink correction and the split-KV merge), so all
of them compute kernels.fp8.quantize_act_1x128's numbers in the same order: scale = max(amax, 1e-12) / 448 (an
all-zero group still gets a finite scale), the group divided by its scale and clamped to e4m3's finite range.
The cast to fp8 is the caller's store."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quant_1x128(v, AXIS: tl.constexpr):
    """v: fp32 groups of 128 along AXIS (one [128] group with AXIS 0, [R, 128] groups with AXIS 1) ->
    (the clamped quotients, like v; the fp32 scale of each group)."""
    scale = tl.maximum(tl.max(tl.abs(v), AXIS), 1e-12) / 448.0
    if AXIS == 0:
        qv = v / scale
    else:
        qv = v / scale[:, None]
    return tl.minimum(tl.maximum(qv, -448.0), 448.0), scale


@triton.jit
def store_zero_rows(q_ptr, s_ptr, r0, r1, s_q, s_sm, s_sk, n_cols, BLOCK: tl.constexpr):
    """Rows r0 .. r1 - 1 of an FP8 GEMM input (its M padding) as quantize_act_1x128 writes an all-zero row:
    zeros with the floor scale, its n_cols columns (a multiple of 128, <= BLOCK, a power of two >= 128) and their
    n_cols / 128 scales. For the kernels that quantise rows a program at a time and write the padding with their
    last program (decode_rotary's merge, moe_gemv's norm-fused GEMV2)."""
    _, floor = quant_1x128(tl.zeros([128], tl.float32), 0)
    cols = tl.arange(0, BLOCK)
    blk = tl.arange(0, BLOCK // 128)
    for r in range(r0, r1):
        tl.store(q_ptr + r * s_q + cols, (cols * 0.0).to(q_ptr.dtype.element_ty), mask=cols < n_cols)
        tl.store(s_ptr + r * s_sm + blk * s_sk, blk * 0.0 + floor, mask=blk * 128 < n_cols)
