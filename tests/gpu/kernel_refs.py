"""Float32 torch references and random-input builders for the kernel tests (GPU tests and the CPU
TRITON_INTERPRET test import this file). Written independently of kernels/reference.py on purpose:
two references that agree are worth more than one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    pool: torch.Tensor            # [num_pages, 2, page, kv_heads, D]
    qo_indptr: torch.Tensor       # int32 [B+1]
    kv_indptr: torch.Tensor       # int32 [B+1]
    kv_indices: torch.Tensor      # int32
    kv_last_page_len: torch.Tensor  # int32 [B]
    kv_lens: list[int]
    q_lens: list[int]


def make_paged_batch(kv_lens, q_lens, kv_heads, head_dim, page, device, dtype=torch.bfloat16,
                     gen: torch.Generator | None = None, spare_pages: int = 3) -> PagedBatch:
    """Random K/V in a pool whose pages are handed out in a shuffled order (so a kernel that ignores
    the page table fails), plus spare pages full of large garbage that no sequence owns."""
    n_pages = [max(1, -(-n // page)) if n > 0 else 0 for n in kv_lens]
    total = sum(n_pages) + spare_pages
    pool = torch.randn(total, 2, page, kv_heads, head_dim, generator=gen, dtype=torch.float32)
    perm = torch.randperm(total, generator=gen)
    owned = perm[: sum(n_pages)]
    garbage = perm[sum(n_pages):]
    pool[garbage] = 1e4  # would dominate any softmax that reads it
    indptr = [0]
    for n in n_pages:
        indptr.append(indptr[-1] + n)
    last = [(n - (p - 1) * page) if p > 0 else 0 for n, p in zip(kv_lens, n_pages)]
    qo = [0]
    for n in q_lens:
        qo.append(qo[-1] + n)
    i32 = dict(dtype=torch.int32, device=device)
    return PagedBatch(pool.to(device=device, dtype=dtype), torch.tensor(qo, **i32), torch.tensor(indptr, **i32),
                      owned.to(**i32), torch.tensor(last, **i32), list(kv_lens), list(q_lens))


@dataclass
class DecodeRotaryCase:
    """One decode step's inputs for the split-KV decode with the rotary + KV write inside (kernels/decode_rotary.py):
    the paged batch whose page tables already count the new token, that token's (page, offset) slot (holding
    garbage, 1e4, so a kernel that read it instead of the fresh row would be far off), its QKV row, the rotary
    tables of its position and the sinks."""

    b: PagedBatch
    pages: torch.Tensor   # int64 [B]
    offs: torch.Tensor    # int64 [B]
    qkv: torch.Tensor     # bf16 [B, (nq + 2 nkv) D]
    cos: torch.Tensor
    sin: torch.Tensor
    sinks: torch.Tensor   # fp32 [nq]


def decode_rotary_case(lens, nq: int, nkv: int, d: int, page: int, device, gen: torch.Generator) -> DecodeRotaryCase:
    from kvrelay.kernels.reference import rotary_cos_sin, yarn_inv_freq

    b = make_paged_batch(lens, [1] * len(lens), nkv, d, page, device, gen=gen)
    slot = [int(b.kv_indices[int(b.kv_indptr[s]) + (n - 1) // page]) for s, n in enumerate(lens)]
    pages = torch.tensor(slot, dtype=torch.long, device=device)
    offs = torch.tensor([(n - 1) % page for n in lens], dtype=torch.long, device=device)
    b.pool[pages, :, offs] = 1e4
    qkv = torch.randn(len(lens), (nq + 2 * nkv) * d, generator=gen).to(torch.bfloat16).to(device)
    inv, conc = yarn_inv_freq(d, 150000.0, 32.0, 4096, beta_fast=32.0, beta_slow=1.0)
    cos, sin = (t.to(device) for t in rotary_cos_sin(torch.tensor(lens) - 1, inv, conc, torch.bfloat16))
    sinks = (torch.randn(nq, generator=gen) + 3).float().to(device)
    return DecodeRotaryCase(b, pages, offs, qkv, cos, sin, sinks)


def gather_kv(b: PagedBatch, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of one sequence as [kv_len, kv_heads, D] float32."""
    p0, p1 = int(b.kv_indptr[seq]), int(b.kv_indptr[seq + 1])
    pages = b.kv_indices[p0:p1].long()
    kv = b.pool[pages].float()  # [n, 2, page, H, D]
    k = kv[:, 0].reshape(-1, *kv.shape[-2:])[: b.kv_lens[seq]]
    v = kv[:, 1].reshape(-1, *kv.shape[-2:])[: b.kv_lens[seq]]
    return k, v


