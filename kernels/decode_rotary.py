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

Used wherever GpuAttention decodes a group with the Triton split kernel, unless KVRELAY_DECODE_ROTARY=0
(engine/layers/attention.GpuAttention.fuses_rotary, with the H200 A/B). Same outputs as
rotary_kv_write + triton_attention.sink_decode (tests/cpu/test_decode_rotary.py, bit for bit under the
interpreter); the range, the loop over keys and the partials are the split kernel's own helpers
(triton_attention._split_program / _split_attend with FRESH / _store_partial).

The merge can run inside this launch too (`merge_counters`, for the output projection's FP8 input): the
split programs of one (sequence, KV head) count themselves in an arrival counter after storing their
partials, and the last to arrive merges that KV head's GROUP query heads (GROUP * D / 128 whole 128-wide
blocks) and quantises them, with triton_attention._merge_quant_block, the merge-quantise kernel's own code:
the same numbers, one launch fewer a layer (kernels/fp8_gemv.py's last-program pattern; no float atomics,
so a replay is bit-exact). The last program of the last row also writes the FP8 input's M-padding rows.
The engine asks for it only with KVRELAY_DECODE_MERGE_FUSE=1 (merge_fuse_enabled) until an H200 A/B has measured it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8_quant import store_zero_rows
from .pdl import launch_dependents, late_trigger, pdl_kwargs, wait
from .switches import fusion_on
from .triton_attention import INTERPRET, LOG2E, MergePending, _merge, _merge_quant_block, _pool_strides, \
    _split_attend, _split_program, _store_partial, _window_arg, split_setup


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
def _sink_decode_rotary_split_kernel(
    qkv, cos, sin, pos, pool, kv_indptr, kv_indices, kv_last, pages, offsets, o_part, lse_part,
    sinks, cnt, q_ptr, s_ptr, BP, s_q, s_sm, s_sk,
    s_qkv, s_cs, s_page, s_kv, s_tok, s_head, qk_scale, WINDOW, N_Q, N_KV,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, F32: tl.constexpr, MERGE: tl.constexpr = False,
    SPLITS_P2: tl.constexpr = 1, QK_P2: tl.constexpr = 128, LATE_TRIGGER: tl.constexpr = False,
    GATHER_CS: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    # kernels/pdl.py: before any load (the QKV row is the previous kernel's) or store (the pool write)
    wait(USE_PDL)
    if not LATE_TRIGGER:  # else after the keys' loop (kernels/pdl.py, KVRELAY_PDL_LATE_TRIGGER)
        launch_dependents(USE_PDL)
    b, kvh, split, p0, kv_len, c0, c1, head, row_ok, offs_d = _split_program(
        kv_indptr, kv_last, WINDOW, GROUP, BLOCK_H, HEAD_DIM, PAGE, BLOCK_N, NUM_SPLITS)
    new_pos = kv_len - 1
    HALF: tl.constexpr = HEAD_DIM // 2
    row = qkv + b.to(tl.int64) * s_qkv
    if GATHER_CS:  # cos/sin are the whole tables: this sequence's row is its position's
        cs = tl.load(pos + b).to(tl.int64) * s_cs
    else:
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
    if LATE_TRIGGER:
        launch_dependents(USE_PDL)
    _store_partial(o_part, lse_part, m_i, l_i, acc, b, head, row_ok, split, tl.num_programs(1) * GROUP, offs_d,
                   HEAD_DIM, NUM_SPLITS)
    if MERGE:
        # every thread's partial stores happen before the one release below (barrier, then a gpu-scope
        # acq_rel atomic); the acquire of the KV head's last arrival then sees all NUM_SPLITS partials. All
        # of it follows the PDL wait (above), so the counters' previous user (the layer before: all layers
        # share them) has completed and left them zero; the output projection waits for this launch.
        tl.debug_barrier()
        slot = cnt + b * N_KV + kvh
        if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
            BLOCKS: tl.constexpr = GROUP * HEAD_DIM // 128  # this KV head's query heads: whole 128-blocks
            n_cols = N_Q * HEAD_DIM
            n_rows = tl.num_programs(0)
            for j in tl.static_range(BLOCKS):
                _merge_quant_block(o_part, lse_part, sinks, q_ptr, s_ptr, b, kvh * BLOCKS + j, n_rows, n_cols,
                                   s_q, s_sm, s_sk, HEAD_DIM, NUM_SPLITS, SPLITS_P2, True)
            if (b == n_rows - 1) & (kvh == N_KV - 1):  # the M-padding rows, as _merge_quant_block writes them
                store_zero_rows(q_ptr, s_ptr, n_rows, BP, s_q, s_sm, s_sk, n_cols, QK_P2)
            tl.atomic_xchg(slot, 0, sem="relaxed", scope="gpu")


@dataclass
class MergedQuant(MergePending):
    """A split-KV decode whose merge already ran inside its kernel, straight into the output projection's
    FP8 input (q, s) for quant_k = the heads' width; the partials stay valid, so `apply` and `quantize`
    for another width still work as MergePending's."""

    q: torch.Tensor | None = None
    s: torch.Tensor | None = None

    def quantize(self, quant_k: int):
        if self.q is not None and quant_k == self.q.shape[1]:
            return self.q, self.s
        return super().quantize(quant_k)


def merge_fuse_enabled() -> bool:
    """Whether the engine's decode asks for the merge inside the decode kernel (MergedQuant):
    KVRELAY_DECODE_MERGE_FUSE, a decode fusion of kernels.switches.DECODE_FUSIONS (the kernel ran on the H200, bit
    for bit the separate launch's output; the model's decode with it was not timed). Same results either way."""
    return fusion_on("KVRELAY_DECODE_MERGE_FUSE")


def sink_decode_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int,
                       pool: torch.Tensor, write_pages: torch.Tensor, write_offsets: torch.Tensor,
                       sinks: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                       kv_last_page_len: torch.Tensor, *, sm_scale: float, window: int | None,
                       num_splits: int | None = None, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                       workspace: tuple[torch.Tensor, torch.Tensor] | None = None, merge: bool = True,
                       merge_counters: torch.Tensor | None = None, positions: torch.Tensor | None = None):
    """kernels.fused.rotary_kv_write(qkv, cos, sin, n_q, n_kv, D, pool, write_pages, write_offsets) then
    triton_attention.sink_decode(q, pool, sinks, ...) in one launch (+ the merge unless merge=False, which
    returns the MergePending as sink_decode does). qkv [B, (n_q + 2 n_kv) D], one new token per sequence,
    whose position the page table already counts (kv_len - 1) but whose K/V are not in the pool yet.
    merge=False with `merge_counters` (int32 zeros, >= B * n_kv, allocated before any CUDA-graph capture; each
    launch leaves them zero): a bf16 decode whose GROUP * D is a multiple of 128 merges inside the kernel and
    returns a MergedQuant holding MergePending.quantize(n_q * D)'s result. `positions` [B] (int): cos/sin are
    the whole rotary tables [max positions, D/2] and each sequence's row is looked up in the kernel."""
    batch = qkv.shape[0]
    head_dim = pool.shape[4]
    if pool.dim() != 5 or pool.shape[1] != 2 or pool.shape[3] != n_kv or pool.stride(-1) != 1:
        raise ValueError(f"sink_decode_rotary: pool {list(pool.shape)} is not [pages, 2, page, {n_kv}, D]")
    if qkv.shape[1] != (n_q + 2 * n_kv) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"sink_decode_rotary: qkv {list(qkv.shape)} is not [B, {(n_q + 2 * n_kv) * head_dim}]")
    cos, sin = cos.contiguous(), sin.contiguous()
    if positions is not None and (positions.shape[0] != batch or cos.shape[-1] * 2 != head_dim):
        raise ValueError(f"sink_decode_rotary: positions {list(positions.shape)} for {batch} rows, tables "
                         f"{list(cos.shape)} for head dim {head_dim}")
    page = pool.shape[2]
    group = n_q // n_kv
    num_splits, (o_part, lse_part) = split_setup(batch, n_q, n_kv, head_dim, window, num_splits, block_n, workspace,
                                                 qkv.device)
    sp, skv, stok, sh = _pool_strides(pool)
    fuse = (not merge and merge_counters is not None and batch > 0 and qkv.dtype == torch.bfloat16
            and (group * head_dim) % 128 == 0)
    n_cols = n_q * head_dim
    q8 = s8 = None
    fused_args = (sinks, lse_part, o_part, o_part, 0, 0, 0, 0)  # unused without MERGE
    if fuse:
        if merge_counters.numel() < batch * n_kv or merge_counters.dtype != torch.int32:
            raise ValueError(f"sink_decode_rotary: {batch * n_kv} int32 merge counters needed, got "
                             f"{merge_counters.numel()} {merge_counters.dtype}")
        bp = -(-batch // 4) * 4  # MergePending.quantize's layout: rows rounded up to 4, scales M-major
        q8 = torch.empty(bp, n_cols, dtype=torch.float8_e4m3fn, device=qkv.device)
        s8 = torch.empty(n_cols // 128, bp, dtype=torch.float32, device=qkv.device).t()
        fused_args = (sinks, merge_counters, q8, s8, bp, q8.stride(0), s8.stride(0), s8.stride(1))
    _sink_decode_rotary_split_kernel[(batch, n_kv, num_splits)](
        qkv, cos, sin, positions if positions is not None else write_pages, pool, kv_indptr, kv_indices,
        kv_last_page_len, write_pages, write_offsets, o_part, lse_part, *fused_args,
        qkv.stride(0), cos.stride(0), sp, skv, stok, sh, sm_scale * LOG2E, _window_arg(window), n_q, n_kv,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, F32=INTERPRET, MERGE=fuse,
        SPLITS_P2=triton.next_power_of_2(num_splits), QK_P2=triton.next_power_of_2(max(n_cols, 128)),
        LATE_TRIGGER=late_trigger("decode"), GATHER_CS=positions is not None, num_warps=num_warps, num_stages=num_stages, **pdl_kwargs(qkv.device))
    if fuse:
        return MergedQuant(o_part, lse_part, sinks, batch, n_q, head_dim, num_splits, qkv.dtype, q8, s8)
    pending = MergePending(o_part, lse_part, sinks, batch, n_q, head_dim, num_splits, qkv.dtype)
    if not merge:
        return pending
    out = torch.empty(batch, n_q, head_dim, dtype=qkv.dtype, device=qkv.device)
    _merge(pending, out)
    return out
