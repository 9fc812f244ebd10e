"""Sorting a batch's (token, expert) pairs by expert for the grouped expert GEMMs (kernels/moe.py): each
expert's pairs in a contiguous segment padded to the GEMM's M block, and the expert of every M block.
Three paths give the same tensors: one Triton program (decode batches), two launches of one program per
chunk of pairs (prefill), and torch ops (CPU, and the reference)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_quant import quant_1x128
from .pdl import enter, pdl_kwargs


# The counting sort's steps, shared by the one-program sort (decode batches) and the chunked one (prefill).
@triton.jit
def _count_pairs(ids, lo, hi, E_P2: tl.constexpr, BLOCK: tl.constexpr):
    """Pairs per expert among pairs [lo, hi): [E_P2] int32."""
    e_ax = tl.arange(0, E_P2)
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros([E_P2], tl.int32)
    for c0 in range(lo, hi, BLOCK):
        v = tl.load(ids + c0 + offs, mask=c0 + offs < hi, other=E_P2).to(tl.int32)
        counts += tl.sum((v[:, None] == e_ax[None, :]).to(tl.int32), 0)
    return counts


@triton.jit
def _place_pairs(ids, sorted_ids, lo, hi, seg, seen, E_P2: tl.constexpr, BLOCK: tl.constexpr):
    """Walk pairs [lo, hi) in order, ranking each among the earlier pairs of its expert (a prefix sum over
    a one-hot [BLOCK, E] tile plus `seen`, the expert's pairs before lo), and write its pair id at its
    expert's padded segment start `seg` + rank."""
    e_ax = tl.arange(0, E_P2)
    offs = tl.arange(0, BLOCK)
    for c0 in range(lo, hi, BLOCK):
        ok = c0 + offs < hi
        v = tl.load(ids + c0 + offs, mask=ok, other=E_P2).to(tl.int32)
        hot = (v[:, None] == e_ax[None, :]).to(tl.int32)
        earlier = tl.cumsum(hot, 0) - hot  # earlier pairs of the same expert in this block
        dest = tl.sum(hot * (seg[None, :] + seen[None, :] + earlier), 1)
        tl.store(sorted_ids + dest, (c0 + offs).to(tl.int32), mask=ok)
        seen += tl.sum(hot, 0)


@triton.jit
def _block_experts(block_expert, sorted_ids, pend, e_ok, used, n, max_blocks, BLOCK_M: tl.constexpr,
                   NB: tl.constexpr, FILL_EMPTY: tl.constexpr):
    """The expert of each M block: how many experts' padded segments end at or before the block's start
    (searchsorted right); blocks past the last segment (from `used`) get E (empty), and with FILL_EMPTY
    their slots the sentinel n."""
    b_ax = tl.arange(0, NB)
    j = tl.arange(0, BLOCK_M)
    ends = tl.where(e_ok, pend, 2147483647)
    for b0 in range(0, max_blocks, NB):
        start = (b0 + b_ax) * BLOCK_M
        be = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), 1)
        tl.store(block_expert + b0 + b_ax, be, mask=b0 + b_ax < max_blocks)
        if FILL_EMPTY:
            tl.store(sorted_ids + start[:, None] + j[None, :], tl.zeros([NB, BLOCK_M], tl.int32) + n,
                     mask=((b0 + b_ax < max_blocks) & (start >= used))[:, None])


