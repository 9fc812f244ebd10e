"""Runner: the model, its paged KV cache and sampling on one device; the API both workers call.

A sequence is identified by any hashable id. Its life: `prefill` (or `import_sequence` + filling the
pages) -> `decode` steps -> `free`. `prefill`/`decode` return fp32 logits of each sequence's last
position; `sample` turns them into tokens. The Runner never decides *when* to stop: that is the
caller's (LLM, workers), which keeps one Runner usable for both disaggregated roles.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Hashable, Sequence

import torch

from kvrelay.engine.config import DEFAULT_GRAPH_BATCH_SIZES, ModelConfig, load_model_config
from kvrelay.engine.kv_cache import BatchLayout, KVCache, OutOfPages, SequenceKV
from kvrelay.engine.kv_geometry import GROUPS
from kvrelay.engine.layers.attention import AttentionFn
from kvrelay.engine.layers.linear import Shard, WeightGetter
from kvrelay.engine.model import GptOss
from kvrelay.engine.sampling import SamplingParams, sample
from kvrelay.engine.staging import StagingRing, pack
from kvrelay.kernels.reference import PagedKV

__all__ = ["Runner", "OutOfPages", "PendingStep", "open_model_weights"]

_WORKSPACE_BYTES = 128 << 20


def graph_head_logits() -> bool:
    """Decode graphs return the logits in the head's dtype (bf16 for a bf16 model) instead of widened to fp32 in
    the graph (one launch fewer a step on the pipelined greedy path, whose argmax picks the same token from
    either): KVRELAY_GRAPH_HEAD_LOGITS, a decode fusion of kernels.select.DECODE_FUSIONS."""
    from kvrelay.kernels.select import fusion_on

    return fusion_on("KVRELAY_GRAPH_HEAD_LOGITS")


def open_model_weights(model: str | Path, cfg: ModelConfig, *, dummy: bool, seed: int) -> WeightGetter:
    """The checkpoint behind a model name/path (or seeded dummy weights of its shape)."""
    from kvrelay.engine.weights import open_weights  # heavy (safetensors, MXFP4): only when loading

    return open_weights(model, cfg, dummy=dummy, seed=seed)


@dataclass
class PendingStep:
    """A greedy decode step launched but not yet read back (`Runner.decode_launch`): the sampled tokens
    stay on the device (the next step can take them from there) while a copy to pinned host memory is
    under way."""

    seq_ids: list
    tokens: torch.Tensor | None  # [n] int64 on the device (None until `Runner.decode_select`)
    host: torch.Tensor | None  # [n] int64, pinned on CUDA; valid once `event` has completed
    event: object | None  # torch.cuda.Event, None on CPU (already complete)
    logits: torch.Tensor | None = None  # a step launched with select_later: its logits, until selected


class Runner:
    """`attention_fn` None (default) picks the device's kernels (kernels.select: the torch reference on
    CPU; FlashInfer/Triton on CUDA); an explicit function is run per layer with the reference's
    signature. On CUDA, decode steps of up to max(cuda_graph_batch_sizes) sequences replay CUDA graphs
    captured at those padded batch sizes (cuda_graphs=False or an empty tuple: always eager)."""

    overlap_capable = True  # decode_launch / decode_collect (a TP group's runner is not)

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
        attention_fn: AttentionFn | None = None,
        cuda_graphs: bool = True,
        cuda_graph_batch_sizes: Sequence[int] = DEFAULT_GRAPH_BATCH_SIZES,
        piecewise_token_sizes: Sequence[int] | None = None,
    ):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = GptOss(cfg, weights, device=self.device, dtype=dtype, quant=quant, shard=shard,
                            attention_fn=attention_fn)
        if num_pages is None:
            num_pages = -(-kv_tokens // page_size)
        self._page_size, self._shard = page_size, shard
        cuda = self.device.type == "cuda"
        self._workspaces = None
        if cuda and self.model.attention_backend == "flashinfer":
            # One float workspace per page group, shared by that group's wrappers (prefill, eager decode,
            # every graph size): their runs never overlap (one stream, layer after layer).
            self._workspaces = {g: torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
                                for g in GROUPS}
        kw = {"workspaces": self._workspaces} if self._workspaces else {}
        self.attn = self.model.make_attention(page_size, **kw)
        sizes = tuple(sorted({int(b) for b in cuda_graph_batch_sizes})) if cuda_graphs else ()
        # Graphs need the device kernels (no host syncs) and one process: collectives stay eager.
        self.cuda_graph_batch_sizes = sizes if (cuda and self.model.attention_fn is None
                                                and shard.world_size == 1) else ()
        # Graph replay (True) or the same padded step run eagerly (False; tests compare the two).
        self.graph_replay = True
        self._graphs = None
        self._gbuf = None  # the decode graphs' fixed buffers (engine/cuda_graph.DecodeGraphBuffers)
        # Ragged forwards (prompt chunks + decode rows) of up to max(piecewise_token_sizes) tokens replay
        # piecewise graphs (engine/cuda_graph.PiecewiseGraphs) wherever decode graphs are used.
        from kvrelay.engine.cuda_graph import DEFAULT_TOKEN_BUCKETS

        pw = DEFAULT_TOKEN_BUCKETS if piecewise_token_sizes is None else tuple(piecewise_token_sizes)
        self.piecewise_token_sizes = tuple(sorted({int(t) for t in pw})) if self.cuda_graph_batch_sizes else ()
        self._pieces = None
        # The host side of each forward's index arrays (token ids, layout, logit rows): reused pinned
        # buffers, one per forward in turn (engine/staging.py). None on the CPU (tensors made as they are).
        self._staging = StagingRing(self.device) if cuda else None
        self._new_pool(num_pages)

    def _new_pool(self, num_pages: int | dict[str, int]) -> None:
        self.kv = KVCache(self.cfg, num_pages=num_pages, page_size=self._page_size, device=self.device,
                          dtype=self.dtype, shard=self._shard)
        # Padding rows of a graph batch write to and attend over one scratch page per group.
        self._scratch = ({g: self.kv.allocators[g].allocate(1)[0] for g in GROUPS}
                         if self.cuda_graph_batch_sizes else {})

    # ---- sizing the pool after the weights (engine/memory.py) ------------------------------------
    def profile_forward(self, num_tokens: int) -> None:
        """One throwaway prefill of `num_tokens` tokens: its peak memory is what the KV pool must leave
        free for every later forward. The pool must hold that many positions in both groups."""
        n = max(1, min(num_tokens, self.max_context - 1))
        sid = object()
        try:
            self._run([(sid, [(i * 7919 + 11) % self.cfg.vocab_size for i in range(n)])])
        finally:
            self.kv.free(sid)

    def drop_kv(self) -> None:
        """Free the pool's device memory (before `resize_kv`); no sequence may be alive."""
        if self.kv.seqs or self._graphs is not None or self._pieces is not None:
            raise RuntimeError("drop_kv: sequences are alive or graphs were captured over this pool")
        # New empty tensors, not views: a view would keep the old storage alive.
        self.kv.pools = {g: self.kv.pools[g].new_empty((self.kv.pools[g].shape[0], 0, *self.kv.pools[g].shape[2:]))
                         for g in GROUPS}
        self._scratch = {}

    def resize_kv(self, num_pages: int | dict[str, int]) -> None:
        """A fresh pool of `num_pages` (per group); before any sequence and any graph capture."""
        if self.kv.seqs or self._graphs is not None or self._pieces is not None:
            raise RuntimeError("resize_kv: sequences are alive or graphs were captured over this pool")
        self.kv = None  # the old pool is freed before the new one is allocated
        self._new_pool(num_pages)

    def warmup(self) -> None:
        """Capture the decode graphs and the piecewise graphs now, so the first request does not pay."""
        if self.cuda_graph_batch_sizes and self._graphs is None:
            self._graph_setup()
        self._capture_pieces()

    def _capture_pieces(self) -> None:
        if self.piecewise_token_sizes and self._pieces is None:
            from kvrelay.engine.cuda_graph import PiecewiseGraphs

            pieces = PiecewiseGraphs(self.model, self.kv, self._scratch, self.piecewise_token_sizes,
                                     pool=self._graphs.pool if self._graphs is not None else None)
            with torch.inference_mode():
                pieces.capture()
            self._pieces = pieces

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
    def internal_pages(self) -> dict[str, int]:
        """Pages the Runner keeps for itself (the CUDA graphs' scratch page per group)."""
        return {g: int(g in self._scratch) for g in GROUPS}

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
    def _check_ids(self, flat: list[int]) -> None:
        # Range check on the host: no device round trip per step.
        if flat and (min(flat) < 0 or max(flat) >= self.cfg.vocab_size):
            raise self._id_error()

    def _id_error(self) -> ValueError:
        return ValueError(f"token id outside [0, {self.cfg.vocab_size})")

    def _ids(self, flat: list[int]) -> torch.Tensor:
        if self._staging is None:
            self._check_ids(flat)
            return self._index(flat)
        # Staged first, then range-checked on the staged int64 copy: numpy's min/max instead of two Python
        # passes over the list (~0.3 ms at 8192 tokens). A bad id leaves only a harmless copy queued.
        try:
            dev, host = pack([(0, flat, torch.long)], self.device, self._staging)
        except OverflowError:  # past int64: outside the vocabulary too
            raise self._id_error() from None
        h = host[0].numpy()
        if h.size and (int(h.min()) < 0 or int(h.max()) >= self.cfg.vocab_size):
            raise self._id_error()
        return dev[0]

    def _run(self, items: list[tuple[Hashable, list[int]]], *, all_logits: bool = False,
             fill=None, all_positions: Collection[int] = (), new_forward: bool = True) -> torch.Tensor:
        """One forward of `items`. new_forward=False: the caller already started this forward's staging
        slot (decode_launch staged its fill rows there)."""
        reserved: list[Hashable] = []
        new = [sid for sid, _ in items if sid not in self.kv.seqs]
        if self._staging is not None and new_forward:
            self._staging.next()
        try:
            for sid, toks in items:
                if not toks:
                    raise ValueError(f"sequence {sid!r}: no tokens to run")
            flat = items[0][1] if len(items) == 1 else list(itertools.chain.from_iterable(t for _, t in items))
            if self._graphs is not None and not all_logits:
                self._capture_pieces()  # after the decode graphs: the pool is sized by then
            # The pieces compute one logit row per sequence: all-position rows (prompt logprobs) run eagerly.
            pieces = (self._pieces if self._pieces is not None and not all_logits and not all_positions
                      and len(flat) <= self._pieces.max_tokens else None)
            if pieces is not None:
                self._check_ids(flat)  # the ids travel with the pieces' own metadata copy
            else:
                ids = self._ids(flat)
                if fill is not None:
                    _fill_ids(ids, fill)
            for sid, toks in items:
                self.kv.reserve(sid, len(toks))
                reserved.append(sid)
            batch = self.kv.plan([(sid, len(toks)) for sid, toks in items], self._staging)
            if pieces is not None:
                self.attn.plan(batch)
                with torch.inference_mode():
                    logits = pieces.forward(flat, batch, self.attn, fill, replay=self.graph_replay)
            else:
                if all_positions and not all_logits:
                    batch = dataclasses.replace(batch, logit_rows=self._index(_logit_rows(items, all_positions)))
                logits = self.model.forward(ids, self.kv, batch, all_logits=all_logits, attn=self.attn)
        except BaseException:
            # A failed prefill leaves no sequence behind; a failed decode keeps the sequences (their KV
            # up to the old length is intact) so the caller can retry or free them.
            for sid in new:
                self.kv.free(sid)
            raise
        for sid, toks in items:
            self.kv.commit(sid, len(toks))
        return logits

    # ---- CUDA-graph decode -----------------------------------------------------------------------
    def _graph_setup(self) -> None:
        """The decode graphs' fixed buffers (engine/cuda_graph.DecodeGraphBuffers), one attention per graph
        size, then capture (largest first, one shared memory pool)."""
        from kvrelay.engine.cuda_graph import DecodeGraphBuffers, DecodeGraphs

        kw = {"workspaces": self._workspaces} if self._workspaces else {}
        # Sequences of one batch use distinct pages, padding rows all use the scratch page.
        mx = max(self.cuda_graph_batch_sizes)
        cap = {g: self.kv.allocators[g].num_pages + mx for g in GROUPS}
        self._gbuf = DecodeGraphBuffers.allocate(
            self.cuda_graph_batch_sizes, cap, self.device,
            lambda bs: self.model.make_attention(self.kv.page_size, graph_batch=bs, graph_max_pages=cap, **kw))
        self._graphs = DecodeGraphs(self._graph_step, self._graph_prepare, self.cuda_graph_batch_sizes)
        self._graphs.capture()

    def _graph_prepare(self, bs: int, n: int) -> None:
        """Host side of a graph step, outside the graph (DecodeGraphBuffers.prepare)."""
        self._gbuf.prepare(bs, self._scratch)

    def _graph_step(self, bs: int) -> torch.Tensor:
        b = self._gbuf
        return self.model.forward(b.i64[:bs], self.kv, b.batches[bs], attn=b.attention[bs], plan=False,
                                  float_logits=not graph_head_logits())

    def _decode_graph(self, items: list[tuple[Hashable, int]], fill=None, clone: bool = True) -> torch.Tensor:
        if self._graphs is None:
            self._graph_setup()
        n = len(items)
        bs = self._graphs.padded_size(n)
        toks = [t for _, t in items]
        self._check_ids(toks)
        for sid, _ in items:
            self.kv.reserve(sid, 1)
        lists = self.kv.plan_decode([sid for sid, _ in items])
        lists["ids"] = toks
        lists["fill"] = fill
        self._gbuf.items = lists
        try:
            if self.graph_replay:
                out, bs = self._graphs.run(n)
            else:
                self._graph_prepare(bs, n)
                out = self._graph_step(bs)
            # The graph's output buffer is overwritten by the next replay; a caller that reduces it on the
            # stream right away (decode_launch: the argmax picks the same token from the head's bf16 values as
            # from their exact fp32 widening) needs no copy. `decode` returns fp32 either way.
            if clone:
                logits = out[:n].clone() if out.dtype == torch.float32 else out[:n].float()
            else:
                logits = out[:n]
        finally:
            self._gbuf.items = None
        for sid, _ in items:
            self.kv.commit(sid, 1)
        return logits

    def prefill(self, seq_id: Hashable, prompt_ids: Sequence[int], *, all_logits: bool = False) -> torch.Tensor:
        """Run a new sequence's prompt; returns the last position's logits [vocab] (fp32), or every
        position's [len, vocab] with all_logits (prompt logprobs)."""
        if all_logits:
            if seq_id in self.kv.seqs:
                raise ValueError(f"sequence {seq_id!r} already exists; free it before prefilling again")
            return self._run([(seq_id, list(map(int, prompt_ids)))], all_logits=True)
        return self.prefill_batch([(seq_id, prompt_ids)])[0]

    def prefill_batch(self, prompts: Sequence[tuple[Hashable, Sequence[int]]]) -> torch.Tensor:
        """Run several new prompts as one ragged batch; logits [B, vocab] in input order."""
        for sid, _ in prompts:
            if sid in self.kv.seqs:
                raise ValueError(f"sequence {sid!r} already exists; free it before prefilling again")
        return self._run([(sid, list(map(int, ids))) for sid, ids in prompts])

    def extend(self, seq_id: Hashable, token_ids: Sequence[int], *, all_logits: bool = False) -> torch.Tensor:
        """Append several tokens to an existing sequence (chunked prefill, re-prefill after a failover);
        the last position's logits, or every new position's with all_logits."""
        out = self._run([(seq_id, list(map(int, token_ids)))], all_logits=all_logits)
        return out if all_logits else out[0]

    def decode(self, seq_ids: Sequence[Hashable], last_tokens: Sequence[int]) -> torch.Tensor:
        """One step for each sequence: append its last sampled token; logits [B, vocab]."""
        self._check_step("decode", seq_ids, last_tokens)
        if self.cuda_graph_batch_sizes and 0 < len(seq_ids) <= self.cuda_graph_batch_sizes[-1]:
            return self._decode_graph([(sid, int(t)) for sid, t in zip(seq_ids, last_tokens)])
        return self._run([(sid, [int(t)]) for sid, t in zip(seq_ids, last_tokens)])

    def decode_launch(self, seq_ids: Sequence[Hashable], last_tokens: Sequence[int | None],
                      prev: PendingStep | None = None, *, select_later: bool = False) -> PendingStep:
        """A greedy decode step (`decode` + argmax) that returns without waiting for the device, so the
        caller can plan the next step while this one runs (vLLM's async scheduling, SGLang's overlap
        scheduler). A row whose last token is None takes it from `prev`, the step before, still on the
        device: the token that step sampled for the same sequence. `decode_collect` reads the tokens.
        `select_later`: only the forward is queued; the caller queues the argmax with `decode_select`
        (structured outputs: the mask is computed while this forward runs) before the next launch."""
        if not seq_ids:
            raise ValueError("decode_launch: at least one sequence")
        self._check_step("decode_launch", seq_ids, last_tokens)
        if self._staging is not None:
            self._staging.next()  # this step's slot: its fill rows, and an eager forward's arrays after them
        fill = None
        missing = [i for i, t in enumerate(last_tokens) if t is None]
        if missing:
            rows = {sid: j for j, sid in enumerate(prev.seq_ids)} if prev is not None else {}
            if any(seq_ids[i] not in rows for i in missing):
                raise ValueError("decode_launch: a row without a last token is not in the previous step")
            fill = (self._index(missing), self._index([rows[seq_ids[i]] for i in missing]), prev.tokens)
        toks = [0 if t is None else int(t) for t in last_tokens]  # 0: placeholder, overwritten by fill
        items = list(zip(seq_ids, toks))
        if self.cuda_graph_batch_sizes and len(items) <= self.cuda_graph_batch_sizes[-1]:
            logits = self._decode_graph(items, fill=fill, clone=False)
        else:
            # An eager step plans attention through the eager wrappers' host buffers: let the step before
            # finish first (no overlap past the largest graph size).
            if prev is not None and prev.event is not None:
                prev.event.synchronize()
            logits = self._run([(sid, [t]) for sid, t in items], fill=fill, new_forward=False)
        step = PendingStep(list(seq_ids), None, None, None, logits)
        return step if select_later else self.decode_select(step)

    def decode_select(self, step: PendingStep, transform: Callable | None = None) -> PendingStep:
        """Queue the argmax of a step launched with select_later, over `transform(logits)` (a mask) when
        given; its logits (a CUDA graph's output buffer, overwritten by the next replay) are dropped."""
        logits, step.logits = step.logits, None
        if logits is None:
            raise ValueError("decode_select: the step's tokens are already selected")
        if transform is not None:
            logits = transform(logits)
        tokens = torch.argmax(logits, dim=-1)  # ties go to the lowest id, as in `sample`
        cuda = self.device.type == "cuda"
        host = torch.empty(len(step.seq_ids), dtype=torch.long, pin_memory=cuda)
        host.copy_(tokens, non_blocking=cuda)
        if cuda:
            step.event = torch.cuda.Event()
            step.event.record()
        step.tokens, step.host = tokens, host
        return step

    def _check_step(self, name: str, seq_ids: Sequence[Hashable], last_tokens: Sequence) -> None:
        if len(seq_ids) != len(last_tokens):
            raise ValueError(f"{name}: one last token per sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"{name}: a sequence appears twice in one step")
        for sid in seq_ids:
            if sid not in self.kv.seqs:
                raise KeyError(f"{name}: unknown sequence {sid!r}")

    @staticmethod
    def decode_collect(step: PendingStep) -> list[int]:
        """The tokens of a launched step, in row order (waits for the device)."""
        if step.host is None:
            raise ValueError("decode_collect: a step launched with select_later was never selected")
        if step.event is not None:
            step.event.synchronize()
        return step.host.tolist()

    def _index(self, values: list[int]) -> torch.Tensor:
        """int64 `values` on the device; on CUDA through the current forward's staging slot."""
        if self._staging is None:
            return torch.tensor(values, dtype=torch.long, device=self.device)
        return pack([(0, values, torch.long)], self.device, self._staging)[0][0]

    def forward_mixed(self, items: Sequence[tuple[Hashable, Sequence[int]]], *,
                      all_positions: Collection[int] = ()) -> torch.Tensor:
        """One ragged forward over new sequences, prompt chunks of existing ones and decode tokens alike
        (a colocated worker's step: queued prompts ride along with the running batch); logits [rows, vocab]
        in input order: one row per item (its last position), or a row per token for the items whose
        index is in `all_positions` (prompt logprobs)."""
        if len({sid for sid, _ in items}) != len(items):
            raise ValueError("forward_mixed: a sequence appears twice in one forward")
        return self._run([(sid, list(map(int, toks))) for sid, toks in items], all_positions=all_positions)

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, vocab] for every position of a throwaway sequence (tests, evaluation)."""
        sid = object()
        try:
            return self._run([(sid, list(map(int, token_ids)))], all_logits=True)
        finally:
            self.kv.free(sid)

    def free(self, seq_id: Hashable) -> None:
        self.kv.free(seq_id)

    # ---- KV transfer ---------------------------------------------------------------------------
    def export_sequence(self, seq_id: Hashable) -> SequenceKV:
        """Length and page ids per group ("full", "sliding"); the bytes are in `kv.pools[group]`
        [layers_in_group, num_pages, 2, page_size, kv_heads, head_dim]."""
        return self.kv.export_sequence(seq_id)

    def fork_sequence(self, src_id: Hashable, dst_id: Hashable) -> SequenceKV:
        """A copy of sequence `src_id` as `dst_id`, sharing its whole pages (KVCache.fork): one choice
        more of the same prompt, without computing the prompt again."""
        return self.kv.fork(src_id, dst_id)

    def import_sequence(self, seq_id: Hashable, length: int) -> SequenceKV:
        """Admit a sequence whose first `length` positions were computed elsewhere: allocates the pages
        (OutOfPages if they do not fit), which the caller fills before the first `decode`."""
        return self.kv.import_sequence(seq_id, length)

    @property
    def kv_pools(self) -> dict[str, torch.Tensor]:
        return {g: self.kv.pools[g] for g in GROUPS}

    # ---- sampling ------------------------------------------------------------------------------
    @staticmethod
    def sample(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
               history: Sequence[Sequence[int]] | None = None, prompts: Sequence | None = None):
        """(token, logprob) per row; `steps[b]` = tokens request b generated before this one, `history[b]`
        those tokens (read only for penalized requests), `prompts[b]` its prompt's tokens (read only for
        repetition_penalty)."""
        if logits.dim() == 1:
            logits = logits[None]
        params, steps = list(params), list(steps)
        if all(p.greedy and not p.logprobs and not p.masks_stops(n) and not p.penalized
               for p, n in zip(params, steps)):
            # The whole batch in one device-to-host transfer (argmax ties go to the lowest id, as in
            # sampling.sample).
            return [(t, None) for t in torch.argmax(logits.float(), dim=-1).tolist()]
        return sample(logits, params, steps, history, prompts)


def _logit_rows(items: list[tuple[Hashable, list[int]]], all_positions: Collection[int]) -> list[int]:
    """Rows of a ragged forward whose logits to compute: each item's last token, or all its tokens."""
    rows, at = [], 0
    for i, (_, toks) in enumerate(items):
        rows += range(at, at + len(toks)) if i in all_positions else [at + len(toks) - 1]
        at += len(toks)
    return rows


def _fill_ids(ids: torch.Tensor, fill) -> None:
    """ids[dst] = tokens[src] on the device: token ids a previous step sampled and nobody read back."""
    dst, src, tokens = fill
    ids[dst] = tokens[src]
