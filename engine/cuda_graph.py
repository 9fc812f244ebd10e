"""CUDA-graph capture and replay of decode steps at padded batch sizes.

Why: a gpt-oss decode step is hundreds of small launches (per layer: norms, GEMMs, attention, routing,
expert GEMMs); at small batches launch gaps dominate. A graph replays the whole step with one launch.

Contract with the step function (the runner's decode forward):
- `step(bs)` reads ONLY fixed device buffers sized for `bs` (token ids, positions, KV metadata, sampling
  inputs) and returns fixed output tensors; it must not sync with the host, allocate differently from
  call to call, or branch on device values.
- Everything that needs the host (FlashInfer `plan`, page-table building) happens in `prepare(bs, n)`
  *outside* the graph, writing into those buffers; padding rows (n..bs-1) must describe harmless work
  (e.g. a 1-token sequence on a scratch page) and their outputs are ignored.
Graphs of all sizes share one memory pool (captured largest first, so smaller ones fit inside it).

Here: `DecodeGraphs` (capture and replay per padded batch size), `DecodeGraphBuffers` (the fixed buffers a
decode step reads, their host-side refill, and the attention backend's replay hook), `PiecewiseGraphs`
(ragged forwards as graphs of everything between the attention kernels).
"""

from __future__ import annotations

