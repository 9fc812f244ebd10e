"""The gpt-oss forward, in one place.

    x = embedding[ids]
    for each layer:  x += attention(rmsnorm(x)); x += moe(rmsnorm(x))
    logits = unembedding(rmsnorm(x))

Activations are bf16; RMSNorm and the attention softmax run in fp32 (docs: gpt-oss-spec.md section 2).
The same forward serves prefill (many tokens per sequence) and decode (one per sequence): a ragged batch
of new tokens is appended to the paged KV cache and attends over it, as `BatchLayout` describes.
Weights come only through `WeightGetter.get`, sliced by `Shard`, so TP/EP need no changes here.
On the GPU the glue between the big kernels runs fused (kernels/fused.py; KVRELAY_FUSED=0 turns it off):
the MoE's combine, the residual add, RMSNorm and the next FP8 GEMM's activation quantisation are one
launch, so a block hands the next one (x, delta) with its MoE outputs not yet summed; with
KVRELAY_MOE_NORM_FUSE=1, at the smallest decode batches not even computed: the MoE's second expert GEMV is left
to the next block, which fuses its residual add + norm into that launch (kernels.moe_gemv.MoePending).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvrelay.engine.config import MODEL_QUANTS, ModelConfig, expert_quant, head_quant, layer_quant
from kvrelay.engine.kv_cache import BatchLayout, KVCache
from kvrelay.engine.layers.attention import Attention, AttentionFn, BatchAttention, GpuAttention
from kvrelay.engine.layers.embedding import Embedding, EmbeddingRows, Unembedding, embed_fuse_enabled
from kvrelay.engine.layers.linear import Shard, WeightGetter
from kvrelay.engine.layers.moe import MoE
from kvrelay.engine.layers.norm import RMSNorm
from kvrelay.engine.layers.rotary import YarnRotary, gather_in_attention
from kvrelay.kernels import select

if TYPE_CHECKING:  # imported where used: kernels.moe_gemv imports triton, which a CPU reference run never needs
    from kvrelay.kernels.moe_gemv import MoePending


class Block:
    def __init__(self, weights: WeightGetter, cfg: ModelConfig, layer: int, *, shard: Shard, quant: str,
                 device, dtype: torch.dtype, experts_quant: str | None = None):
        self.layer = layer
        self.shard = shard
        eps = cfg.rms_norm_eps
        self.attn_norm = RMSNorm(weights, f"block.{layer}.attn.norm.scale", eps, device)
        self.attn = Attention(weights, cfg, layer, shard=shard, quant=quant, device=device, dtype=dtype)
        self.mlp_norm = RMSNorm(weights, f"block.{layer}.mlp.norm.scale", eps, device)
        self.mlp = MoE(weights, cfg, layer, shard=shard, quant=experts_quant or quant, device=device, dtype=dtype)

        # GPU: the glue between the big kernels fused (kernels/fused.py): residual add (with the previous
        # block's MoE combine) + RMSNorm + the QKV GEMM's FP8 activation quantisation in one launch,
        # rotary + KV write in one, residual add + RMSNorm before the MoE in one. Same math, fewer launches
        # (a batch-1 decode step is launch-bound).
        self.fused = select.fuse_glue(device)
        self.eps = eps

    # The residual stream between blocks is a pair (x, delta): x plus a `delta` still to be added (the
    # previous block's MoE outputs, uncombined, on the fused path: a tensor, or a MoePending whose last GEMV
    # is still to launch; None otherwise). GptOss.forward runs a block as residual_attention_in -> attend ->
    # attention_out_deferred; `add_delta` finishes a pair.
    def attend(self, q: torch.Tensor, cache: KVCache, attn: BatchAttention):
        """The attention kernel of this layer on q; on the fused path a FlashInfer decode leaves the sink
        to the output projection's quantisation kernel (a SinkPending), a Triton split-KV decode its merge
        (a MergePending, or a MergedQuant already quantised for the FP8 output projection's quant_k)."""
        return attn.run(q, cache.layer_pool(self.layer), cache.layer_group(self.layer), self.attn.sinks,
                        self.attn.sm_scale, self.attn.window, defer_sink=self.fused,
                        quant_k=self.attn.out.quant_k if self.fused else None)

    # The two halves around the attention kernel (a piecewise CUDA graph replays them, engine/cuda_graph.py).
    def attention_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                     batch: BatchLayout) -> torch.Tensor:
        """Norm, QKV, rotary and the KV-cache write for this layer's new tokens: q [T, Hq, D]."""
        return self.residual_attention_in(x, None, cos, sin, cache, batch)[1]

    def attention_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, then the MoE half of the block: the block's output."""
        return self.add_delta(*self.attention_out_deferred(x, o))

    def residual_attention_in(self, x: torch.Tensor | EmbeddingRows, delta: torch.Tensor | MoePending | None,
                              cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, batch: BatchLayout, *,
                              defer_rotary: bool = False, rotary_positions: torch.Tensor | None = None):
        """(x + delta, q): the residual stream finished, then attention_in on it. defer_rotary (the fused
        path, for an attention that fuses_rotary): q is a RotaryPending, the rotary and KV write left to the
        attention kernel. A MoePending delta launches its GEMV2 with the add + norm (+ quantisation) fused;
        an EmbeddingRows x (the first block, KVRELAY_EMBED_FUSE=1) is looked up inside the norm's launch.
        rotary_positions (with defer_rotary; KVRELAY_ROTARY_GATHER=1): cos/sin are the whole tables, looked up
        at these positions by the attention kernel."""
        group = cache.layer_group(self.layer)
        pool, pages, offsets = cache.layer_pool(self.layer), batch.write_pages[group], batch.write_offsets[group]
        if isinstance(x, EmbeddingRows) and (not self.fused or delta is not None):
            x = x.lookup()
        if not self.fused:
            x = self.add_delta(x, delta)
            return x, self.attn.project_in(self.attn_norm(x), cos, sin, pool, pages, offsets)
        from kvrelay.kernels.fused import add_rms_norm
        from kvrelay.kernels.moe_gemv import MoePending

        kp = self.attn.qkv.quant_k
        if isinstance(x, EmbeddingRows):
            x_new, h = add_rms_norm(x.table, None, self.attn_norm.scale, self.eps, quant_k=kp, rows=x.ids, gather=True)
        elif isinstance(delta, MoePending):
            x_new, h = delta.finish_norm(x, self.attn_norm.scale, self.eps, quant_k=kp)
        else:
            x_new, h = add_rms_norm(x, delta, self.attn_norm.scale, self.eps, quant_k=kp)
        x = x if x_new is None else x_new
        if defer_rotary:
            hq, sx = (h, None) if kp is None else h
            return x, self.attn.project_in_deferred(hq, sx, x.shape[0], x.dtype, cos, sin, pool, pages, offsets,
                                                    rotary_positions)
        if kp is None:
            return x, self.attn.project_in(h, cos, sin, pool, pages, offsets)
        return x, self.attn.project_in_quantized(*h, x.shape[0], x.dtype, cos, sin, pool, pages, offsets)

    def attention_out_deferred(self, x: torch.Tensor, o):
        """attention_out as (x, delta) with the MoE's outputs left uncombined in delta where the next
        kernel can sum them (fused path, one rank; at the smallest decode batches a MoePending, their last
        GEMV not launched yet); (block output, None) otherwise. `o`: the attention output, or its SinkPending
        (Attention.project_out)."""
        a = self.shard.all_reduce(self.attn.project_out(o))
        if not self.fused:
            x = x + a
            return x + self.shard.all_reduce(self.mlp(self.mlp_norm(x))), None
        from kvrelay.kernels.fused import add_rms_norm

        if self.shard.world_size == 1:
            # decode sizes: the residual add, the MoE's norm and its router in one launch (kernels/router.py)
            routed = self.mlp.fused_route_in(x, a, self.mlp_norm.scale, self.eps)
            if routed is not None:
                x, h, gate, experts = routed
                return x, self.mlp.routed_uncombined(h, gate, experts)
        x, h = add_rms_norm(x, a, self.mlp_norm.scale, self.eps)
        if self.shard.world_size == 1 and self.mlp.gpu is not None:
            return x, self.mlp.uncombined(h)
        return x, self.shard.all_reduce(self.mlp(h))

    def add_delta(self, x: torch.Tensor, delta: torch.Tensor | MoePending | None) -> torch.Tensor:
        if delta is None:
            return x
        if not self.fused and delta.dim() == 2:
            return x + delta
        from kvrelay.kernels.fused import add_rms_norm

        return add_rms_norm(x, moe_outputs(delta), None, self.eps)[0]


