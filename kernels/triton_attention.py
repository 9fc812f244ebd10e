"""Triton sink attention over the paged KV pool: the portable GPU backend (and a second opinion on
FlashInfer), also runnable under TRITON_INTERPRET=1 on CPU tensors.

Math (gpt-oss spec §2.2): p_k = exp(s_k) / (sum_k' exp(s_k') + exp(S_h)), S_h not scaled by sm_scale,
its mass dropped. In an online softmax that is simply "start the running max at S_h with running sum 1"
(exp(S_h - S_h) = 1) and never add a value row for it. Masks: key k visible to query q iff
k <= q and (window is None or k > q - window), with q aligned to the end of the KV (FlashInfer's
convention, which also makes a sliding group that dropped old pages correct: only distances matter).

Pool layout per layer: [num_pages, 2, page_size, kv_heads, head_dim] (NHD), pages in CSR form
(kv_indptr, kv_indices, kv_last_page_len), as kernels/reference.PagedKV describes.

GQA: one program owns one KV head and all GROUP query heads that share it, so each K/V tile is loaded
once for the whole group. Rows of the score tile are (token, head) pairs: row r = token r // GROUP,
head r % GROUP.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from .fp8_quant import quant_1x128
from .pdl import enter, pdl_kwargs

LOG2E = 1.4426950408889634
# The CPU interpreter (triton 3.9) computes bf16 x bf16 tl.dot wrongly (garbage of order 1e10, seen
# 2026-11-29); under it the dots run on float32 copies, on a GPU on the native bf16 tensor cores.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _kv_len(kv_indptr, kv_last, b, PAGE: tl.constexpr):
    p0 = tl.load(kv_indptr + b)
    n_pages = tl.load(kv_indptr + b + 1) - p0
    last = tl.load(kv_last + b)
    return p0, tl.where(n_pages > 0, (n_pages - 1) * PAGE + last, 0)


@triton.jit
def _load_kv_tile(pool, kv_indices, p0, kpos, kvalid, kvh, which: tl.constexpr, offs_d,
                  s_page, s_kv, s_tok, s_head, PAGE: tl.constexpr):
    # Gather BLOCK_N rows of K or V through the page table; rows past the end read page slot 0
    # (masked) so no index ever leaves the table.
    page = tl.load(kv_indices + p0 + kpos // PAGE, mask=kvalid, other=0).to(tl.int64)
    ptr = (pool + page[:, None] * s_page + which * s_kv + (kpos % PAGE)[:, None] * s_tok
           + kvh * s_head + offs_d[None, :])
    return tl.load(ptr, mask=kvalid[:, None], other=0.0)


@triton.jit
def _sink_prefill_kernel(
    q, out, pool, sinks, qo_indptr, kv_indptr, kv_indices, kv_last, tile_seq, tile_q0,
    s_qt, s_qh, s_ot, s_oh, s_page, s_kv, s_tok, s_head,
    qk_scale, WINDOW,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(tile_seq + tile)
    q_local0 = tl.load(tile_q0 + tile)
    qo0 = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - qo0
    p0, kv_len = _kv_len(kv_indptr, kv_last, b, PAGE)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP
    rows = tl.arange(0, BLOCK_M)
    tok = q_local0 + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    offs_d = tl.arange(0, HEAD_DIM)
    qv = tl.load(q + (qo0 + tok).to(tl.int64)[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    # Query positions are aligned to the end of the KV (queries are its last q_len entries).
    qpos = kv_len - q_len + tok

    # The sink seeds the running max; its exp(0) = 1 seeds the running sum (log2 domain throughout).
    m_i = tl.load(sinks + head).to(tl.float32) * 1.4426950408889634
    l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    q_first = kv_len - q_len + q_local0
    q_last = tl.minimum(q_first + BLOCK_Q - 1, kv_len - 1)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(q_first - WINDOW + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    for start in range(lo, q_last + 1, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kvalid = kpos < kv_len
        k = _load_kv_tile(pool, kv_indices, p0, kpos, kvalid, kvh, 0, offs_d, s_page, s_kv, s_tok, s_head, PAGE)
        s = _dot(qv, tl.trans(k), F32) * qk_scale
        vis = (kpos[None, :] <= qpos[:, None]) & kvalid[None, :]
        if WINDOW > 0:
            vis = vis & (kpos[None, :] > qpos[:, None] - WINDOW)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv_tile(pool, kv_indices, p0, kpos, kvalid, kvh, 1, offs_d, s_page, s_kv, s_tok, s_head, PAGE)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out + (qo0 + tok).to(tl.int64)[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :],
             o.to(out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _split_range(kv_indptr, kv_last, b, split, WINDOW, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 NUM_SPLITS: tl.constexpr):
    # The keys split `split` of NUM_SPLITS covers for the one query of sequence b (at position kv_len - 1):
    # a BLOCK_N-aligned contiguous chunk [c0, c1) of the visible keys. -> (first page entry, kv_len, c0, c1)
    p0, kv_len = _kv_len(kv_indptr, kv_last, b, PAGE)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(kv_len - WINDOW, 0)
    n_vis = kv_len - lo
    chunk = tl.cdiv(tl.cdiv(n_vis, NUM_SPLITS), BLOCK_N) * BLOCK_N
    c0 = lo + split * chunk
    return p0, kv_len, c0, tl.minimum(c0 + chunk, kv_len)


@triton.jit
def _split_program(kv_indptr, kv_last, WINDOW, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    # What program (sequence b, KV head kvh, split) of a split-KV decode kernel covers: its keys (as
    # _split_range), its query heads (GROUP rows of a BLOCK_H tile, row_ok masking the padding) and the head
    # dim's offsets. -> (b, kvh, split, p0, kv_len, c0, c1, head, row_ok, offs_d)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    p0, kv_len, c0, c1 = _split_range(kv_indptr, kv_last, b, split, WINDOW, PAGE, BLOCK_N, NUM_SPLITS)
    rows = tl.arange(0, BLOCK_H)
    return b, kvh, split, p0, kv_len, c0, c1, kvh * GROUP + rows, rows < GROUP, tl.arange(0, HEAD_DIM)


@triton.jit
def _split_attend(qv, pool, kv_indices, p0, c0, c1, kvh, offs_d, s_page, s_kv, s_tok, s_head, qk_scale, fresh_pos,
                  k_new, v_new, FRESH: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr):
    # Online softmax of the group's query rows qv [BLOCK_H, D] over keys [c0, c1), without the sink:
    # (running max, running sum, unnormalised output). FRESH: the key at fresh_pos is not read from the pool
    # but taken from k_new / v_new [1, D] (kernels/decode_rotary.py: the new token, not yet written).
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for start in range(c0, c1, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kvalid = kpos < c1
        read = kvalid
        if FRESH:
            read = kvalid & (kpos != fresh_pos)
        k = _load_kv_tile(pool, kv_indices, p0, kpos, read, kvh, 0, offs_d, s_page, s_kv, s_tok, s_head, PAGE)
        v = _load_kv_tile(pool, kv_indices, p0, kpos, read, kvh, 1, offs_d, s_page, s_kv, s_tok, s_head, PAGE)
        if FRESH:
            k = tl.where((kpos == fresh_pos)[:, None], k_new, k)
            v = tl.where((kpos == fresh_pos)[:, None], v_new, v)
        s = _dot(qv, tl.trans(k), F32) * qk_scale
        s = tl.where(kvalid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # An empty prefix has m_i = -inf; guard exp2(-inf - (-inf)) which would be NaN.
        alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp2(m_i - m_new))
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _store_partial(o_part, lse_part, m_i, l_i, acc, b, head, row_ok, split, n_heads, offs_d,
                   HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    # The split's normalised partial output and its log2-sum-exp, WITHOUT the sink (the merge adds it once).
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    base = (b.to(tl.int64) * n_heads + head) * NUM_SPLITS + split
    tl.store(o_part + base[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
    tl.store(lse_part + base, lse, mask=row_ok)


@triton.jit
def _sink_decode_split_kernel(
    q, pool, kv_indptr, kv_indices, kv_last, o_part, lse_part,
    s_qb, s_qh, s_page, s_kv, s_tok, s_head,
    qk_scale, WINDOW,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, F32: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # kernels/pdl.py: before any load (q and the pool's new row are the rotary/KV-write kernel's) or store
    enter(USE_PDL)
    # One query per sequence at position kv_len - 1. Split s of NUM_SPLITS covers a contiguous chunk of
    # the visible keys and writes its normalised partial output plus its log2-sum-exp WITHOUT the sink:
    # the sink must enter exactly once, so the merge kernel adds it.
    b, kvh, split, p0, kv_len, c0, c1, head, row_ok, offs_d = _split_program(
        kv_indptr, kv_last, WINDOW, GROUP, BLOCK_H, HEAD_DIM, PAGE, BLOCK_N, NUM_SPLITS)
    qv = tl.load(q + b.to(tl.int64) * s_qb + head[:, None] * s_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i, l_i, acc = _split_attend(qv, pool, kv_indices, p0, c0, c1, kvh, offs_d, s_page, s_kv, s_tok, s_head,
                                  qk_scale, 0, qv, qv, False, BLOCK_H, HEAD_DIM, PAGE, BLOCK_N, F32)
    _store_partial(o_part, lse_part, m_i, l_i, acc, b, head, row_ok, split, tl.num_programs(1) * GROUP, offs_d,
                   HEAD_DIM, NUM_SPLITS)


@triton.jit
def _sink_decode_merge_kernel(o_part, lse_part, sinks, out, s_ob, s_oh,
                              HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                              USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: the partials are the split kernel's, just written
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_heads = tl.num_programs(1)
    base = (b.to(tl.int64) * n_heads + h) * NUM_SPLITS
    sp = tl.arange(0, SPLITS_P2)
    lse = tl.load(lse_part + base + sp, mask=sp < NUM_SPLITS, other=float("-inf"))
    sink = tl.load(sinks + h).to(tl.float32) * 1.4426950408889634
    m = tl.maximum(tl.max(lse, 0), sink)  # finite: the sink is always there
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0) + tl.exp2(sink - m)
    offs_d = tl.arange(0, HEAD_DIM)
    o = tl.load(o_part + (base + sp)[:, None] * HEAD_DIM + offs_d[None, :], mask=(sp < NUM_SPLITS)[:, None], other=0.0)
    res = tl.sum(o * w[:, None], 0) / denom
    tl.store(out + b.to(tl.int64) * s_ob + h * s_oh + offs_d, res.to(out.dtype.element_ty))


@triton.jit
def _merge_quant_block(o_part, lse_part, sinks, q_ptr, s_ptr, b, kb, B, n_cols, s_q, s_sm, s_sk,
                       HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                       CG: tl.constexpr = False):
    # _sink_decode_merge_kernel's math for the heads of one 128-wide block kb of the flattened output row b,
    # rounded to bf16 as its store rounds, then kernels/fp8_gemm.py _quant_act_kernel's 1x128 quantisation
    # for the output projection. Rows >= B (M padding) come out as zeros with the floor scale, as
    # quantize_act_1x128 writes them. CG: read the partials from L2 (.cg), for a caller in the kernel that
    # wrote them (kernels/decode_rotary.py's last program of a KV head), never a stale L1 line.
    c = kb * 128 + tl.arange(0, 128)
    ok = (c < n_cols) & (c * 0 + b < B)
    h = c // HEAD_DIM
    n_heads = n_cols // HEAD_DIM
    sp = tl.arange(0, SPLITS_P2)
    row = (b.to(tl.int64) * n_heads + h) * NUM_SPLITS  # [128]: each column's head's first partial
    ok2 = (sp[:, None] < NUM_SPLITS) & ok[None, :]
    if CG:
        lse = tl.load(lse_part + row[None, :] + sp[:, None], mask=ok2, other=float("-inf"), cache_modifier=".cg")
    else:
        lse = tl.load(lse_part + row[None, :] + sp[:, None], mask=ok2, other=float("-inf"))
    sink = tl.load(sinks + h, mask=ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m = tl.maximum(tl.max(lse, 0), sink)  # finite: the sink is always there
    w = tl.exp2(lse - m[None, :])
    denom = tl.sum(w, 0) + tl.exp2(sink - m)
    o_ptr = o_part + (row[None, :] + sp[:, None]) * HEAD_DIM + (c % HEAD_DIM)[None, :]
    if CG:
        o = tl.load(o_ptr, mask=ok2, other=0.0, cache_modifier=".cg")
    else:
        o = tl.load(o_ptr, mask=ok2, other=0.0)
    v = (tl.sum(o * w, 0) / denom).to(tl.bfloat16).to(tl.float32)
    qv, scale = quant_1x128(v, 0)
    tl.store(q_ptr + b.to(tl.int64) * s_q + c, qv.to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + b * s_sm + kb * s_sk, scale)


@triton.jit
def _sink_decode_merge_quant_kernel(o_part, lse_part, sinks, q_ptr, s_ptr, B, n_cols, s_q, s_sm, s_sk,
                                    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                                    USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: the partials are the split kernel's, just written
    # one program per (row incl. M padding, 128-wide block): the merge and the quantisation in one launch
    _merge_quant_block(o_part, lse_part, sinks, q_ptr, s_ptr, tl.program_id(0), tl.program_id(1), B, n_cols,
                       s_q, s_sm, s_sk, HEAD_DIM, NUM_SPLITS, SPLITS_P2)


@dataclass
class MergePending:
    """A split-KV decode whose merge (and sink) is still to run: the partials of `sink_decode(...,
    merge=False)` for `batch` rows of `n_heads` heads. `apply` merges into a [B, Hq, D] output like
    sink_decode; `quantize` merges straight into the output projection's FP8 input (one launch)."""

    o_part: torch.Tensor
    lse_part: torch.Tensor
    sinks: torch.Tensor
    batch: int
    n_heads: int
    head_dim: int
    num_splits: int
    dtype: torch.dtype

    def apply(self) -> torch.Tensor:
        out = torch.empty(self.batch, self.n_heads, self.head_dim, dtype=self.dtype, device=self.o_part.device)
        _merge(self, out)
        return out

    def quantize(self, quant_k: int):
        """(fp8 [Bp, Kp], scale f32 [Bp, Kp/128] M-major, Bp = B rounded up to 4): what
        kernels.fp8_gemm.quantize_act_1x128(self.apply().reshape(B, -1), quant_k) returns, in one launch
        (same math; only the fp32 order of the merge's sums over splits may differ)."""
        b, n_cols = self.batch, self.n_heads * self.head_dim
        if quant_k % 128 or quant_k < n_cols or self.dtype != torch.bfloat16:
            raise ValueError(f"MergePending.quantize: quant_k {quant_k} must be a multiple of 128 and >= {n_cols}, "
                             f"and the output bf16 (got {self.dtype})")
        bp = -(-b // 4) * 4
        q = torch.empty(bp, quant_k, dtype=torch.float8_e4m3fn, device=self.o_part.device)
        s = torch.empty(quant_k // 128, bp, dtype=torch.float32, device=self.o_part.device).t()
        if bp:
            _sink_decode_merge_quant_kernel[(bp, quant_k // 128)](
                self.o_part, self.lse_part, self.sinks, q, s, b, n_cols, q.stride(0), s.stride(0), s.stride(1),
                HEAD_DIM=self.head_dim, NUM_SPLITS=self.num_splits,
                SPLITS_P2=triton.next_power_of_2(self.num_splits), num_warps=4, **pdl_kwargs(q.device))
        return q, s


def _merge(p: MergePending, out: torch.Tensor) -> None:
    _sink_decode_merge_kernel[(p.batch, p.n_heads)](
        p.o_part, p.lse_part, p.sinks, out, out.stride(0), out.stride(1),
        HEAD_DIM=p.head_dim, NUM_SPLITS=p.num_splits, SPLITS_P2=triton.next_power_of_2(p.num_splits), num_warps=1,
        **pdl_kwargs(out.device))


def _window_arg(window: int | None) -> int:
    return 0 if window is None or window <= 0 else int(window)


def prefill_tiles(qo_indptr, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """(tile_seq, tile_q0) of a host qo_indptr (numpy or a sequence of ints) as int64 numpy arrays: one tile
    per BLOCK_Q queries of each sequence, in sequence order. No Python loop over sequences or tiles (an
    8192-token prompt has 512 tiles at BLOCK_Q 16)."""
    qo = np.asarray(qo_indptr, dtype=np.int64)
    n_tiles = -(-np.diff(qo) // block_q)  # ceil(len / block_q): the starts range(0, len, block_q)
    first = np.cumsum(n_tiles) - n_tiles  # each sequence's first tile
    seq = np.repeat(np.arange(len(n_tiles), dtype=np.int64), n_tiles)
    q0 = (np.arange(int(n_tiles.sum()), dtype=np.int64) - np.repeat(first, n_tiles)) * block_q
    return seq, q0


def plan_prefill_tiles(qo_indptr: torch.Tensor, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host-side plan: `prefill_tiles` as int32 tensors on the queries' device. Done once per batch,
    outside any CUDA graph (it reads qo_indptr on the host)."""
    seq, q0 = prefill_tiles(qo_indptr.cpu().numpy(), block_q)
    dev = qo_indptr.device
    return (torch.tensor(seq, dtype=torch.int32, device=dev), torch.tensor(q0, dtype=torch.int32, device=dev))


def _pool_strides(pool: torch.Tensor) -> tuple[int, int, int, int]:
    if pool.dim() != 5 or pool.shape[1] != 2:
        raise ValueError(f"pool must be [num_pages, 2, page_size, kv_heads, head_dim], got {list(pool.shape)}")
    if pool.stride(-1) != 1:
        raise ValueError("pool's head_dim must be contiguous")
    return pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3)


def sink_prefill(q: torch.Tensor, pool: torch.Tensor, sinks: torch.Tensor, qo_indptr: torch.Tensor,
                 kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *,
                 sm_scale: float, window: int | None, out: torch.Tensor | None = None,
                 tiles: tuple[torch.Tensor, torch.Tensor] | None = None, block_q: int | None = None,
                 block_n: int = 64, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Ragged causal (optionally windowed) attention with sinks for q [T, Hq, D] -> [T, Hq, D]."""
    n_tok, n_heads, head_dim = q.shape
    kv_heads, page = pool.shape[3], pool.shape[2]
    group = n_heads // kv_heads
    if block_q is None:
        block_q = max(1, 128 // group)  # 128 score rows per program
    if tiles is None:
        tiles = plan_prefill_tiles(qo_indptr, block_q)
    tile_seq, tile_q0 = tiles
    if out is None:
        out = torch.empty_like(q)
    if tile_seq.numel() == 0:
        return out
    sp, skv, stok, sh = _pool_strides(pool)
    _sink_prefill_kernel[(tile_seq.numel(), kv_heads)](
        q, out, pool, sinks, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, tile_seq, tile_q0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), sp, skv, stok, sh,
        sm_scale * LOG2E, _window_arg(window),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_Q=block_q, BLOCK_N=block_n, F32=INTERPRET,
        num_warps=num_warps, num_stages=num_stages)
    return out


def default_num_splits(batch: int, kv_heads: int, max_kv_len: int | None = None, num_sms: int = 132,
                       block_n: int = 64, window: int | None = None) -> int:
    """Splits so that batch * kv_heads * splits fills the SMs about four times over (a CUDA-graph
    friendly function of the batch size alone unless max_kv_len caps it). A sliding layer sees at most
    `window` keys, which the kernel cuts into BLOCK_N-aligned chunks: more than ceil(window / block_n)
    splits would only launch empty programs (64 splits over a 128-key window: 62 of them empty) and
    widen the merge, so the window caps the count."""
    splits = max(1, math.ceil(4 * num_sms / max(1, batch * kv_heads)))
    if max_kv_len is not None:
        splits = min(splits, max(1, math.ceil(max_kv_len / (4 * block_n))))
    if window is not None and window > 0:
        splits = min(splits, max(1, math.ceil(window / block_n)))
    return min(splits, 64)


def sink_decode(q: torch.Tensor, pool: torch.Tensor, sinks: torch.Tensor, kv_indptr: torch.Tensor,
                kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *, sm_scale: float,
                window: int | None, out: torch.Tensor | None = None, num_splits: int | None = None,
                block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                workspace: tuple[torch.Tensor, torch.Tensor] | None = None, merge: bool = True):
    """Split-KV decode: q [B, Hq, D] (one new token per sequence, already in the pool) -> [B, Hq, D], or
    with merge=False the split kernel's partials as a MergePending (the output projection then merges
    them into its FP8 input in one launch, MergePending.quantize).

    Graph-safe: reads all lengths on the device; `num_splits` and `workspace` fixed per batch size (a
    workspace from decode_workspace for at least this batch and split count; a larger one is fine).
    num_splits None: default_num_splits of this batch and window."""
    batch, n_heads, head_dim = q.shape
    kv_heads, page = pool.shape[3], pool.shape[2]
    group = n_heads // kv_heads
    if out is None and merge:
        out = torch.empty_like(q)
    num_splits, (o_part, lse_part) = split_setup(batch, n_heads, kv_heads, head_dim, window, num_splits, block_n,
                                                 workspace, q.device)
    sp, skv, stok, sh = _pool_strides(pool)
    _sink_decode_split_kernel[(batch, kv_heads, num_splits)](
        q, pool, kv_indptr, kv_indices, kv_last_page_len, o_part, lse_part,
        q.stride(0), q.stride(1), sp, skv, stok, sh, sm_scale * LOG2E, _window_arg(window),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, F32=INTERPRET, num_warps=num_warps, num_stages=num_stages,
        **pdl_kwargs(q.device))
    pending = MergePending(o_part, lse_part, sinks, batch, n_heads, head_dim, num_splits, q.dtype)
    if not merge:
        return pending
    _merge(pending, out)
    return out


def split_setup(batch: int, n_heads: int, kv_heads: int, head_dim: int, window: int | None, num_splits: int | None,
                block_n: int, workspace: tuple[torch.Tensor, torch.Tensor] | None, device):
    """A split-KV decode launch's split count (None: default_num_splits) and its (o_part, lse_part)
    workspace (None: a new one; a given one must be big enough)."""
    if num_splits is None:
        dev = torch.device(device)
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
        num_splits = default_num_splits(batch, kv_heads, num_sms=num_sms, block_n=block_n, window=window)
    if workspace is None:
        workspace = decode_workspace(batch, n_heads, head_dim, num_splits, device)
    o_part, lse_part = workspace
    if lse_part.numel() < batch * n_heads * num_splits or o_part.numel() < batch * n_heads * num_splits * head_dim:
        raise ValueError(f"decode workspace of {lse_part.numel()} rows is smaller than batch {batch} x "
                         f"{n_heads} heads x {num_splits} splits")
    return num_splits, workspace


def decode_workspace(batch: int, n_heads: int, head_dim: int, num_splits: int,
                     device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(batch * n_heads * num_splits * head_dim, dtype=torch.float32, device=device),
            torch.empty(batch * n_heads * num_splits, dtype=torch.float32, device=device))


def paged_attention(q: torch.Tensor, pool: torch.Tensor, qo_indptr: torch.Tensor, kv, sinks: torch.Tensor,
                    sm_scale: float, window: int | None) -> torch.Tensor:
    """Drop-in for kernels.reference.paged_attention (same arguments, `kv` a PagedKV)."""
    return sink_prefill(q, pool, sinks, qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len,
                        sm_scale=sm_scale, window=window)
