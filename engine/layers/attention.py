"""gpt-oss attention: fused QKV with bias, YaRN rotary, GQA over the paged KV cache, per-head sinks,
sliding window on even layers, output projection with bias. Sharded by query heads."""

from __future__ import annotations

from typing import Callable

import torch

from kvrelay.engine import parallel
from kvrelay.engine.layers.linear import Linear, Shard, WeightGetter
from kvrelay.engine.parallel import HeadRange
from kvrelay.kernels.reference import PagedKV, apply_rotary, write_kv


def head_range(cfg, shard: Shard) -> HeadRange:
    """The query/KV heads this rank holds. One rule for the layer, the KV cache and the KV handoff plan
    (engine/kv_sharding.py), which must all agree on which rank holds which KV head. It also rejects
    splits whose ranks would straddle GQA groups unevenly (e.g. 48 query / 6 KV heads on 8 ranks)."""
    return parallel.head_range(cfg.num_attention_heads, cfg.num_key_value_heads, shard.rank, shard.world_size)


# (q [T,Hq,D], layer pool, qo_indptr, PagedKV, sinks, sm_scale, window) -> [T,Hq,D]; the reference is
# kernels.reference.paged_attention, a GPU backend swaps in its own with the same signature.
AttentionFn = Callable[..., torch.Tensor]


class Attention:
    def __init__(self, weights: WeightGetter, cfg, layer: int, *, shard: Shard, quant: str, device,
                 dtype: torch.dtype):
        self.layer = layer
        self.heads = h = head_range(cfg, shard)
        self.head_dim = d = cfg.head_dim
        self.window = cfg.sliding_window if cfg.layer_is_sliding(layer) else None
        self.sm_scale = cfg.sm_scale
        self.shard = shard
        p = f"block.{layer}.attn."
        # Q, K and V rows of this rank's heads, fused back into one projection.
        rows = (
            slice(h.q0 * d, h.q1 * d),
            slice(cfg.q_width + h.kv0 * d, cfg.q_width + h.kv1 * d),
            slice(cfg.q_width + cfg.kv_width + h.kv0 * d, cfg.q_width + cfg.kv_width + h.kv1 * d),
        )
        get = lambda name, s: weights.get(p + name, slices=s, dtype=dtype, device=device)  # noqa: E731
        qkv_w = torch.cat([get("qkv.weight", (r,)) for r in rows])
        qkv_b = torch.cat([get("qkv.bias", (r,)) for r in rows])
        self.qkv = Linear(qkv_w, qkv_b, quant)
        # Row-parallel output: each rank multiplies its heads' columns; the bias is added once (rank 0)
        # so the all-reduce sums to the single-process result.
        out_w = get("out.weight", (slice(None), slice(h.q0 * d, h.q1 * d)))
        out_b = get("out.bias", ()) if shard.rank == 0 else None
        self.out = Linear(out_w, out_b, quant)
        self.sinks = weights.get(p + "sinks", slices=(slice(h.q0, h.q1),), dtype=torch.float32, device=device)

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pool: torch.Tensor,
        qo_indptr: torch.Tensor,
        kv: PagedKV,
        write_pages: torch.Tensor,
        write_offsets: torch.Tensor,
        attention_fn: AttentionFn,
    ) -> torch.Tensor:
        """x [T, hidden] (already normed) -> this rank's partial output [T, hidden] (not yet reduced)."""
        h, d = self.heads, self.head_dim
        qkv = self.qkv(x)
        q, k, v = qkv.split([h.num_q * d, h.num_kv * d, h.num_kv * d], dim=-1)
        q = apply_rotary(q.view(-1, h.num_q, d), cos, sin)
        k = apply_rotary(k.view(-1, h.num_kv, d), cos, sin)
        # The cache holds K after rotary (positions are absolute), so attention never re-rotates.
        write_kv(pool, k, v.view(-1, h.num_kv, d), write_pages, write_offsets)
        o = attention_fn(q, pool, qo_indptr, kv, self.sinks, self.sm_scale, self.window)
        return self.out(o.reshape(-1, h.num_q * d))
