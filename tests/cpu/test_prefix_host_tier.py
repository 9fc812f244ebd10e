"""The prefix cache's host-memory tier (engine/host_tier.py under engine/prefix_cache.py): pages the device
evicts move to host slots and a hit copies them back byte for byte (random KV, never zeros), within the
tier's byte budget and least recently used first; pages a sequence holds or a lookup restores are never
taken; every reference is accounted under a random workload that evicts and restores all the time; and
greedy decoding on the tiny model with a host hit equals decoding without any cache."""

from __future__ import annotations

import random

import pytest
import torch

from kvrelay.engine.config import PRESETS
from kvrelay.engine.host_tier import HostKVStore, _runs
from kvrelay.engine.kv_cache import KVCache
from kvrelay.engine.kv_geometry import FULL, GROUPS, SLIDING, first_live_page
from kvrelay.engine.runner import Runner

from prefix_kv import check_references, fill, greedy, pair_bytes

CFG = PRESETS["tiny"]  # 3 layers: 1 full, 2 sliding; window 8
pytestmark = pytest.mark.usefixtures("model_single_thread")


def cache(pages: int, host_pairs: int, page_size: int = 4) -> KVCache:
    kv = KVCache(CFG, num_pages=pages, page_size=page_size)
    for g in GROUPS:  # random KV everywhere: a restore that copied nothing (or zeros) cannot pass
        kv.pools[g].copy_(torch.randn(kv.pools[g].shape, generator=torch.Generator().manual_seed(7)))
    kv.enable_prefix_cache(host_bytes=host_pairs * pair_bytes(kv))
    return kv


def test_store_round_trip_keeps_the_bytes():
    pools = {g: torch.randn(2, 10, 2, 4, 2, 8).to(torch.bfloat16) for g in GROUPS}
    store = HostKVStore(pools, budget_bytes=6 * sum(p[:, 0].numel() * 2 for p in pools.values()))
    assert store.capacity == 6 and not store.pinned  # pinned memory only for a CUDA pool
    want = {g: pools[g][:, [3, 7, 1]].clone() for g in GROUPS}
    slots = {g: [store.take(g) for _ in range(3)] for g in GROUPS}
    assert slots[FULL] == [0, 1, 2]
    for g in GROUPS:
        store.save(g, [3, 7, 1], [slots[g][0], slots[g][2], slots[g][1]])  # not in slot order
        pools[g].normal_()
        store.load(g, [slots[g][0], slots[g][2], slots[g][1]], [9, 0, 5])
        assert torch.equal(pools[g][:, [9, 0, 5]], want[g])
    assert store.used_bytes() == 3 * sum(store.page_bytes.values())
    assert list(_runs([4, 5, 6, 9, 2, 3])) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    with pytest.raises(ValueError, match="holds no page"):
        HostKVStore(pools, budget_bytes=100)


def test_an_evicted_prefix_comes_back_from_host_byte_for_byte():
    kv = cache(pages=8, host_pairs=16)
    a = list(range(100, 116))  # 4 blocks of 4
    fill(kv, "a", a)
    blocks = kv.seqs["a"].pages[FULL][:4]
    want_full = kv.pools[FULL][:, blocks].clone()
    first = first_live_page(SLIDING, 16, 4, CFG.sliding_window)  # the window before position 16
    sliding = {b.key[1]: b.sliding for b in kv.prefix._blocks.values()}
    want_sliding = kv.pools[SLIDING][:, [sliding[tuple(a[4 * j: 4 * j + 4])] for j in range(first, 4)]].clone()
    kv.free("a")
    fill(kv, "b", list(range(500, 532)))  # the whole pool: a's pages all go to host
    pc = kv.prefix
    assert pc.cached_pages()[FULL] == 8 and pc.host_pages() == {FULL: 4, SLIDING: 4}
    assert pc.stats.evicted_pages[FULL] == 4 and pc.stats.to_host_pages == 8
    kv.free("b")
    for g in GROUPS:  # whatever the device held of a is gone
        kv.pools[g].normal_()
    assert kv.begin_prefix("a2", a + [1]) == 16 and kv.host_hit("a2") == 16
    seq = kv.seqs["a2"]
    assert torch.equal(kv.pools[FULL][:, seq.pages[FULL]], want_full)
    assert seq.first_page[SLIDING] == first and torch.equal(kv.pools[SLIDING][:, seq.pages[SLIDING]], want_sliding)
    s = pc.stats
    assert (s.host_hits, s.host_hit_tokens, s.hit_tokens) == (1, 16, 16)
    assert s.to_device_pages == 4 + (4 - first)
    assert s.to_device_bytes == 4 * kv.prefix.host.page_bytes[FULL] + (4 - first) * kv.prefix.host.page_bytes[SLIDING]
    # One tier at a time: a's blocks are device blocks again, their host slots given back; b's went down.
    for blk in pc._blocks.values():
        assert (blk.full is None) != (blk.host_full is None)
        assert not (blk.sliding is not None and blk.host_sliding is not None)
    assert pc.host_pages()[FULL] == 4 and pc.summary()["host"]["hits"] == 1
    kv.free("a2")
    pc.clear()
    assert all(a.num_used == 0 for a in kv.allocators.values()) and pc.host_pages() == {FULL: 0, SLIDING: 0}
    assert pc.host.num_free(FULL) == pc.host.capacity


