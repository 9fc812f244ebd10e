"""The gpt-oss forward, in one place.

    x = embedding[ids]
    for each layer:  x += attention(rmsnorm(x)); x += moe(rmsnorm(x))
    logits = unembedding(rmsnorm(x))

Activations are bf16; RMSNorm and the attention softmax run in fp32 (docs: gpt-oss-spec.md section 2).
The same forward serves prefill (many tokens per sequence) and decode (one per sequence): a ragged batch
of new tokens is appended to the paged KV cache and attends over it, as `BatchLayout` describes.
Weights come only through `WeightGetter.get`, sliced by `Shard`, so TP/EP need no changes here.
"""

from __future__ import annotations

import torch

from kvrelay.engine.config import ModelConfig
from kvrelay.engine.kv_cache import BatchLayout, KVCache
from kvrelay.engine.layers.attention import Attention, AttentionFn, BatchAttention, GpuAttention
from kvrelay.engine.layers.embedding import Embedding, Unembedding
from kvrelay.engine.layers.linear import QUANTS, Shard, WeightGetter
from kvrelay.engine.layers.moe import MoE
from kvrelay.engine.layers.norm import RMSNorm
from kvrelay.engine.layers.rotary import YarnRotary
from kvrelay.kernels import select


class Block:
    def __init__(self, weights: WeightGetter, cfg: ModelConfig, layer: int, *, shard: Shard, quant: str,
                 device, dtype: torch.dtype):
        self.layer = layer
        self.shard = shard
        eps = cfg.rms_norm_eps
        self.attn_norm = RMSNorm(weights, f"block.{layer}.attn.norm.scale", eps, device)
        self.attn = Attention(weights, cfg, layer, shard=shard, quant=quant, device=device, dtype=dtype)
        self.mlp_norm = RMSNorm(weights, f"block.{layer}.mlp.norm.scale", eps, device)
        self.mlp = MoE(weights, cfg, layer, shard=shard, quant=quant, device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                 batch: BatchLayout, attn: BatchAttention) -> torch.Tensor:
        q = self.attention_in(x, cos, sin, cache, batch)
        group = cache.layer_group(self.layer)
        o = attn.run(q, cache.layer_pool(self.layer), group, self.attn.sinks, self.attn.sm_scale,
                     self.attn.window)
        return self.attention_out(x, o)

    # The two halves around the attention kernel (a piecewise CUDA graph replays them, engine/cuda_graph.py).
    def attention_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                     batch: BatchLayout) -> torch.Tensor:
        """Norm, QKV, rotary and the KV-cache write for this layer's new tokens: q [T, Hq, D]."""
        group = cache.layer_group(self.layer)
        return self.attn.project_in(self.attn_norm(x), cos, sin, cache.layer_pool(self.layer),
                                    batch.write_pages[group], batch.write_offsets[group])

    def attention_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, then the MoE half of the block: the block's output."""
        x = x + self.shard.all_reduce(self.attn.project_out(o))
        return x + self.shard.all_reduce(self.mlp(self.mlp_norm(x)))


class GptOss:
    """The model: weights on `device`, no state besides them (the KV cache is passed in)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: WeightGetter,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        quant: str = "bf16",
        shard: Shard = Shard(),
        attention_fn: AttentionFn | None = None,
    ):
        if quant not in QUANTS:
            raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
        self.cfg, self.device, self.dtype, self.quant, self.shard = cfg, torch.device(device), dtype, quant, shard
        # None: the device's kernels (kernels.select); an explicit function runs through the generic
        # per-layer wrapper (the reference, or any drop-in with its signature).
        self.attention_backend = "custom" if attention_fn is not None else select.attention_backend(
            self.device, cfg.head_dim)
        if attention_fn is None and self.attention_backend == "reference":
            from kvrelay.kernels.reference import paged_attention as attention_fn
        self.attention_fn = attention_fn
        common = dict(shard=shard, device=device, dtype=dtype)
        self.embedding = Embedding(weights, cfg, **common)
        self.rotary = YarnRotary(cfg, device=device, dtype=dtype)
        self.blocks = [Block(weights, cfg, i, quant=quant, **common) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(weights, "norm.scale", cfg.rms_norm_eps, device)
        self.unembedding = Unembedding(weights, cfg, **common)

    def make_attention(self, page_size: int, **gpu_kwargs) -> BatchAttention:
        """A per-batch attention object for this model (plan once per forward, run in every layer)."""
        if self.attention_fn is not None:
            return BatchAttention(self.attention_fn)
        heads = self.blocks[0].attn.heads if self.blocks else None
        return GpuAttention(self.cfg, heads.num_kv, heads.num_q, page_size, self.device, self.dtype,
                            self.attention_backend, **gpu_kwargs)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, batch: BatchLayout, *,
                all_logits: bool = False, attn: BatchAttention | None = None, plan: bool = True) -> torch.Tensor:
        """Append the ragged tokens `ids` [T] to the cache and return logits [B, vocab] (fp32) for each
        sequence's last new token, or [T, vocab] for every token when all_logits (tests, scoring).

        `attn` (default: one made for `cache` and kept) is planned here unless plan=False (a CUDA-graph
        step plans outside the graph)."""
        if attn is None:
            attn = self._default_attention(cache)
        if plan:
            attn.plan(batch)
        x, cos, sin = self.embed(ids, batch.positions)
        for block in self.blocks:
            x = block(x, cos, sin, cache, batch, attn)
        return self.head(x, None if all_logits else batch.logit_rows)

    def embed(self, ids: torch.Tensor, positions: torch.Tensor):
        """Token embeddings [T, hidden] and the rotary tables of the tokens' positions."""
        cos, sin = self.rotary(positions)
        return self.embedding(ids), cos, sin

    def head(self, x: torch.Tensor, logit_rows: torch.Tensor | None) -> torch.Tensor:
        """Final norm and unembedding of `logit_rows` of x (every row when None): fp32 logits."""
        if logit_rows is not None:
            x = x[logit_rows]
        return self.unembedding(self.norm(x)).float()

    def _default_attention(self, cache: KVCache) -> BatchAttention:
        att = getattr(self, "_attention", None)
        if att is None or getattr(self, "_attention_page", None) != cache.page_size:
            att = self._attention = self.make_attention(cache.page_size)
            self._attention_page = cache.page_size
        return att
