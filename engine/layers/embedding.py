"""Token embedding and the (untied, bias-free) unembedding, both sharded by vocabulary rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrelay.engine.layers.linear import Shard, WeightGetter


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


class Unembedding:
    def __init__(self, weights: WeightGetter, cfg, *, shard: Shard, device, dtype: torch.dtype):
        self.shard = shard
        self.vocab = cfg.vocab_size
        self.start, self.stop = _vocab_span(cfg.vocab_size, shard)
        self.per = -(-cfg.vocab_size // shard.world_size)
        self.weight = weights.get("unembedding.weight", slices=(slice(self.start, self.stop),), dtype=dtype,
                                  device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] in x's dtype (bf16, as the torch reference returns them)."""
        logits = F.linear(x, self.weight)
        if self.shard.world_size == 1:
            return logits
        logits = F.pad(logits, (0, self.per - logits.shape[-1]))
        return self.shard.all_gather_last(logits)[..., : self.vocab]
