"""engine/kv_sharding.py: which prefill rank holds each KV head and which decode rank needs it."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvrelay.engine.kv_sharding import assemble_kv, head_byte_runs, kv_heads_of_rank, plan_kv_handoff
from kvrelay.engine.parallel import ParallelConfigError


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


def test_head_byte_runs_select_exactly_the_heads():
    page_size, heads, dim = 4, 4, 3
    page = torch.arange(2 * page_size * heads * dim, dtype=torch.int16).view(2, page_size, heads, dim)
    raw = page.view(torch.uint8).flatten()
    assert head_byte_runs(page_size, heads, dim, 2, (0, 4)) == ((0, raw.numel()),)
    for h0, h1 in [(0, 2), (1, 3), (3, 4)]:
        runs = head_byte_runs(page_size, heads, dim, 2, (h0, h1))
        assert len(runs) == 2 * page_size
        got = torch.cat([raw[o:o + n] for o, n in runs]).view(torch.int16)
        assert torch.equal(got, page[:, :, h0:h1].flatten())
    with pytest.raises(ValueError, match="outside a page"):
        head_byte_runs(page_size, heads, dim, 2, (2, 5))
