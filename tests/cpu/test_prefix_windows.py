"""The prefix cache's sliding group under pressure (engine/prefix_windows.py) and its pool share
(engine/memory.py, prefill.prefix_cache_sliding_share): on a sliding pool much smaller than the full one,
multi-turn conversations keep resuming at their deepest boundary (plain LRU lost it: chains lose their
sliding pages leaf first), issue 16's H200 workload on 20b's pool geometry included; eviction takes mid-chain pages before the windows of leaves, forks and prompt
ends, never a page a sequence holds, and the host tier keeps the same order; each block's guard is
exactly the anchors covering it through a random workload; greedy decoding of such a conversation on the
tiny model equals decoding without the cache; and the pool split gives the cache its share of windows."""

from __future__ import annotations

import random

import pytest
from prefix_kv import check_references, fill, in_use, pair_bytes

from kvrelay.engine.config import PRESETS, load_model_config
from kvrelay.engine.kv_cache import KVCache
from kvrelay.engine.kv_geometry import FULL, GROUPS, SLIDING, first_live_page
from kvrelay.engine.memory import GIB, split_pages
from kvrelay.engine.prefix_windows import window_depth
from kvrelay.engine.runner import Runner

CFG = PRESETS["tiny"]  # window 8: at 4-token pages a boundary needs the sliding pages of its last 2 blocks
PS = 4
pytestmark = pytest.mark.usefixtures("model_single_thread")


def turn(kv: KVCache, sid: str, prompt: list[int], answer: list[int], chunk: int = 8) -> int:
    """One chat turn as a colocated worker runs it (no model): the prompt after its hit in chunks, then
    the answer fed back a token a step (the last one sampled is never written); returns the hit."""
    start = at = kv.begin_prefix(sid, prompt)
    while at < len(prompt):
        n = min(chunk, len(prompt) - at)
        kv.reserve(sid, n)
        kv.commit(sid, n)
        at += n
    for t in answer[:-1]:
        kv.extend_tokens(sid, [t])
        kv.reserve(sid, 1)
        kv.commit(sid, 1)
    kv.free(sid)
    return start


