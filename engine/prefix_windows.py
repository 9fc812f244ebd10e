"""Which sliding-window pages of the prefix cache resume something, and the order the sliding group evicts
in (engine/prefix_cache.py keeps the blocks; this module only ranks their sliding pages). Torch-free.

A cached chain can be resumed at block boundary B only if the sliding pages of the last window before B
are cached. So a sliding page is worth what the boundaries whose window it lies in are worth, and most of
a long chain's boundaries are worth nothing: a later prompt resumes where an earlier one ended or forked,
not in the middle of it. The sliding pool is small next to the full one (engine/memory.py: running windows
plus a share of the budget for the cache), and under plain LRU a chain's pages leave leaf first (they are
touched leaf to root), so the window a conversation's next turn needs was the first to go.

An *anchor* is a cached block at whose end a later prompt is likely to resume: a leaf (no cached child:
the end of a prompt, or of an answer a colocated worker generated), a fork (two or more children: prompts
that share a head and diverge), or a block some prompt ended in (`_Block.end`: the next turn of a chat
repeats the prompt and diverges right after it, since harmony renders the previous answer without its
analysis). Each block counts the anchors whose window covers it (`guard`): an anchor covers itself and
its `window_depth` nearest ancestors, the blocks of the window before its end (window_depth(128, 16) = 8)
and one more: the window before its start, since a prompt repeated whole must leave its last token to
compute and so, at a multiple of page_size, resumes a block short (9 pages at 20b: kv_geometry's
window_pages). Counts change only when the tree does (a block cached or dropped, a child added or
removed, a prompt end marked), each change walking that many blocks, so ranking costs nothing at
eviction time.

The sliding group evicts unguarded pages first (mid-chain pages that resume nothing alone), then guarded
ones, each class least recently used first (`WindowLRU`). A hit or an insert touches only the sliding
pages of the window it resumed or ended after (PrefixCache._touch), not its whole chain: so under pressure
on guarded pages a resume point ages from its own last use, and the ones no turn comes back to (an old
answer a later turn diverged from, an earlier turn's prompt end) go before the latest one of any chain.
The host tier's sliding slots drop in the same order. Everything is deterministic in the cache's calls
(insertion-ordered dicts, counters), as TP ranks running the cache in lockstep need.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator


def window_depth(window: int, page_size: int) -> int:
    """Blocks whose sliding pages the window before a block boundary needs (fewer near a chain's head):
    logical pages first_live_page(SLIDING, B) .. B/page_size - 1 of kv_geometry, i.e. ceil((window-1)/ps)."""
    return -(-(window - 1) // page_size)


class WindowLRU:
    """Blocks with a page of the sliding group in one tier (device or host), in eviction order: unguarded
    ones least recently used first, then guarded ones likewise. Dict-like over block ids, like the plain
    OrderedDict the full group uses; `regroup` moves a block whose guard changed (to the most recent end
    of its new class)."""

    def __init__(self) -> None:
        self._plain: collections.OrderedDict[int, object] = collections.OrderedDict()
        self._guarded: collections.OrderedDict[int, object] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._plain) + len(self._guarded)

    def __contains__(self, bid: int) -> bool:
        return bid in self._plain or bid in self._guarded

    def __setitem__(self, bid: int, b) -> None:
        """Add (or re-add) `b` as the most recent of its class."""
        self._plain.pop(bid, None)
        self._guarded.pop(bid, None)
        (self._guarded if b.guard else self._plain)[bid] = b

    def __delitem__(self, bid: int) -> None:
        if self._plain.pop(bid, None) is None:
            del self._guarded[bid]

    def move_to_end(self, bid: int) -> None:
        (self._plain if bid in self._plain else self._guarded).move_to_end(bid)

    def values(self) -> Iterator:
        """Eviction order (the caller must not change the LRU while it iterates)."""
        return itertools.chain(self._plain.values(), self._guarded.values())

    def guarded(self) -> int:
        return len(self._guarded)

    def regroup(self, b) -> None:
        src, dst = (self._plain, self._guarded) if b.guard else (self._guarded, self._plain)
        if b.id in src:
            dst[b.id] = src.pop(b.id)


def reanchor(b, *, alive: bool, depth: int, lrus: tuple[WindowLRU, ...]) -> None:
    """Decide again whether block `b` is an anchor (it is cached, `alive`, and is a leaf, a fork or a
    prompt's end) and, if that changed, add or take its count from the guards of the `depth` blocks its
    windows cover (itself and its depth - 1 nearest ancestors), moving those whose guard crossed zero
    between the classes of `lrus`."""
    want = alive and (b.children != 1 or b.end)
    if want == b.anchor:
        return
    b.anchor = want
    delta = 1 if want else -1
    x = b
    for _ in range(depth):
        if x is None:
            break
        was = x.guard > 0
        x.guard += delta
        if (x.guard > 0) != was:
            for lru in lrus:
                lru.regroup(x)
        x = x.parent
