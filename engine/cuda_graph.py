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
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Callable, Sequence

import torch

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


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
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
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
