"""The prefix cache on a TP group (engine/prefix_cache.py under engine/kv_cache.py, one cache per rank):
ranks that make the same calls in the same order take the same hits into the same pages, evict the same
pages and use the same host slots, so their digests stay equal; each rank's pages (and host slots) hold
its own shard's KV, byte for byte, through evictions to the host tier and restores from it; a rank that
saw one call more disagrees at once by its digest; the group's host tier is split over the ranks and
its byte counters count the whole group (a TP1 cache of the same pool, driven alike, counts the same).
The forwards are simulated: every written position gets a value derived from the tokens up to it and the
rank, so a page that came from the wrong prefix, the wrong rank or a stale slot cannot pass."""

from __future__ import annotations

import random

import pytest
import torch

from kvrelay.engine.config import PRESETS
from kvrelay.engine.kv_cache import KVCache
from kvrelay.engine.kv_geometry import GROUPS, SLIDING
from kvrelay.engine.parallel import ParallelContext

from prefix_kv import pair_bytes

CFG = PRESETS["tiny"]  # 2 KV heads (one per rank at TP2); window 8
PS = 4
PAGES = 40


def caches(tp: int, host_pairs: int) -> list[KVCache]:
    out = [KVCache(CFG, num_pages=PAGES, page_size=PS, dtype=torch.float32,
                   shard=ParallelContext(rank=r, world_size=tp)) for r in range(tp)]
    group_bytes = host_pairs * pair_bytes(out[0]) * tp  # the group's tier: host_pairs blocks on every rank
    for kv in out:
        kv.enable_prefix_cache(host_bytes=group_bytes)
    return out


def value(tokens: list[int], pos: int, rank: int) -> float:
    """What a forward writes at `pos` of a sequence of `tokens` on `rank` (exact in float32)."""
    return float(hash(tuple(tokens[: pos + 1])) % 100_000 + rank * 1_000_000)


def run(kv: KVCache, sid: str, tokens: list[int]) -> int | None:
    """A prompt under the cache as a prefill rank runs it (prefill_worker/ranks.begin_cached, finish_cached): resume
    after the hit, compute the rest in chunks of 5, each position written with its value; None (nothing
    kept, the lookup uncounted) if the pool has no room."""
    start = kv.begin_prefix(sid, tokens)
    if not kv.can_allocate(len(tokens) - start, length=start):
        kv.free(sid)
        kv.prefix.retract(len(tokens), start, kv.host_hit(sid))
        return None
    for s in range(start, len(tokens), 5):
        n = min(5, len(tokens) - s)
        kv.reserve(sid, n)
        plan = kv.plan_lists([(sid, n)])
        for g in GROUPS:
            for i, pos in enumerate(plan["positions"]):
                kv.pools[g][:, plan["w_pages"][g][i], :, plan["w_offsets"][g][i]] = value(tokens, pos, kv.tp_rank)
        kv.commit(sid, n)
    return start


def check_kv(kv: KVCache, sid: str, tokens: list[int]) -> None:
    """Every position the sequence's pages hold has its own prefix's value on this rank."""
    seq = kv.seqs[sid]
    for g in GROUPS:
        first = seq.first_page[g]
        lo = max(0, seq.length - CFG.sliding_window + 1) if g == SLIDING else 0
        for i, page in enumerate(seq.pages[g]):
            for off in range(PS):
                pos = (first + i) * PS + off
                if lo <= pos < seq.length:
                    got = kv.pools[g][:, page, :, off]
                    want = value(tokens, pos, kv.tp_rank)
                    assert bool((got == want).all()), f"{sid} {g} position {pos} on rank {kv.tp_rank}"


def state(kv: KVCache) -> tuple:
    seqs = {sid: (s.length, {g: list(s.pages[g]) for g in GROUPS}, dict(s.first_page)) for sid, s in kv.seqs.items()}
    return kv.prefix.digest, seqs, kv.prefix.summary(), kv.free_pages()


