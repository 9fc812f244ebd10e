"""The prefix cache (engine/prefix_cache.py through engine/kv_cache.KVCache): bookkeeping (reference
counts, LRU eviction under pressure that never touches pages a sequence holds, every page back at the
end) and token-for-token equality of greedy decoding on the tiny model with and without the cache, for a
window smaller than a page (page 16, window 8) and larger (page 4), including prompts that diverge inside
the last window before the cached boundary."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.config import PRESETS
from kvrelay.engine.kv_cache import KVCache, OutOfPages
from kvrelay.engine.kv_geometry import FULL, SLIDING
from kvrelay.engine.runner import Runner

from prefix_kv import check_references, fill, greedy, in_use

CFG = PRESETS["tiny"]  # sliding_window 8
pytestmark = pytest.mark.usefixtures("model_single_thread")


def test_shared_pages_are_refcounted_and_all_come_back():
    kv = KVCache(CFG, num_pages=32, page_size=4)
    kv.enable_prefix_cache()
    a = list(range(100, 130))  # 30 tokens: 7 whole blocks
    assert fill(kv, "a", a, chunk=8) == 0
    assert len(kv.prefix) == 7
    # Same 30 tokens again: resume at 28 (the last whole block that leaves a token to compute).
    assert fill(kv, "b", a) == 28
    shared = kv.seqs["a"].pages[FULL][:7]
    assert kv.seqs["b"].pages[FULL][:7] == shared
    assert all(kv.allocators[FULL].refs(p) == 3 for p in shared)  # a, b, the cache
    kv.free("a")
    assert all(kv.allocators[FULL].refs(p) == 2 for p in shared)
    assert kv.allocators[FULL].evictable == 0  # b still uses every cached full page
    kv.free("b")
    assert kv.allocators[FULL].evictable == 7
    assert kv.free_pages() == {FULL: 32, SLIDING: 32}  # cached pages count as obtainable
    kv.prefix.clear()
    assert in_use(kv) == {FULL: 0, SLIDING: 0}


def test_a_hit_resumes_only_where_the_sliding_window_is_cached():
    kv = KVCache(CFG, num_pages=64, page_size=4)
    kv.enable_prefix_cache()
    a = list(range(40))
    fill(kv, "a", a, chunk=40)  # one forward: every block's sliding page reached the cache as it left
    kv.free("a")
    b = a[:22] + [999] * 10  # diverges inside block 5 (positions 20..23)
    assert kv.begin_prefix("b", b) == 20
    # Resuming at 20, the next query (20) sees 13..20: sliding pages 3 and 4 are the shared ones.
    assert kv.seqs["b"].first_page[SLIDING] == 3 and len(kv.seqs["b"].pages[SLIDING]) == 2
    kv.free("b")
    # Without the sliding pages of the window before 20, the best boundary is an earlier one.
    blocks = {b.key[1]: b for b in kv.prefix._blocks.values()}
    kv.prefix._drop_sliding(blocks[tuple(range(12, 16))])
    assert fill(kv, "c", b) == 12  # 12 needs pages 1, 2 (positions 5..11): still cached
    kv.free("c")
    kv.prefix.clear()
    assert in_use(kv) == {FULL: 0, SLIDING: 0}


def test_lru_eviction_under_pressure_never_evicts_pages_in_use():
    kv = KVCache(CFG, num_pages=12, page_size=4)
    kv.enable_prefix_cache()
    old, new = list(range(16)), list(range(50, 66))
    fill(kv, "old", old)
    kv.free("old")
    fill(kv, "new", new)
    kv.free("new")
    assert len(kv.prefix) == 8 and kv.allocators[FULL].num_free == 4
    assert fill(kv, "user", new) == 12  # pins 3 of new's blocks
    pinned = set(kv.seqs["user"].pages[FULL])
    assert kv.allocators[FULL].num_free == 3  # user computed block 3 into a page of its own
    # 8 pages: the 3 free, then old's 4 (least recently used, tail first), then new's unpinned tail.
    kv.reserve("big", 32)
    assert not pinned & set(kv.seqs["big"].pages[FULL])
    assert kv.prefix.stats.evicted_pages[FULL] == 5
    assert {b.key[1] for b in kv.prefix._blocks.values()} == {tuple(new[i:i + 4]) for i in (0, 4, 8)}
    with pytest.raises(OutOfPages):  # the pinned blocks are all that is left: never taken
        kv.reserve("more", 4)
    assert set(kv.seqs["user"].pages[FULL]) == pinned and len(kv.prefix) == 3
    kv.free("big")
    kv.free("user")
    kv.prefix.clear()
    assert in_use(kv) == {FULL: 0, SLIDING: 0}


def test_eviction_takes_a_chain_tail_first():
    kv = KVCache(CFG, num_pages=16, page_size=4)
    kv.enable_prefix_cache()
    fill(kv, "a", list(range(16)))
    kv.free("a")
    kv.prefix.evict(FULL, 1)
    assert {b.key[1] for b in kv.prefix._blocks.values()} == {tuple(range(i, i + 4)) for i in (0, 4, 8)}
    assert fill(kv, "b", list(range(16))) == 12


# ---- the model: greedy tokens with and without the cache --------------------------------------------

def runner(page_size: int) -> Runner:
    return Runner.load("tiny", dummy=True, seed=0, page_size=page_size, num_pages=96)


SYSTEM = [(i * 37 + 5) % 200 + 10 for i in range(45)]


@pytest.mark.parametrize("page_size", [4, 16])
def test_greedy_tokens_equal_with_and_without_the_cache(page_size):
    prompts = [SYSTEM + [7, 8, 9],  # fills the cache
               SYSTEM + [11, 12],  # shares the system prompt
               SYSTEM[:41] + [3, 4, 5, 6, 7],  # diverges at 41, inside the window before a boundary
               SYSTEM + [7, 8, 9],  # the whole first prompt again
               SYSTEM[:30] + [50] * 20]
    plain = runner(page_size)
    want = [greedy(plain, f"p{i}", p, 12, chunk=16)[0] for i, p in enumerate(prompts)]
    cached = runner(page_size)
    cached.kv.enable_prefix_cache()
    got, hits = zip(*(greedy(cached, f"c{i}", p, 12, chunk=16) for i, p in enumerate(prompts)))
    assert list(got) == want
    ps = page_size
    assert hits[0] == 0 and all(h > 0 and h % ps == 0 for h in hits[1:])
    assert hits[2] == 40 // ps * ps and hits[3] == (len(prompts[3]) - 1) // ps * ps
    assert cached.kv.prefix.stats.hit_tokens == sum(hits)
    cached.kv.prefix.clear()
    assert cached.free_pages() == plain.free_pages()


def test_the_shared_sliding_pages_are_read():
    """Control for the test above: a hit that attends over wrong sliding-window KV changes the tokens."""
    prompt = SYSTEM + [7, 8, 9]
    r = runner(16)
    r.kv.enable_prefix_cache()
    want, _ = greedy(r, "a", prompt, 12, chunk=16)
    hit = r.kv.prefix.lookup(prompt, len(prompt) - 1)
    assert hit is not None and hit.tokens == 32
    r.kv.pools[SLIDING][:, list(hit.sliding)] = 0.0
    got, start = greedy(r, "b", prompt, 12, chunk=16)
    assert start == 32 and got != want


def test_topology_switch():
    from kvrelay.cluster.specs import colocated_spec, prefill_spec
    from kvrelay.cluster.topology import TopologyError, parse_topology

    base = "model: {name: tiny, dummy: true}\ndevice: cpu\n"
    t = parse_topology(base, source="t.yaml")
    assert t.prefill.prefix_cache is False and prefill_spec(t).prefix_cache is False
    t = parse_topology(base + "prefill: {prefix_cache: true}\ncolocate: true\n", source="t.yaml")
    assert colocated_spec(t).prefix_cache is True
    with pytest.raises(TopologyError, match="prefill.prefix_cache: expected a boolean"):
        parse_topology(base + "prefill: {prefix_cache: 1}\n", source="t.yaml")
    # A TP prefill group caches too (every rank alike); colocated workers still run at tp 1 only.
    t = parse_topology(base + "prefill: {prefix_cache: true, tp: 2, prefix_cache_host_gib: 1}\n", source="t.yaml")
    assert prefill_spec(t).prefix_cache is True and prefill_spec(t).tp == 2
    assert prefill_spec(t).prefix_cache_host_bytes == 1 << 30  # the group's; each rank keeps 1/tp
    with pytest.raises(TopologyError, match="t.yaml.*prefill.tp: colocated workers run at tp 1"):
        parse_topology(base + "prefill: {prefix_cache: true, tp: 2}\ndecode: {tp: 2}\ncolocate: true\n",
                       source="t.yaml")


def test_generated_tokens_are_cached_too():
    """What a sequence generates (extend_tokens, fed back by decode steps) is offered like its prompt: the
    next turn, which repeats the conversation so far, resumes inside the previous answer."""
    prompt = SYSTEM + [7, 8, 9]  # 48 tokens
    plain, cached = runner(16), runner(16)
    cached.kv.enable_prefix_cache()

    def run(r, sid, p, n):
        start = r.kv.begin_prefix(sid, p) if r.kv.prefix is not None else 0
        logits = r.extend(sid, p[start:])
        out = [int(logits.argmax())]
        for _ in range(n - 1):
            r.kv.extend_tokens(sid, out[-1:])
            out.append(int(r.decode([sid], [out[-1]])[0].argmax()))
        r.free(sid)
        return out, start

    first, _ = run(cached, "a", prompt, 30)  # positions 0..76 written: 4 whole blocks
    assert run(plain, "a", prompt, 30)[0] == first
    turn = prompt + first + [5, 6, 7]
    got, start = run(cached, "b", turn, 10)
    assert start == 64 > len(prompt)
    assert got == run(plain, "b", turn, 10)[0]


@pytest.mark.parametrize("page_size", [4, 16])
def test_random_workload_keeps_every_reference_accounted(page_size):
    """Random prompts from a few shared prefixes, chunked, some decoding (extend_tokens), freed in random
    order, on a pool small enough that eviction runs all the time: after every operation each page's
    reference count is exactly its holders (sequences' tables + the cache), free + used is the pool, the
    evictable count is the cache-only pages, and at the end every page comes back."""
    import random

    rng = random.Random(page_size)
    kv = KVCache(CFG, num_pages=48, page_size=page_size)
    kv.enable_prefix_cache()
    heads = [[rng.randrange(50) for _ in range(rng.randrange(8, 60))] for _ in range(4)]

    def check():
        check_references(kv)
        # A block some sequence holds has a parent some sequence holds: cache-only pages have no held
        # descendants, so eviction (leaves first) can take every one `evictable` counts.
        refs = kv.allocators[FULL].refs
        for blk in kv.prefix._blocks.values():
            if blk.parent is not None and refs(blk.full) > 1:
                assert refs(blk.parent.full) > 1

    live: dict[str, list] = {}  # sequence -> [tokens, positions written, decode steps left]
    for step in range(600):
        r = rng.random()
        if live and (r < 0.2 or len(live) > 4):
            sid = rng.choice(sorted(live))
            del live[sid]
            kv.free(sid)
        elif r < 0.45 or not live:  # begin another one, maybe beside others that share its head
            sid = f"s{step}"
            tokens = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            live[sid] = [tokens, kv.begin_prefix(sid, tokens), rng.randrange(0, 20)]
        else:  # advance one of them: a prompt chunk, or a decode step once its prompt is in
            sid = rng.choice(sorted(live))
            tokens, at, steps = live[sid]
            n = min(rng.randrange(1, 24), len(tokens) - at) if at < len(tokens) else int(steps > 0)
            if n:
                free = kv.free_pages()
                need = {g: kv._missing(kv.seqs[sid], g, kv.seqs[sid].length + n) for g in (FULL, SLIDING)}
                if any(need[g] > free[g] for g in need):  # not promised: give this one up
                    del live[sid]
                    kv.free(sid)
                else:  # promised by free_pages(): must succeed, evicting what it takes
                    if at >= len(tokens):
                        kv.extend_tokens(sid, [rng.randrange(50)])
                        live[sid][2] = steps - 1
                    else:
                        live[sid][1] = at + n
                    kv.reserve(sid, n)
                    kv.commit(sid, n)
        check()
    for sid in live:
        kv.free(sid)
    check()
    assert kv.prefix.stats.hits > 0 and sum(kv.prefix.stats.evicted_pages.values()) > 0
    kv.prefix.clear()
    assert in_use(kv) == {FULL: 0, SLIDING: 0}


def test_two_sequences_computing_one_prefix_keep_the_count_of_evictable_pages_true():
    """Two prompts with one prefix computed side by side (both began before either committed): the second
    one's blocks are not hung under the first one's pages, so a cached page nobody uses is always one
    that eviction can take, and a reservation that free_pages() allows always succeeds."""
    kv = KVCache(CFG, num_pages=16, page_size=4)
    kv.enable_prefix_cache()
    head = list(range(8))
    assert kv.begin_prefix("a", head + [50] * 4) == 0 and kv.begin_prefix("b", head + [60] * 8) == 0
    for sid, n in (("a", 12), ("b", 16)):
        kv.reserve(sid, n)
        kv.commit(sid, n)
    kv.free("a")  # a's blocks are cache-only now; b holds its own copy of the head
    want = kv.free_pages()[FULL]
    kv.reserve("c", want * 4)  # every page free_pages() promised
    assert kv.allocators[FULL].num_free == 0
    kv.free("c")
    kv.free("b")
    kv.prefix.clear()
    assert in_use(kv) == {FULL: 0, SLIDING: 0}
