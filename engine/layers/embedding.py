"""Token embedding and the (untied, bias-free) unembedding, both sharded by vocabulary rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrelay.engine.layers.linear import Linear, Shard, WeightGetter


def _vocab_span(vocab: int, shard: Shard) -> tuple[int, int]:
    # Vocab sizes need not split evenly (201088 does for TP<=8 but tiny configs may not): the last
    # rank takes the remainder, and all_gather_last is then replaced by padding below.
    per = -(-vocab // shard.world_size)
    return min(shard.rank * per, vocab), min((shard.rank + 1) * per, vocab)


class Embedding:
    def __init__(self, weights: WeightGetter, cfg, *, shard: Shard, device, dtype: torch.dtype):
        self.shard = shard
        self.start, self.stop = _vocab_span(cfg.vocab_size, shard)
        self.weight = weights.get("embedding.weight", slices=(slice(self.start, self.stop),), dtype=dtype,
                                  device=device)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.world_size == 1:
            return F.embedding(ids, self.weight)
        # Each rank looks up the ids it owns and contributes zeros for the rest; the sum is the row.
        local = ids - self.start
        owned = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * owned[:, None]
        return self.shard.all_reduce(x)


@dataclass(frozen=True)
class EmbeddingRows:
    """A lookup not made yet: the first block's fused residual glue reads the rows straight from the table
    (kernels.fused.add_rms_norm(..., gather=True): the lookup and the norm + FP8 quantisation in one launch);
    any other consumer calls `lookup`."""

    table: torch.Tensor  # [vocab, hidden]: one rank's whole table (world size 1)
    ids: torch.Tensor  # [T] token ids

    def lookup(self) -> torch.Tensor:
        return F.embedding(self.ids, self.table)


def embed_fuse_enabled() -> bool:
    """The token lookup fused into the first block's norm launch (EmbeddingRows; one launch fewer a step):
    KVRELAY_EMBED_FUSE, a decode fusion of kernels.select.DECODE_FUSIONS. The same bits either way."""
    from kvrelay.kernels.select import fusion_on

    return fusion_on("KVRELAY_EMBED_FUSE")


class Unembedding:
    """quant "fp8-block128": this rank's vocabulary rows quantised once at load and multiplied as every FP8
    linear is (engine/layers/linear.Linear: 1x128 activation scales, cuBLAS blockwise on a GPU)."""

    def __init__(self, weights: WeightGetter, cfg, *, shard: Shard, device, dtype: torch.dtype,
                 quant: str = "bf16"):
        self.shard = shard
        self.vocab = cfg.vocab_size
        self.start, self.stop = _vocab_span(cfg.vocab_size, shard)
        self.per = -(-cfg.vocab_size // shard.world_size)
        w = weights.get("unembedding.weight", slices=(slice(self.start, self.stop),), dtype=dtype, device=device)
        self.linear = Linear(w, None, quant) if quant != "bf16" else None
        self.weight = w if self.linear is None else self.linear.weight  # FP8: the bf16 copy is not kept

    @property
    def quant_k(self) -> int | None:
        """K padded to 128 when the product runs the GPU FP8 GEMM (input may come pre-quantised), else None."""
        return self.linear.quant_k if self.linear is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] in x's dtype (bf16, as the torch reference returns them)."""
        return self._gather(F.linear(x, self.weight) if self.linear is None else self.linear(x))

    def run_quantized(self, xq: torch.Tensor, sx: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
        """self(x) of m rows that arrive FP8-quantised for this GEMM (kernels.fused.add_rms_norm quant_k)."""
        return self._gather(self.linear.run_quantized(xq, sx, m, dtype))

    def _gather(self, logits: torch.Tensor) -> torch.Tensor:
        if self.shard.world_size == 1:
            return logits
        logits = F.pad(logits, (0, self.per - logits.shape[-1]))
        return self.shard.all_gather_last(logits)[..., : self.vocab]
