"""Partition math and collectives of engine/parallel.py, the collectives over real gloo process groups
(spawned ranks on 127.0.0.1)."""

from __future__ import annotations

import time

import pytest
import torch

from kvrelay.engine.config import PRESETS
from kvrelay.engine.parallel import SINGLE, ParallelContext, RankFailed, all_gather, all_reduce, run_ranks
from kvrelay.engine.partition import ParallelConfigError, check_partition, head_range, padded_range, shard_range

pytestmark = pytest.mark.timeout(180)


# ---- partition math ---------------------------------------------------------------------------------

def test_shard_range_covers_everything_once():
    for total, world in [(64, 1), (64, 2), (64, 8), (32, 4), (128, 8), (2880, 8)]:
        spans = [shard_range(total, r, world) for r in range(world)]
        assert spans[0][0] == 0 and spans[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert {b - a for a, b in spans} == {total // world}


def test_shard_range_rejects_uneven_and_bad_rank():
    with pytest.raises(ParallelConfigError, match="num_experts=32 is not divisible by 3 ranks"):
        shard_range(32, 0, 3, "num_experts")
    with pytest.raises(ParallelConfigError, match="outside a group"):
        shard_range(32, 4, 4)


def test_padded_range_is_even_width_and_complete():
    spans = [padded_range(1000, r, 3) for r in range(3)]
    assert spans == [(0, 334), (334, 668), (668, 1000)]
    assert padded_range(2, 3, 4) == (2, 2)  # more ranks than items: trailing ranks own nothing


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_head_range_gpt_oss(tp):
    # 64 query heads over 8 KV heads: every rank gets 64/tp query heads and exactly their KV heads.
    ranges = [head_range(64, 8, r, tp) for r in range(tp)]
    assert [h.num_q for h in ranges] == [64 // tp] * tp
    assert [h.num_kv for h in ranges] == [8 // tp] * tp
    for h in ranges:
        assert h.q0 // 8 == h.kv0 and (h.q1 - 1) // 8 == h.kv1 - 1


def test_head_range_replicates_kv_when_ranks_outnumber_kv_heads():
    # 8 query / 2 KV heads on 4 ranks: ranks 0,1 share KV head 0, ranks 2,3 share KV head 1.
    assert [(h.q0, h.q1, h.kv0, h.kv1) for h in (head_range(8, 2, r, 4) for r in range(4))] == [
        (0, 2, 0, 1), (2, 4, 0, 1), (4, 6, 1, 2), (6, 8, 1, 2)]


def test_head_range_errors():
    with pytest.raises(ParallelConfigError, match="num_attention_heads=64 is not divisible by 3"):
        head_range(64, 8, 0, 3)
    with pytest.raises(ParallelConfigError, match="num_key_value_heads=4 is not divisible by 6"):
        head_range(24, 4, 0, 6)  # 6 ranks would straddle GQA groups
    # 6 query heads per rank over groups of 8: rank 1 would hold 2 heads of group 0 and 4 of group 1.
    with pytest.raises(ParallelConfigError, match="num_key_value_heads=6 is not divisible by 8"):
        head_range(48, 6, 1, 8)


def test_check_partition_names_the_problem():
    cfg = PRESETS["gpt-oss-20b"]
    for tp in (1, 2, 4, 8):
        check_partition(cfg, tp)
    with pytest.raises(ParallelConfigError, match="num_experts=32 is not divisible by 64 ranks"):
        check_partition(cfg.replace(num_attention_heads=64, num_key_value_heads=64), 64)
    with pytest.raises(ParallelConfigError, match=r"experts: num_experts=6 is not divisible by 4"):
        check_partition(PRESETS["tiny"].replace(num_experts=6), 4)
    with pytest.raises(ParallelConfigError, match="attention: .*num_attention_heads=8 is not divisible by 3"):
        check_partition(PRESETS["tiny"].replace(num_experts=6), 3)
    # EP1: experts stay whole in count, the intermediate dimension is what must split.
    check_partition(PRESETS["tiny"].replace(num_experts=6), 2, expert_parallel=False)
    with pytest.raises(ParallelConfigError, match="intermediate_size=96 is not divisible by 5"):
        check_partition(PRESETS["tiny"].replace(num_attention_heads=10, num_key_value_heads=5), 5,
                        expert_parallel=False)


def test_context_validates_and_is_a_noop_alone():
    with pytest.raises(ParallelConfigError):
        ParallelContext(rank=2, world_size=2)
    x = torch.arange(4.0)
    assert all_reduce(x, SINGLE) is x and torch.equal(x, torch.arange(4.0))
    assert all_gather(x, SINGLE) is x
    assert SINGLE.span(8) == (0, 8) and SINGLE.is_leader


# ---- collectives over gloo -----------------------------------------------------------------------

def _collectives(ctx: ParallelContext) -> dict:
    r, n = ctx.rank, ctx.world_size
    s = torch.full((3,), float(r + 1), dtype=torch.bfloat16)
    ctx.all_reduce(s)
    g = ctx.all_gather_last(torch.full((2, 2), float(r)))
    g0 = all_gather(torch.full((1, 2), float(r)), ctx, dim=0)
    return {"rank": r, "world": n, "sum": s.float().tolist(), "gather": g.tolist(), "gather0": g0.tolist()}


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_over_gloo(world):
    out = run_ranks(_collectives, world, timeout_s=120)
    assert [o["rank"] for o in out] == list(range(world))
    total = float(sum(range(1, world + 1)))
    for o in out:
        assert o["world"] == world and o["sum"] == [total] * 3
        assert o["gather"] == [[float(r) for r in range(world) for _ in range(2)]] * 2
        assert o["gather0"] == [[float(r)] * 2 for r in range(world)]


def _fails_on_rank_1(ctx: ParallelContext) -> int:
    if ctx.rank == 1:
        raise ArithmeticError("rank one is broken")
    return ctx.rank


def _hangs_on_rank_0(ctx: ParallelContext) -> int:
    if ctx.rank == 0:
        time.sleep(600)
    return ctx.rank


def test_rank_failure_and_timeout_are_reported():
    with pytest.raises(RankFailed, match="(?s)rank 1 of 2 failed.*ArithmeticError: rank one is broken"):
        run_ranks(_fails_on_rank_1, 2, timeout_s=90)
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"ranks \[0\] did not finish in 20"):
        run_ranks(_hangs_on_rank_0, 2, timeout_s=20)
    assert time.monotonic() - t0 < 40  # the stuck rank was stopped, not waited for
