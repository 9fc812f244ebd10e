"""Batch planning: from the page tables of the sequences in one forward to the index arrays the forward reads.

KVCache (engine/kv_cache.py) owns the pages and each sequence's page tables; the functions here only read
them (any object with `length`, `pages` and `first_page` per group, as kv_cache.SequencePages) and lay out
where each new token goes and what it attends to: `plan_lists` as Python lists, `plan_arrays` the same as
numpy arrays for long prompt chunks (no Python loop over tokens), `plan_decode` as numpy arrays for a
decode step (no Python loop over pages), and `layout` as the tensors of a `BatchLayout`, with
host copies for the planners that run on the CPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Hashable

import numpy as np
import torch

from kvrelay.engine.kv_geometry import GROUPS, pages_spanned
from kvrelay.engine.staging import StagingRing, pack
from kvrelay.kernels.reference import PagedKV


@dataclass(frozen=True)
class BatchLayout:
    """Everything one forward needs about where its tokens go and what they attend to.

    Tokens are laid out ragged, sequence after sequence (qo_indptr); `logit_rows` are the rows of each
    sequence's last new token. `host` holds CPU copies (pinned on a CUDA device) of the small index
    arrays that planners read on the host (FlashInfer's plan, Triton's tile plan): "qo_indptr" and per
    group "kv_indptr"/"kv_last_page_len", so planning never waits for the device. A layout made from a
    staging ring (a Runner's forward, engine/staging.py) has host copies in the ring's slot: read them
    while that forward is set up, not after the ring comes round to the slot again."""

    qo_indptr: torch.Tensor
    positions: torch.Tensor
    logit_rows: torch.Tensor
    kv: dict[str, PagedKV]
    write_pages: dict[str, torch.Tensor]
    write_offsets: dict[str, torch.Tensor]
    num_tokens: int = 0
    num_seqs: int = 0
    host: dict | None = None

    @property
    def is_decode(self) -> bool:
        """One new token per sequence (a decode step): the decode attention kernels apply."""
        return self.num_tokens == self.num_seqs


def plan_lists(batch: list[tuple[Hashable, object, int]], *, page_size: int, max_context: int) -> dict:
    """The layout of appending n_new tokens to each (seq_id, page tables, n_new) of `batch`, in order, as
    Python lists: qo, positions, rows, and per group indptr, indices, last_len, w_pages, w_offsets."""
    ps = page_size
    qo, positions, rows = [0], [], []
    indptr = {g: [0] for g in GROUPS}
    indices = {g: [] for g in GROUPS}
    last_len = {g: [] for g in GROUPS}
    w_pages = {g: [] for g in GROUPS}
    w_offsets = {g: [] for g in GROUPS}
    for seq_id, seq, n_new in batch:
        start, end = seq.length, seq.length + n_new
        if end > max_context:
            raise ValueError(f"sequence {seq_id!r} would reach {end} > max_context={max_context}")
        pos = list(range(start, end))
        positions += pos
        qo.append(qo[-1] + n_new)
        rows.append(qo[-1] - 1)
        for g in GROUPS:
            first, pages = seq.first_page[g], seq.pages[g]
            n_pages = pages_spanned(end, ps) - first
            if n_pages > len(pages):
                raise RuntimeError(f"sequence {seq_id!r} not reserved for {n_new} tokens")
            indices[g] += pages[:n_pages]
            indptr[g].append(len(indices[g]))
            last_len[g].append(end - (pages_spanned(end, ps) - 1) * ps)
            w_pages[g] += [pages[p // ps - first] for p in pos]
            w_offsets[g] += [p % ps for p in pos]

    return dict(qo=qo, positions=positions, rows=rows, indptr=indptr, indices=indices, last_len=last_len,
                w_pages=w_pages, w_offsets=w_offsets)


# KVCache.plan: batches of at least this many new tokens are planned with plan_arrays (numpy's per-call cost
# beats the lists' per-token cost from a few dozen tokens a sequence; decode steps stay on lists/plan_decode)
ARRAYS_MIN_TOKENS = 256


def plan_arrays(batch: list[tuple[Hashable, object, int]], *, page_size: int, max_context: int) -> dict:
    """`plan_lists` as numpy int64 arrays, with no Python loop over tokens (one over sequences): what a long
    prompt chunk is planned with. At 8192 tokens the per-token lists and their conversion to tensors were
    ~3 ms of host time before the first layer's first kernel (the GPU idles meanwhile); this is ~0.1 ms.
    Same values as plan_lists, element for element (tests/cpu/test_kv_cache.py)."""
    ps = page_size
    qo, positions = [0], []
    indptr = {g: [0] for g in GROUPS}
    indices = {g: [] for g in GROUPS}
    last_len = {g: [] for g in GROUPS}
    w_pages = {g: [] for g in GROUPS}
    w_offsets = {g: [] for g in GROUPS}
    for seq_id, seq, n_new in batch:
        start, end = seq.length, seq.length + n_new
        if end > max_context:
            raise ValueError(f"sequence {seq_id!r} would reach {end} > max_context={max_context}")
        pos = np.arange(start, end, dtype=np.int64)
        positions.append(pos)
        qo.append(qo[-1] + n_new)
        for g in GROUPS:
            first, pages = seq.first_page[g], seq.pages[g]
            n_pages = pages_spanned(end, ps) - first
            if n_pages > len(pages):
                raise RuntimeError(f"sequence {seq_id!r} not reserved for {n_new} tokens")
            table = np.array(pages, dtype=np.int64)
            indices[g].append(table[:n_pages])
            indptr[g].append(indptr[g][-1] + n_pages)
            last_len[g].append(end - (pages_spanned(end, ps) - 1) * ps)
            w_pages[g].append(table[pos // ps - first])  # plan_lists' pages[p // ps - first], element for element
            w_offsets[g].append(pos % ps)

    def cat(parts: list) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    qo_a = np.array(qo, dtype=np.int64)
    return dict(qo=qo_a, positions=cat(positions), rows=qo_a[1:] - 1,
                indptr={g: np.array(indptr[g], dtype=np.int64) for g in GROUPS},
                indices={g: cat(indices[g]) for g in GROUPS},
                last_len={g: np.array(last_len[g], dtype=np.int64) for g in GROUPS},
                w_pages={g: cat(w_pages[g]) for g in GROUPS}, w_offsets={g: cat(w_offsets[g]) for g in GROUPS})


def plan_decode(seqs: list, *, page_size: int, max_context: int) -> dict:
    """`plan_lists` for one new token per sequence (a decode step, already reserved), as numpy arrays
    built without a Python loop over pages: a 256-sequence step's host planning in a fraction of the
    time, which the CUDA-graph step needs (the GPU waits while the host plans)."""
    ps = page_size
    n = len(seqs)
    pos = np.fromiter((q.length for q in seqs), dtype=np.int64, count=n)
    if n and int(pos.max()) + 1 > max_context:
        raise ValueError(f"a sequence would reach {int(pos.max()) + 1} > max_context={max_context}")
    spanned = (pos + ps) // ps  # pages spanned by length pos + 1
    out = dict(qo=np.arange(n + 1), positions=pos, rows=np.arange(n), indptr={}, indices={}, last_len={},
               w_pages={}, w_offsets={})
    for g in GROUPS:
        tables = [q.pages[g] for q in seqs]
        first = np.fromiter((q.first_page[g] for q in seqs), dtype=np.int64, count=n)
        used = spanned - first
        held = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        if (used > held).any():
            raise RuntimeError("a sequence is not reserved for its decode token")
        if (used == held).all():
            flat = list(itertools.chain.from_iterable(tables))
            last = [t[-1] for t in tables]
        else:
            flat = list(itertools.chain.from_iterable(t[:u] for t, u in zip(tables, used.tolist())))
            last = [t[u - 1] for t, u in zip(tables, used.tolist())]
        out["indices"][g] = np.array(flat, dtype=np.int32)
        out["indptr"][g] = np.concatenate([[0], np.cumsum(used)])
        out["last_len"][g] = pos + 1 - (spanned - 1) * ps
        out["w_pages"][g] = np.array(last, dtype=np.int64)  # the new position is in the last page
        out["w_offsets"][g] = pos % ps
    return out


def layout(lists: dict, device: torch.device, staging: StagingRing | None = None) -> BatchLayout:
    """The BatchLayout on `device` of a `plan_lists` (or `plan_arrays`) result. `staging`: the ring whose
    current slot holds the host arrays (a Runner's, on CUDA); without one a CUDA layout takes fresh pinned
    memory and a CPU layout stays as it is, tensors made one by one."""
    qo, positions, rows = lists["qo"], lists["positions"], lists["rows"]
    indptr, indices, last_len = lists["indptr"], lists["indices"], lists["last_len"]
    w_pages, w_offsets = lists["w_pages"], lists["w_offsets"]
    n_tok, n_seq = len(positions), len(rows)
    host = {"qo_indptr": qo, "kv_indptr": indptr, "kv_last_page_len": last_len, "positions": positions,
            "write_pages": w_pages, "write_offsets": w_offsets}
    if device.type != "cuda" and staging is None:
        def t(x: list[int], dtype=torch.int32) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=device)

        return BatchLayout(
            qo_indptr=t(qo),
            positions=t(positions, torch.long),
            logit_rows=t(rows, torch.long),
            kv={g: PagedKV(t(indptr[g]), t(indices[g]), t(last_len[g])) for g in GROUPS},
            write_pages={g: t(w_pages[g], torch.long) for g in GROUPS},
            write_offsets={g: t(w_offsets[g], torch.long) for g in GROUPS},
            num_tokens=n_tok, num_seqs=n_seq,
            host={k: ({g: torch.tensor(v[g], dtype=_HOST_DTYPE.get(k, torch.int32)) for g in GROUPS}
                      if isinstance(v, dict) else torch.tensor(v, dtype=_HOST_DTYPE.get(k, torch.int32)))
                  for k, v in host.items()},
        )
    # CUDA: every array in one pinned host buffer (int64 for indexing, int32 for the attention kernels),
    # one asynchronous copy, device views; no copy from pageable memory (which would wait for the stream)
    # and no per-layer host work.
    i64, i32 = torch.int64, torch.int32
    parts = [("positions", positions, i64), ("logit_rows", rows, i64)]
    parts += [(("wp", g), w_pages[g], i64) for g in GROUPS] + [(("wo", g), w_offsets[g], i64) for g in GROUPS]
    parts += [("qo", qo, i32)] + [(("ip", g), indptr[g], i32) for g in GROUPS]
    parts += [(("ix", g), indices[g], i32) for g in GROUPS] + [(("ll", g), last_len[g], i32) for g in GROUPS]
    dev, hv = pack(parts, device, staging)
    return BatchLayout(
        qo_indptr=dev["qo"],
        positions=dev["positions"],
        logit_rows=dev["logit_rows"],
        kv={g: PagedKV(dev[("ip", g)], dev[("ix", g)], dev[("ll", g)]) for g in GROUPS},
        write_pages={g: dev[("wp", g)] for g in GROUPS},
        write_offsets={g: dev[("wo", g)] for g in GROUPS},
        num_tokens=n_tok, num_seqs=n_seq,
        host={"qo_indptr": hv["qo"], "kv_indptr": {g: hv[("ip", g)] for g in GROUPS},
              "kv_last_page_len": {g: hv[("ll", g)] for g in GROUPS},
              # what a piecewise graph step copies into its fixed buffers (engine/cuda_graph.py)
              "positions": hv["positions"], "write_pages": {g: hv[("wp", g)] for g in GROUPS},
              "write_offsets": {g: hv[("wo", g)] for g in GROUPS}},
    )


# Host copies that index rows (int64, as on the device); the rest are the attention kernels' int32.
_HOST_DTYPE = {"positions": torch.long, "write_pages": torch.long, "write_offsets": torch.long}