import contextlib
import gc
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvrelay.engine.kv_geometry import GROUPS

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@contextlib.contextmanager
def _capturing():
    """Around a capture: no garbage collection. A collected CUDA object of an earlier Runner (a graph,
    an event, a pinned buffer) calls the CUDA runtime from its destructor, which invalidates a capture in
    progress (seen on the H200: "operation failed due to a previous error during capture", once in a
    test session that had built several Runners)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# Other threads of the process (Ray's, NIXL's progress thread, the grammar thread) never touch our
# stream; "thread_local" keeps a CUDA call of theirs from invalidating a capture of ours.
_MODE = "thread_local"


class DecodeGraphs:
    def __init__(self, step: Callable[[int], Any], prepare: Callable[[int, int], None],
                 batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, warmup: int = 2):
        self.step = step
        self.prepare = prepare
        self.batch_sizes = sorted(set(int(b) for b in batch_sizes))
        self.warmup = warmup
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Any] = {}
        self.pool = None

    def padded_size(self, n: int) -> int | None:
        """Smallest captured size >= n, or None when n is larger than every size (run eagerly)."""
        i = bisect_left(self.batch_sizes, n)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def capture(self, sizes: Sequence[int] | None = None) -> None:
        sizes = sorted(sizes or self.batch_sizes, reverse=True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in sizes:
                # Warm-up outside the graph compiles Triton kernels and lets libraries create their
                # handles/workspaces, none of which may happen during capture.
                self.prepare(bs, bs)
                for _ in range(self.warmup):
                    self.step(bs)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with _capturing(), torch.cuda.graph(g, pool=self.pool, stream=stream, capture_error_mode=_MODE):
                    self.outputs[bs] = self.step(bs)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[bs] = g
        torch.cuda.current_stream().wait_stream(stream)

    def run(self, n: int) -> tuple[Any, int]:
        """Run one decode step for n real sequences: plan outside, replay inside. Returns (outputs of
        the padded size, padded size); callers take the first n rows. Falls back to eager when no
        graph of a large enough size exists."""
        bs = self.padded_size(n)
        if bs is None or bs not in self.graphs:
            bs = bs or n
            self.prepare(bs, n)
            return self.step(bs), bs
        self.prepare(bs, n)
        self.graphs[bs].replay()
        return self.outputs[bs], bs


@dataclass
class DecodeGraphBuffers:
    """The fixed device buffers every captured decode step reads, for up to `max_batch` rows: two flat
    tensors (int64: token ids, positions, logit rows, write pages/offsets per group; int32: qo_indptr,
    per group kv indptr and last page lengths, then each group's page indices) at the offsets of
    `graph_offsets`, one BatchLayout of views and one attention per graph size. `prepare` is the host
    side of a step, outside the graph: the real rows' plan (`items`, set by the caller; None while
    capturing) padded with scratch-page rows, one copy per buffer, then the attention backend's replay
    hook (`plan_replay`: FlashInfer's plan into its own fixed buffers)."""

    i64: torch.Tensor
    i32: torch.Tensor
    offsets64: dict
    offsets32: dict
    n32: int  # int32 entries before the page indices
    cap: dict[str, int]  # page indices per group
    max_batch: int
    batches: dict[int, Any] = field(default_factory=dict)  # graph size -> BatchLayout of views
    attention: dict[int, Any] = field(default_factory=dict)  # graph size -> its BatchAttention
    items: dict | None = None  # the decode plan (KVCache.plan_decode + ids, fill) of the step to prepare
    planned: Any = None  # event recorded after the last plan's copies were queued

    @classmethod
    def allocate(cls, sizes: Sequence[int], cap: dict[str, int], device, make_attention) -> "DecodeGraphBuffers":
        from kvrelay.engine.kv_cache import BatchLayout
        from kvrelay.kernels.reference import PagedKV

        mx = max(sizes)
        o, o32, n32 = graph_offsets(mx, cap)
        b = cls(torch.zeros(7 * mx, dtype=torch.long, device=device),
                torch.zeros(n32 + sum(cap.values()), dtype=torch.int32, device=device), o, o32, n32, dict(cap), mx)
        # Static parts: qo_indptr = 0..bs, logit rows = 0..bs-1.
        b.i32[: mx + 1].copy_(torch.arange(mx + 1, dtype=torch.int32))
        b.i64[o["rows"]: o["rows"] + mx].copy_(torch.arange(mx))
        for bs in sizes:
            kv = {g: PagedKV(b.i32[o32[("ip", g)]: o32[("ip", g)] + bs + 1],
                             b.i32[o32[("ix", g)]: o32[("ix", g)] + cap[g]],
                             b.i32[o32[("ll", g)]: o32[("ll", g)] + bs]) for g in GROUPS}
            b.batches[bs] = BatchLayout(
                qo_indptr=b.i32[: bs + 1], positions=b.i64[o["pos"]: o["pos"] + bs],
                logit_rows=b.i64[o["rows"]: o["rows"] + bs], kv=kv,
                write_pages={g: b.i64[o[("wp", g)]: o[("wp", g)] + bs] for g in GROUPS},
                write_offsets={g: b.i64[o[("wo", g)]: o[("wo", g)] + bs] for g in GROUPS},
                num_tokens=bs, num_seqs=bs, host={"kv_indptr": {}, "kv_last_page_len": {}})
            b.attention[bs] = make_attention(bs)
        return b

    def prepare(self, bs: int, scratch: dict[str, int]) -> None:
        # FlashInfer's plan writes its schedule into one page-locked host buffer per wrapper and queues a
        # copy from it (no sync). With overlapped steps the previous plan's copy may still be queued behind
        # the running step: wait for that copy (not for the step) before writing the buffer again.
        while self.planned is not None and not self.planned.query():  # polled: releases the GIL, no sync
            time.sleep(20e-6)
        lists, o32, n32 = self.items, self.offsets32, self.n32
        a64, a32, idx_len = graph_host_arrays(lists, bs, self.max_batch, self.offsets64, o32, n32, scratch)
        cuda = self.i64.is_cuda  # the CPU runs the same steps uncaptured (tests)
        host64, host32 = torch.from_numpy(a64), torch.from_numpy(a32)
        if cuda:
            host64, host32 = host64.pin_memory(), host32.pin_memory()
        self.i64.copy_(host64, non_blocking=True)
        if lists is not None and lists.get("fill") is not None:
            dst, src, tokens = lists["fill"]
            self.i64[dst] = tokens[src]  # rows whose token is still on the device (the step before's)
        self.i32[:n32].copy_(host32[:n32], non_blocking=True)
        at = n32
        for g in GROUPS:
            k = idx_len[g]
            self.i32[o32[("ix", g)]: o32[("ix", g)] + k].copy_(host32[at: at + k], non_blocking=True)
            at += k
        batch = self.batches[bs]
        for g in GROUPS:
            batch.host["kv_indptr"][g] = host32[o32[("ip", g)]: o32[("ip", g)] + bs + 1]
            batch.host["kv_last_page_len"][g] = host32[o32[("ll", g)]: o32[("ll", g)] + bs]
        self.attention[bs].plan_replay(batch, idx_len)
        if cuda and not torch.cuda.is_current_stream_capturing():
            self.planned = torch.cuda.Event()
            self.planned.record()


# Token counts a mixed (prompt chunks + decode rows) forward is padded to; beyond the largest it runs
# eagerly. Measured on the H200 (bench.mixed, 20b, 64 decode rows + one chunk, 40b34af): 320 tokens
# 24 ms piecewise vs 39 ms eager (host-bound), 576: 31 vs 40, 1088: 39 vs 40, 2112 (padded to 2560):
# 65 vs 61, 4160: equal. From ~1k tokens the GPU time hides the host's, and padding only adds work.
DEFAULT_TOKEN_BUCKETS = (128, 256, 384, 512, 640, 768, 896, 1024, 1280)


class PiecewiseGraphs:
    """Ragged forwards (a colocated worker's prompt chunks riding with the decode batch, decode steps
    past the largest decode graph) as CUDA graphs of everything *between* the attention kernels,
    captured per padded token count; attention runs eagerly in between (vLLM's piecewise graphs).

    Why: measured on the H200 (2026-12-01), an eager 20b forward of a few hundred to a few thousand
    tokens spends ~44 ms launching ~1,300 kernels for ~16 ms of GPU work, so under load the prompt-
    carrying steps were host-bound and prefill ran at a third of its speed. Attention cannot sit inside
    these graphs: its plan (FlashInfer's schedule, Triton's tiles) depends on how the tokens split into
    sequences, which changes every step. Everything else depends only on the token count.

    Per bucket of `bs` tokens, layer after layer: piece 0 = embedding + layer 0's norm/QKV/rotary/KV
    write; piece i = layer i-1's output projection, residual and MoE + layer i's attention input;
    the last piece = the last layer's second half. Pieces pass activations through fixed buffers
    (x: the residual stream, q: the attention input, o: its output), so no pool-allocated tensor
    outlives a capture and the pool can be shared with the decode graphs. Padding rows (n..bs-1) are
    token 0 at position 0 writing to the scratch page; attention never reads them and their rows of
    every output are ignored. The final norm + unembedding of the logit rows runs eagerly (its row
    count varies)."""

    def __init__(self, model, cache, scratch: dict[str, int], buckets=DEFAULT_TOKEN_BUCKETS, *,
                 pool=None, warmup: int = 2):
        from kvrelay.engine.kv_cache import GROUPS

        self.model, self.cache, self.scratch = model, cache, scratch
        self.groups = GROUPS
        self.buckets = sorted(set(int(b) for b in buckets))
        self.warmup = warmup
        self.pool = pool
        mx, dev = self.buckets[-1], cache.device
        heads = model.blocks[0].attn.heads
        d = model.cfg.head_dim
        self.x = torch.zeros(mx, model.cfg.hidden_size, dtype=model.dtype, device=dev)
        self.q = torch.zeros(mx, heads.num_q, d, dtype=model.dtype, device=dev)
        self.o = torch.zeros(mx, heads.num_q, d, dtype=model.dtype, device=dev)
        # Per bucket: rows ids, positions, then write pages and offsets per group ([2 + 2 * groups, bs]).
        self.meta = {bs: torch.zeros(2 + 2 * len(GROUPS), bs, dtype=torch.long, device=dev)
                     for bs in self.buckets}
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def padded_size(self, n: int) -> int | None:
        i = bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    # ---- the pieces (read and write only the fixed buffers) --------------------------------------
    def _piece(self, bs: int, i: int) -> None:
        m, meta = self.model, self.meta[bs]
        ng = len(self.groups)
        lay = _Writes({g: meta[2 + j] for j, g in enumerate(self.groups)},
                      {g: meta[2 + ng + j] for j, g in enumerate(self.groups)})
        if i == 0:
            x, cos, sin = m.embed(meta[0], meta[1])
        else:
            cos, sin = m.rotary(meta[1])
            x = m.blocks[i - 1].attention_out(self.x[:bs], self.o[:bs])
        if i < len(m.blocks):
            self.q[:bs].copy_(m.blocks[i].attention_in(x, cos, sin, self.cache, lay))
        self.x[:bs].copy_(x)

    def _pieces(self, bs: int) -> int:
        return len(self.model.blocks) + 1

    def _fill_meta(self, bs: int, n: int, ids, host: dict | None) -> None:
        """Rows 0..n-1 from the batch's pinned host arrays, padding rows after them; one copy."""
        import numpy as np

        h = np.zeros((2 + 2 * len(self.groups), bs), dtype=np.int64)
        if n:
            h[0, :n] = ids
            h[1, :n] = host["positions"].numpy()
        for j, g in enumerate(self.groups):
            if n:
                h[2 + j, :n] = host["write_pages"][g].numpy()
                h[2 + len(self.groups) + j, :n] = host["write_offsets"][g].numpy()
            h[2 + j, n:] = self.scratch[g]
        src = torch.from_numpy(h)
        if self.meta[bs].is_cuda:
            src = src.pin_memory()
        self.meta[bs].copy_(src, non_blocking=True)

    # ---- capture and run ---------------------------------------------------------------------
    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in sorted(self.buckets, reverse=True):
                self._fill_meta(bs, 0, None, None)  # all padding: harmless work on the scratch page
                for _ in range(self.warmup):  # compiles the Triton kernels of this size, outside capture
                    for i in range(self._pieces(bs)):
                        self._piece(bs, i)
                torch.cuda.synchronize()
                graphs = []
                for i in range(self._pieces(bs)):
                    g = torch.cuda.CUDAGraph()
                    with _capturing(), torch.cuda.graph(g, pool=self.pool, stream=stream,
                                                        capture_error_mode=_MODE):
                        self._piece(bs, i)
                    if self.pool is None:
                        self.pool = g.pool()
                    graphs.append(g)
                self.graphs[bs] = graphs
        torch.cuda.current_stream().wait_stream(stream)

    def forward(self, ids: list[int], batch, attn, fill=None, *, replay: bool = True) -> torch.Tensor:
        """The forward of `batch` (a planned BatchLayout of len(ids) tokens; `attn` planned for it):
        logits [num_seqs, vocab] fp32 of its logit rows. replay=False runs the same pieces eagerly
        (tests compare the two)."""
        n = len(ids)
        bs = self.padded_size(n)
        if bs is None:
            raise ValueError(f"{n} tokens: more than the largest piecewise graph ({self.max_tokens})")
        self._fill_meta(bs, n, ids, batch.host)
        if fill is not None:
            dst, src, tokens = fill
            self.meta[bs][0][dst] = tokens[src]
        graphs = self.graphs.get(bs) if replay else None
        m = self.model
        for i in range(self._pieces(bs)):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._piece(bs, i)
            if i < len(m.blocks):
                blk = m.blocks[i]
                group = self.cache.layer_group(i)
                self.o[:n].copy_(attn.run(self.q[:n], self.cache.layer_pool(i), group, blk.attn.sinks,
                                          blk.attn.sm_scale, blk.attn.window).view(n, *self.o.shape[1:]))
        return m.head(self.x[:n], batch.logit_rows)


class _Writes:
    """The slice of a BatchLayout that a layer's attention input reads: where the new K/V rows go."""

    def __init__(self, write_pages: dict, write_offsets: dict):
        self.write_pages, self.write_offsets = write_pages, write_offsets


def graph_offsets(mx: int, cap: dict[str, int]) -> tuple[dict, dict, int]:
    """Where each array lives in the graph step's two fixed buffers (int64, int32) for up to mx rows and
    `cap[g]` page indices per group: (int64 offsets, int32 offsets, int32 size before the indices)."""
    o = {"ids": 0, "pos": mx, "rows": 2 * mx}
    for i, g in enumerate(GROUPS):
        o[("wp", g)], o[("wo", g)] = (3 + 2 * i) * mx, (4 + 2 * i) * mx
    n32 = (mx + 1) + 2 * (2 * mx + 1)
    o32, at = {"qo": 0}, mx + 1
    for g in GROUPS:
        o32[("ip", g)], o32[("ll", g)] = at, at + mx + 1
        at += 2 * mx + 1
    for g in GROUPS:
        o32[("ix", g)] = at
        at += cap[g]
    return o, o32, n32


def graph_host_arrays(lists: dict | None, bs: int, mx: int, o: dict, o32: dict, n32: int,
                      scratch: dict[str, int]) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """A graph step's host buffers: int64 [7 * mx] (ids, positions, logit rows, write pages/offsets per
    group at the offsets `o`) and int32 [n32 + indices] (qo_indptr, per group kv indptr and last page
    lengths at `o32`, then each group's page indices), the real rows of `lists` (a decode plan, None
    while capturing) padded to bs rows that each hold one scratch page. numpy throughout: no Python loop
    over rows or pages (a 256-row step's host time is what the GPU waits for between graphs)."""
    n = 0 if lists is None else len(lists["positions"])
    pad = bs - n
    h64 = np.zeros(7 * mx, dtype=np.int64)
    if n:
        h64[:n] = lists["ids"]
        h64[o["pos"]: o["pos"] + n] = lists["positions"]
    for g in GROUPS:
        at = o[("wp", g)]
        if n:
            h64[at: at + n] = lists["w_pages"][g]
            h64[o[("wo", g)]: o[("wo", g)] + n] = lists["w_offsets"][g]
        h64[at + n: at + bs] = scratch[g]  # padding rows write to the scratch page, offset 0
    h64[o["rows"]: o["rows"] + mx] = np.arange(mx)
    small = np.zeros(n32, dtype=np.int32)
    small[: mx + 1] = np.arange(mx + 1)
    idx = {}
    for g in GROUPS:
        ip = np.empty(bs + 1, dtype=np.int64)
        ip[: n + 1] = lists["indptr"][g] if n else 0
        ip[n + 1:] = ip[n] + np.arange(1, pad + 1)
        small[o32[("ip", g)]: o32[("ip", g)] + bs + 1] = ip
        if n:
            small[o32[("ll", g)]: o32[("ll", g)] + n] = lists["last_len"][g]
        small[o32[("ll", g)] + n: o32[("ll", g)] + bs] = 1
        idx[g] = np.concatenate([np.asarray(lists["indices"][g] if n else [], dtype=np.int32),
                                 np.full(pad, scratch[g], dtype=np.int32)])
    return h64, np.concatenate([small, idx[GROUPS[0]], idx[GROUPS[1]]]), {g: len(idx[g]) for g in GROUPS}