def test_the_host_tier_keeps_its_budget_and_drops_its_oldest_first():
    kv = cache(pages=8, host_pairs=4)
    chains = [list(range(10 * i, 10 * i + 8)) for i in range(1, 4)]  # A, B, C: 2 blocks each
    for i, c in enumerate(chains):
        fill(kv, f"c{i}", c)
        kv.free(f"c{i}")
    kv.reserve("big", 32)  # every device page: A, B, C (oldest first) leave; the host keeps 4 blocks
    pc = kv.prefix
    assert pc.host_pages() == {FULL: 4, SLIDING: 4} and pc.host.used_bytes() <= 4 * pair_bytes(kv)
    assert pc.stats.host_evicted_pages[FULL] == 2  # A's two blocks, tail first
    kept = {blk.key[1] for blk in pc._blocks.values()}
    assert kept == {tuple(c[j: j + 4]) for c in chains[1:] for j in (0, 4)}
    kv.free("big")
    assert kv.begin_prefix("a", chains[0] + [1]) == 0  # A was dropped
    assert kv.begin_prefix("b", chains[1] + [1]) == 8 and kv.host_hit("b") == 8
    for sid in ("a", "b"):
        kv.free(sid)
    pc.clear()


def test_a_hit_takes_what_the_device_can_spare_and_never_a_held_page():
    kv = cache(pages=8, host_pairs=16)
    a = list(range(100, 116))  # 4 blocks
    fill(kv, "a", a)
    kv.free("a")
    fill(kv, "hold1", list(range(300, 324)))  # 6 pages: a's blocks 3 and 2 leave to host
    kv.free("hold1")
    assert fill(kv, "touch", a[:8] + [1]) == 8  # a's blocks 0, 1 are the most recently used now
    kv.free("touch")
    fill(kv, "hold2", list(range(400, 420)))  # 5 pages: 5 of hold1's 6 blocks leave
    held = {g: list(kv.seqs["hold2"].pages[g]) for g in GROUPS}
    assert kv.allocators[FULL].num_free == 0 and kv.allocators[FULL].evictable == 3
    # Resuming at 16 would need blocks 2 and 3 back (2 full pages): only one can be had without taking
    # a page the hit itself shares (blocks 0, 1) or one hold2 holds; so block 2 comes back, a hit of 12.
    assert kv.begin_prefix("a2", a + [1]) == 12 and kv.host_hit("a2") == 4
    assert {g: kv.seqs["hold2"].pages[g] for g in GROUPS} == held
    kv.free("a2")
    kv.free("hold2")
    assert kv.begin_prefix("a3", a + [1]) == 16 and kv.host_hit("a3") == 4  # with room, all of it
    kv.free("a3")
    kv.prefix.clear()
    assert all(al.num_used == 0 for al in kv.allocators.values())


def test_a_block_computed_again_takes_its_device_page_back():
    kv = cache(pages=8, host_pairs=16)
    a = list(range(100, 116))
    fill(kv, "a", a)
    kv.free("a")
    kv.reserve("big", 32)
    kv.free("big")
    assert kv.prefix.host_pages()[FULL] == 4
    start = kv.begin_prefix("again", a, lookup=False)  # computes every position (prompt logprobs)
    assert start == 0
    kv.reserve("again", 16)
    kv.commit("again", 16)
    assert kv.prefix.host_pages() == {FULL: 0, SLIDING: 0} and kv.prefix.cached_pages()[FULL] == 4
    kv.free("again")
    kv.prefix.clear()


def kv_of(tokens: list[int], p: int, shape) -> torch.Tensor:
    """What a model would write at position p of a sequence holding `tokens`: a function of the prefix."""
    g = torch.Generator().manual_seed(hash(tuple(tokens[: p + 1])) & 0x7FFFFFFF)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("page_size", [4, 16])