def moe_outputs(delta: torch.Tensor | MoePending | None) -> torch.Tensor | None:
    """A residual delta as a tensor (or None): a MoePending's GEMV2 launched alone, for the consumers that fuse
    no norm into it (the head's rows, the piecewise graphs' add_delta)."""
    from kvrelay.kernels.moe_gemv import MoePending

    return delta.outputs() if isinstance(delta, MoePending) else delta


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
        if quant not in MODEL_QUANTS:
            raise ValueError(f"quant must be one of {MODEL_QUANTS}, got {quant!r}")
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
        self.blocks = [Block(weights, cfg, i, quant=layer_quant(quant), experts_quant=expert_quant(quant), **common)
                       for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(weights, "norm.scale", cfg.rms_norm_eps, device)
        self.fused_head = select.fuse_glue(self.device)
        self.unembedding = Unembedding(weights, cfg, quant=head_quant(quant), **common)

    def make_attention(self, page_size: int, **gpu_kwargs) -> BatchAttention:
        """A per-batch attention object for this model (plan once per forward, run in every layer)."""
        if self.attention_fn is not None:
            return BatchAttention(self.attention_fn)
        heads = self.blocks[0].attn.heads if self.blocks else None
        return GpuAttention(self.cfg, heads.num_kv, heads.num_q, page_size, self.device, self.dtype,
                            self.attention_backend, **gpu_kwargs)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, batch: BatchLayout, *,
                all_logits: bool = False, attn: BatchAttention | None = None, plan: bool = True,
                float_logits: bool = True) -> torch.Tensor:
        """Append the ragged tokens `ids` [T] to the cache and return logits [B, vocab] (fp32) for each
        sequence's last new token, or [T, vocab] for every token when all_logits (tests, scoring);
        float_logits=False: in the head's dtype (GptOss.head).

        `attn` (default: one made for `cache` and kept) is planned here unless plan=False (a CUDA-graph
        step plans outside the graph)."""
        if attn is None:
            attn = self._default_attention(cache)
        if plan:
            attn.plan(batch)
        # per page group, once a forward: a Triton split-KV decode may take the rotary and KV write into its
        # kernel (GpuAttention.fuses_rotary); where every layer's does, it may look the rows up too
        defer: dict[str, bool] = {}
        for block in self.blocks:
            group = cache.layer_group(block.layer)
            if group not in defer:
                defer[group] = block.fused and attn.fuses_rotary(group)
        gather = bool(defer) and all(defer.values()) and gather_in_attention()
        if self.blocks and self.blocks[0].fused and self.shard.world_size == 1 and embed_fuse_enabled():
            x = EmbeddingRows(self.embedding.weight, ids)  # looked up by the first block's norm launch
        else:
            x = self.embedding(ids)
        cos, sin = (self.rotary.cos, self.rotary.sin) if gather else self.rotary(batch.positions)
        delta = None
        for block in self.blocks:
            x, q = block.residual_attention_in(x, delta, cos, sin, cache, batch,
                                               defer_rotary=defer[cache.layer_group(block.layer)],
                                               rotary_positions=batch.positions if gather else None)
            # summed into x: drop the MoE outputs ([T, k, hidden], 189 MB bf16 for an 8k-token prefill)
            # before this block's MoE allocates its own
            delta = None
            x, delta = block.attention_out_deferred(x, block.attend(q, cache, attn))
        return self.head(x, None if all_logits else batch.logit_rows, delta, float_logits=float_logits)

    def embed(self, ids: torch.Tensor, positions: torch.Tensor):
        """Token embeddings [T, hidden] and the rotary tables of the tokens' positions."""
        cos, sin = self.rotary(positions)
        return self.embedding(ids), cos, sin

    def head(self, x: torch.Tensor, logit_rows: torch.Tensor | None,
             delta: torch.Tensor | MoePending | None = None, *, float_logits: bool = True) -> torch.Tensor:
        """Final norm and unembedding of `logit_rows` of x + delta (every row when None): fp32 logits, or with
        float_logits=False the unembedding's own dtype (bf16 for a bf16 model: the same values before the
        exact widening; a decode graph that leaves it to its caller saves the conversion launch).
        On the fused path one kernel adds the last block's MoE outputs and norms only the logit rows."""
        if self.fused_head:
            from kvrelay.kernels.fused import add_rms_norm

            # an FP8 head takes the normed rows already quantised (its 1x128 scales) from the same launch
            kq = self.unembedding.quant_k
            h = add_rms_norm(x, moe_outputs(delta), self.norm.scale, self.norm.eps, rows=logit_rows,
                             store_x=False, quant_k=kq)[1]
            if kq is None:
                out = self.unembedding(h)
            else:
                rows = x.shape[0] if logit_rows is None else logit_rows.shape[0]
                out = self.unembedding.run_quantized(*h, rows, x.dtype)
        else:
            if delta is not None:
                x = self.blocks[-1].add_delta(x, delta)
            if logit_rows is not None:
                x = x[logit_rows]
            out = self.unembedding(self.norm(x))
        return out.float() if float_logits else out

    def _default_attention(self, cache: KVCache) -> BatchAttention:
        att = getattr(self, "_attention", None)
        if att is None or getattr(self, "_attention_page", None) != cache.page_size:
            att = self._attention = self.make_attention(cache.page_size)
            self._attention_page = cache.page_size
        return att
