"""What the prefix-cache tests of tests/cpu (test_prefix_cache, test_prefix_host_tier, test_prefix_cache_tp,
test_prefix_windows) drive a KVCache with and check it by: a prompt filled as a forward would fill it (no
model), the bytes one cached block holds, the reference accounting every page must satisfy, and greedy
decoding through a Runner whose cache may resume the prompt."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrelay.engine.kv_cache import KVCache
from kvrelay.engine.kv_geometry import FULL

if TYPE_CHECKING:
    from kvrelay.engine.runner import Runner


def fill(kv: KVCache, sid, tokens, chunk: int | None = None) -> int:
    """begin_prefix + reserve/commit in chunks (all the rest at once by default), as a forward would (no
    model): returns the hit."""
    start = kv.begin_prefix(sid, tokens)
    at = start
    while at < len(tokens):
        n = min(chunk or len(tokens), len(tokens) - at)
        kv.reserve(sid, n)
        kv.commit(sid, n)
        at += n
    return start


def in_use(kv: KVCache) -> dict[str, int]:
    return {g: a.num_used for g, a in kv.allocators.items()}


def pair_bytes(kv: KVCache) -> int:
    """The bytes of one block: a page of every group, K and V (the unit host-tier budgets are given in)."""
    return sum(p[:, 0].numel() * p.element_size() for p in kv.pools.values())


def check_references(kv: KVCache) -> None:
    """Each device page's reference count is exactly its holders (sequences' tables + the cache), free +
    used is the pool, and the evictable count is the cache-only pages."""
    for g, alloc in kv.allocators.items():
        holders: dict[int, int] = {}
        for s in kv.seqs.values():
            for p in s.pages[g]:
                holders[p] = holders.get(p, 0) + 1
        cached = {b.full if g == FULL else b.sliding for b in kv.prefix._blocks.values()} - {None}
        for p in cached:
            holders[p] = holders.get(p, 0) + 1
        assert {p: alloc.refs(p) for p in holders} == holders
        assert alloc.num_used == len(holders) and alloc.num_free + alloc.num_used == alloc.num_pages
        assert alloc.evictable == sum(1 for p in cached if holders[p] == 1)


def greedy(r: Runner, sid, prompt: list[int], n: int, chunk: int | None = None) -> tuple[list[int], int]:
    """`n` greedy tokens after `prompt` (resumed where the runner's prefix cache, if any, has it; the rest
    in forwards of `chunk` tokens, all at once by default), the sequence freed: (tokens, resumed at)."""
    start = r.kv.begin_prefix(sid, prompt) if r.kv.prefix is not None else 0
    at, logits = start, None
    while at < len(prompt):
        logits = r.extend(sid, prompt[at: at + (chunk or len(prompt))])
        at += chunk or len(prompt)
    out = [int(logits.argmax())]
    for _ in range(n - 1):
        out.append(int(r.decode([sid], [out[-1]])[0].argmax()))
    r.free(sid)
    return out, start
