"""Which rank holds which KV head, and who must copy what when prefill and decode are sharded differently.

A TPp prefill group leaves each sequence's K/V split by KV head over its p ranks (rank r holds the KV
heads its query heads read, see `partition.head_range`); a TPd decode group needs the same heads split
over d ranks. With p != d (either direction) a decode rank's heads live on one or several prefill ranks,
and a prefill rank's heads go to one or several decode ranks. This module answers that question once,
as pure data, so the transfer code (NIXL descriptors in transfer/nixl.py) and the in-process tests
use the same answer and each decode rank pulls exactly its own heads, never a whole peer's page.

When ranks outnumber KV heads a head is replicated on several ranks; every copy is identical (the same
projection of the same tokens), so a decode rank may read any of them. The plan spreads the readers of a
replicated head over its holders so no prefill rank serves every pull.

Everything here is pure (ints and tuples) except `assemble_kv`, which applies a plan to tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvrelay.engine.partition import head_range


@dataclass(frozen=True)
class HeadSlice:
    """Copy KV heads [kv0, kv1) (global ids) from prefill rank `src_rank`, where they are local slots
    [src0, src1), into local slots [dst0, dst1) of the decode rank the slice belongs to."""

    src_rank: int
    kv0: int
    kv1: int
    src0: int
    src1: int
    dst0: int
    dst1: int

    @property
    def num_heads(self) -> int:
        return self.kv1 - self.kv0


@dataclass(frozen=True)
class KVHandoffPlan:
    num_q_heads: int
    num_kv_heads: int
    prefill_tp: int
    decode_tp: int
    prefill_heads: tuple[tuple[int, int], ...]  # per prefill rank: its global KV heads [kv0, kv1)
    decode_heads: tuple[tuple[int, int], ...]  # per decode rank
    pulls: tuple[tuple[HeadSlice, ...], ...]  # per decode rank: what it copies, ordered by dst slot

    def for_decode_rank(self, rank: int) -> tuple[HeadSlice, ...]:
        return self.pulls[rank]

    def source_ranks(self, decode_rank: int) -> tuple[int, ...]:
        """Prefill ranks a decode rank must read from (the handles it needs), in ascending order."""
        return tuple(sorted({s.src_rank for s in self.pulls[decode_rank]}))

    def readers(self, prefill_rank: int) -> tuple[int, ...]:
        """Decode ranks that read from this prefill rank: it may free a sequence's pages only after all
        of them have released it."""
        return tuple(d for d in range(self.decode_tp) if prefill_rank in self.source_ranks(d))

    @property
    def identity(self) -> bool:
        """Every decode rank reads only its same-numbered prefill rank, whole pages: a plain copy."""
        return self.prefill_tp == self.decode_tp


def kv_heads_of_rank(num_q_heads: int, num_kv_heads: int, rank: int, tp: int) -> tuple[int, int]:
    """Global KV heads [kv0, kv1) held by `rank` of a TP group (same rule as the attention layer)."""
    h = head_range(num_q_heads, num_kv_heads, rank, tp)
    return h.kv0, h.kv1


def plan_kv_handoff(num_q_heads: int, num_kv_heads: int, prefill_tp: int, decode_tp: int) -> KVHandoffPlan:
    """The copy plan from a TP`prefill_tp` group to a TP`decode_tp` group. Raises
    partition.ParallelConfigError if either group cannot shard these heads."""
    pre = tuple(kv_heads_of_rank(num_q_heads, num_kv_heads, r, prefill_tp) for r in range(prefill_tp))
    dec = tuple(kv_heads_of_rank(num_q_heads, num_kv_heads, r, decode_tp) for r in range(decode_tp))
    holders = [[r for r, (a, b) in enumerate(pre) if a <= h < b] for h in range(num_kv_heads)]
    readers = [[r for r, (a, b) in enumerate(dec) if a <= h < b] for h in range(num_kv_heads)]
    pulls = []
    for d, (a, b) in enumerate(dec):
        slices: list[HeadSlice] = []
        for h in range(a, b):
            # The i-th reader of a head takes the (i mod n)-th copy: replicas share the load evenly.
            src = holders[h][readers[h].index(d) % len(holders[h])]
            src_slot, dst_slot = h - pre[src][0], h - a
            last = slices[-1] if slices else None
            if last and last.src_rank == src and last.src1 == src_slot and last.dst1 == dst_slot:
                slices[-1] = HeadSlice(src, last.kv0, h + 1, last.src0, src_slot + 1, last.dst0, dst_slot + 1)
            else:
                slices.append(HeadSlice(src, h, h + 1, src_slot, src_slot + 1, dst_slot, dst_slot + 1))
        pulls.append(tuple(slices))
    return KVHandoffPlan(num_q_heads, num_kv_heads, prefill_tp, decode_tp, pre, dec, tuple(pulls))


def page_copy_runs(s: HeadSlice, page_size: int, src_local_heads: int, dst_local_heads: int, head_dim: int,
                   itemsize: int) -> tuple[tuple[int, int, int], ...]:
    """Byte runs (src_offset, dst_offset, length) that copy slice `s` from one source page into one
    destination page, both laid out `[2, page_size, local_kv_heads, head_dim]` (NHD) but with each side's
    own head count. Whole pages on both sides are one run (the TPp == TPd case); a subset of heads is
    strided, one run per (K or V, token): 2 * page_size NIXL descriptors per page and layer."""
    if not (0 <= s.src0 < s.src1 <= src_local_heads and 0 <= s.dst0 < s.dst1 <= dst_local_heads):
        raise ValueError(f"slice {s} does not fit pages of {src_local_heads} -> {dst_local_heads} KV heads")
    head = head_dim * itemsize
    if s.num_heads == src_local_heads == dst_local_heads:
        return ((0, 0, 2 * page_size * src_local_heads * head),)
    src_row, dst_row = src_local_heads * head, dst_local_heads * head  # one token's K (or V), all heads
    return tuple((kv * page_size * src_row + t * src_row + s.src0 * head,
                  kv * page_size * dst_row + t * dst_row + s.dst0 * head, s.num_heads * head)
                 for kv in range(2) for t in range(page_size))


def assemble_kv(plan: KVHandoffPlan, decode_rank: int, sources: Mapping[int, torch.Tensor],
                head_axis: int = -2) -> torch.Tensor:
    """One decode rank's KV from the prefill ranks' tensors: `sources[p]` holds prefill rank p's local
    heads along `head_axis` (any leading shape: pages, K/V, tokens); the result holds the decode rank's
    heads in its local order. Only the source ranks in `plan.source_ranks(decode_rank)` are read."""
    slices = plan.for_decode_rank(decode_rank)
    missing = [s.src_rank for s in slices if s.src_rank not in sources]
    if missing:
        raise KeyError(f"decode rank {decode_rank} needs prefill ranks {sorted(set(missing))}")
    parts = [sources[s.src_rank].narrow(head_axis, s.src0, s.num_heads) for s in slices]
    return torch.cat(parts, dim=head_axis)
