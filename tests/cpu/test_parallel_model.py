"""Sharded gpt-oss ("EPn TPn" over n gloo ranks) against the single-process model.

The strict check runs in fp32, where sharding changes only the summation order, so logits must agree to
~1e-6: any wrong slice, double-counted bias or missing all-reduce shows up far above that. In bf16 (the
serving dtype) the rounding of partial sums differs by design, so the check there is the greedy tokens
plus logits no further from the single-process result than bf16 itself is from fp32.

Per-rank memory and sliced loading are checked without processes: a model is built for every rank
(constructing it needs no communication) on the meta device, from a weight source that records reads.
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.config import PRESETS
from kvrelay.engine.model import GptOss
from kvrelay.engine.parallel import ParallelContext, held_tensor_bytes, run_ranks
from kvrelay.engine.partition import ParallelConfigError
from kvrelay.engine.runner import Runner
from kvrelay.engine.weights import canonical_shapes, open_weights

pytestmark = pytest.mark.timeout(240)

CFG = PRESETS["tiny"]  # 8 query / 2 KV heads, 8 experts: TP4 also replicates KV heads
PROMPT = [5, 17, 300, 9, 44, 1000, 3, 12, 8, 77, 501, 2, 640, 31]
STEPS = 6


def _greedy(cfg, shard: ParallelContext, dtype: torch.dtype) -> tuple[list[int], torch.Tensor]:
    runner = Runner(cfg, open_weights(None, cfg, dummy=True, seed=3), dtype=dtype, page_size=4,
                    kv_tokens=128, shard=shard)
    logits = [runner.prefill("s", PROMPT)]
    tokens = [int(logits[-1].argmax())]
    for _ in range(STEPS - 1):
        logits.append(runner.decode(["s"], [tokens[-1]])[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def _rank(ctx: ParallelContext, cfg) -> dict:
    out = {dt: _greedy(cfg, ctx, dt) for dt in (torch.float32, torch.bfloat16)}
    runner_bytes = held_tensor_bytes(GptOss(cfg, open_weights(None, cfg, dummy=True, seed=3), shard=ctx))
    return {"out": out, "weight_bytes": runner_bytes}


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return {dt: _greedy(CFG, ParallelContext(), dt) for dt in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("world,expert_parallel", [(2, True), (4, True), (2, False)],
                         ids=["EP2TP2", "EP4TP4", "EP1TP2"])
def test_sharded_model_matches_single_process(reference, world, expert_parallel):
    ranks = run_ranks(_rank, world, CFG, timeout_s=150, expert_parallel=expert_parallel)
    ref32_tokens, ref32 = reference[torch.float32]
    ref16_tokens, ref16 = reference[torch.bfloat16]
    bf16_noise = (ref16 - ref32).abs().max().item()
    single_bytes = held_tensor_bytes(GptOss(CFG, open_weights(None, CFG, dummy=True, seed=3)))
    for r, res in enumerate(ranks):
        tokens32, logits32 = res["out"][torch.float32]
        tokens16, logits16 = res["out"][torch.bfloat16]
        assert tokens32 == ref32_tokens and tokens16 == ref16_tokens, f"rank {r}"
        assert (logits32 - ref32).abs().max().item() < 2e-5, f"rank {r}: fp32 logits differ"
        assert (logits16 - ref16).abs().max().item() <= 1.5 * bf16_noise, f"rank {r}: bf16 logits differ"
        # Every rank ends with the same full-vocabulary logits (all-gathered), so any rank may sample.
        assert torch.equal(logits16, ranks[0]["out"][torch.bfloat16][1])
        print(f"EP{world if expert_parallel else 1} TP{world} rank {r}: weights {res['weight_bytes'] / 2**20:.2f} MiB "
              f"of {single_bytes / 2**20:.2f} MiB single-process")
    # The tiny model's replicated part (router, norms, rotary table) is a large share of it, so only
    # demand a clear cut here; the real-size proportions are checked exactly on the meta device below.
    assert max(r["weight_bytes"] for r in ranks) < 0.75 * single_bytes


def test_uneven_expert_split_is_a_config_error():
    cfg = CFG.replace(num_experts=6)
    weights = open_weights(None, cfg, dummy=True, seed=0)
    with pytest.raises(ParallelConfigError, match="num_experts=6 is not divisible by 4 ranks"):
        GptOss(cfg, weights, shard=ParallelContext(rank=1, world_size=4))
    with pytest.raises(ParallelConfigError, match="num_attention_heads=8 is not divisible by 3 ranks"):
        GptOss(cfg.replace(num_experts=6), weights, shard=ParallelContext(rank=0, world_size=3))
    # EP1 TP2 keeps all 6 experts on every rank and splits their intermediate dimension instead.
    GptOss(cfg, weights, shard=ParallelContext(rank=1, world_size=2, expert_parallel=False))


# ---- per-rank memory at real size (meta tensors: shapes without storage) --------------------------

class _MetaWeights:
    """A WeightGetter that returns meta tensors of the requested region and records every read."""

    def __init__(self, cfg):
        self.shapes = canonical_shapes(cfg)
        self.reads: list[tuple[str, tuple[int, ...]]] = []

    def get(self, name, slices=(), dtype=None, device=None):
        shape = self.shapes[name]
        full = tuple(slices) + (slice(None),) * (len(shape) - len(slices))
        dims = tuple(len(range(*s.indices(n))) for s, n in zip(full, shape))
        self.reads.append((name, dims))
        return torch.empty(dims, dtype=dtype or torch.bfloat16, device="meta")


# Tensors every rank needs whole (tiny: norms and the router); everything else must be sliced.
_REPLICATED = ("norm.scale", "mlp.gate.weight", "mlp.gate.bias", "attn.out.bias", "mlp.mlp2_bias")


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_per_rank_weights_are_one_nth_and_reads_are_sliced(name):
    cfg = PRESETS[name]
    sizes = {}
    for world in (1, 2, 4, 8):
        per_rank = []
        for rank in range(world):
            ws = _MetaWeights(cfg)
            model = GptOss(cfg, ws, device="meta", shard=ParallelContext(rank, world))
            per_rank.append(held_tensor_bytes(model))
            if world > 1:
                whole = [n for n, dims in ws.reads if dims == ws.shapes[n] and not n.endswith(_REPLICATED)]
                assert not whole, f"rank {rank}/{world} read whole tensors {whole[:3]}"
        sizes[world] = per_rank
        assert max(per_rank) - min(per_rank) < 0.001 * max(per_rank)  # an even split
    for world in (2, 4, 8):
        ratio = sizes[1][0] / sizes[world][0]
        print(f"{name} bf16 weights per rank at TP{world}: {sizes[world][0] / 2**30:.2f} GiB "
              f"(TP1 {sizes[1][0] / 2**30:.2f} GiB, ratio {ratio:.3f})")
        assert 0.99 * world < ratio <= world