def conversations(kv: KVCache, n_conv: int, turns: int, seed: int = 0) -> list[tuple[int, int]]:
    """`n_conv` chats taking turns, each prompt the chat so far plus a new message: (hit, the deepest
    boundary the chat's previous turn wrote) per turn after the first."""
    rng = random.Random(seed)
    hist: dict[int, list[int]] = {c: [] for c in range(n_conv)}
    out = []
    for t in range(turns):
        for c in range(n_conv):
            prompt = hist[c] + [rng.randrange(100, 1000) for _ in range(rng.randrange(6, 14))]
            answer = [rng.randrange(100, 1000) for _ in range(rng.randrange(6, 14))]
            hit = turn(kv, f"{c}.{t}", prompt, answer)
            if t:
                out.append((hit, (len(hist[c]) - 1) // PS * PS))
            hist[c] = prompt + answer
    return out


def test_conversations_resume_at_their_deepest_boundary_on_a_small_sliding_pool():
    # 3 chats x 5 turns on 20 sliding pages (a running turn holds up to 5): plain LRU resumed the later
    # turns far short of the previous answer's end (224 of the 548 positions: a chain lost its sliding
    # pages leaf first); keeping the resume points' windows resumes every turn at its deepest boundary.
    kv = KVCache(CFG, num_pages={FULL: 400, SLIDING: 20}, page_size=PS)
    kv.enable_prefix_cache()
    got = conversations(kv, 3, 5)
    assert kv.prefix.stats.evicted_pages[SLIDING] > 30 and kv.prefix.stats.evicted_pages[FULL] == 0
    assert [h for h, _ in got] == [best for _, best in got]
    assert sum(best for _, best in got) == 548
    kv.prefix.clear()
    assert in_use(kv) == {FULL: 0, SLIDING: 0}



def test_the_h200_multi_turn_workload_resumes_every_turn_on_the_old_sliding_pool():
    """Issue 16's workload (8 conversations x 7 turns over a 6k system prompt, 8k..32k prompts, 256-token
    answers, prompts in 8192-token chunks) on 20b's pool geometry (window 128, 16-token pages, 275,657
    full pages) with the sliding pool it had on the H200 (5,633 pages, no cache share): every turn
    resumes at the deepest boundary (939,264 positions, all the host tier reached there). Plain LRU
    resumed 695,600 here (856k on the GPU, where the turns overlapped). Tiny heads keep the pools small."""
    import dataclasses

    cfg = dataclasses.replace(CFG, num_hidden_layers=2, num_key_value_heads=1, num_attention_heads=1, head_dim=2,
                              sliding_window=128)
    ps = 16
    kv = KVCache(cfg, num_pages={FULL: 275657, SLIDING: 5633}, page_size=ps)
    pc = kv.enable_prefix_cache()
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(6144)]
    hist = {c: list(system) for c in range(8)}
    got = want = 0
    for t in range(7):
        for c in range(8):
            prompt = hist[c] + [rng.randrange(1000) for _ in range(2048 if t == 0 else 3840)]
            answer = [rng.randrange(1000) for _ in range(256)]
            hit = turn(kv, f"{c}.{t}", prompt, answer, chunk=8192)
            best = (len(hist[c]) - 1) // ps * ps if t else (6144 if c else 0)
            assert hit == best, (c, t)
            got, want = got + hit, want + best
            hist[c] = prompt + answer
    assert got == want == 939264 and pc.stats.evicted_pages[SLIDING] > 8000

def block(kv: KVCache, tokens: list[int], j: int):
    """Block j of a cached chain of `tokens`."""
    return kv.prefix._chain(tokens, j + 1)[j]


def sliding_gone(kv: KVCache, tokens: list[int], n: int) -> list[int]:
    return [j for j in range(n) if block(kv, tokens, j).sliding is None]


def test_eviction_takes_unguarded_pages_first_then_the_least_recent_windows_never_held_ones():
    kv = KVCache(CFG, num_pages=64, page_size=PS)
    pc = kv.enable_prefix_cache()
    assert window_depth(CFG.sliding_window, PS) == 2 and window_depth(8, 16) == 1 and pc._depth == 3
    a = list(range(100, 140))  # 40 tokens: blocks 0..9, a leaf (and its prompt's end) at 9
    b = a[:22] + [7] * 10  # forks after block 4: its own blocks 5..7
    assert fill(kv, "a", a) == 0 and fill(kv, "b", b) == 20
    kv.free("a")
    kv.free("b")
    # Guarded: the leaf's windows (blocks 7..9: the boundaries at 40 and 36), the fork's (2..4), b's leaf's.
    assert [j for j in range(10) if block(kv, a, j).guard] == [2, 3, 4, 7, 8, 9]
    assert [j for j in range(5, 8) if block(kv, b, j).guard] == [5, 6, 7]
    assert kv.begin_prefix("c", a[:28] + [1] * 5) == 28  # holds the sliding pages of blocks 5 and 6
    assert pc.evict(SLIDING, 2) == 2 and sliding_gone(kv, a, 10) == [0, 1]  # the only unguarded, unheld ones
    for tokens, want in ((a, 36), (b, 28), (a[:22] + [9] * 5, 20)):  # every resume point still resumes
        assert kv.begin_prefix("d", tokens) == want
        kv.free("d")
    # Then the least recently used window page: a's block 9 (only the boundary at 40 reads it; the lookups
    # above each touched the window they resumed after, nothing else of their chain).
    assert pc.evict(SLIDING, 1) == 1 and sliding_gone(kv, a, 10) == [0, 1, 9]
    assert pc.evict(SLIDING, 100) == 13 - 3 - 2  # all but c's two
    assert sliding_gone(kv, a, 10) == [0, 1, 2, 3, 4, 7, 8, 9] and pc.cached_pages()[SLIDING] == 2
    kv.free("c")
    pc.clear()
    assert in_use(kv) == {FULL: 0, SLIDING: 0}


def test_a_prompt_end_inside_a_longer_chain_keeps_its_window():
    """A chat's next turn repeats the prompt and diverges right after it (harmony drops the previous
    answer's analysis): the block a prompt ended in keeps its window while the answer after it is
    mid-chain, also when the prompt ends inside its own hit."""
    kv = KVCache(CFG, num_pages=64, page_size=PS)
    pc = kv.enable_prefix_cache()
    prompt, answer = list(range(100, 122)), list(range(500, 520))  # 22 tokens: ends in block 4
    turn(kv, "a", prompt, answer)  # + 19 answer tokens written: blocks 5..9
    conv = prompt + answer
    assert block(kv, conv, 4).end and not block(kv, conv, 9).end
    assert [j for j in range(10) if block(kv, conv, j).guard] == [2, 3, 4, 7, 8, 9]
    assert pc.evict(SLIDING, 4) == 4 and sliding_gone(kv, conv, 10) == [0, 1, 5, 6]
    for tokens, want in ((prompt + [9] * 8, 20), (conv[:41] + [9] * 5, 40)):
        assert kv.begin_prefix("b", tokens) == want
        kv.free("b")
    pc.clear()
    kv = KVCache(CFG, num_pages=64, page_size=PS)
    pc = kv.enable_prefix_cache()
    fill(kv, "x", prompt + [1, 2])  # 24 tokens: 6 blocks
    kv.free("x")
    assert not block(kv, prompt, 4).end
    assert fill(kv, "y", prompt) == 20  # its 5 whole blocks are all in the hit: the hit's tail is its end
    kv.free("y")
    assert block(kv, prompt, 4).end and block(kv, prompt, 4).anchor
    pc.clear()


def test_the_host_tier_drops_mid_chain_sliding_pages_first():
    kv = KVCache(CFG, num_pages={FULL: 64, SLIDING: 16}, page_size=PS)
    pc = kv.enable_prefix_cache(host_bytes=4 * pair_bytes(kv))  # 4 slots a group
    a, b = list(range(100, 140)), list(range(300, 320))
    fill(kv, "a", a)
    kv.free("a")
    assert pc.evict(SLIDING, 10) == 10  # every sliding page of a leaves the device, the leaf's window last
    host = lambda tokens, n: [j for j in range(n) if block(kv, tokens, j).host_sliding is not None]  # noqa: E731
    assert host(a, 10)[1:] == [7, 8, 9] and pc.stats.host_evicted_pages[SLIDING] == 6
    fill(kv, "b", b)
    kv.free("b")
    assert pc.evict(SLIDING, 2) == 2  # b's blocks 0, 1 (unguarded): the slots they take were unguarded ones
    assert host(a, 10) == [7, 8, 9] and host(b, 5) == [1]  # plain LRU would have dropped a's 7 for b's 1
    assert kv.begin_prefix("c", a) == 36 and kv.host_hit("c") == 36  # restored from the host tier
    kv.free("c")
    pc.clear()
    assert pc.host_pages() == {FULL: 0, SLIDING: 0}


@pytest.mark.parametrize("host", [False, True])
def test_random_workload_keeps_guards_exact_and_evicts_only_cache_only_pages(host):
    rng = random.Random(5 + host)
    kv = KVCache(CFG, num_pages={FULL: 60, SLIDING: 14}, page_size=PS)
    pc = kv.enable_prefix_cache(host_bytes=10 * pair_bytes(kv) if host else 0)
    heads = [[rng.randrange(50) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    depth = window_depth(CFG.sliding_window, PS)

    def check():
        blocks = list(pc._blocks.values())
        want = {b.id: 0 for b in blocks}
        for b in blocks:
            assert b.anchor == (b.children != 1 or b.end)
            x = b
            for _ in range(depth + 1 if b.anchor else 0):  # its window's blocks and one more
                if x is None:
                    break
                want[x.id] += 1
                x = x.parent
        assert {b.id: b.guard for b in blocks} == want
        on_device = {b.id for b in blocks if b.sliding is not None}
        assert {b.id for b in pc._slru.values()} == on_device and len(pc._slru) == len(on_device)
        assert pc._slru.guarded() == sum(1 for b in blocks if b.sliding is not None and b.guard)
        assert {b.id for b in pc._hlru[SLIDING].values()} == {b.id for b in blocks if b.host_sliding is not None}
        check_references(kv)

    live: dict[str, list] = {}
    for step in range(400):
        r = rng.random()
        if live and (r < 0.2 or len(live) > 2):
            sid = rng.choice(sorted(live))
            del live[sid]
            kv.free(sid)
        elif r < 0.45 or not live:
            sid = f"s{step}"
            tokens = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            live[sid] = [tokens, kv.begin_prefix(sid, tokens), rng.randrange(0, 16)]
        else:
            sid = rng.choice(sorted(live))
            tokens, at, steps = live[sid]
            n = min(rng.randrange(1, 12), len(tokens) - at) if at < len(tokens) else int(steps > 0)
            if n:
                seq = kv.seqs[sid]
                need = {g: kv._missing(seq, g, seq.length + n) for g in GROUPS}
                if any(need[g] > kv.free_pages()[g] for g in need):
                    del live[sid]
                    kv.free(sid)
                else:
                    held = {g: list(seq.pages[g]) for g in GROUPS}
                    if at >= len(tokens):
                        kv.extend_tokens(sid, [rng.randrange(50)])
                        live[sid][2] = steps - 1
                    else:
                        live[sid][1] = at + n
                    kv.reserve(sid, n)
                    for g in GROUPS:  # what it held is still its own (never evicted under it)
                        assert seq.pages[g][:len(held[g])] == held[g]
                    kv.commit(sid, n)
        check()
    for sid in live:
        kv.free(sid)
    check()
    assert pc.stats.evicted_pages[SLIDING] > 50 and pc.stats.hits > 20
    pc.clear()
    assert in_use(kv) == {FULL: 0, SLIDING: 0} and len(pc._slru) == 0


def test_greedy_tokens_of_a_conversation_equal_with_and_without_the_cache():
    """Two chats taking turns on the tiny model with 14 sliding pages: each turn's greedy tokens equal a
    cache-free runner's, and every later turn resumes at the deepest boundary its previous turn wrote."""
    def run(r: Runner, sid: str, prompt: list[int], n: int) -> tuple[list[int], int]:
        start = r.kv.begin_prefix(sid, prompt) if r.kv.prefix is not None else 0
        logits = None
        for at in range(start, len(prompt), 8):
            logits = r.extend(sid, prompt[at: at + 8])
        out = [int(logits.argmax())]
        for _ in range(n - 1):
            if r.kv.prefix is not None:
                r.kv.extend_tokens(sid, out[-1:])
            out.append(int(r.decode([sid], [out[-1]])[0].argmax()))
        r.free(sid)
        return out, start

    plain = Runner.load("tiny", dummy=True, seed=0, page_size=PS, num_pages=200)
    cached = Runner.load("tiny", dummy=True, seed=0, page_size=PS, num_pages={FULL: 200, SLIDING: 14})
    cached.kv.enable_prefix_cache()
    rng = random.Random(3)
    hist: dict[int, list[int]] = {0: [], 1: []}
    for t in range(3):
        for c in (0, 1):
            prompt = hist[c] + [rng.randrange(10, 1000) for _ in range(9)]
            want, _ = run(plain, f"p{c}.{t}", prompt, 10)
            got, hit = run(cached, f"c{c}.{t}", prompt, 10)
            assert got == want
            if t:
                assert hit == (len(hist[c]) - 1) // PS * PS > 0
            hist[c] = prompt + got
    assert cached.kv.prefix.stats.evicted_pages[SLIDING] > 10


def test_the_pool_split_gives_a_caching_worker_its_share_of_windows():
    cfg = load_model_config("gpt-oss-20b")
    args = dict(budget_bytes=int(281290.5 * 393216), page_size=16, kv_heads=8, max_seqs=512, chunk_tokens=8192,
                max_tokens=512 * 131072)
    # The H200 colocated 20b run's pool (103 GiB of KV): 5,633 sliding pages = 512 windows + the chunk headroom.
    assert split_pages(cfg, **args) == {FULL: 275657, SLIDING: 5633}
    with_cache = split_pages(cfg, **args, cache_share=0.05)
    extra = with_cache[SLIDING] - 5633
    assert extra == int(0.05 * args["budget_bytes"]) // 393216 // 9 * 9 == 14058  # 1,562 windows of 9
    assert with_cache == {FULL: 275657 - extra, SLIDING: 5633 + extra}
    assert split_pages(cfg, **{**args, "max_tokens": 4096}, cache_share=0.05) == {FULL: 256, SLIDING: 256}
    assert split_pages(cfg, **{**args, "budget_bytes": 20 * GIB}, cache_share=0.0)[SLIDING] == 5633


def test_topology_key_and_the_worker_specs():
    from kvrelay.cluster.specs import colocated_spec, decode_spec, prefill_spec
    from kvrelay.cluster.topology import TopologyError, parse_topology

    base = "model: {name: tiny, dummy: true}\ndevice: cpu\n"
    t = parse_topology(base + "prefill: {prefix_cache: true}\ncolocate: true\n", source="t.yaml")
    assert t.prefill.prefix_cache_sliding_share == 0.05 and colocated_spec(t).prefix_cache_sliding_share == 0.05
    t = parse_topology(base + "prefill: {prefix_cache: true, prefix_cache_sliding_share: 0.1}\n", source="t.yaml")
    assert prefill_spec(t).prefix_cache_sliding_share == 0.1
    assert not hasattr(decode_spec(t), "prefix_cache_sliding_share")  # a decode worker keeps today's split
    t = parse_topology(base + "prefill: {prefix_cache_sliding_share: 0.1}\n", source="t.yaml")
    assert prefill_spec(t).prefix_cache_sliding_share == 0.0  # no cache: today's split
    for value, why in (("x", "expected a number"), ("-0.1", "must be a number in \\[0, 0.5\\]"),
                       ("0.6", "must be a number in \\[0, 0.5\\]"), (".nan", "must be a number in")):
        with pytest.raises(TopologyError, match=f"^t.yaml: prefill.prefix_cache_sliding_share: {why}"):
            parse_topology(base + f"prefill: {{prefix_cache: true, prefix_cache_sliding_share: {value}}}\n",
                           source="t.yaml")


def test_sliding_window_first_page_matches_the_guard_depth():
    # The guard covers exactly the blocks a boundary's lookup asks for (kv_geometry's window rule).
    for window, ps in ((8, 4), (8, 16), (128, 16), (9, 4), (5, 1)):
        for k in range(1, 40):
            assert k - first_live_page(SLIDING, k * ps, ps, window) == min(k, window_depth(window, ps))


def test_caching_workers_hand_their_share_to_the_pool_plan(monkeypatch):
    """A colocated worker with the cache sizes its pool with its share, a decode worker without (today's
    split), and load_sized_runner passes the share on to plan_cuda_pool on the GPU."""
    from types import SimpleNamespace

    from kvrelay.cluster.specs import colocated_spec, decode_spec, model_spec
    from kvrelay.cluster.topology import parse_topology
    from kvrelay.decode_worker import colocated, worker
    from kvrelay.engine import memory
    from kvrelay.workers import loading

    t = parse_topology("model: {name: tiny, dummy: true}\ndevice: cpu\nprefill: {prefix_cache: true}\n"
                       "colocate: true\n", source="t.yaml")
    seen: list[dict] = []
    monkeypatch.setattr(worker, "load_sized_runner", lambda model, **k: seen.append(k) or "runner")
    w = colocated.ColocatedWorker.__new__(colocated.ColocatedWorker)
    w.chunk_tokens, w._sliding_share, w.plan_log = 64, colocated_spec(t).prefix_cache_sliding_share, []
    assert w._load_single(colocated_spec(t).decode) == "runner" and seen[-1]["cache_share"] == 0.05
    d = worker.DecodeWorker.__new__(worker.DecodeWorker)
    d.plan_log = []
    d._load_single(decode_spec(t))
    assert seen[-1]["cache_share"] == 0.0

    plans: list[dict] = []
    fake = SimpleNamespace(resize_kv=lambda pages: None, warmup=lambda: None)
    monkeypatch.setattr(loading, "load_runner", lambda *a, **k: fake)
    monkeypatch.setattr(memory, "plan_cuda_pool", lambda runner, **k: plans.append(k) or SimpleNamespace(
        pages={FULL: 1, SLIDING: 1}, describe=lambda: "KV pool"))
    assert loading.load_sized_runner(model_spec(t), device="cuda", page_size=16, fraction=0.9, max_seqs=4,
                                     chunk_tokens=64, max_tokens=4096, need_tokens=64, key="k",
                                     cache_share=0.05) is fake
    assert plans[-1]["cache_share"] == 0.05
