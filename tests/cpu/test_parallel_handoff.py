"""KV handoff between differently sharded groups, at the engine level: a TPp prefill group exports each
rank's KV pages, transfer/sharding.py maps heads to the TPd decode group, each decode rank imports exactly its
heads and keeps decoding. The greedy tokens must equal one process running the whole request.

The config has 4 KV heads so TP2 -> TP4 makes each decode rank take half of one prefill rank's heads
(the strided case a NIXL pull must describe head by head) and TP4 -> TP1 gathers from four ranks.
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.config import PRESETS
from kvrelay.transfer.sharding import assemble_kv, plan_kv_handoff
from kvrelay.engine.parallel import ParallelContext, run_ranks
from kvrelay.engine.runner import Runner
from kvrelay.engine.weights import open_weights

pytestmark = pytest.mark.timeout(240)

CFG = PRESETS["tiny"].replace(num_key_value_heads=4)
PROMPT = [11, 400, 7, 93, 250, 3, 999, 64, 18, 5, 700, 41, 2, 8, 300, 77, 120]  # > window, spans pages
STEPS = 6
GROUPS = ("full", "sliding")


def _runner(shard: ParallelContext) -> Runner:
    return Runner(CFG, open_weights(None, CFG, dummy=True, seed=7), page_size=4, kv_tokens=128, shard=shard)


def _prefill_rank(ctx: ParallelContext) -> dict:
    runner = _runner(ctx)
    first = int(runner.prefill("req", PROMPT).argmax())
    seq = runner.export_sequence("req")
    # What a NIXL READ of this rank's pages would carry: [layers, pages, 2, page_size, local_kv, head_dim].
    pages = {g: runner.kv_pools[g][:, list(seq.pages[g])].clone() for g in GROUPS}
    return {"first": first, "length": seq.length, "first_page": seq.first_page, "pages": pages}


def _decode_rank(ctx: ParallelContext, length: int, first_page: dict, kv: list[dict], first: int) -> list[int]:
    runner = _runner(ctx)
    seq = runner.import_sequence("req", length)
    assert seq.first_page == first_page, "both sides derive the sliding group's first page from the length"
    for g in GROUPS:
        runner.kv_pools[g][:, list(seq.pages[g])] = kv[ctx.rank][g]
    tokens = [first]
    for _ in range(STEPS - 1):
        tokens.append(int(runner.decode(["req"], [tokens[-1]])[0].argmax()))
    return tokens


def _single_process() -> list[int]:
    runner = _runner(ParallelContext())
    tokens = [int(runner.prefill("req", PROMPT).argmax())]
    for _ in range(STEPS - 1):
        tokens.append(int(runner.decode(["req"], [tokens[-1]])[0].argmax()))
    return tokens


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 4), (4, 1)])
def test_handoff_between_shardings_keeps_greedy_tokens(prefill_tp, decode_tp):
    torch.set_num_threads(1)
    expected = _single_process()
    if prefill_tp == 1:
        exported = [_prefill_rank(ParallelContext())]
    else:
        exported = run_ranks(_prefill_rank, prefill_tp, timeout_s=120)
    assert len({e["first"] for e in exported}) == 1  # every rank sampled from the same gathered logits
    plan = plan_kv_handoff(CFG.num_attention_heads, CFG.num_key_value_heads, prefill_tp, decode_tp)
    per_rank = []
    for r in range(decode_tp):
        # Only the prefill ranks the plan names are read: a decode rank never sees a whole peer's heads
        # unless it needs them all.
        sources = {p: exported[p]["pages"] for p in plan.source_ranks(r)}
        per_rank.append({g: assemble_kv(plan, r, {p: s[g] for p, s in sources.items()}) for g in GROUPS})
        want = plan.decode_heads[r][1] - plan.decode_heads[r][0]
        assert all(t.shape[-2] == want for t in per_rank[-1].values())
    args = (exported[0]["length"], exported[0]["first_page"], per_rank, exported[0]["first"])
    if decode_tp == 1:
        tokens = [_decode_rank(ParallelContext(), *args)]
    else:
        tokens = run_ranks(_decode_rank, decode_tp, *args, timeout_s=120)
    for r, got in enumerate(tokens):
        assert got == expected, f"TP{prefill_tp} -> TP{decode_tp}, decode rank {r}: {got} != {expected}"


def test_handoff_with_wrong_heads_diverges():
    """The test above can fail: giving decode rank 0 another rank's heads changes its output."""
    torch.set_num_threads(1)
    expected = _single_process()
    exported = _prefill_rank(ParallelContext())
    swapped = {g: t.flip(-2) for g, t in exported["pages"].items()}  # KV heads in reverse order
    got = _decode_rank(ParallelContext(), exported["length"], exported["first_page"], [swapped],
                       exported["first"])
    assert got[1:] != expected[1:]
