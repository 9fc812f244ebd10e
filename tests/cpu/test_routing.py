"""KV-aware routing (router.policy: kv-aware, cluster/routing.py): the router's index of the prompt blocks
it sent to each prefill worker, and the choice it makes from it: the worker with the least queued plus
uncached prompt work, so a long shared prefix pulls requests to the worker that holds it until that
worker's queue costs more than recomputing the prefix elsewhere."""

from __future__ import annotations

import pytest

from kvrelay.cluster.routing import PrefixIndex, block_hashes, rank

PS = 16
SYSTEM = list(range(1000, 1100))  # 6 whole blocks


def test_block_hashes_name_whole_prefixes():
    a, b = block_hashes(SYSTEM + [1, 2], PS), block_hashes(SYSTEM[:50] + [7] * 52, PS)
    assert len(a) == 6 and len(b) == 6
    assert a[:3] == b[:3] and a[3] != b[3]  # b diverges at 50, in block 3
    assert block_hashes(SYSTEM[16:32], PS) != a[1:2]  # the same tokens after another prefix differ


def test_index_matches_longest_prefix_and_forgets():
    idx = PrefixIndex(PS, max_blocks=8)
    idx.record(0, block_hashes(SYSTEM, PS))
    assert idx.matched_tokens(0, block_hashes(SYSTEM[:70] + [5] * 30, PS)) == 64
    assert idx.matched_tokens(1, block_hashes(SYSTEM, PS)) == 0
    idx.record(0, block_hashes(list(range(64)), PS))  # 4 new blocks: 10 > 8, the oldest tail blocks go
    assert idx.matched_tokens(0, block_hashes(SYSTEM, PS)) == 64
    assert idx.matched_tokens(0, block_hashes(list(range(64)), PS)) == 64
    idx.forget(0)
    assert idx.matched_tokens(0, block_hashes(SYSTEM, PS)) == 0
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_rank_trades_the_cached_prefix_against_the_queue():
    # worker a holds 96 of the 110-token prompt, b nothing
    assert rank(["a", "b"], 110, [96, 0], [0, 0], [0.0, 0.0]) == ["a", "b"]
    assert rank(["a", "b"], 110, [96, 0], [95, 0], [0.0, 0.0]) == ["a", "b"]  # 95 + 14 < 110
    assert rank(["a", "b"], 110, [96, 0], [97, 0], [0.0, 0.0]) == ["b", "a"]  # 97 + 14 > 110
    assert rank(["a", "b"], 10, [0, 0], [0, 0], [5.0, 1.0]) == ["b", "a"]  # a tie: the one used longest ago


def client(n_prefill: int, policy: str = "kv-aware", colocated: bool = False):
    from kvrelay.cluster.engine_client import DisaggregatedEngineClient

    return DisaggregatedEngineClient([object() for _ in range(n_prefill)], [object()], model_name="m",
                                     max_context=4096, policy=policy, page_size=PS, colocated=colocated)


def test_the_engine_client_routes_shared_prefixes_together():
    c = client(3)
    prompt = SYSTEM + [1] * 10
    first = c._pick_prefill(block_hashes(prompt, PS), len(prompt))
    others = [c._pick_prefill(block_hashes(p, PS), len(p)) for p in ([2] * 40, [3] * 40)]
    assert len({first.rank, *(w.rank for w in others)}) == 3  # nothing cached yet: spread out
    follow = SYSTEM + [4] * 20
    assert c._pick_prefill(block_hashes(follow, PS), len(follow)) is first
    first.queued_tokens = 500  # its queue now costs more than recomputing the 96 cached tokens
    assert c._pick_prefill(block_hashes(follow, PS), len(follow)) is not first
    c._mark_dead(first)
    assert c.prefix_index.matched_tokens(first.rank, block_hashes(follow, PS)) == 0


def test_policy_is_checked():
    with pytest.raises(ValueError, match="router.policy: 'nearest' is not one of least-loaded, round-robin, kv-aware"):
        client(1, policy="nearest")
    from kvrelay.cluster.topology import TopologyError, parse_topology

    t = parse_topology("model: {name: tiny, dummy: true}\ndevice: cpu\nrouter: {policy: kv-aware}\n", source="t.yaml")
    assert t.router.policy == "kv-aware"
    with pytest.raises(TopologyError, match="router.policy"):
        parse_topology("model: {name: tiny, dummy: true}\ndevice: cpu\nrouter: {policy: nearest}\n", source="t.yaml")
