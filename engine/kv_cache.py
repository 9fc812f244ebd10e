"""Paged KV cache: CPU bookkeeping (page allocator, per-sequence page tables) apart from the device pool.

Layers fall in two page groups, "full" (odd layers) and "sliding" (even layers). All layers of a group
share page ids, so one page table per group describes a sequence. Logical page j of a sequence always
covers positions [j*page_size, (j+1)*page_size); the sliding group releases the pages that lie wholly
before the window, so it holds only the last ~`sliding_window` positions, and its page table starts at
logical page `first_page`. Both sides of a KV transfer derive `first_page` from the length alone, which
is what lets a sequence be exported and imported as a list of page ids.

The pool of a group is one tensor [layers_in_group, num_pages, 2, page_size, kv_heads, head_dim]; a
layer's view [num_pages, 2, page_size, kv_heads, head_dim] is FlashInfer's NHD paged layout.

What one forward reads of these tables (`plan`, `BatchLayout`) is laid out in engine/batch_plan.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Hashable

import torch

from kvrelay.engine import batch_plan
from kvrelay.engine.batch_plan import BatchLayout
from kvrelay.engine.config import ModelConfig
from kvrelay.engine.kv_geometry import (FULL, GROUPS, SLIDING, first_live_page, group_layers, layer_groups, layout_hash,
                                        pages_spanned)
from kvrelay.engine.layers.linear import Shard
from kvrelay.engine.partition import head_range
from kvrelay.engine.host_tier import HostKVStore
from kvrelay.engine.prefix_cache import PrefixCache


class OutOfPages(RuntimeError):
    """Raised when a request needs more pages than are free; nothing is allocated in that case."""


class PageAllocator:
    """Free-list of page ids [0, num_pages) with reference counts. Lowest ids go out first, which keeps
    tests readable. A page is shared by taking another reference (`share`) and goes back to the free list
    when its last reference is released. The prefix cache (engine/prefix_cache.py) holds one reference on
    each page it keeps (`cache`/`uncache`); `evictable` counts the pages it holds alone."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs: dict[int, int] = {}
        self._cached: set[int] = set()
        self.evictable = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        # the last n free ids, last first (what n pops give), without a Python loop over pages: an
        # 8192-token prompt takes 513 pages a group before its forward's first kernel
        k = len(self._free) - n
        pages = self._free[k:][::-1]
        del self._free[k:]
        self._refs.update(dict.fromkeys(pages, 1))
        return pages

    def share(self, pages) -> None:
        for p in pages:
            if p not in self._refs:
                raise ValueError(f"page {p} shared but not allocated")
            self._refs[p] += 1
            if p in self._cached and self._refs[p] == 2:
                self.evictable -= 1

    def release(self, pages) -> None:
        for p in pages:
            r = self._refs.get(p)
            if r is None:
                raise ValueError(f"page {p} released but not allocated")
            if r == 1:
                del self._refs[p]
                self._free.append(p)
            else:
                self._refs[p] = r - 1
                if p in self._cached and r == 2:
                    self.evictable += 1

    def cache(self, page: int) -> None:
        """The prefix cache takes a reference on `page` (allocated, held by a sequence)."""
        if page in self._cached:
            raise ValueError(f"page {page} cached twice")
        self.share([page])
        self._cached.add(page)

    def uncache(self, page: int) -> None:
        """The prefix cache drops its reference: the page is freed if nobody else holds it."""
        self._cached.remove(page)
        if self._refs[page] == 1:
            self.evictable -= 1
        self.release([page])


@dataclass
class SequencePages:
    """One sequence's page tables (mutable bookkeeping, owned by KVCache)."""

    length: int = 0
    pages: dict[str, list[int]] = field(default_factory=lambda: {g: [] for g in GROUPS})
    first_page: dict[str, int] = field(default_factory=lambda: {g: 0 for g in GROUPS})
    # Prefix cache: the tokens this sequence holds or is about to (its prompt, then each token it
    # generates, see `extend_tokens`), the blocks of them already offered to the cache, and the last of
    # those (the parent of the next).
    tokens: list[int] | None = None
    cached_blocks: int = 0
    cached_tail: object = None
    host_hit: int = 0  # positions of its hit that only the host tier held (PrefixHit.host_tokens)
    prompt_blocks: int = 0  # whole blocks of its prompt: the last one is a resume point (PrefixCache.mark_end)


