"""Prefix cache bookkeeping: which page-aligned token blocks of earlier sequences still have their KV in
the pool, and which pages a new sequence may share to skip recomputing them. Torch-free.

A block is `page_size` tokens at a page-aligned offset, keyed by its parent block and its own tokens, so a
block names the whole token prefix up to its end (the dict compares the tokens themselves: no hash can
collide). Only whole pages are cached, so the page holding the first token a new sequence computes is
always its own, never a shared one, and a shared page is only ever read.

gpt-oss keeps two page groups (engine/kv_geometry.py). A block owns its full-attention page, and may own
its sliding-window page. A sequence can resume at block boundary B only if every full page before B is
cached *and* the sliding pages covering the last window before B ([B - window + 1, B), i.e. logical pages
`first_live_page(SLIDING, B)` .. B/page_size - 1) are cached too: sliding layers of the next token attend
to them. A prompt's blocks are offered to the cache as its forwards commit, each with its sliding page
before that page leaves the sequence's window (KVCache.begin_prefix), so any block boundary of a cached
prompt can be resumed (prompts that share a system prompt and diverge after it); on a colocated worker the
tokens a request generates follow (KVCache.extend_tokens), so a conversation's next turn resumes inside
the previous answer. Each group evicts on its own demand: the sliding pool is small (about one window
per running sequence), so under load sliding pages go much sooner than full ones, and a lookup then
falls back to the longest boundary whose window is still cached.

Pages are reference-counted in the group's PageAllocator: the cache holds one reference on each page it
keeps, each sequence one on each page in its table. A page held by the cache alone is evictable, in
least-recently-used order (touched leaf to root on every hit and insert, so the deepest block of the
oldest chain goes first and a chain never loses its head before its tail); a page a sequence (or a lease,
or a pull, which pin the sequence) holds is never evicted.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrelay.engine.kv_geometry import FULL, SLIDING, first_live_page


@dataclass(eq=False)
class _Block:
    key: tuple  # (parent block id, 0 for the first block; this block's tokens)
    id: int
    parent: "_Block | None"
    full: int  # page id in the full-attention group
    sliding: int | None = None  # page id in the sliding group, if kept
    children: int = 0


@dataclass
class PrefixStats:
    """Counters for /metrics and `kvrelay status`."""

    queries: int = 0  # sequences that looked up a prefix
    hits: int = 0  # ... and reused at least one block
    query_tokens: int = 0  # tokens those sequences asked about
    hit_tokens: int = 0  # tokens whose prefill a hit skipped
    inserted_blocks: int = 0
    evicted_pages: dict[str, int] = field(default_factory=lambda: {FULL: 0, SLIDING: 0})

    def as_dict(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "query_tokens": self.query_tokens,
                "hit_tokens": self.hit_tokens, "inserted_blocks": self.inserted_blocks,
                "evicted_pages": dict(self.evicted_pages)}


@dataclass(frozen=True)
class PrefixHit:
    """A reusable prefix: `tokens` positions, the full pages of blocks 0 .. tokens/page_size - 1 and the
    sliding pages from logical page `sliding_first` on."""

    tokens: int
    full: tuple[int, ...]
    sliding: tuple[int, ...]
    sliding_first: int
    tail: object = None  # the last block (where an insert of the sequence's later blocks continues)


class PrefixCache:
    def __init__(self, *, page_size: int, window: int, allocators: dict):
        self.page_size = page_size
        self.window = window
        self.allocators = allocators  # group -> PageAllocator (shared with KVCache)
        self._blocks: dict[tuple, _Block] = {}
        self._lru: collections.OrderedDict[int, _Block] = collections.OrderedDict()  # oldest first
        self._slru: collections.OrderedDict[int, _Block] = collections.OrderedDict()  # those with a sliding page
        self._ids = itertools.count(1)
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def summary(self) -> dict:
        """The counters plus the pages held now (what `kvrelay status` shows)."""
        return {**self.stats.as_dict(), "cached_pages": self.cached_pages(),
                "evictable_pages": {g: a.evictable for g, a in self.allocators.items()}}

    def cached_pages(self) -> dict[str, int]:
        """Pages the cache holds a reference on, per group (in use by sequences or not)."""
        return {FULL: len(self._blocks), SLIDING: sum(b.sliding is not None for b in self._blocks.values())}

    # ---- lookup --------------------------------------------------------------------------------
    def _chain(self, tokens: Sequence[int], max_blocks: int) -> list[_Block]:
        chain: list[_Block] = []
        ps = self.page_size
        parent = 0
        for j in range(max_blocks):
            b = self._blocks.get((parent, tuple(tokens[j * ps: (j + 1) * ps])))
            if b is None:
                break
            chain.append(b)
            parent = b.id
        return chain

    def lookup(self, tokens: Sequence[int], limit: int) -> PrefixHit | None:
        """The longest cached prefix of `tokens` of at most `limit` positions at which a sequence can
        resume (full pages and the sliding window before the boundary all cached), touched as used; None
        if there is none. Counts the query."""
        self.stats.queries += 1
        self.stats.query_tokens += len(tokens)
        ps = self.page_size
        chain = self._chain(tokens, max(0, limit) // ps)
        for k in range(len(chain), 0, -1):
            first = first_live_page(SLIDING, k * ps, ps, self.window)
            if all(chain[j].sliding is not None for j in range(first, k)):
                self._touch(chain[k - 1])
                self.stats.hits += 1
                self.stats.hit_tokens += k * ps
                return PrefixHit(k * ps, tuple(b.full for b in chain[:k]),
                                 tuple(chain[j].sliding for j in range(first, k)), first, chain[k - 1])
        return None

    def retract(self, query_tokens: int, hit_tokens: int) -> None:
        """Uncount a lookup whose sequence was dropped before it ran (it looks up again when it does)."""
        self.stats.queries -= 1
        self.stats.query_tokens -= query_tokens
        if hit_tokens:
            self.stats.hits -= 1
            self.stats.hit_tokens -= hit_tokens

    def _touch(self, b: "_Block | None") -> None:
        while b is not None:  # leaf first: the head of the chain ends up most recent
            self._lru.move_to_end(b.id)
            if b.sliding is not None:
                self._slru.move_to_end(b.id)
            b = b.parent

    # ---- insertion -----------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], full: Sequence[int], sliding: dict[int, int], *, start: int = 0,
               end: int | None = None, parent: "_Block | None" = None) -> "_Block | None":
        """Cache blocks [start, end) of a sequence holding `tokens`: `full[j]` is block j's full page,
        `sliding` maps logical page -> sliding page for the sliding pages the sequence holds; `parent` is
        block start - 1 as an earlier insert returned it. A block already cached on the sequence's own
        page gains the sliding page it lacks. Returns the last block, or None where the sequence holds a
        copy of its own of a cached block (it computed the block beside another sequence): its later
        blocks are not hung below pages it does not hold, so that every sequence holds the cached pages
        of its blocks' ancestors, a cached page only the cache holds has no descendant a sequence holds,
        and each such page can be evicted (what `evictable` promises)."""
        ps = self.page_size
        end = min(len(tokens) // ps, len(full)) if end is None else end
        if start and (parent is None or self._blocks.get(parent.key) is not parent):
            # A guard: the tail is on a page the sequence holds, so it cannot have been evicted; if it
            # was replaced anyway, walk from the head again.
            start, parent = 0, None
        new = 0
        for j in range(start, end):
            key = (parent.id if parent else 0, tuple(tokens[j * ps: (j + 1) * ps]))
            b = self._blocks.get(key)
            if b is not None and b.full != full[j]:
                self._touch(parent)
                self.stats.inserted_blocks += new
                return None
            if b is None:
                b = _Block(key, next(self._ids), parent, full[j])
                self.allocators[FULL].cache(full[j])
                self._blocks[key] = b
                self._lru[b.id] = b
                if parent is not None:
                    parent.children += 1
                new += 1
            if b.sliding is None and j in sliding:
                b.sliding = sliding[j]
                self.allocators[SLIDING].cache(b.sliding)
                self._slru[b.id] = b
            parent = b
        self._touch(parent)
        self.stats.inserted_blocks += new
        return parent

    # ---- eviction ------------------------------------------------------------------------------
    def evictable(self, group: str) -> int:
        return self.allocators[group].evictable

    def evict(self, group: str, n: int) -> int:
        """Free at least `n` pages of `group` held by the cache alone, least recently used first (a full
        page only from a block without cached children, so a chain loses its tail first). Returns how
        many were freed (fewer if no more are evictable)."""
        alloc = self.allocators[group]
        freed = 0
        for b in list((self._slru if group == SLIDING else self._lru).values()):
            if freed >= n:
                break
            if group == SLIDING:
                if b.sliding is not None and alloc.refs(b.sliding) == 1:
                    self._drop_sliding(b)
                    freed += 1
            elif b.id in self._lru and b.children == 0 and alloc.refs(b.full) == 1:
                freed += 1
                self._remove(b)
        self.stats.evicted_pages[group] += freed
        return freed

    def _remove(self, b: _Block) -> None:
        # Its parent becomes a leaf and may go in the same sweep: it is later in LRU order (see _touch).
        del self._blocks[b.key]
        del self._lru[b.id]
        if b.parent is not None:
            b.parent.children -= 1
        self.allocators[FULL].uncache(b.full)
        if b.sliding is not None:
            self._drop_sliding(b)
            self.stats.evicted_pages[SLIDING] += 1

    def _drop_sliding(self, b: _Block) -> None:
        self.allocators[SLIDING].uncache(b.sliding)
        b.sliding = None
        del self._slru[b.id]

    def clear(self) -> None:
        """Drop every block (pages still used by sequences stay theirs)."""
        while self._blocks:
            leaves = [b for b in self._blocks.values() if b.children == 0]
            for b in leaves:
                self._remove(b)
