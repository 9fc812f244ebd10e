"""Small fused Triton kernels for the per-layer glue of a decode step.

A batch-1 decode step of gpt-oss-20b launched ~1,300 kernels, and in a CUDA graph the gaps between them
cost more than the kernels (bench/results/profile-decode-*.json): RMSNorm as torch ops is 8 launches,
the half-split rotary of q and k 12. Each becomes one launch here. Both compute in fp32 and round once
(the torch reference rounds after every bf16 op), so results can differ from it by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_quant import quant_1x128
from .pdl import enter, pdl_kwargs


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load or store
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * (x * inv)).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (any float dtype, unit stride in H), weight [H] -> RMSNorm(x) in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, weight, out, x.stride(0), out.stride(0), x.shape[1], eps,
                                        BLOCK=triton.next_power_of_2(x.shape[1]), **pdl_kwargs(x.device))
    return out


@triton.jit
def _rotary_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_qkv, stride_cs, n_q,
                      HALF: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load or store
    t = tl.program_id(0)
    head = tl.program_id(1)  # 0..n_q-1 are query heads, then the kv heads
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    src = qkv_ptr + t * stride_qkv + head * 2 * HALF
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    if head < n_q:
        dst = q_ptr + (t * n_q + head) * 2 * HALF
    else:
        n_kv = tl.num_programs(1) - n_q
        dst = k_ptr + (t * n_kv + head - n_q) * 2 * HALF
    ty = q_ptr.dtype.element_ty
    tl.store(dst + offs, (x1 * c - x2 * s).to(ty), mask=mask)
    tl.store(dst + HALF + offs, (x2 * c + x1 * s).to(ty), mask=mask)


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (n_q + 2 n_kv) * head_dim] (q heads, then k, then v) and tables [T, head_dim/2] ->
    rotated q [T, n_q, head_dim] and k [T, n_kv, head_dim] (new contiguous tensors; v is untouched)."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    t = qkv.shape[0]
    q = torch.empty((t, n_q, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, n_kv, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t:
        half = head_dim // 2
        _rotary_qk_kernel[(t, n_q + n_kv)](qkv, cos, sin, q, k, qkv.stride(0), cos.stride(0), n_q,
                                           HALF=half, BLOCK=triton.next_power_of_2(half), **pdl_kwargs(qkv.device))
    return q, k


# ---------------------------------------------------------------------------------------------------
# The residual stream between the big kernels: residual add (+ the MoE's combine) + RMSNorm (+ the 1x128
# FP8 activation quantisation of the next GEMM's input), one launch instead of three or four.
# ---------------------------------------------------------------------------------------------------
# Warps per row program of add_rms_norm: a row is one latency-bound program (loads, a reduction, stores), and
# more warps keep more of its loads in flight. H200, CUDA-graph replay, the attention-in launch at batch 1
# (x + 4 bf16 MoE pair rows, norm, 1x128 FP8 quantisation; the same bits whatever the warps): 3.2 us with
# 4 warps, 2.7 with 8, 1.85 with 16; 16 warps were also the fastest at 4, 16, 64, 128 and 512 rows (3.8 ->
# 2.35 us at 128, 5.3 -> 4.6 at 512; bench/results/sweep-glue-*.json). Launches of up to NORM_WIDE_ROWS rows
# (decode batches, small mixed forwards) take NORM_WIDE_WARPS; larger ones (prefill, not swept) keep 4.
NORM_WIDE_WARPS, NORM_WIDE_ROWS = 16, 512


@triton.jit
def add_rms_norm_row(x_ptr, d_ptr, w_ptr, xo_ptr, out_ptr, q_ptr, s_ptr, r, src, T, H, eps,
                     s_x, s_dt, s_dk, s_xo, s_o, s_q, s_sm, s_sk,
                     DELTA: tl.constexpr, K_SUM: tl.constexpr, STORE_X: tl.constexpr, NORM: tl.constexpr,
                     QUANT: tl.constexpr, N_GROUPS: tl.constexpr, BLOCK: tl.constexpr, CG: tl.constexpr = False):
    """Output row r of add_rms_norm, read from input row src (int64): the whole row body of
    _add_rms_norm_kernel, which kernels/moe_gemv.py's norm-fused GEMV2 runs too (the same code, so the same
    bits). Rows r >= T only in QUANT mode: the GEMM's M padding, written as zeros with the floor scale, as
    kernels.fp8_gemm.quantize_act_1x128 writes them. CG: the delta loads read from L2 (.cg: other programs of
    the same launch wrote the delta, which a stale L1 line must not shadow). A bool, not the modifier string:
    triton 3.6 (the H200 image's) does not take a str constexpr default in a nested jit call."""
    offs = tl.arange(0, BLOCK)
    # (offs * 0 + r): a vector row test; Triton's interpreter rejects a vector mask & a scalar condition
    mask = (offs < H) & (offs * 0 + r < T)
    x = tl.load(x_ptr + src * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    if DELTA == 1:  # a finished bf16/fp32 delta [T, H]: torch's add (fp32 math, one rounding to x's dtype)
        if CG:
            d = tl.load(d_ptr + src * s_dt + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            d = tl.load(d_ptr + src * s_dt + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + d).to(x_ptr.dtype.element_ty).to(tl.float32)
    if DELTA == 2:  # the MoE's weighted expert outputs [T, K, H] (bf16 for a bf16 model, fp32 for fp32):
        acc = tl.zeros([BLOCK], tl.float32)  # kernels.moe_gemv's combine (fixed order, fp32, rounded to
        for j in tl.static_range(K_SUM):  # bf16), then the residual add
            if CG:
                acc += tl.load(d_ptr + src * s_dt + j * s_dk + offs, mask=mask, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
            else:
                acc += tl.load(d_ptr + src * s_dt + j * s_dk + offs, mask=mask, other=0.0).to(tl.float32)
        d = acc.to(tl.bfloat16).to(tl.float32)
        x = (x + d).to(x_ptr.dtype.element_ty).to(tl.float32)
    if STORE_X:
        tl.store(xo_ptr + r.to(tl.int64) * s_xo + offs, x.to(xo_ptr.dtype.element_ty), mask=mask)
    if NORM:
        # exactly _rms_norm_kernel's math on the new residual row
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        w = tl.load(w_ptr + offs, mask=offs < H, other=0.0).to(tl.float32)
        y = (w * (x * inv)).to(x_ptr.dtype.element_ty)
        if QUANT:
            # exactly _quant_act_kernel's math on the rounded normed row, per 128-wide group
            g = tl.reshape(y.to(tl.float32), [BLOCK // 128, 128])
            qv, scale = quant_1x128(g, 1)
            gi = tl.arange(0, BLOCK // 128)
            col = gi[:, None] * 128 + tl.arange(0, 128)[None, :]
            tl.store(q_ptr + r.to(tl.int64) * s_q + col, qv.to(q_ptr.dtype.element_ty), mask=col < N_GROUPS * 128)
            tl.store(s_ptr + r * s_sm + gi * s_sk, scale, mask=gi < N_GROUPS)
        else:
            tl.store(out_ptr + r.to(tl.int64) * s_o + offs, y, mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, rows_ptr, xo_ptr, out_ptr, q_ptr, s_ptr, T, H, eps,
                         s_x, s_dt, s_dk, s_xo, s_o, s_q, s_sm, s_sk,
                         DELTA: tl.constexpr, K_SUM: tl.constexpr, ROWS: tl.constexpr, STORE_X: tl.constexpr,
                         NORM: tl.constexpr, QUANT: tl.constexpr, N_GROUPS: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load (rows, x, delta are the previous kernels') or store
    # One program per output row r (rows >= T only in QUANT mode: the GEMM's M padding).
    r = tl.program_id(0)
    src = r
    if ROWS:
        src = tl.load(rows_ptr + tl.minimum(r, T - 1))
    add_rms_norm_row(x_ptr, d_ptr, w_ptr, xo_ptr, out_ptr, q_ptr, s_ptr, r, src.to(tl.int64), T, H, eps,
                     s_x, s_dt, s_dk, s_xo, s_o, s_q, s_sm, s_sk, DELTA, K_SUM, STORE_X, NORM, QUANT, N_GROUPS, BLOCK)


def norm_block(h: int, quant_k: int | None) -> int:
    """add_rms_norm_row's BLOCK for rows of h (and quant_k, the GEMM's K padded to 128, when quantising):
    add_rms_norm's and the norm-fused GEMV2's, so both lay out (and reduce) a row alike."""
    block = triton.next_power_of_2(max(h, 128))
    if quant_k is None:
        return block
    if quant_k % 128 or quant_k < h:
        raise ValueError(f"add_rms_norm: quant_k {quant_k} must be a multiple of 128 and >= {h}")
    # at least two 128-wide groups per row: a [1, 128] group tile is a shape not worth risking
    return max(block, triton.next_power_of_2(quant_k), 256)


def quant_buffers(n: int, quant_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (fp8 [Mp, quant_k], scale f32 [Mp, quant_k/128] M-major) for n rows quantised 1x128,
    Mp = n rounded up to 4: kernels.fp8_gemm.quantize_act_1x128's layout, as add_rms_norm_row fills it."""
    mp = -(-n // 4) * 4
    return (torch.empty(mp, quant_k, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(quant_k // 128, mp, dtype=torch.float32, device=device).t())


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, eps: float, *,
                 quant_k: int | None = None, rows: torch.Tensor | None = None, store_x: bool = True,
                 num_warps: int | None = None, gather: bool = False):
    """The residual stream's glue in one launch. x [T, H] (unit stride in H); delta None, a finished
    [T, H] tensor (added as torch's `x + delta`), or the MoE's weighted expert outputs fp32 or bf16 [T, k, H]
    (summed over k in order in fp32 and rounded to bf16 as kernels.moe_gemv's combine does, then added); then
    RMSNorm with `weight` (None: no norm). Returns (new x or None, normed):
    - new x [T, H] in x's dtype (None when store_x=False, or when delta is None: x is unchanged);
    - normed [T, H] in x's dtype, or with quant_k set (the GEMM's K padded to 128) the 1x128 FP8
      quantisation kernels.fp8_gemm.quantize_act_1x128(normed, quant_k) returns: (fp8 [Mp, Kp], scale
      f32 [Mp, Kp/128] M-major, Mp = rows rounded up to 4), bit for bit; None when weight is None.
    `rows` (int64 [R]): only those rows are normed and returned (the head's logit rows); needs
    store_x=False, unless `gather`: then x is a table (the token embedding), delta None, and the rows it picks
    are the new x [R, H] (stored) as well as what is normed: F.embedding(rows, x) and the first block's norm
    in one launch, the same bits. Each step is the unfused op's exact math; only the fp32 order of the sum of
    squares may differ from the separate RMSNorm kernel on a GPU (the compiler picks the reduction tree).
    num_warps: None for the measured choice (NORM_WIDE_WARPS up to NORM_WIDE_ROWS rows; bench/sweep_glue.py)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, h = x.shape
    if gather and (rows is None or delta is not None):
        raise ValueError("add_rms_norm: gather= looks rows= up in the table x; it takes no delta")
    if rows is not None and store_x and not gather:
        raise ValueError("add_rms_norm: rows= selects output rows; the residual cannot be stored then")
    if delta is None:
        kind, k_sum, d = 0, 1, x
        store_x = store_x and gather  # else x is unchanged
    elif delta.dim() == 3:
        if delta.shape[0] != t or delta.shape[2] != h or delta.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"add_rms_norm: MoE outputs must be fp32 or bf16 [{t}, k, {h}], got "
                             f"{list(delta.shape)} {delta.dtype}")
        kind, k_sum, d = 2, delta.shape[1], delta
        if d.stride(-1) != 1:
            d = d.contiguous()
    else:
        if tuple(delta.shape) != (t, h):
            raise ValueError(f"add_rms_norm: delta {list(delta.shape)} does not match x {list(x.shape)}")
        kind, k_sum, d = 1, 1, delta if delta.stride(-1) == 1 else delta.contiguous()
    n_out = t if rows is None else rows.shape[0]
    x_new = torch.empty(n_out, h, dtype=x.dtype, device=x.device) if store_x else None
    norm = weight is not None
    block = norm_block(h, quant_k if norm else None)
    out = q = s = None
    grid = n_out
    if norm and quant_k is not None:
        q, s = quant_buffers(n_out, quant_k, x.device)
        grid = q.shape[0]
    elif norm:
        out = torch.empty(n_out, h, dtype=x.dtype, device=x.device)
    if grid:
        dummy = x
        _add_rms_norm_kernel[(grid,)](
            x, d, weight if norm else dummy, rows if rows is not None else dummy,
            x_new if x_new is not None else dummy, out if out is not None else dummy,
            q if q is not None else dummy, s if s is not None else dummy, n_out, h, eps,
            x.stride(0), d.stride(0), d.stride(1) if kind == 2 else 0,
            x_new.stride(0) if x_new is not None else 0, out.stride(0) if out is not None else 0,
            q.stride(0) if q is not None else 0, s.stride(0) if s is not None else 0,
            s.stride(1) if s is not None else 0,
            DELTA=kind, K_SUM=k_sum, ROWS=rows is not None, STORE_X=x_new is not None, NORM=norm,
            QUANT=q is not None, N_GROUPS=(quant_k or 128) // 128, BLOCK=block,
            num_warps=num_warps or (NORM_WIDE_WARPS if grid <= NORM_WIDE_ROWS else 4), **pdl_kwargs(x.device))
    return x_new, ((q, s) if q is not None else out)


# ---------------------------------------------------------------------------------------------------
# q/k rotary + the KV-cache write: one launch instead of three (rotary, then two index_put for K and V)
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _rotary_kv_write_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, pool_ptr, pages_ptr, offsets_ptr,
                            stride_qkv, stride_cs, n_q, n_kv, s_pg, s_kv, s_off, s_head,
                            HALF: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load or store (the pool write may overwrite what the last kernel read)
    t = tl.program_id(0)
    head = tl.program_id(1)  # 0..n_q-1 are query heads, then the kv heads
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    row = qkv_ptr + t.to(tl.int64) * stride_qkv
    src = row + head * 2 * HALF
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    ty = q_ptr.dtype.element_ty
    # _rotary_qk_kernel's math, rounded to the activation dtype as its stores round
    r1 = (x1 * c - x2 * s).to(ty)
    r2 = (x2 * c + x1 * s).to(ty)
    if head < n_q:
        dst = q_ptr + (t.to(tl.int64) * n_q + head) * 2 * HALF
        tl.store(dst + offs, r1, mask=mask)
        tl.store(dst + HALF + offs, r2, mask=mask)
    else:
        kvh = head - n_q
        page = tl.load(pages_ptr + t).to(tl.int64)
        off = tl.load(offsets_ptr + t).to(tl.int64)
        dst = pool_ptr + page * s_pg + off * s_off + kvh * s_head
        pty = pool_ptr.dtype.element_ty
        tl.store(dst + offs, r1.to(pty), mask=mask)
        tl.store(dst + HALF + offs, r2.to(pty), mask=mask)
        v = row + (n_q + n_kv + kvh) * 2 * HALF
        tl.store(dst + s_kv + offs, tl.load(v + offs, mask=mask, other=0.0).to(pty), mask=mask)
        tl.store(dst + s_kv + HALF + offs, tl.load(v + HALF + offs, mask=mask, other=0.0).to(pty), mask=mask)


@triton.jit
def _rotary_kv_write_tile_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, pool_ptr, pages_ptr, offsets_ptr, T,
                                 stride_qkv, stride_cs, n_q, n_kv, s_pg, s_kv, s_off, s_head,
                                 HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
                                 BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load or store
    # Prefill sizes: one program per (BLOCK_T tokens, BLOCK_H heads), _rotary_kv_write_kernel's math per
    # element. Head blocks 0..cdiv(n_q, BLOCK_H)-1 are query heads, the rest kv heads.
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hb = tl.program_id(1)
    n_qb = tl.cdiv(n_q, BLOCK_H)
    is_q = hb < n_qb
    first = tl.where(is_q, hb * BLOCK_H, n_q + (hb - n_qb) * BLOCK_H)
    head = first + tl.arange(0, BLOCK_H)  # index into qkv's heads: q, then k
    h_ok = head < tl.where(is_q, n_q, n_q + n_kv)
    j = tl.arange(0, BLOCK)
    t3 = tok.to(tl.int64)[:, None, None]
    h3 = head[None, :, None]
    j3 = j[None, None, :]
    tj = (tok[:, None, None] < T) & (j3 < HALF)
    mask = tj & h_ok[None, :, None]
    src = qkv_ptr + t3 * stride_qkv + h3 * 2 * HALF + j3
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t3 * stride_cs + j3, mask=tj, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t3 * stride_cs + j3, mask=tj, other=0.0).to(tl.float32)
    ty = q_ptr.dtype.element_ty
    r1 = (x1 * c - x2 * s).to(ty)
    r2 = (x2 * c + x1 * s).to(ty)
    if is_q:
        dst = q_ptr + (t3 * n_q + h3) * 2 * HALF + j3
        tl.store(dst, r1, mask=mask)
        tl.store(dst + HALF, r2, mask=mask)
    else:
        t_ok = tok < T
        page = tl.load(pages_ptr + tok, mask=t_ok, other=0).to(tl.int64)[:, None, None]
        off = tl.load(offsets_ptr + tok, mask=t_ok, other=0).to(tl.int64)[:, None, None]
        kvh = h3 - n_q
        dst = pool_ptr + page * s_pg + off * s_off + kvh * s_head + j3
        pty = pool_ptr.dtype.element_ty
        tl.store(dst, r1.to(pty), mask=mask)
        tl.store(dst + HALF, r2.to(pty), mask=mask)
        v = qkv_ptr + t3 * stride_qkv + (n_q + n_kv + kvh) * 2 * HALF + j3
        tl.store(dst + s_kv, tl.load(v, mask=mask, other=0.0).to(pty), mask=mask)
        tl.store(dst + s_kv + HALF, tl.load(v + HALF, mask=mask, other=0.0).to(pty), mask=mask)


# Token counts from which rotary_kv_write launches the tiled kernel; decode (<= 64 tokens, in CUDA graphs)
# keeps the (token, head) programs it was tuned with. At prefill sizes those were 590k programs of 32
# elements for 8192 tokens of 20b (710 us a call on the H200 against a ~40 us bandwidth floor).
ROTARY_TILE_MIN_TOKENS = 128
ROTARY_TILE = (16, 8, 4)  # (BLOCK_T, BLOCK_H, num_warps); bench.kernels --only glue times the alternatives


def rotary_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int, head_dim: int,
                    pool: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor, *,
                    tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """rotary_qk + kernels.reference.write_kv in one launch: qkv [T, (n_q + 2 n_kv) * head_dim], tables
    [T, head_dim/2], a layer pool [num_pages, 2, page_size, n_kv, head_dim] (unit stride in head_dim),
    pages/offsets [T] (int) -> rotated q [T, n_q, head_dim] (new); rotated K and V stored at
    pool[pages[t], 0/1, offsets[t]] in the pool's dtype (rounded to qkv's dtype first, as the unfused
    path rounds). Rows sharing one (page, offset) (graph padding on the scratch page) race, as index_put's do.
    tile: (tokens, heads, warps) per program of the tiled launch, None for the default by T (ROTARY_TILE
    from ROTARY_TILE_MIN_TOKENS tokens), (1, 1, 4) for today's (token, head) programs; same bits."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if pool.dim() != 5 or pool.shape[1] != 2 or pool.shape[3] != n_kv or pool.shape[4] != head_dim \
            or pool.stride(-1) != 1:
        raise ValueError(f"rotary_kv_write: pool {list(pool.shape)} is not [pages, 2, page, {n_kv}, {head_dim}]")
    cos, sin = cos.contiguous(), sin.contiguous()
    t = qkv.shape[0]
    q = torch.empty((t, n_q, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tile is None:
        tile = ROTARY_TILE if t >= ROTARY_TILE_MIN_TOKENS else (1, 1, 4)
    block_t, block_h, num_warps = tile
    half = head_dim // 2
    args = (qkv, cos, sin, q, pool, pages, offsets)
    strides = (pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3))
    if t and block_t == 1 and block_h == 1:
        _rotary_kv_write_kernel[(t, n_q + n_kv)](
            *args, qkv.stride(0), cos.stride(0), n_q, n_kv, *strides,
            HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=num_warps, **pdl_kwargs(qkv.device))
    elif t:
        grid = (triton.cdiv(t, block_t), triton.cdiv(n_q, block_h) + triton.cdiv(n_kv, block_h))
        _rotary_kv_write_tile_kernel[grid](
            *args, t, qkv.stride(0), cos.stride(0), n_q, n_kv, *strides, HALF=half,
            BLOCK=triton.next_power_of_2(half), BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps,
            **pdl_kwargs(qkv.device))
    return q


# ---------------------------------------------------------------------------------------------------
# FlashInfer decode's exact sink correction + the output projection's 1x128 FP8 quantisation: one launch
# instead of two (kernels.attention.apply_sink_correction in place, then quantize_act_1x128)
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _sink_quant_kernel(out_ptr, lse_ptr, sinks_ptr, q_ptr, s_ptr, B, n_cols, s_ob, s_oh, s_lb, s_q, s_sm, s_sk,
                       HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load or store
    # One program per (row, 128-wide K block), rows >= B (M padding) written as zeros with the floor scale.
    b = tl.program_id(0)
    kb = tl.program_id(1)
    c = kb * 128 + tl.arange(0, 128)
    ok = (c < n_cols) & (c * 0 + b < B)
    h = c // HEAD_DIM
    l2 = tl.load(lse_ptr + b * s_lb + h, mask=ok, other=0.0)
    s = tl.load(sinks_ptr + h, mask=ok, other=0.0).to(tl.float32)
    # _sink_correction_kernel's factor and its rounded in-place store, then _quant_act_kernel's math
    f = 1.0 / (1.0 + tl.exp(s - l2 * 0.6931471805599453))
    o = tl.load(out_ptr + b.to(tl.int64) * s_ob + h * s_oh + c % HEAD_DIM, mask=ok, other=0.0).to(tl.float32)
    v = (o * f).to(out_ptr.dtype.element_ty).to(tl.float32)
    qv, scale = quant_1x128(v, 0)
    tl.store(q_ptr + b.to(tl.int64) * s_q + c, qv.to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + b * s_sm + kb * s_sk, scale)


def sink_correct_quantize(out: torch.Tensor, lse_log2: torch.Tensor, sinks: torch.Tensor, quant_k: int):
    """Attention output without its sink [B, H, D] (FlashInfer decode, unit stride in D), its log2
    log-sum-exp [B, H] and the sinks [H] -> the sink-corrected output flattened to [B, H*D] and quantised
    for the output projection, exactly as apply_sink_correction followed by
    kernels.fp8_gemm.quantize_act_1x128(., quant_k) computes it: (fp8 [Bp, Kp], scale f32 [Bp, Kp/128]
    M-major, Bp = B rounded up to 4). `out` itself is left as it is."""
    b, n_heads, d = out.shape
    if out.stride(-1) != 1:
        out = out.contiguous()
    lse = lse_log2.contiguous()
    n_cols = n_heads * d
    if quant_k % 128 or quant_k < n_cols:
        raise ValueError(f"sink_correct_quantize: quant_k {quant_k} must be a multiple of 128 and >= {n_cols}")
    bp = -(-b // 4) * 4
    q = torch.empty(bp, quant_k, dtype=torch.float8_e4m3fn, device=out.device)
    s = torch.empty(quant_k // 128, bp, dtype=torch.float32, device=out.device).t()
    if bp:
        _sink_quant_kernel[(bp, quant_k // 128)](out, lse, sinks, q, s, b, n_cols, out.stride(0), out.stride(1),
                                                 lse.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                                 HEAD_DIM=d, num_warps=1, **pdl_kwargs(out.device))
    return q, s


# ---------------------------------------------------------------------------------------------------
# The MoE router's logits at decode sizes: one GEMV launch. cuBLAS ran it as a split-K GEMM plus its
# reduction kernel (two launches, ~4 + 2 us at batch 1 on the H200, bench/results/profile-decode-*).
# ---------------------------------------------------------------------------------------------------
ROUTER_GEMV_MAX_TOKENS = 64  # above this cuBLAS's GEMM is the better kernel


@triton.jit
def router_logit_tile(x_ptr, w_ptr, b_ptr, t, offs_e, e_ok, K, s_xt, s_we, HAS_BIAS: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 logits of experts offs_e for token t: bf16 products summed in fp32 per BLOCK_K step, + bias.
    kernels/router.py calls it too, so both kernels sum in the same order (bit-equal logits)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_E], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        xv = tl.load(x_ptr + t.to(tl.int64) * s_xt + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * s_we + k0 + offs_k[None, :],
                     mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wt * xv[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_e, mask=e_ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _router_gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, E, K, s_xt, s_we, s_ot, HAS_BIAS: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load or store (the K loop loads x and w together)
    t = tl.program_id(0)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    acc = router_logit_tile(x_ptr, w_ptr, b_ptr, t, offs_e, e_ok, K, s_xt, s_we, HAS_BIAS, BLOCK_E, BLOCK_K)
    tl.store(out_ptr + t.to(tl.int64) * s_ot + offs_e, acc.to(out_ptr.dtype.element_ty), mask=e_ok)


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for the router: x [T, H], weight [E, H], bias [E] -> [T, E] in x's dtype;
    bf16 products summed in fp32, the bias added in fp32, one rounding (cuBLAS's math; only the order
    of the fp32 sum differs)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    t, h = x.shape
    e = weight.shape[0]
    out = torch.empty(t, e, dtype=x.dtype, device=x.device)
    if t:
        block_e = 4
        _router_gemv_kernel[(t, triton.cdiv(e, block_e))](
            x, weight, bias if bias is not None else weight, out, e, h, x.stride(0), weight.stride(0),
            out.stride(0), HAS_BIAS=bias is not None, BLOCK_E=block_e, BLOCK_K=1024, **pdl_kwargs(x.device))
    return out