def workload(seed: int, steps: int):
    """Prompts from a few shared system prompts that diverge anywhere (inside a window, at a page
    boundary, past it), repeats, and sequences held a while (as leases are) before they are freed."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 500) for _ in range(rng.randrange(10, 40))] for _ in range(4)]
    held: list[str] = []
    seen: list[list[int]] = []
    for i in range(steps):
        if held and (len(held) > 3 or rng.random() < 0.4):
            yield "free", held.pop(rng.randrange(len(held))), None
            continue
        if seen and rng.random() < 0.25:
            tokens = list(rng.choice(seen))
        else:
            base = rng.choice(systems)
            tokens = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 25))]
        seen.append(tokens)
        sid = f"s{i}"
        held.append(sid)
        yield "run", sid, tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ranks_making_the_same_calls_never_diverge(seed):
    ranks = caches(2, host_pairs=12)
    solo, = caches(1, host_pairs=12)  # the same pool at TP1: the same decisions, the group's bytes
    assert ranks[0].prefix.host.capacity == ranks[1].prefix.host.capacity == solo.prefix.host.capacity == 12
    prompts: dict[str, list[int]] = {}
    for op, sid, tokens in workload(seed, 160):
        if op == "free":
            for kv in (*ranks, solo):
                kv.free(sid)
        else:
            starts = {run(kv, sid, tokens) for kv in (*ranks, solo)}
            assert len(starts) == 1, f"{sid}: hits {starts}"
            if starts != {None}:
                prompts[sid] = tokens
                for kv in ranks:
                    check_kv(kv, sid, tokens)
            else:
                for kv in (*ranks, solo):
                    assert sid not in kv.seqs
        a, b, c = (state(kv) for kv in (*ranks, solo))
        assert a == b, f"after {op} {sid}: the ranks' caches differ"
        assert a == c, f"after {op} {sid}: TP2 decided otherwise than TP1"
    pc = ranks[0].prefix.summary()
    # The workload exercised what lockstep has to agree on: hits, evictions to host, host hits, drops.
    assert pc["hits"] > 20 and pc["evicted_pages"]["full"] > 10
    assert pc["host"]["hits"] > 0 and pc["host"]["to_device_pages"] > 0 and pc["host"]["evicted_pages"]["full"] > 0
    assert pc["host"]["to_host_bytes"] == solo.prefix.summary()["host"]["to_host_bytes"] > 0
    # Each rank moved half of those bytes (its KV head); the counters are the group's.
    assert ranks[0].prefix.host.page_bytes == {g: b // 2 for g, b in solo.prefix.host.page_bytes.items()}
    for sid in list(ranks[0].seqs):
        for kv in (*ranks, solo):
            kv.free(sid)
    for kv in ranks:
        assert kv.free_pages() == {g: PAGES for g in GROUPS}  # only evictable, cache-held pages remain


def test_one_call_more_on_one_rank_shows_in_the_digest():
    a, b = caches(2, host_pairs=4)
    prompt = list(range(1, 30))
    for kv in (a, b):
        run(kv, "x", prompt)
        kv.free("x")
    assert a.prefix.digest == b.prefix.digest != 0
    run(a, "y", prompt + [7])  # a hit on rank 0 alone
    assert a.prefix.digest != b.prefix.digest
    run(b, "y", prompt + [7])
    assert a.prefix.digest == b.prefix.digest  # the same calls: the same state again
    run(a, "z", [5] * 20)
    run(b, "z", [6] * 20)  # other tokens: other blocks cached
    assert a.prefix.digest != b.prefix.digest


def test_the_group_host_tier_is_split_over_the_ranks():
    ranks = caches(2, host_pairs=6)
    for kv in ranks:
        assert kv.prefix.host.bytes_total == 6 * pair_bytes(kv)  # half the group's bytes each
        assert kv.prefix.summary()["host"]["bytes_total"] == 2 * 6 * pair_bytes(kv)  # reported for the group


def test_begin_and_finish_cached_on_a_runner(model_single_thread):
    """The two halves every rank runs (prefill_worker/ranks.py) on a real Runner: a hit resumes after
    the cached prefix and the forward of the rest gives the plain prefill's greedy token; without room
    the sequence is gone and its lookup uncounted (nothing changed but the LRU); a prompt that wants every
    position's logits is not looked up."""
    from kvrelay.engine.runner import Runner
    from kvrelay.prefill_worker.ranks import begin_cached, finish_cached

    system = [(i * 37 + 5) % 200 + 10 for i in range(45)]
    plain = Runner.load("tiny", dummy=True, seed=0, page_size=16, num_pages=8)
    cached = Runner.load("tiny", dummy=True, seed=0, page_size=16, num_pages=8)
    cached.kv.enable_prefix_cache()
    for i, prompt in enumerate([system + [7, 8], system[:40] + [3, 4, 5]]):  # the second diverges in a window
        begun = begin_cached(cached, f"c{i}", prompt)
        assert begun.room and begun.start == (0, 32)[i] and begun.digest == cached.kv.prefix.digest
        logits = finish_cached(cached, f"c{i}", prompt, begun)
        assert int(logits.argmax()) == int(plain.prefill(f"p{i}", prompt).argmax())
        cached.free(f"c{i}")
        plain.free(f"p{i}")
    stats = cached.kv.prefix.summary()
    held = cached.kv.allocators["full"].num_used
    big = system + list(range(300, 400))  # 145 tokens: more than 8 pages can hold with the cache's
    cached.prefill("hold", list(range(500, 560)))  # 4 pages held by a sequence
    begun = begin_cached(cached, "big", big)
    assert not begun.room and not cached.has_sequence("big") and finish_cached(cached, "big", big, begun) is None
    assert {k: v for k, v in cached.kv.prefix.summary().items() if k in ("queries", "hits", "hit_tokens")} == {
        k: stats[k] for k in ("queries", "hits", "hit_tokens")}
    cached.free("hold")
    assert cached.kv.allocators["full"].num_used == held
    every = begin_cached(cached, "all", system + [7, 8], all_logits=True)
    assert every.start == 0 and every.room
    assert finish_cached(cached, "all", system + [7, 8], every, all_logits=True).shape[0] == 47
