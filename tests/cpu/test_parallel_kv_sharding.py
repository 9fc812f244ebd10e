"""transfer/sharding.py: which prefill rank holds each KV head and which decode rank needs it."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvrelay.transfer.sharding import assemble_kv, kv_heads_of_rank, page_copy_runs, plan_kv_handoff
from kvrelay.engine.partition import ParallelConfigError


def _full_kv(num_kv: int) -> torch.Tensor:
    # [pages=3, 2, page_size=4, kv_heads, head_dim=5] with every element naming its head.
    t = torch.randn(3, 2, 4, num_kv, 5)
    t[..., 0] = torch.arange(num_kv, dtype=t.dtype)
    return t


def _rank_local(full: torch.Tensor, rng: tuple[int, int]) -> torch.Tensor:
    return full[..., rng[0]:rng[1], :].clone()


@pytest.mark.parametrize("q,kv", [(64, 8), (8, 2), (8, 4)])
def test_every_pair_of_shardings_rebuilds_each_decode_rank(q, kv):
    tps = [t for t in (1, 2, 4, 8) if q % t == 0 and (kv % t == 0 or t % kv == 0) and (q // t) % max(1, t // kv) == 0]
    full = _full_kv(kv)
    for p, d in itertools.product(tps, tps):
        plan = plan_kv_handoff(q, kv, p, d)
        sources = {r: _rank_local(full, plan.prefill_heads[r]) for r in range(p)}
        for r in range(d):
            a, b = plan.decode_heads[r]
            got = assemble_kv(plan, r, sources)
            assert torch.equal(got, full[..., a:b, :]), (p, d, r)
            # Only the listed source ranks are needed.
            assert torch.equal(assemble_kv(plan, r, {s: sources[s] for s in plan.source_ranks(r)}), got)


def test_tp2_to_tp4_and_back_on_eight_heads():
    down = plan_kv_handoff(64, 8, 2, 4)  # prefill ranks hold heads 0-3 and 4-7
    assert down.decode_heads == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert [down.source_ranks(r) for r in range(4)] == [(0,), (0,), (1,), (1,)]
    s = down.for_decode_rank(1)[0]
    assert (s.src_rank, s.kv0, s.kv1, s.src0, s.src1, s.dst0, s.dst1) == (0, 2, 4, 2, 4, 0, 2)
    assert down.readers(0) == (0, 1) and down.readers(1) == (2, 3)
    up = plan_kv_handoff(64, 8, 4, 1)
    assert up.source_ranks(0) == (0, 1, 2, 3)
    assert [(x.src_rank, x.dst0, x.dst1) for x in up.for_decode_rank(0)] == [(0, 0, 2), (1, 2, 4), (2, 4, 6), (3, 6, 8)]
    same = plan_kv_handoff(64, 8, 4, 4)
    assert same.identity and all(same.source_ranks(r) == (r,) for r in range(4))
    assert all(len(same.for_decode_rank(r)) == 1 for r in range(4))


def test_replicated_heads_spread_readers_over_copies():
    # 2 KV heads over 4 prefill ranks: head 0 on ranks 0,1 and head 1 on ranks 2,3.
    plan = plan_kv_handoff(8, 2, 4, 4)
    assert plan.prefill_heads == ((0, 1), (0, 1), (1, 2), (1, 2))
    assert [plan.source_ranks(r) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    to_one = plan_kv_handoff(8, 2, 4, 1)
    assert to_one.source_ranks(0) == (0, 2)
    assert [plan_kv_handoff(8, 2, 4, 2).source_ranks(r) for r in range(2)] == [(0,), (2,)]


def test_kv_heads_of_rank_and_errors():
    assert [kv_heads_of_rank(64, 8, r, 8) for r in range(8)] == [(i, i + 1) for i in range(8)]
    with pytest.raises(ParallelConfigError, match="not divisible by 3"):
        plan_kv_handoff(64, 8, 2, 3)
    with pytest.raises(KeyError, match=r"needs prefill ranks \[1\]"):
        assemble_kv(plan_kv_handoff(64, 8, 2, 1), 0, {0: torch.zeros(1, 4, 3)})


@pytest.mark.parametrize("p,d", [(2, 4), (4, 1), (1, 2), (4, 4)])
def test_page_copy_runs_move_exactly_each_decode_ranks_heads(p, d):
    """Byte-level copies with the runs (what NIXL READ descriptors would do) rebuild the decode page."""
    page_size, dim, num_kv = 4, 3, 4
    plan = plan_kv_handoff(8, num_kv, p, d)
    full = torch.randn(2, page_size, num_kv, dim, dtype=torch.bfloat16)
    src_pages = {r: full[:, :, a:b].contiguous() for r, (a, b) in enumerate(plan.prefill_heads)}
    for r, (a, b) in enumerate(plan.decode_heads):
        dst = torch.zeros(2, page_size, b - a, dim, dtype=torch.bfloat16)
        dst_bytes = dst.view(-1).view(torch.uint8)
        runs = 0
        for s in plan.for_decode_rank(r):
            src_bytes = src_pages[s.src_rank].view(-1).view(torch.uint8)
            src_heads = plan.prefill_heads[s.src_rank][1] - plan.prefill_heads[s.src_rank][0]
            for so, do, n in page_copy_runs(s, page_size, src_heads, b - a, dim, 2):
                dst_bytes[do:do + n] = src_bytes[so:so + n]
                runs += 1
        assert torch.equal(dst, full[:, :, a:b]), (p, d, r)
        if plan.identity:
            assert runs == 1  # same sharding: one whole-page copy per page and layer
    with pytest.raises(ValueError, match="does not fit"):
        page_copy_runs(plan_kv_handoff(8, 4, 1, 1).for_decode_rank(0)[0], page_size, 2, 4, dim, 2)