def test_random_workload_restores_the_bytes_and_keeps_every_reference(page_size):
    """Random prompts from a few shared prefixes, written with KV that depends on the prefix, on a device
    pool and a host tier both small enough that pages move between them all the time: every hit's pages
    (restored from host or not) hold exactly the KV of its prefix; references, free lists and host slots
    add up after every operation; a page is in one tier at a time; at the end everything comes back."""
    rng = random.Random(page_size)
    kv = KVCache(CFG, num_pages=160 // page_size + 4, page_size=page_size)  # 44 pages of 4, 14 of 16
    kv.enable_prefix_cache(host_bytes=(24 if page_size == 4 else 8) * pair_bytes(kv))
    pc = kv.prefix
    ps = page_size
    heads = [[rng.randrange(50) for _ in range(rng.randrange(8, 60))] for _ in range(5)]

    def write(sid, tokens, start, n):
        seq = kv.seqs[sid]
        for p in range(start, start + n):
            for g in GROUPS:
                page = seq.pages[g][p // ps - seq.first_page[g]]
                kv.pools[g][:, page, :, p % ps] = kv_of(tokens, p, kv.pools[g][:, 0, :, 0].shape)

    def check_hit(sid, tokens, start):
        seq = kv.seqs[sid]
        for p in range(start):
            for g in GROUPS:
                j = p // ps - seq.first_page[g]
                if j >= 0:
                    want = kv_of(tokens, p, kv.pools[g][:, 0, :, 0].shape)
                    assert torch.equal(kv.pools[g][:, seq.pages[g][j], :, p % ps], want), (sid, p, g)

    def check():
        check_references(kv)
        for g in kv.allocators:
            slots = [b.host_full if g == FULL else b.host_sliding for b in pc._blocks.values()]
            slots = [s for s in slots if s is not None]
            assert len(slots) == len(set(slots)) == pc.host.capacity - pc.host.num_free(g)
        for b in pc._blocks.values():
            assert (b.full is None) != (b.host_full is None)
            assert b.sliding is None or b.host_sliding is None
            if b.full is None:
                assert b.sliding is None
            if b.full is not None and b.parent is not None:
                assert b.parent.full is not None  # device blocks are closed under parents
            kids = [c for c in pc._blocks.values() if c.parent is b]
            assert b.children == len(kids) and b.device_children == sum(c.full is not None for c in kids)

    live: dict[str, list] = {}  # sequence -> [tokens, positions written, decode steps left]
    hits = 0
    for step in range(500):
        r = rng.random()
        if live and (r < 0.25 or len(live) > 3):
            sid = rng.choice(sorted(live))
            del live[sid]
            kv.free(sid)
        elif r < 0.5 or not live:
            sid = f"s{step}"
            tokens = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            start = kv.begin_prefix(sid, tokens)
            check_hit(sid, tokens, start)
            hits += kv.host_hit(sid) > 0
            live[sid] = [tokens, start, rng.randrange(0, 12)]
        else:
            sid = rng.choice(sorted(live))
            tokens, at, steps = live[sid]
            n = min(rng.randrange(1, 24), len(tokens) - at) if at < len(tokens) else int(steps > 0)
            if n:
                free = kv.free_pages()
                need = {g: kv._missing(kv.seqs[sid], g, kv.seqs[sid].length + n) for g in GROUPS}
                if any(need[g] > free[g] for g in need):
                    del live[sid]
                    kv.free(sid)
                else:
                    if at >= len(tokens):
                        tokens.append(rng.randrange(50))
                        kv.extend_tokens(sid, tokens[-1:])
                        live[sid][2] = steps - 1
                    else:
                        live[sid][1] = at + n
                    kv.reserve(sid, n)
                    write(sid, tokens, kv.seqs[sid].length, n)
                    kv.commit(sid, n)
        check()
    for sid in live:
        kv.free(sid)
    check()
    s = pc.stats
    assert hits > 5 and s.host_hits == hits and s.to_device_pages > 0 and s.host_evicted_pages[FULL] > 0
    pc.clear()
    assert all(a.num_used == 0 for a in kv.allocators.values())
    assert all(pc.host.num_free(g) == pc.host.capacity for g in GROUPS)


# ---- the model: greedy tokens with a host hit -------------------------------------------------------

def test_greedy_tokens_after_a_host_hit_equal_no_cache():
    plain = Runner.load("tiny", dummy=True, seed=0, page_size=16, num_pages=96)
    small = Runner.load("tiny", dummy=True, seed=0, page_size=16, num_pages=12)
    small.kv.enable_prefix_cache(host_bytes=64 * pair_bytes(small.kv))
    system = [(i * 37 + 5) % 200 + 10 for i in range(100)]
    prompts = [system + [7, 8], [(i * 11) % 300 + 3 for i in range(150)], system[:90] + [4, 5, 6]]
    for i, p in enumerate(prompts):
        got, start = greedy(small, f"s{i}", p, 10)
        assert got == greedy(plain, f"p{i}", p, 10)[0], i
    # The third prompt resumed at 80 (it diverges inside block 5), most of it from blocks the second one
    # pushed to host (the device kept the head of the chain, the most recently used end).
    st = small.kv.prefix.stats
    assert start == 80 and st.host_hits == 1 and 0 < st.host_hit_tokens <= 80
    assert st.to_host_bytes > 0 and st.to_device_bytes > 0
    small.kv.prefix.clear()
    assert all(a.num_used == small.internal_pages()[g] for g, a in small.kv.allocators.items())


# ---- the topology key, preflight, status and /metrics -----------------------------------------------

def test_topology_key_is_validated_and_reaches_both_caching_roles():
    from kvrelay.cluster.specs import colocated_spec, prefill_spec
    from kvrelay.cluster.topology import TopologyError, parse_topology

    base = "model: {name: tiny, dummy: true}\ndevice: cpu\n"
    t = parse_topology(base, source="t.yaml")
    assert t.prefill.prefix_cache_host_gib == 0.0 and prefill_spec(t).prefix_cache_host_bytes == 0
    t = parse_topology(base + "prefill: {prefix_cache: true, prefix_cache_host_gib: 1.5}\ncolocate: true\n",
                       source="t.yaml")
    assert colocated_spec(t).prefix_cache_host_bytes == prefill_spec(t).prefix_cache_host_bytes == 3 << 29
    for value, why in (("yes", "prefill.prefix_cache_host_gib: expected a number"),
                       ("-1", "prefill.prefix_cache_host_gib: must be a number >= 0"),
                       (".nan", "prefill.prefix_cache_host_gib: must be a number >= 0")):
        with pytest.raises(TopologyError, match=f"^t.yaml: {why}"):
            parse_topology(base + f"prefill: {{prefix_cache: true, prefix_cache_host_gib: {value}}}\n", source="t.yaml")
    with pytest.raises(TopologyError, match="^t.yaml: prefill.prefix_cache_host_gib: .*prefill.prefix_cache: true"):
        parse_topology(base + "prefill: {prefix_cache_host_gib: 2}\n", source="t.yaml")


def test_preflight_checks_that_the_host_tiers_fit():
    from kvrelay.cluster.preflight import GIB, PreflightError, run_checks
    from kvrelay.cluster.topology import parse_topology

    text = ("model: {name: tiny, dummy: true, max_context: 1024}\ndevice: cpu\n"
            "router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}\n"
            "prefill: {workers: 2, max_prompt_tokens: 512, prefix_cache: true, prefix_cache_host_gib: GIB}\n")
    off = parse_topology(text.replace("GIB", "0"), source="t.yaml")
    assert run_checks(off, memory_bytes=lambda: 8 * GIB)[3].startswith("host tier  off")
    on = parse_topology(text.replace("GIB", "3"), source="t.yaml")
    assert "2 x 3 GiB" in run_checks(on, memory_bytes=lambda: 8 * GIB)[3]
    with pytest.raises(PreflightError, match=r"^t.yaml: prefill.prefix_cache_host_gib: 2 caching worker\(s\) x 3 GiB"):
        run_checks(on, memory_bytes=lambda: 5 * GIB)


def test_status_row_and_metrics_count_the_host_tier():
    from prometheus_client import REGISTRY

    from kvrelay.cluster import cache_metrics
    from kvrelay.cluster.status import _table

    kv = cache(pages=8, host_pairs=16)
    fill(kv, "a", list(range(100, 116)))
    kv.free("a")
    kv.reserve("big", 32)
    kv.free("big")
    assert kv.begin_prefix("a2", list(range(100, 117))) == 16
    pc = kv.prefix.summary()
    row = {"role": "colocated", "rank": 0, "tp_rank": 0, "tp_size": 1, "pid": 1, "node": "n", "healthy": True,
           "pages_in_use": {FULL: 1, SLIDING: 1}, "pages_total": {FULL: 8, SLIDING: 8}, "running": 0,
           "admitted": 0, "prefix_cache": pc}
    line = _table([row]).splitlines()[1]
    assert "host tier 1/2 hits, 16 tokens saved" in line and "MiB to host" in line

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = (value("kvrelay_prefix_cache_host_hits_total"),
              value("kvrelay_prefix_cache_host_bytes_total", direction="device_to_host"),
              value("kvrelay_prefix_cache_host_bytes_total", direction="host_to_device"))
    moved = kv.prefix.stats.host_bytes
    assert moved[0] > 0 and moved[1] > 0
    cache_metrics.observe(("test", 0), 16, moved)
    cache_metrics.observe(("test", 0), 0, moved)  # totals: the same bytes are not counted twice
    cache_metrics.observe(("test", 0), 0, (1, 1))  # a restarted worker counts from zero again
    after = (value("kvrelay_prefix_cache_host_hits_total"),
             value("kvrelay_prefix_cache_host_bytes_total", direction="device_to_host"),
             value("kvrelay_prefix_cache_host_bytes_total", direction="host_to_device"))
    assert [a - b for a, b in zip(after, before)] == [16, moved[0] + 1, moved[1] + 1]
