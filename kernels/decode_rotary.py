"""Split-KV sink decode that also does the layer's rotary and KV-cache write: one launch instead of two.

At batch-1 decode every layer runs kernels.fused.rotary_kv_write (q and k rotated, k and v stored into the
pool) and then triton_attention's split kernel, which reads q and the pool back. Here each program (sequence,
KV head, split) of the split kernel reads the QKV projection's row itself: its GROUP query heads rotated as
rotary_kv_write rotates them (the same fp32 expressions, rounded to the activation dtype, so q enters the dot
as the same bf16 values), and the new token's k and v. The new token sits at position kv_len - 1, which exactly
one split covers; that split uses the fresh k/v for that row (its pool slot is not written yet) and stores
them into the pool at (write_pages[b], write_offsets[b]), as rotary_kv_write would; no other program reads
that slot. The partials and the merge are triton_attention's (MergePending), so the sink, the merge and the
output projection's quantisation are unchanged.

One pass (`final=True`, a launch of one split): with a single split there is nothing to merge across programs, so
the program that attended finishes the row itself: the merge kernel's sink arithmetic on its own partial (the same
fp32 expressions, so the same bits as the partial stored and merged by _sink_decode_merge_kernel with one split),
the output stored in the activation dtype, and, when the output projection's FP8 input is asked for (`quant_k`),
_sink_decode_merge_quant_kernel's 1x128 quantisation of its GROUP heads' whole 128-wide blocks (the M padding rows
as zeros with the floor scale, as that kernel writes them): the merge launch disappears. GpuAttention uses it for
sliding-window layers, whose window it then decodes in one split, when KVRELAY_DECODE_ONE_PASS=1 (off until timed
on the H200 against the two-split decode + merge).

Used wherever GpuAttention decodes a group with the Triton split kernel, unless KVRELAY_DECODE_ROTARY=0
(engine/layers/attention.GpuAttention.fuses_rotary, with the H200 A/B). Same outputs as
rotary_kv_write + triton_attention.sink_decode (tests/cpu/test_decode_rotary.py, bit for bit under the
interpreter); the range, the loop over keys and the partials are the split kernel's own helpers
(triton_attention._split_program / _split_attend with FRESH / _store_partial).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import enter, pdl_kwargs
from .fp8_gemm import FP8, quantize_act_1x128
from .triton_attention import INTERPRET, LOG2E, MergePending, _merge, _partial, _pool_strides, _split_attend, \
    _split_program, _store_partial, _window_arg, split_setup


def one_pass_enabled() -> bool:
    """KVRELAY_DECODE_ONE_PASS=1: sliding-window layers decode in one split whose program also applies the sink
    and quantises the output projection's input (`final`), with no merge launch. Read when a decode batch's
    splits are chosen (GpuAttention), so a CUDA graph keeps the setting it was captured with. Off by default:
    not yet timed on the H200 against the two-split decode + merge."""
    return os.environ.get("KVRELAY_DECODE_ONE_PASS") == "1"


@triton.jit
def _rotate(row, cos, sin, heads, ok, offs_d, HALF: tl.constexpr):
    # rotary_kv_write's half-split rotary of head rows `heads` of one QKV row, in fp32: d < HALF gets
    # x1 c - x2 s, d >= HALF gets x2 c + x1 s, with (x1, x2) the two halves (the partner column is d +- HALF)
    partner = (offs_d + HALF) % (2 * HALF)
    x = tl.load(row + heads[:, None] * (2 * HALF) + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    xp = tl.load(row + heads[:, None] * (2 * HALF) + partner[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    c = tl.load(cos + offs_d % HALF).to(tl.float32)[None, :]
    s = tl.load(sin + offs_d % HALF).to(tl.float32)[None, :]
    return tl.where((offs_d < HALF)[None, :], x * c - xp * s, x * c + xp * s)


@triton.jit
def _store_final(out, q8, sc, sinks, m_i, l_i, acc, b, kvh, head, row_ok, offs_d, s_ob, s_oh, s_q, s_sm, s_sk, B, BP,
                 GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    # The whole row of the GROUP heads of a one-split decode: _store_partial's partial (o, lse: _partial), then
    # _sink_decode_merge_kernel's arithmetic for one split (its sums over one split are that split's terms), so
    # `out` gets the bits sink_decode's merge would store. QUANT: then _sink_decode_merge_quant_kernel's 1x128
    # quantisation of the output projection's input row b, whose 128-wide blocks hold HPB whole heads each (the
    # group's heads are contiguous columns, GROUP * HEAD_DIM of them); the program of sequence 0 also writes the
    # M padding rows B..BP-1 of its blocks as that kernel does (zeros, floor scale).
    o, lse = _partial(m_i, l_i, acc)
    sink = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m = tl.maximum(lse, sink)
    w = tl.exp2(lse - m)
    denom = w + tl.exp2(sink - m)
    res = o * w[:, None] / denom[:, None]
    tl.store(out + b.to(tl.int64) * s_ob + head[:, None] * s_oh + offs_d[None, :], res.to(out.dtype.element_ty),
             mask=row_ok[:, None])
    if QUANT:
        HPB: tl.constexpr = 128 // HEAD_DIM
        NB: tl.constexpr = BLOCK_H // HPB
        # [BLOCK_H, D] -> [NB, 128]: row-major, so block row r holds heads HPB r .. HPB r + HPB - 1 side by side
        v = tl.reshape(res.to(tl.bfloat16).to(tl.float32), [NB, 128])
        scale = tl.maximum(tl.max(tl.abs(v), 1), 1e-12) / 448.0
        qv = tl.minimum(tl.maximum(v / scale[:, None], -448.0), 448.0)
        blk = tl.arange(0, NB)
        blk_ok = blk < GROUP // HPB
        kb = kvh * (GROUP // HPB) + blk  # the blocks of row b this KV head's query heads fill
        cols = kb[:, None] * 128 + tl.arange(0, 128)[None, :]
        tl.store(q8 + b.to(tl.int64) * s_q + cols, qv.to(q8.dtype.element_ty), mask=blk_ok[:, None])
        tl.store(sc + b * s_sm + kb * s_sk, scale, mask=blk_ok)
        if b == 0:
            # an all-zero row's: the scale floor (the same fp32 division) and zeros
            floor = tl.full([NB], 1e-12, tl.float32) / 448.0
            for r in range(B, BP):
                tl.store(q8 + r * s_q + cols, tl.zeros([NB, 128], q8.dtype.element_ty), mask=blk_ok[:, None])
                tl.store(sc + r * s_sm + kb * s_sk, floor, mask=blk_ok)


# B / BP (a one-pass launch's rows and M-padded rows) are not specialised: one compile serves every batch size.
@triton.jit(do_not_specialize=["B", "BP"])
def _sink_decode_rotary_split_kernel(
    qkv, cos, sin, pool, kv_indptr, kv_indices, kv_last, pages, offsets, o_part, lse_part,
    sinks, out, q8, sc, s_ob, s_oh, s_q, s_sm, s_sk, B, BP,
    s_qkv, s_cs, s_page, s_kv, s_tok, s_head, qk_scale, WINDOW, N_Q, N_KV,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, F32: tl.constexpr, FINAL: tl.constexpr = False,
    QUANT: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    # FINAL (one split): the row finished here (_store_final: sink, output, and with QUANT the output
    # projection's FP8 input) instead of a partial for the merge kernel; sinks/out/q8/sc are unused otherwise.
    # kernels/pdl.py: before any load (the QKV row is the previous kernel's) or store (the pool write)
    enter(USE_PDL)
    b, kvh, split, p0, kv_len, c0, c1, head, row_ok, offs_d = _split_program(
        kv_indptr, kv_last, WINDOW, GROUP, BLOCK_H, HEAD_DIM, PAGE, BLOCK_N, NUM_SPLITS)
    new_pos = kv_len - 1
    HALF: tl.constexpr = HEAD_DIM // 2
    row = qkv + b.to(tl.int64) * s_qkv
    cs = b.to(tl.int64) * s_cs
    ty = qkv.dtype.element_ty
    pty = pool.dtype.element_ty
    qv = _rotate(row, cos + cs, sin + cs, head, row_ok, offs_d, HALF).to(ty)
    one = tl.arange(0, 1) + kvh
    k_new = _rotate(row, cos + cs, sin + cs, N_Q + one, one >= 0, offs_d, HALF).to(ty).to(pty)  # [1, D]
    v_new = tl.load(row + (N_Q + N_KV + one)[:, None] * HEAD_DIM + offs_d[None, :]).to(pty)
    if (c0 <= new_pos) & (new_pos < c1):  # the one split that holds the new token writes it to the pool
        dst = (pool + tl.load(pages + b).to(tl.int64) * s_page + tl.load(offsets + b).to(tl.int64) * s_tok
               + kvh * s_head + offs_d[None, :])
        tl.store(dst, k_new)
        tl.store(dst + s_kv, v_new)
    m_i, l_i, acc = _split_attend(qv, pool, kv_indices, p0, c0, c1, kvh, offs_d, s_page, s_kv, s_tok, s_head,
                                  qk_scale, new_pos, k_new, v_new, True, BLOCK_H, HEAD_DIM, PAGE, BLOCK_N, F32)
    if FINAL:
        _store_final(out, q8, sc, sinks, m_i, l_i, acc, b, kvh, head, row_ok, offs_d, s_ob, s_oh, s_q, s_sm, s_sk,
                     B, BP, GROUP, BLOCK_H, HEAD_DIM, QUANT)
    else:
        _store_partial(o_part, lse_part, m_i, l_i, acc, b, head, row_ok, split, tl.num_programs(1) * GROUP, offs_d,
                       HEAD_DIM, NUM_SPLITS)


@dataclass
class MergedOutput:
    """A one-pass decode's finished attention output (`sink_decode_rotary(..., final=True, merge=False)`): `out`
    [B, Hq, D], and when the launch was asked for the output projection's FP8 input, that input (q8, sc) as
    MergePending.quantize returns it. Answers apply / quantize as a MergePending does."""

    out: torch.Tensor
    q8: torch.Tensor | None = None
    sc: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.out.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.out.dtype

    def apply(self) -> torch.Tensor:
        return self.out

    def quantize(self, quant_k: int):
        if self.q8 is not None and quant_k == self.q8.shape[1]:
            return self.q8, self.sc
        # another padding of K than the launch wrote: the same numbers from the stored output (one split: the
        # merge-quantise kernel's value is the stored bf16 output's, quantised as quantize_act_1x128 does)
        return quantize_act_1x128(self.out.reshape(self.batch, -1), quant_k)


def final_quant_ok(n_q: int, n_kv: int, head_dim: int, dtype: torch.dtype, quant_k: int | None) -> bool:
    """Whether a one-pass launch can write the output projection's FP8 input itself: bf16 activations, a K of
    exactly the heads' columns (no padding blocks), and 128-wide blocks of whole heads within each KV group."""
    group = n_q // n_kv
    return (quant_k is not None and dtype == torch.bfloat16 and quant_k == n_q * head_dim and quant_k % 128 == 0
            and 128 % head_dim == 0 and group % (128 // head_dim) == 0)


def sink_decode_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int,
                       pool: torch.Tensor, write_pages: torch.Tensor, write_offsets: torch.Tensor,
                       sinks: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                       kv_last_page_len: torch.Tensor, *, sm_scale: float, window: int | None,
                       num_splits: int | None = None, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                       workspace: tuple[torch.Tensor, torch.Tensor] | None = None, merge: bool = True,
                       final: bool = False, quant_k: int | None = None):
    """kernels.fused.rotary_kv_write(qkv, cos, sin, n_q, n_kv, D, pool, write_pages, write_offsets) then
    triton_attention.sink_decode(q, pool, sinks, ...) in one launch (+ the merge unless merge=False, which
    returns the MergePending as sink_decode does). qkv [B, (n_q + 2 n_kv) D], one new token per sequence,
    whose position the page table already counts (kv_len - 1) but whose K/V are not in the pool yet.
    final=True (one split only): no merge launch; the output [B, n_q, D], or with merge=False a MergedOutput that
    also holds the output projection's FP8 input for `quant_k` when final_quant_ok (else it quantises on demand)."""
    batch = qkv.shape[0]
    head_dim = pool.shape[4]
    if pool.dim() != 5 or pool.shape[1] != 2 or pool.shape[3] != n_kv or pool.stride(-1) != 1:
        raise ValueError(f"sink_decode_rotary: pool {list(pool.shape)} is not [pages, 2, page, {n_kv}, D]")
    if qkv.shape[1] != (n_q + 2 * n_kv) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"sink_decode_rotary: qkv {list(qkv.shape)} is not [B, {(n_q + 2 * n_kv) * head_dim}]")
    cos, sin = cos.contiguous(), sin.contiguous()
    page = pool.shape[2]
    group = n_q // n_kv
    num_splits, (o_part, lse_part) = split_setup(batch, n_q, n_kv, head_dim, window, num_splits, block_n, workspace,
                                                 qkv.device)
    if final and num_splits != 1:
        raise ValueError(f"sink_decode_rotary: final=True needs one split, got {num_splits}")
    sp, skv, stok, sh = _pool_strides(pool)
    out = q8 = sc = None
    bp = -(-batch // 4) * 4  # quantize_act_1x128's M padding for cuBLAS
    quant = final and final_quant_ok(n_q, n_kv, head_dim, qkv.dtype, quant_k) and not merge
    if final:
        out = torch.empty(batch, n_q, head_dim, dtype=qkv.dtype, device=qkv.device)
    if quant:
        q8 = torch.empty(bp, quant_k, dtype=FP8, device=qkv.device)
        sc = torch.empty(quant_k // 128, bp, dtype=torch.float32, device=qkv.device).t()
    # the one-pass outputs and their strides; unused otherwise (fixed dummies, so the split launch's compile
    # does not vary with them)
    o_, q_, s_ = (out if final else o_part), (q8 if quant else o_part), (sc if quant else o_part)
    strides = ((o_.stride(0), o_.stride(1)) if final else (0, 0)) + \
        ((q_.stride(0), s_.stride(0), s_.stride(1)) if quant else (0, 0, 0)) + ((batch, bp) if final else (0, 0))
    _sink_decode_rotary_split_kernel[(batch, n_kv, num_splits)](
        qkv, cos, sin, pool, kv_indptr, kv_indices, kv_last_page_len, write_pages, write_offsets, o_part, lse_part,
        sinks, o_, q_, s_, *strides,
        qkv.stride(0), cos.stride(0), sp, skv, stok, sh, sm_scale * LOG2E, _window_arg(window), n_q, n_kv,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, F32=INTERPRET, FINAL=final, QUANT=quant, num_warps=num_warps,
        num_stages=num_stages, **pdl_kwargs(qkv.device))
    if final:
        return out if merge else MergedOutput(out, q8, sc)
    pending = MergePending(o_part, lse_part, sinks, batch, n_q, head_dim, num_splits, qkv.dtype)
    if not merge:
        return pending
    out = torch.empty(batch, n_q, head_dim, dtype=qkv.dtype, device=qkv.device)
    _merge(pending, out)
    return out
