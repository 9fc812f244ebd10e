"""Pure-torch reference kernels: the CPU path of the engine and the oracle for the GPU kernels.

Each function here is the single place its math lives; GPU backends (FlashInfer, Triton) replace a
function by device but must agree with it, and tests/gpu compare against these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# ---------------------------------------------------------------------------------------------------
# YaRN rotary
# ---------------------------------------------------------------------------------------------------


def yarn_inv_freq(
    head_dim: int, theta: float, factor: float, original_context: int, beta_fast: float, beta_slow: float
) -> tuple[torch.Tensor, float]:
    """NTK-by-parts inverse frequencies [head_dim/2] (fp32) and the concentration (attention) factor.

    The correction bounds are not rounded (gpt-oss's `truncate: false`), and are clamped into
    [0, head_dim-1] as transformers does; for the real configs the clamp never binds (low ~ 8.09).
    """
    half = head_dim // 2
    freq = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolated = 1.0 / freq
    interpolated = 1.0 / (factor * freq)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(correction_dim(beta_fast), 0.0)
    high = min(correction_dim(beta_slow), float(head_dim - 1))
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero; any tiny width gives the same step
    ramp = ((torch.arange(half, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # weight of the original (extrapolated) frequency
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    concentration = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, concentration


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, concentration: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, head_dim/2] for absolute positions, scaled by the concentration in fp32 and
    only then rounded to the activation dtype (the order every reference uses)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return (angles.cos() * concentration).to(dtype), (angles.sin() * concentration).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (NeoX) rotation of x [T, heads, head_dim] with tables [T, head_dim/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# ---------------------------------------------------------------------------------------------------
# MoE routing and activation
# ---------------------------------------------------------------------------------------------------


def route_topk(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token, then a softmax over just those k logits, in the logits' dtype (bf16).
    Returns (weights [T, k], expert ids [T, k])."""
    values, experts = torch.topk(router_logits, k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), experts


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss activation on interleaved rows: even = gate (clamped above only), odd = up (clamped both
    ways, then +1)."""
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def mxfp4_dequant(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes [..., K/2] (or [..., K/32, 16]) + E8M0 scales [..., K/32] -> float32 [..., K], computed from
    the E2M1 fields (sign, 2-bit exponent, 1-bit mantissa), not a table: the float32 reference the MXFP4 kernels
    (kernels/moe_mxfp4.py) are tested against, independent of engine/mxfp4.py's table decode."""
    b = blocks.reshape(*scales.shape, 16).to(torch.int32)
    codes = torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)  # element 2j low nibble, 2j + 1 high
    exp, man = (codes >> 1) & 3, (codes & 1).float()
    mag = torch.where(exp == 0, man * 0.5, (1.0 + man * 0.5) * torch.exp2(exp.float() - 1))
    val = torch.where((codes & 8) != 0, -mag, mag)
    return (val * torch.exp2(scales.float() - 127).unsqueeze(-1)).flatten(-2)


def moe_experts_mxfp4_ref(x, ids, route_w, w1, s1, b1, w2, s2, b2, alpha: float = 1.702,
                          limit: float = 7.0, act_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float32 expert mixture for given routing with MXFP4 weights (w1 [E, 2I, H/2] bytes + s1 [E, 2I, H/32];
    w2 [E, H, I/2] + s2 [E, H, I/32]): x [T, H], ids / route_w [T, k] -> the weighted outputs [T, k, H], each
    pair w_j (W2 act + b2) with act = clamped SwiGLU(W1 x + b1), every step in float32 (act_dtype: act rounded
    to it between the GEMMs, as the served kernels store it in bf16)."""
    t, k = ids.shape
    out = torch.zeros(t, k, w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        h = x[tok].float() @ mxfp4_dequant(w1[e], s1[e]).T + b1[e].float()
        act = clamped_swiglu(h, alpha, limit).to(act_dtype).float()
        y = act @ mxfp4_dequant(w2[e], s2[e]).T + b2[e].float()
        out[tok, slot] = y * route_w[tok, slot].float()[:, None]
    return out


# ---------------------------------------------------------------------------------------------------
# Paged attention with sinks
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PagedKV:
    """One page group's batch description in FlashInfer CSR form (all int32 tensors).

    Sequence b owns pages kv_indices[kv_indptr[b]:kv_indptr[b+1]], in position order; its last page
    holds kv_last_page_len[b] entries. The KV entries are the sequence's *most recent* ones (a sliding
    group may have dropped older pages), so queries are aligned to the end of the KV, as in FlashInfer.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor

    def kv_len(self, b: int, page_size: int) -> int:
        n_pages = int(self.kv_indptr[b + 1] - self.kv_indptr[b])
        return 0 if n_pages == 0 else (n_pages - 1) * page_size + int(self.kv_last_page_len[b])


def write_kv(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor) -> None:
    """Store K/V rows [T, kv_heads, head_dim] at (page, offset) of a layer pool
    [num_pages, 2, page_size, kv_heads, head_dim]."""
    pool[pages, 0, offsets] = k.to(pool.dtype)
    pool[pages, 1, offsets] = v.to(pool.dtype)


def paged_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv: PagedKV,
    sinks: torch.Tensor,
    sm_scale: float,
    window: int | None,
) -> torch.Tensor:
    """Causal attention of ragged queries q [T, Hq, D] over a paged pool, with one learned sink logit per
    query head in the softmax denominator (not scaled, its mass dropped), logits and softmax in fp32.

    `window` (sliding layers) keeps the keys with distance < window, i.e. `window` keys including the
    query itself. The output has q's dtype.
    """
    page_size = pool.shape[2]
    n_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = pool.shape[3]
    group = n_heads // kv_heads
    out = torch.empty_like(q)
    sink = sinks.to(torch.float32).view(kv_heads, group, 1, 1)
    qo = qo_indptr.tolist()
    indptr = kv.kv_indptr.tolist()
    for b in range(len(qo) - 1):
        q0, q1 = qo[b], qo[b + 1]
        if q1 == q0:
            continue
        kv_len = kv.kv_len(b, page_size)
        pages = kv.kv_indices[indptr[b]: indptr[b + 1]].long()
        keys = pool[pages, 0].reshape(-1, kv_heads, head_dim)[:kv_len].float()
        vals = pool[pages, 1].reshape(-1, kv_heads, head_dim)[:kv_len].float()
        n_q = q1 - q0
        # [kv_heads, group, n_q, D] so each KV head is used by its consecutive block of query heads.
        qh = q[q0:q1].float().view(n_q, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.einsum("hgqd,khd->hgqk", qh, keys) * sm_scale
        q_pos = torch.arange(n_q, device=q.device)[:, None] + (kv_len - n_q)
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        m = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
        p = torch.exp(scores - m)
        denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink - m)
        o = torch.einsum("hgqk,khd->hgqd", p / denom, vals)
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(n_q, n_heads, head_dim).to(q.dtype)
    return out