def sink_attention_ref(q: torch.Tensor, b: PagedBatch, sinks: torch.Tensor, sm_scale: float,
                       window: int | None, use_sink: bool = True) -> torch.Tensor:
    """Float32 reference: softmax over [scores, sink] per row, sink column dropped. Returns float32."""
    n_heads = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s in range(len(b.q_lens)):
        q0, nq, nk = int(b.qo_indptr[s]), b.q_lens[s], b.kv_lens[s]
        if nq == 0:
            continue
        k, v = gather_kv(b, s)
        group = n_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [nk, Hq, D]; head h uses kv head h // group
        v = v.repeat_interleave(group, dim=1)
        qs = q[q0:q0 + nq].float()
        logits = torch.einsum("qhd,khd->hqk", qs, k) * sm_scale
        qpos = torch.arange(nk - nq, nk, device=q.device)[:, None]
        kpos = torch.arange(nk, device=q.device)[None, :]
        vis = kpos <= qpos
        if window:
            vis &= kpos > qpos - window
        logits = logits.masked_fill(~vis, float("-inf"))
        sink_col = sinks.float()[:, None, None].expand(n_heads, nq, 1)
        if not use_sink:
            sink_col = torch.full_like(sink_col, float("-inf"))
        full = torch.cat([logits, sink_col], dim=-1)
        p = torch.softmax(full, dim=-1)[..., :-1]
        p = torch.nan_to_num(p)  # rows with no key and no sink
        out[q0:q0 + nq] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-12))


# ---------------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------------

def swiglu_ref(gu: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    g = gu[..., 0::2].clamp(max=limit)
    u = gu[..., 1::2].clamp(-limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + 1)


def _fake_quant_1x128(v: torch.Tensor) -> torch.Tensor:
    from kvrelay.kernels.fp8 import dequantize_act_1x128, quantize_act_1x128
    q, s = quantize_act_1x128(v.bfloat16().reshape(1, -1))
    return dequantize_act_1x128(q, s).reshape(-1)


def moe_ref(x, ids, weights, w1, b1, w2, b2, alpha=1.702, limit=7.0, quant_act=False,
            round_pairs=False) -> torch.Tensor:
    """Float32 expert mixture for given routing: x [T, H]; ids/weights [T, k]; w1 [E, 2I, H] (interleaved
    gate/up rows); w2 [E, H, I]. Weights given already dequantised. quant_act: the GEMM inputs go
    through 1x128 fp8 quantisation (after bf16 rounding), as the fp8 tensor-core path does. round_pairs:
    each weighted expert output rounded to bf16 before the sum, as the grouped path stores them
    (kernels/moe.py, a bf16 model)."""
    xf = x.float()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        xt = _fake_quant_1x128(xf[t]) if quant_act else xf[t]
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w1[e].float() @ xt + b1[e].float()
            a = swiglu_ref(h, alpha, limit)
            if quant_act:
                a = _fake_quant_1x128(a)
            y = float(weights[t, j]) * (w2[e].float() @ a + b2[e].float())
            out[t] += y.bfloat16().float() if round_pairs else y
    return out


def poison_allocator(nbytes: int) -> None:
    """Fill a block of the CUDA caching allocator with NaN and free it, so that the next torch.empty of
    up to that size (intermediates and outputs a kernel allocates itself) starts as NaN, not zeros."""
    if torch.cuda.is_available():
        x = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device="cuda")
        del x


def bits(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (torch.equal on e4m3 compares bit patterns then), anything else as it is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same(a: torch.Tensor, b: torch.Tensor, what) -> None:
    """Same shape, dtype, strides and bits (fp8 by its bytes)."""
    assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride(), (what, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b)), (what, (a.float() - b.float()).abs().max())