@dataclass(frozen=True)
class SequenceKV:
    """What a KV transfer needs to know about a sequence: its length and, per group, the logical index
    of its first held page and the page ids in position order."""

    length: int
    pages: dict[str, tuple[int, ...]]
    first_page: dict[str, int]


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_pages: int | dict[str, int],
        page_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        shard: Shard = Shard(),
    ):
        self.cfg = cfg
        self.page_size = page_size
        self.window = cfg.sliding_window
        self.device = torch.device(device)
        self.dtype = dtype
        # The attention layer's rule (it asks the same function): more ranks than KV heads replicate one.
        heads = head_range(cfg.num_attention_heads, cfg.num_key_value_heads, shard.rank, shard.world_size)
        self.kv_heads = heads.num_kv
        self.tp_rank, self.tp_size = shard.rank, shard.world_size
        counts = num_pages if isinstance(num_pages, dict) else {g: num_pages for g in GROUPS}
        groups = layer_groups(cfg.layer_types)
        self.group_layers = {g: group_layers(groups, g) for g in GROUPS}
        self._layer_slot = {
            layer: (g, i) for g, layers in self.group_layers.items() for i, layer in enumerate(layers)
        }
        self.allocators = {g: PageAllocator(counts[g]) for g in GROUPS}
        # The device pools: these tensors are what a NIXL agent registers.
        self.pools = {
            g: torch.zeros(
                (len(self.group_layers[g]), counts[g], 2, page_size, self.kv_heads, cfg.head_dim),
                dtype=dtype, device=self.device,
            )
            for g in GROUPS
        }
        self.seqs: dict[Hashable, SequencePages] = {}
        self.prefix: PrefixCache | None = None  # enable_prefix_cache()

    def enable_prefix_cache(self, host_bytes: int = 0) -> PrefixCache:
        """Keep the whole prompt blocks of finished prefills for later sequences (engine/prefix_cache.py):
        cached pages nobody uses are evicted on demand, so they never take room a reservation counts on;
        with `host_bytes`, evicted pages move to a host-memory tier of that size (engine/host_tier.py,
        pinned on CUDA) and come back on a hit. On a TP rank `host_bytes` is the whole group's tier: each
        rank keeps 1/tp_size of it, the slots for its own KV heads of the same pages (every rank's cache
        makes the same decisions, engine/prefix_cache.py), and the byte counters count the group's."""
        if self.prefix is None:
            host = HostKVStore(self.pools, host_bytes // self.tp_size) if host_bytes > 0 else None
            self.prefix = PrefixCache(page_size=self.page_size, window=self.window, allocators=self.allocators,
                                      host=host, ranks=self.tp_size)
        return self.prefix

    # ---- layout --------------------------------------------------------------------------------
    def layer_pool(self, layer: int) -> torch.Tensor:
        g, i = self._layer_slot[layer]
        return self.pools[g][i]

    def layer_group(self, layer: int) -> str:
        return self._layer_slot[layer][0]

    def layout_hash(self) -> str:
        """What a page of one KV head means in this pool (kv_geometry.layout_hash; the KV handoff's
        KVLayout hashes the same fields), so two pools can check they agree before pages are copied."""
        cfg = self.cfg
        return layout_hash(model=cfg.name, dtype=str(self.dtype).removeprefix("torch."), page_size=self.page_size,
                           layer_types=layer_groups(cfg.layer_types), kv_heads=cfg.num_key_value_heads,
                           head_dim=cfg.head_dim, sliding_window=cfg.sliding_window, q_heads=cfg.num_attention_heads)

    # ---- capacity ------------------------------------------------------------------------------
    def _first_needed_page(self, group: str, length: int) -> int:
        return first_live_page(group, length, self.page_size, self.window)

    def _pages_spanned(self, length: int) -> int:
        return pages_spanned(length, self.page_size)

    def pages_needed(self, n_tokens: int, *, length: int = 0) -> dict[str, int]:
        """Peak pages per group that appending n_tokens to a sequence of `length` allocates. A sliding
        group holds the whole chunk during the forward (its queries need all of it) and trims after."""
        # A sequence already holds every page its current length spans from its first page on, and the
        # first page only moves after the forward, so the increment is the same for both groups.
        n = self._pages_spanned(length + n_tokens) - self._pages_spanned(length)
        return {g: n for g in GROUPS}

    def free_pages(self) -> dict[str, int]:
        """Pages an allocation can have now: free ones plus cached ones nobody else uses (evicted on demand)."""
        return {g: a.num_free + a.evictable for g, a in self.allocators.items()}

    def _take_all(self, need: dict[str, int]) -> dict[str, list[int]]:
        """`need[group]` pages of each group, evicting cache-only pages where the free list is short; all
        or nothing."""
        taken: dict[str, list[int]] = {}
        try:
            for g, n in need.items():
                alloc = self.allocators[g]
                if n > alloc.num_free and self.prefix is not None:
                    self.prefix.evict(g, n - alloc.num_free)
                taken[g] = alloc.allocate(n)
        except OutOfPages:
            for g, pages in taken.items():
                self.allocators[g].release(pages)
            raise
        return taken

    def can_allocate(self, n_tokens: int, *, length: int = 0) -> bool:
        free = self.free_pages()
        return all(n <= free[g] for g, n in self.pages_needed(n_tokens, length=length).items())

    def _missing(self, seq: SequencePages, group: str, new_length: int) -> int:
        return max(0, self._pages_spanned(new_length) - seq.first_page[group] - len(seq.pages[group]))

    # ---- sequence lifecycle --------------------------------------------------------------------
    def length(self, seq_id: Hashable) -> int:
        return self.seqs[seq_id].length

    def reserve(self, seq_id: Hashable, n_new: int) -> None:
        """Make room for n_new more tokens (creating the sequence if new). All or nothing."""
        seq = self.seqs.get(seq_id) or SequencePages()
        need = {g: self._missing(seq, g, seq.length + n_new) for g in GROUPS}
        free = self.free_pages()
        for g, n in need.items():
            if n > free[g]:
                raise OutOfPages(f"{g} group: need {n} pages, {free[g]} free")
        for g, pages in self._take_all(need).items():
            seq.pages[g].extend(pages)
        self.seqs[seq_id] = seq

    def commit(self, seq_id: Hashable, n_new: int) -> None:
        """Record that n_new tokens were written, then release sliding pages that fell out of the window."""
        seq = self.seqs[seq_id]
        seq.length += n_new
        if seq.tokens is not None:
            self._offer(seq)  # before the trim: the sliding pages leaving the window go to the cache
        self._trim(seq)

    def _trim(self, seq: SequencePages) -> None:
        first = self._first_needed_page(SLIDING, seq.length)
        drop = first - seq.first_page[SLIDING]
        if drop > 0:
            self.allocators[SLIDING].release(seq.pages[SLIDING][:drop])
            del seq.pages[SLIDING][:drop]
            seq.first_page[SLIDING] = first

    def free(self, seq_id: Hashable) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            for g in GROUPS:
                self.allocators[g].release(seq.pages[g])

    def fork(self, src_id: Hashable, dst_id: Hashable) -> SequenceKV:
        """A new sequence `dst_id` holding what `src_id` holds (the n choices of one prompt, vLLM's
        parallel sampling): every page wholly below the length is shared read-only (a reference more; no
        step writes a position below a sequence's length again), the last partial page of each group is
        copied into a page of its own (the next token of each sequence writes there), and a page wholly
        past the length gets a fresh page. The sliding group shares the same way: its pages are appended
        and dropped whole, never overwritten in place, so sharing them is safe until each sequence's trim
        releases its own reference. All or nothing (OutOfPages); the copy is queued on the device."""
        if dst_id in self.seqs:
            raise ValueError(f"sequence {dst_id!r} already exists")
        src = self.seqs[src_id]
        ps = self.page_size
        plan: dict[str, list[tuple[str, int]]] = {}  # per group, per page: ("share" | "copy" | "new", src page)
        for g in GROUPS:
            first = src.first_page[g]
            plan[g] = [("share" if (first + i + 1) * ps <= src.length else "copy" if (first + i) * ps < src.length
                        else "new", page) for i, page in enumerate(src.pages[g])]
        fresh = self._take_all({g: sum(kind != "share" for kind, _ in plan[g]) for g in GROUPS})
        pages: dict[str, list[int]] = {}
        for g in GROUPS:
            shared = [page for kind, page in plan[g] if kind == "share"]
            self.allocators[g].share(shared)
            new = iter(fresh[g])
            pages[g] = [page if kind == "share" else next(new) for kind, page in plan[g]]
            copies = [(page, dst) for (kind, page), dst in zip(plan[g], pages[g]) if kind == "copy"]
            if copies:
                s = torch.tensor([a for a, _ in copies], dtype=torch.long, device=self.device)
                d = torch.tensor([b for _, b in copies], dtype=torch.long, device=self.device)
                self.pools[g][:, d] = self.pools[g][:, s]
        self.seqs[dst_id] = SequencePages(length=src.length, pages=pages, first_page=dict(src.first_page))
        return self.export_sequence(dst_id)

    # ---- prefix cache --------------------------------------------------------------------------
    def begin_prefix(self, seq_id: Hashable, tokens: Sequence[int], *, lookup: bool = True) -> int:
        """Start a sequence that will hold `tokens` (a prompt, known up front) under the prefix cache: it
        shares the pages of the longest cached prefix that leaves at least one token to compute (with
        `lookup`; a request that needs every prompt position's logits passes False), and each whole block
        of `tokens` it computes is offered to the cache as its forwards commit (with its sliding page,
        before that page leaves the window). Returns the positions already computed (0 without a hit);
        the caller runs the rest (`host_hit` says how many of them came back from the host tier). Without
        a host tier it allocates nothing; a hit in the host tier allocates the device pages it copies
        back only where free or evictable pages allow (they are pages the prompt would take anyway)."""
        if self.prefix is None:
            raise RuntimeError("the prefix cache is not enabled")
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        seq = SequencePages(tokens=[int(t) for t in tokens], prompt_blocks=len(tokens) // self.page_size)
        hit = self.prefix.lookup(seq.tokens, len(tokens) - 1) if lookup else None
        if hit is not None:
            self.allocators[FULL].share(hit.full)
            self.allocators[SLIDING].share(hit.sliding)
            seq.length = hit.tokens
            seq.pages = {FULL: list(hit.full), SLIDING: list(hit.sliding)}
            seq.first_page = {FULL: 0, SLIDING: hit.sliding_first}
            seq.cached_blocks, seq.cached_tail, seq.host_hit = len(hit.full), hit.tail, hit.host_tokens
            if seq.cached_blocks == seq.prompt_blocks:  # the prompt ends in its hit's last block
                self.prefix.mark_end(hit.tail)
        self.seqs[seq_id] = seq
        return seq.length

    def host_hit(self, seq_id: Hashable) -> int:
        """Positions of the sequence's prefix hit that came back from the host tier (0 if none)."""
        seq = self.seqs.get(seq_id)
        return seq.host_hit if seq is not None else 0

    def _offer(self, seq: SequencePages) -> None:
        """Give the cache the whole blocks of `seq.tokens` written since the last offer."""
        end = min(seq.length, len(seq.tokens)) // self.page_size
        if end > seq.cached_blocks:
            base = seq.first_page[SLIDING]
            sliding = {base + i: p for i, p in enumerate(seq.pages[SLIDING])}
            seq.cached_tail = self.prefix.insert(seq.tokens, seq.pages[FULL], sliding, start=seq.cached_blocks,
                                                 end=end, parent=seq.cached_tail, prompt_end=seq.prompt_blocks)
            seq.cached_blocks = end
            if seq.cached_tail is None:  # its blocks are another sequence's copy (see PrefixCache.insert)
                seq.tokens = None

    def extend_tokens(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """A sequence begun under the prefix cache will hold `tokens` next (its sampled tokens, fed back):
        their whole blocks are offered to the cache too once written (a later prompt that repeats the
        conversation so far reuses them). No-op for other sequences."""
        seq = self.seqs.get(seq_id)
        if seq is not None and seq.tokens is not None:
            seq.tokens.extend(tokens)

    # ---- transfer ------------------------------------------------------------------------------
    def export_sequence(self, seq_id: Hashable) -> SequenceKV:
        seq = self.seqs[seq_id]
        return SequenceKV(seq.length, {g: tuple(seq.pages[g]) for g in GROUPS}, dict(seq.first_page))

    def import_sequence(self, seq_id: Hashable, length: int) -> SequenceKV:
        """Create a sequence of `length` already-computed positions and allocate its pages; the caller
        then fills those pages (e.g. a NIXL READ into `pools`) before the first decode step."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        seq = SequencePages(length=length)
        need = {}
        free = self.free_pages()
        for g in GROUPS:
            seq.first_page[g] = self._first_needed_page(g, length)
            need[g] = self._pages_spanned(length) - seq.first_page[g]
            if need[g] > free[g]:
                raise OutOfPages(f"{g} group: need {need[g]} pages, {free[g]} free")
        seq.pages = self._take_all(need)
        self.seqs[seq_id] = seq
        return self.export_sequence(seq_id)

    def copy_pages(self, src: "KVCache", src_kv: SequenceKV, dst_kv: SequenceKV) -> None:
        """Copy a sequence's pages from another cache in the same process (the NIXL path does the same
        thing across processes); used by tests and single-host handoff."""
        # Whole pages: both pools must also hold the same heads (the same TP shape).
        if src.layout_hash() != self.layout_hash() or (src.tp_size, src.tp_rank) != (self.tp_size, self.tp_rank):
            raise ValueError("KV layouts differ; refusing to copy pages")
        for g in GROUPS:
            if src_kv.first_page[g] != dst_kv.first_page[g] or len(src_kv.pages[g]) != len(dst_kv.pages[g]):
                raise ValueError(f"{g} page tables do not correspond")
            s = torch.tensor(src_kv.pages[g], dtype=torch.long, device=src.device)
            d = torch.tensor(dst_kv.pages[g], dtype=torch.long, device=self.device)
            self.pools[g][:, d] = src.pools[g][:, s].to(self.device)

    # ---- per-forward metadata (engine/batch_plan.py lays it out) ------------------------------
    def plan_lists(self, batch: list[tuple[Hashable, int]]) -> dict:
        """The layout of `plan` as Python lists (for callers that fill their own fixed buffers, e.g. the
        CUDA-graph decode step): qo, positions, rows, and per group indptr, indices, last_len, w_pages,
        w_offsets."""
        return batch_plan.plan_lists([(sid, self.seqs[sid], n) for sid, n in batch], page_size=self.page_size,
                                     max_context=self.cfg.max_context)

    def plan_decode(self, seq_ids: list[Hashable]) -> dict:
        """`plan_lists` for one new token per sequence (a decode step, already reserved), as numpy arrays."""
        return batch_plan.plan_decode([self.seqs[sid] for sid in seq_ids], page_size=self.page_size,
                                      max_context=self.cfg.max_context)

    def plan(self, batch: list[tuple[Hashable, int]], staging=None) -> BatchLayout:
        """Layout for appending n_new tokens to each (already reserved) sequence, in order. Long batches
        are planned as numpy arrays (batch_plan.plan_arrays, no Python loop over tokens), short ones as
        lists (cheaper for a few tokens); both give the same layout. `staging`: the caller's
        engine/staging.StagingRing, whose current slot takes the host arrays (batch_plan.layout)."""
        if sum(n for _, n in batch) >= batch_plan.ARRAYS_MIN_TOKENS:
            lists = batch_plan.plan_arrays([(sid, self.seqs[sid], n) for sid, n in batch], page_size=self.page_size,
                                           max_context=self.cfg.max_context)
        else:
            lists = self.plan_lists(batch)
        return batch_plan.layout(lists, self.device, staging)
