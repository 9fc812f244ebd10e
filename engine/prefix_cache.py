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
the previous answer. Each group evicts on its own demand: the sliding pool is small (running windows plus
a share of the budget, engine/memory.py), so under load sliding pages go much sooner than full ones, and
a lookup then falls back to the longest boundary whose window is still cached. The sliding group keeps
the windows before the boundaries a later prompt would resume at (a chain's leaves, forks and prompt
ends) and evicts mid-chain sliding pages first (engine/prefix_windows.py).

Pages are reference-counted in the group's PageAllocator: the cache holds one reference on each page it
keeps, each sequence one on each page in its table. A page held by the cache alone is evictable, in
least-recently-used order (full pages touched leaf to root on every hit and insert, so the deepest block
of the oldest chain goes first and a chain never loses its head before its tail; sliding pages in the
order of engine/prefix_windows.py); a page a sequence (or a lease, or a pull, which pin the sequence)
holds is never evicted.

With a host tier (engine/host_tier.py, `prefill.prefix_cache_host_gib`), an evicted page is not dropped
but moved to a host slot: the block stays in the tree with its page in host memory (each page of a block
lives in one tier at a time: `full` or `host_full`, `sliding` or `host_sliding`). Device blocks are
closed under parents (a sequence holds its blocks' ancestors, and a device page is moved only from a
block without device children), so a chain is device blocks from its head, then host blocks. A lookup
walks both; a hit that needs host pages allocates device pages for them (evicting other cache-only pages
to host as usual), copies them back and turns those blocks into device blocks again, so the caller sees
a device hit. The host tier evicts least recently used too, a full slot only from a block without
children; blocks whose pages a lookup is restoring are never taken. Host slots are given back when their
block returns to the device (a lookup, or a sequence that computed the same block again).

On a TP group every rank keeps its shard of the KV heads in the same page ids, so every rank runs this
cache on the same calls in the same order (prefill_worker/ranks.py `begin_cached`): everything here is
deterministic in those calls (insertion-ordered dicts, counters, free lists; no clock, no randomness),
so the ranks take the same hits, evict the same pages and use the same host slots, each copying its own
shard. `digest` folds every decision in as it is made (a hit, a block cached, a page moved or dropped),
so the leader compares one number per op to know its followers still agree; the byte counters count
the whole group's bytes (`ranks` shards of the same size moved at once), the other counters one
group's decisions.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.engine.kv_geometry import FULL, GROUPS, SLIDING, first_live_page
from kvrelay.engine.prefix_stats import PrefixHit, PrefixStats
from kvrelay.engine.prefix_windows import WindowLRU, reanchor, window_depth


@dataclass(eq=False)
class _Block:
    key: tuple  # (parent block id, 0 for the first block; this block's tokens)
    id: int
    parent: "_Block | None"
    full: int | None  # page id in the full-attention group (None while the block is in the host tier)
    sliding: int | None = None  # page id in the sliding group, if kept on the device
    children: int = 0  # cached children, in either tier
    device_children: int = 0  # ... whose full page is on the device
    host_full: int | None = None  # host slots (engine/host_tier.py) holding the pages the device evicted
    host_sliding: int | None = None
    end: bool = False  # a prompt ended with this block (a resume point: engine/prefix_windows.py)
    anchor: bool = False  # a leaf, a fork or a prompt's end: the window before its end is guarded
    guard: int = 0  # anchors whose window covers this block's sliding page


