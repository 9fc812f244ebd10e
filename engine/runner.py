"""Runner: the model, its paged KV cache and sampling on one device; the API both workers call.

A sequence is identified by any hashable id. Its life: `prefill` (or `import_sequence` + filling the
pages) -> `decode` steps -> `free`. `prefill`/`decode` return fp32 logits of each sequence's last
position; `sample` turns them into tokens. The Runner never decides *when* to stop: that is the
caller's (LLM, workers), which keeps one Runner usable for both disaggregated roles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Hashable, Sequence

import torch

from kvrelay.engine.config import ModelConfig, load_model_config
from kvrelay.engine.kv_cache import GROUPS, KVCache, OutOfPages, SequenceKV
from kvrelay.engine.layers.attention import AttentionFn
from kvrelay.engine.layers.linear import Shard, WeightGetter
from kvrelay.engine.model import GptOss
from kvrelay.engine.sampling import SamplingParams, sample
from kvrelay.kernels.reference import paged_attention

__all__ = ["Runner", "OutOfPages", "open_model_weights"]


def open_model_weights(model: str | Path, cfg: ModelConfig, *, dummy: bool, seed: int) -> WeightGetter:
    """The checkpoint behind a model name/path (or seeded dummy weights of its shape)."""
    from kvrelay.engine.weights import open_weights  # heavy (safetensors, MXFP4): only when loading

    return open_weights(model, cfg, dummy=dummy, seed=seed)


class Runner:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: WeightGetter,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        quant: str = "bf16",
        page_size: int = 16,
        num_pages: int | dict[str, int] | None = None,
        kv_tokens: int = 65536,
        shard: Shard = Shard(),
        attention_fn: AttentionFn = paged_attention,
    ):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = GptOss(cfg, weights, device=self.device, dtype=dtype, quant=quant, shard=shard,
                            attention_fn=attention_fn)
        if num_pages is None:
            num_pages = -(-kv_tokens // page_size)
        self.kv = KVCache(cfg, num_pages=num_pages, page_size=page_size, device=self.device, dtype=dtype,
                          shard=shard)

    @classmethod
    def load(cls, model: str | Path, *, dummy: bool = False, seed: int = 0, **kwargs) -> "Runner":
        cfg = load_model_config(model)
        return cls(cfg, open_model_weights(model, cfg, dummy=dummy, seed=seed), **kwargs)

    @property
    def max_context(self) -> int:
        return self.cfg.max_context

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    # ---- capacity ------------------------------------------------------------------------------
    def free_pages(self) -> dict[str, int]:
        return self.kv.free_pages()

    def pages_needed(self, n_tokens: int, *, length: int = 0) -> dict[str, int]:
        return self.kv.pages_needed(n_tokens, length=length)

    def can_admit(self, n_tokens: int, *, length: int = 0) -> bool:
        return self.kv.can_allocate(n_tokens, length=length)

    def has_sequence(self, seq_id: Hashable) -> bool:
        return seq_id in self.kv.seqs

    def length(self, seq_id: Hashable) -> int:
        return self.kv.length(seq_id)

    # ---- forward -------------------------------------------------------------------------------
    def _run(self, items: list[tuple[Hashable, list[int]]], *, all_logits: bool = False) -> torch.Tensor:
        reserved: list[Hashable] = []
        new = [sid for sid, _ in items if sid not in self.kv.seqs]
        try:
            for sid, toks in items:
                if not toks:
                    raise ValueError(f"sequence {sid!r}: no tokens to run")
                self.kv.reserve(sid, len(toks))
                reserved.append(sid)
            batch = self.kv.plan([(sid, len(toks)) for sid, toks in items])
            ids = torch.tensor([t for _, toks in items for t in toks], dtype=torch.long, device=self.device)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
                raise ValueError(f"token id outside [0, {self.cfg.vocab_size})")
            logits = self.model.forward(ids, self.kv, batch, all_logits=all_logits)
        except BaseException:
            # A failed prefill leaves no sequence behind; a failed decode keeps the sequences (their KV
            # up to the old length is intact) so the caller can retry or free them.
            for sid in new:
                self.kv.free(sid)
            raise
        for sid, toks in items:
            self.kv.commit(sid, len(toks))
        return logits

    def prefill(self, seq_id: Hashable, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Run a new sequence's prompt; returns the last position's logits [vocab] (fp32)."""
        return self.prefill_batch([(seq_id, prompt_ids)])[0]

    def prefill_batch(self, prompts: Sequence[tuple[Hashable, Sequence[int]]]) -> torch.Tensor:
        """Run several new prompts as one ragged batch; logits [B, vocab] in input order."""
        for sid, _ in prompts:
            if sid in self.kv.seqs:
                raise ValueError(f"sequence {sid!r} already exists; free it before prefilling again")
        return self._run([(sid, [int(t) for t in ids]) for sid, ids in prompts])

    def extend(self, seq_id: Hashable, token_ids: Sequence[int]) -> torch.Tensor:
        """Append several tokens to an existing sequence (chunked prefill, re-prefill after a failover)."""
        return self._run([(seq_id, [int(t) for t in token_ids])])[0]

    def decode(self, seq_ids: Sequence[Hashable], last_tokens: Sequence[int]) -> torch.Tensor:
        """One step for each sequence: append its last sampled token; logits [B, vocab]."""
        if len(seq_ids) != len(last_tokens):
            raise ValueError("decode: one last token per sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("decode: a sequence appears twice in one step")
        for sid in seq_ids:
            if sid not in self.kv.seqs:
                raise KeyError(f"decode: unknown sequence {sid!r}")
        return self._run([(sid, [int(t)]) for sid, t in zip(seq_ids, last_tokens)])

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, vocab] for every position of a throwaway sequence (tests, evaluation)."""
        sid = object()
        try:
            return self._run([(sid, [int(t) for t in token_ids])], all_logits=True)
        finally:
            self.kv.free(sid)

    def free(self, seq_id: Hashable) -> None:
        self.kv.free(seq_id)

    # ---- KV transfer ---------------------------------------------------------------------------
    def export_sequence(self, seq_id: Hashable) -> SequenceKV:
        """Length and page ids per group ("full", "sliding"); the bytes are in `kv.pools[group]`
        [layers_in_group, num_pages, 2, page_size, kv_heads, head_dim]."""
        return self.kv.export_sequence(seq_id)

    def import_sequence(self, seq_id: Hashable, length: int) -> SequenceKV:
        """Admit a sequence whose first `length` positions were computed elsewhere: allocates the pages
        (OutOfPages if they do not fit), which the caller fills before the first `decode`."""
        return self.kv.import_sequence(seq_id, length)

    @property
    def kv_pools(self) -> dict[str, torch.Tensor]:
        return {g: self.kv.pools[g] for g in GROUPS}

    # ---- sampling ------------------------------------------------------------------------------
    @staticmethod
    def sample(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]):
        """(token, logprob) per row; `steps[b]` = tokens request b generated before this one."""
        if logits.dim() == 1:
            logits = logits[None]
        return sample(logits, list(params), list(steps))