@triton.jit
def _sort_pairs_kernel(ids, sorted_ids, block_expert, counts_out, n, E, max_blocks,
                       E_P2: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    # One program: a stable counting sort of the (token, expert) pairs by expert: count, place, block
    # experts (sorted_ids arrives filled with the sentinel). Same result as the torch ops below, in ~3
    # launches instead of ~15 (a decode step runs this once per layer).
    enter(USE_PDL)  # kernels/pdl.py: before any load or store
    e_ok = tl.arange(0, E_P2) < E
    counts = _count_pairs(ids, 0, n, E_P2, BLOCK)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pend = tl.cumsum(padded, 0)
    tl.store(counts_out + tl.arange(0, E_P2), counts, mask=e_ok)
    _place_pairs(ids, sorted_ids, 0, n, pend - padded, tl.zeros([E_P2], tl.int32), E_P2, BLOCK)
    _block_experts(block_expert, sorted_ids, pend, e_ok, 0, n, max_blocks, BLOCK_M, NB, False)


# Pairs up to here: the one-program sort above; past it (prefill), the chunked sort below: one program
# per CHUNK pairs, so 32,768 pairs (an 8k-token prefill) sort in two launches instead of ~15 torch ops.
SORT_KERNEL_MAX_PAIRS = 8192
SORT_CHUNK_PROGRAMS = 128  # the chunked sort's programs for a long batch (CHUNK grows past 128 x BLOCK)


# n, CHUNK, chunk and block counts vary with the batch: unspecialised, one compiled kernel serves them all
@triton.jit(do_not_specialize=["n", "E", "CHUNK"])
def _sort_count_kernel(ids, chunk_counts, n, E, CHUNK, E_P2: tl.constexpr, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    # The chunked sort's pass 1: program p counts the pairs per expert of its CHUNK pairs into
    # chunk_counts[p, :E] (every entry written: no zeroing launch).
    enter(USE_PDL)  # kernels/pdl.py: before any load or store
    p = tl.program_id(0)
    e_ax = tl.arange(0, E_P2)
    counts = _count_pairs(ids, p * CHUNK, tl.minimum(p * CHUNK + CHUNK, n), E_P2, BLOCK)
    tl.store(chunk_counts + p * E + e_ax, counts, mask=e_ax < E)


@triton.jit(do_not_specialize=["n", "E", "CHUNK", "num_chunks", "max_blocks"])
def _sort_place_kernel(ids, chunk_counts, sorted_ids, block_expert, counts_out, n, E, CHUNK, num_chunks,
                       max_blocks, E_P2: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                       QB: tl.constexpr, NB: tl.constexpr, USE_PDL: tl.constexpr = False):
    # Pass 2: program p sums every chunk's counts (the experts' totals, hence their padded segments) and
    # those of the chunks before its own (where its pairs of each expert start), then places its pairs as
    # the one-program sort does. Same stable order, padding and block experts as the torch ops; program 0
    # also writes the padding slots' sentinel, the per-expert counts and the expert of every M block.
    enter(USE_PDL)  # kernels/pdl.py: before any load or store
    p = tl.program_id(0)
    e_ax = tl.arange(0, E_P2)
    e_ok = e_ax < E
    q_ax = tl.arange(0, QB)
    total = tl.zeros([E_P2], tl.int32)
    before = tl.zeros([E_P2], tl.int32)
    for q0 in range(0, num_chunks, QB):
        q = q0 + q_ax
        cc = tl.load(chunk_counts + q[:, None] * E + e_ax[None, :],
                     mask=(q < num_chunks)[:, None] & e_ok[None, :], other=0)
        total += tl.sum(cc, 0)
        before += tl.sum(tl.where((q < p)[:, None], cc, 0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pend = tl.cumsum(padded, 0)
    seg = pend - padded
    _place_pairs(ids, sorted_ids, p * CHUNK, tl.minimum(p * CHUNK + CHUNK, n), seg, before, E_P2, BLOCK)
    if p == 0:
        tl.store(counts_out + e_ax, total, mask=e_ok)
        # the padding slots of each expert's segment, [count, padded), hold the sentinel n
        j = tl.arange(0, BLOCK_M)
        tl.store(sorted_ids + (seg + total)[:, None] + j[None, :], tl.zeros([E_P2, BLOCK_M], tl.int32) + n,
                 mask=e_ok[:, None] & (j[None, :] < (padded - total)[:, None]))
        _block_experts(block_expert, sorted_ids, pend, e_ok, tl.sum(tl.where(e_ok, padded, 0), 0), n,
                       max_blocks, BLOCK_M, NB, True)


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, *, path: str = "auto"):
    """(sorted pair ids padded per expert to block_m with the sentinel T*k, expert of each M block
    (num_experts = empty), count per expert). No host sync: capturable. path "kernel" (one Triton
    program, for decode-sized batches), "chunked" (two launches of one program per chunk of pairs, for
    prefill), "torch", or "auto" (on CUDA: kernel up to SORT_KERNEL_MAX_PAIRS pairs, chunked past it).
    All three give the same tensors (int32 from the kernels, int64 counts from torch)."""
    flat = ids.reshape(-1)
    n = flat.numel()
    max_blocks = triton.cdiv(n, block_m) + min(num_experts, n)  # sum_e ceil(c_e/BM) <= n/BM + non-empty experts
    e_p2 = triton.next_power_of_2(num_experts)
    block = max(16, 8192 // e_p2)
    if path == "auto" and ids.is_cuda and n > 0:
        path = "kernel" if n <= SORT_KERNEL_MAX_PAIRS else "chunked"
    if path == "kernel":
        sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=ids.device)
        block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
        counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
        _sort_pairs_kernel[(1,)](flat, sorted_ids, block_expert, counts, n, num_experts, max_blocks,
                                 E_P2=e_p2, BLOCK=block, BLOCK_M=block_m, NB=64, num_warps=8,
                                 **pdl_kwargs(ids.device))
        return sorted_ids, block_expert, counts
    if path == "chunked":
        chunk = triton.cdiv(triton.cdiv(max(n, 1), SORT_CHUNK_PROGRAMS), block) * block
        num_chunks = triton.cdiv(max(n, 1), chunk)
        # Every slot is written by _sort_place_kernel (pairs, padding, whole empty blocks): torch.empty.
        sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
        block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
        counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
        chunk_counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=ids.device)
        pdl = pdl_kwargs(ids.device)
        _sort_count_kernel[(num_chunks,)](flat, chunk_counts, n, num_experts, chunk, E_P2=e_p2, BLOCK=block,
                                          num_warps=4, **pdl)
        _sort_place_kernel[(num_chunks,)](flat, chunk_counts, sorted_ids, block_expert, counts, n, num_experts,
                                          chunk, num_chunks, max_blocks, E_P2=e_p2, BLOCK=block,
                                          BLOCK_M=block_m, QB=max(1, 4096 // e_p2), NB=64, num_warps=4, **pdl)
        return sorted_ids, block_expert, counts
    if path not in ("torch", "auto"):
        raise ValueError(f"sort path must be auto, kernel, chunked or torch, got {path!r}")
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    se = flat[order]
    rank = torch.arange(n, device=ids.device) - (torch.cumsum(counts, 0) - counts)[se]
    dest = (pend - padded)[se] + rank
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=ids.device)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(max_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(pend, starts, right=True).to(torch.int32)
    return sorted_ids, block_expert, counts


@triton.jit
def tile_order(pid, num_m, n_n, GROUP_M: tl.constexpr):
    """(M block, N tile) of program `pid` of a grouped GEMM's 1-D grid (kernels/moe.py, moe_ws.py): GROUP_M M
    blocks walk the N tiles together; blocks are sorted by expert, so neighbours mostly share an expert and
    its weight tiles come from L2 for all but the first (GROUP_M = 1: the N tiles of one M block back to back)."""
    if GROUP_M == 1:
        pid_m = pid // n_n
        pid_n = pid % n_n
    else:
        per_group = GROUP_M * n_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


# ---- the GEMM input in expert-sorted rows ------------------------------------------------------------------
@triton.jit
def _quant_sorted_kernel(x, sorted_ids, block_expert, q, s, n_pairs, E, K, ROW_DIV, SORT_BM, s_xm, s_qm, s_sm,
                         BLOCK_M: tl.constexpr, SLOT_ROWS: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load or store
    # One program per (BLOCK_M slots, 128-wide K block): slot j gets row sorted_ids[j] // ROW_DIV of x, 1x128
    # quantised with fp8_quant.quant_1x128 (the same numbers as quantize_act_1x128 gives that row); a padding
    # slot (sentinel id) a zero row with the floor scale; the slots of empty blocks (expert E: the grouped GEMM
    # returns before reading them) are left unwritten. SLOT_ROWS: x's rows are already the slots (GEMM1's output
    # for a GEMM2 that reads sorted rows): slot j gets row j, the same way.
    slots = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    offs = kb * 128 + tl.arange(0, 128)
    pair = tl.load(sorted_ids + slots)
    used = tl.load(block_expert + slots // SORT_BM) < E
    ok = pair < n_pairs
    if SLOT_ROWS:
        src = slots.to(tl.int64)
    else:
        src = (tl.where(ok, pair, 0) // ROW_DIV).to(tl.int64)
    v = tl.load(x + src[:, None] * s_xm + offs[None, :], mask=ok[:, None] & (offs < K)[None, :], other=0.0)
    qv, scale = quant_1x128(v.to(tl.float32), 1)
    tl.store(q + slots.to(tl.int64)[:, None] * s_qm + offs[None, :], qv.to(q.dtype.element_ty), mask=used[:, None])
    tl.store(s + slots * s_sm + kb, scale, mask=used)


def quantize_sorted(x: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, num_experts: int,
                    n_pairs: int, row_div: int, k_padded: int, *, slot_rows: bool = False):
    """The FP8 input of a grouped GEMM that reads its rows in the sort's order (kernels/moe.py, a GemmConfig
    with sorted_a): x [R, K] bf16 -> (fp8 [S, k_padded], scale f32 [S, k_padded/128] row-major), S =
    len(sorted_ids) (sort_by_expert's tensors for num_experts experts); slot j holds x[sorted_ids[j] // row_div]
    quantised as quantize_act_1x128 quantises it (bit for bit), padding slots zeros; the slots of empty blocks
    are not written (never read). slot_rows: x holds one row per slot already (row_div unused)."""
    slots = sorted_ids.numel()
    sort_bm = slots // block_expert.numel()
    q = torch.empty(slots, k_padded, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(slots, k_padded // 128, dtype=torch.float32, device=x.device)
    block = 16
    if slots % block or sort_bm % block or k_padded % 128 or x.stride(-1) != 1:
        raise ValueError(f"quantize_sorted: {slots} slots in blocks of {sort_bm} (multiples of {block}), "
                         f"K padded to {k_padded} (a multiple of 128), unit-stride rows")
    if slots:
        _quant_sorted_kernel[(slots // block, k_padded // 128)](
            x, sorted_ids, block_expert, q, s, n_pairs, num_experts, x.shape[1], row_div,
            sort_bm, x.stride(0), q.stride(0), s.stride(0), BLOCK_M=block, SLOT_ROWS=slot_rows, num_warps=4,
            **pdl_kwargs(x.device))
    return q, s