class PrefixCache:
    def __init__(self, *, page_size: int, window: int, allocators: dict, host=None, ranks: int = 1):
        """`host`: an engine.host_tier.HostKVStore (or None: evicted pages are dropped); `ranks`: the TP
        ranks that hold a shard of each page alike (bytes are counted for all of them)."""
        self.page_size = page_size
        self.ranks = ranks
        self.digest = 0  # every decision so far, folded (`_note`): equal on ranks that agree
        self.window = window
        self.allocators = allocators  # group -> PageAllocator (shared with KVCache)
        self.host = host
        self._blocks: dict[tuple, _Block] = {}
        self._lru: collections.OrderedDict[int, _Block] = collections.OrderedDict()  # oldest first
        self._slru = WindowLRU()  # those with a sliding page, in eviction order (unguarded first)
        # The host tier, per group: blocks with a page there, in eviction order.
        self._hlru: dict = {FULL: collections.OrderedDict(), SLIDING: WindowLRU()}
        self._depth = window_depth(window, page_size) + 1  # blocks an anchor guards (prefix_windows.py)
        self._restoring: set[int] = set()  # blocks a lookup is copying back: their slots stay
        self._saves: dict[str, dict[int, int]] = {g: {} for g in GROUPS}  # slot -> device page, not yet copied
        self._ids = itertools.count(1)
        self.stats = PrefixStats()

    def _note(self, *xs: int) -> None:
        # A tuple of ints hashes the same in every process (no hash randomization for ints).
        self.digest = hash((self.digest, *xs))

    def __len__(self) -> int:
        return len(self._blocks)

    def summary(self) -> dict:
        """The counters plus the pages held now (what `kvrelay status` shows)."""
        out = {**self.stats.as_dict(), "cached_pages": self.cached_pages(),
               "evictable_pages": {g: a.evictable for g, a in self.allocators.items()},
               "digest": self.digest}
        if self.host is not None:
            out["host"] = {**self.stats.host_dict(), "pages": self.host_pages(), "capacity_pages": self.host.capacity,
                           "bytes_used": self.host.used_bytes() * self.ranks,
                           "bytes_total": self.host.bytes_total * self.ranks,
                           "pinned": self.host.pinned}
        return out

    def cached_pages(self) -> dict[str, int]:
        """Device pages the cache holds a reference on, per group (in use by sequences or not)."""
        return {FULL: len(self._lru), SLIDING: len(self._slru)}

    def host_pages(self) -> dict[str, int]:
        """Host slots in use, per group."""
        return {g: len(self._hlru[g]) for g in GROUPS}

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
        resume (full pages and the sliding window before the boundary all cached, in either tier, and
        device pages free for what is in the host tier), touched as used; None if there is none. Pages
        of the hit in the host tier are copied back first. Counts the query."""
        self.stats.queries += 1
        self.stats.query_tokens += len(tokens)
        ps = self.page_size
        chain = self._chain(tokens, max(0, limit) // ps)
        on_device = next((j for j, b in enumerate(chain) if b.full is None), len(chain))
        device_best = 0  # the longest boundary the device alone resumes
        for k in range(on_device, 0, -1):
            first = first_live_page(SLIDING, k * ps, ps, self.window)
            if all(chain[j].sliding is not None for j in range(first, k)):
                device_best = k
                break
        if len(chain) > device_best:  # longer boundaries need pages from the host tier
            fa, sa = self.allocators[FULL], self.allocators[SLIDING]
            on_host, alone = [0], [0]  # per prefix of the chain: full pages in host, device ones only cached
            for b in chain:
                on_host.append(on_host[-1] + (b.full is None))
                alone.append(alone[-1] + (b.full is not None and fa.refs(b.full) == 1))
            for k in range(len(chain), device_best, -1):
                first = first_live_page(SLIDING, k * ps, ps, self.window)
                window = chain[first:k]
                if not all(b.sliding is not None or b.host_sliding is not None for b in window):
                    continue
                # Room for the host pages, in what is free or evictable once the hit shares its own
                # (cheap here: the chain may be thousands of blocks long and k falls one by one).
                s_need = sum(b.sliding is None for b in window)
                s_alone = sum(b.sliding is not None and sa.refs(b.sliding) == 1 for b in window)
                if (on_host[k] <= fa.num_free + fa.evictable - alone[k]
                        and s_need <= sa.num_free + sa.evictable - s_alone and self._restore(chain[:k], first)):
                    return self._hit(chain, k, first, (k - device_best) * ps)
        if device_best:
            return self._hit(chain, device_best, first_live_page(SLIDING, device_best * ps, ps, self.window), 0)
        return None

    def _hit(self, chain: list[_Block], k: int, first: int, host_tokens: int) -> PrefixHit:
        ps = self.page_size
        self._touch(chain[k - 1])
        self._note(1, chain[k - 1].id, k, host_tokens)
        self.stats.hits += 1
        self.stats.hit_tokens += k * ps
        if host_tokens:
            self.stats.host_hits += 1
            self.stats.host_hit_tokens += host_tokens
        return PrefixHit(k * ps, tuple(b.full for b in chain[:k]), tuple(chain[j].sliding for j in range(first, k)),
                         first, chain[k - 1], host_tokens)

    def _restore(self, chain: list[_Block], first: int) -> bool:
        """Copy the host pages of `chain` (full pages of all, sliding pages from `first`) into device
        pages; False (nothing changed) if the device cannot spare the pages."""
        fulls = [b for b in chain if b.full is None]
        slides = [b for b in chain[first:] if b.sliding is None]
        need = {FULL: len(fulls), SLIDING: len(slides)}
        held = {FULL: [b.full for b in chain if b.full is not None],
                SLIDING: [b.sliding for b in chain[first:] if b.sliding is not None]}
        for g, n in need.items():  # the hit's own device pages stop being evictable once it shares them
            a = self.allocators[g]
            if n > a.num_free + a.evictable - sum(a.refs(p) == 1 for p in held[g]):
                return False
        for g in GROUPS:
            self.allocators[g].share(held[g])  # not evicted to make room for the rest
        self._restoring = {b.id for b in chain}
        pages: dict[str, list[int]] = {}
        try:
            for g, n in need.items():
                a = self.allocators[g]
                if n > a.num_free:
                    self.evict(g, n - a.num_free)
                if n > a.num_free:  # not what `evictable` promised; leave everything as it was
                    for h, taken in pages.items():
                        self.allocators[h].release(taken)
                    return False
                pages[g] = a.allocate(n)
            self._flush()  # the pages just evicted leave before the restored ones land (stream order)
            self.host.load(FULL, [b.host_full for b in fulls], pages[FULL])
            self.host.load(SLIDING, [b.host_sliding for b in slides], pages[SLIDING])
        finally:
            self._restoring = set()
            for g in GROUPS:
                self.allocators[g].release(held[g])
        for b, page in zip(fulls, pages[FULL]):
            self._adopt_full(b, page)
        for b, page in zip(slides, pages[SLIDING]):
            self._adopt_sliding(b, page)
        for g in GROUPS:
            self.allocators[g].release(pages[g])  # the cache's reference (taken by _adopt_*) remains
            self.stats.to_device_pages += need[g]
            self.stats.to_device_bytes += need[g] * self.host.page_bytes[g] * self.ranks
        return True

    def _adopt_full(self, b: _Block, page: int) -> None:
        """A host block's full page is on the device again (restored, or computed again by a sequence)."""
        self.allocators[FULL].cache(page)
        self._note(2, b.id, page)
        b.full = page
        self._host_free(FULL, b)
        self._lru[b.id] = b
        if b.parent is not None:
            b.parent.device_children += 1

    def _adopt_sliding(self, b: _Block, page: int) -> None:
        self.allocators[SLIDING].cache(page)
        self._note(3, b.id, page)
        b.sliding = page
        if b.host_sliding is not None:
            self._host_free(SLIDING, b)
        self._slru[b.id] = b

    def retract(self, query_tokens: int, hit_tokens: int, host_tokens: int = 0) -> None:
        """Uncount a lookup whose sequence was dropped before it ran (it looks up again when it does)."""
        self.stats.queries -= 1
        self.stats.query_tokens -= query_tokens
        if hit_tokens:
            self.stats.hits -= 1
            self.stats.hit_tokens -= hit_tokens
        if host_tokens:
            self.stats.host_hits -= 1
            self.stats.host_hit_tokens -= host_tokens

    def _touch(self, b: "_Block | None") -> None:
        # Sliding pages: only those the boundary at `b`'s end reads (and the one before it), head first.
        # The rest of the chain was not used, so an old resume point on the way ages from its own last use.
        window, x = [], b
        for _ in range(self._depth):
            if x is None:
                break
            if x.sliding is not None:
                window.append(x.id)
            x = x.parent
        for bid in reversed(window):
            self._slru.move_to_end(bid)
        while b is not None:  # leaf first: the head of the chain ends up most recent
            self._lru.move_to_end(b.id)
            b = b.parent

    def _anchor(self, b: _Block) -> None:
        reanchor(b, alive=self._blocks.get(b.key) is b, depth=self._depth, lrus=(self._slru, self._hlru[SLIDING]))

    def mark_end(self, b: _Block) -> None:
        """A prompt ended with block `b`: the window before its end is a resume point."""
        if not b.end and self._blocks.get(b.key) is b:
            b.end = True
            self._note(8, b.id)
            self._anchor(b)

    # ---- insertion -----------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], full: Sequence[int], sliding: dict[int, int], *, start: int = 0,
               end: int | None = None, parent: "_Block | None" = None, prompt_end: int = 0) -> "_Block | None":
        """Cache blocks [start, end) of a sequence holding `tokens`: `full[j]` is block j's full page,
        `sliding` maps logical page -> sliding page for the sliding pages the sequence holds; `parent` is
        block start - 1 as an earlier insert returned it; `prompt_end`: the whole blocks of its prompt
        (block prompt_end - 1 is marked as a prompt's end, `mark_end`). A block already cached on the sequence's own
        page gains the sliding page it lacks; one in the host tier takes the sequence's pages instead of
        its slots. Returns the last block, or None where the sequence holds a
        copy of its own of a cached block (it computed the block beside another sequence): its later
        blocks are not hung below pages it does not hold, so that every sequence holds the cached pages
        of its blocks' ancestors, a cached page only the cache holds has no descendant a sequence holds,
        and each such page can be evicted (what `evictable` promises)."""
        ps = self.page_size
        end = min(len(tokens) // ps, len(full)) if end is None else end
        if start and (parent is None or self._blocks.get(parent.key) is not parent or parent.full is None):
            # A guard: the tail is on a page the sequence holds, so it cannot have been evicted; if it
            # was replaced anyway, walk from the head again.
            start, parent = 0, None
        new = 0
        for j in range(start, end):
            key = (parent.id if parent else 0, tuple(tokens[j * ps: (j + 1) * ps]))
            b = self._blocks.get(key)
            if b is not None and b.full is None:
                self._adopt_full(b, full[j])  # the sequence computed it again: its page, not the slot
            if b is not None and b.full != full[j]:
                self._touch(parent)
                self.stats.inserted_blocks += new
                return None
            if b is None:
                b = _Block(key, next(self._ids), parent, full[j])
                self.allocators[FULL].cache(full[j])
                self._note(4, b.id, full[j], hash(key))  # its tokens too (ints hash alike everywhere)
                self._blocks[key] = b
                self._lru[b.id] = b
                if parent is not None:
                    parent.children += 1
                    parent.device_children += 1
                    self._anchor(parent)  # a leaf no more, or a fork now
                self._anchor(b)
                new += 1
            if j == prompt_end - 1:
                self.mark_end(b)
            if b.sliding is None and j in sliding:
                self._adopt_sliding(b, sliding[j])
            parent = b
        self._touch(parent)
        self.stats.inserted_blocks += new
        return parent

    # ---- eviction ------------------------------------------------------------------------------
    def evictable(self, group: str) -> int:
        return self.allocators[group].evictable

    def evict(self, group: str, n: int) -> int:
        """Free at least `n` device pages of `group` held by the cache alone, least recently used first (a
        full page only from a block without device children, so a chain loses its tail first; sliding
        pages outside every resume point's window first, engine/prefix_windows.py), moving them to the
        host tier if there is one. Returns how many were freed (fewer if no more are evictable)."""
        alloc = self.allocators[group]
        freed = 0
        if group == SLIDING:  # picked first: evicting them changes no block's guard
            victims = list(itertools.islice((b for b in self._slru.values() if alloc.refs(b.sliding) == 1), max(0, n)))
            for b in victims:
                self._evict_sliding(b)
            freed = len(victims)
        for b in list(self._lru.values()) if group == FULL else ():
            if freed >= n:
                break
            if b.id in self._lru and b.device_children == 0 and alloc.refs(b.full) == 1:
                freed += 1
                self._evict_full(b)
        self.stats.evicted_pages[group] += freed
        self._flush()
        return freed

    def _evict_full(self, b: _Block) -> None:
        # Its parent becomes a device leaf and may go in the same sweep: it is later in LRU order (_touch).
        slot = self._host_slot(FULL)
        if slot is None:  # no host tier (or no slot left): the block goes
            if b.sliding is not None:
                self.stats.evicted_pages[SLIDING] += 1
            self._remove(b)
            return
        if b.sliding is not None:
            self._evict_sliding(b)
            self.stats.evicted_pages[SLIDING] += 1
        del self._lru[b.id]
        if b.parent is not None:
            b.parent.device_children -= 1
        self._save(FULL, b, slot, b.full)
        self.allocators[FULL].uncache(b.full)
        b.full, b.host_full = None, slot

    def _evict_sliding(self, b: _Block) -> None:
        slot = self._host_slot(SLIDING) if b.full is not None else None
        page = b.sliding
        self._drop_sliding(b)
        if slot is not None:
            self._save(SLIDING, b, slot, page)
            b.host_sliding = slot

    def _save(self, group: str, b: _Block, slot: int, page: int) -> None:
        """Queue device `page` -> host `slot` (copied in `_flush`, before the page can be written again)."""
        self._saves[group][slot] = page
        self._note(5, b.id, slot, page)
        self._hlru[group][b.id] = b  # most recent of the host tier: it left the device just now
        self.stats.to_host_pages += 1
        self.stats.to_host_bytes += self.host.page_bytes[group] * self.ranks

    def _flush(self) -> None:
        if self.host is None:
            return
        for g in GROUPS:
            if self._saves[g]:
                slots = sorted(self._saves[g])
                self.host.save(g, [self._saves[g][s] for s in slots], slots)
                self._saves[g].clear()

    def _host_slot(self, group: str) -> int | None:
        """A free host slot of `group`, dropping the least recently used host page for it if need be."""
        if self.host is None:
            return None
        slot = self.host.take(group)
        if slot is not None:
            return slot
        for b in self._hlru[group].values():
            if b.id in self._restoring or (group == FULL and b.children):
                continue
            self.stats.host_evicted_pages[group] += 1
            if group == FULL:
                self.stats.host_evicted_pages[SLIDING] += b.host_sliding is not None
                self._remove(b)
            else:
                self._host_free(SLIDING, b)
            return self.host.take(group)
        return None

    def _host_free(self, group: str, b: _Block) -> None:
        slot = b.host_full if group == FULL else b.host_sliding
        if slot is None:
            return
        self._saves[group].pop(slot, None)  # it left before its copy was made: nothing to copy
        self.host.give(group, slot)
        del self._hlru[group][b.id]
        if group == FULL:
            b.host_full = None
        else:
            b.host_sliding = None

    def _remove(self, b: _Block) -> None:
        """Drop block `b` from the cache, whichever tier its pages are in."""
        self._note(6, b.id)
        if b.children:  # only when the host tier had no slot for it: its (host) descendants go first
            for c in [c for c in self._blocks.values() if c.parent is b]:
                self._remove(c)
        del self._blocks[b.key]
        self._anchor(b)  # its window is no resume point any more
        if b.parent is not None:
            b.parent.children -= 1
            self._anchor(b.parent)  # a leaf again, or no fork
        if b.full is not None:
            del self._lru[b.id]
            if b.parent is not None:
                b.parent.device_children -= 1
            self.allocators[FULL].uncache(b.full)
        else:
            self._host_free(FULL, b)
        if b.sliding is not None:
            self._drop_sliding(b)
        self._host_free(SLIDING, b)

    def _drop_sliding(self, b: _Block) -> None:
        self._note(7, b.id, b.sliding)
        self.allocators[SLIDING].uncache(b.sliding)
        b.sliding = None
        del self._slru[b.id]

    def clear(self) -> None:
        """Drop every block (pages still used by sequences stay theirs)."""
        while self._blocks:
            leaves = [b for b in self._blocks.values() if b.children == 0]
            for b in leaves:
                self._remove(b)
