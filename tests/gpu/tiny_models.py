"""Tiny model configs and dummy weights shared by the GPU model tests (one spelling of each)."""

from __future__ import annotations


def attn64_cfg(layers: int = 4):
    """The 'tiny-attn64' model: the fixture's shape but gpt-oss's attention geometry (head_dim 64, 64 query
    and 8 KV heads, a 128-token window), so FlashInfer's kernels and the Triton split-KV decode run as in
    the full models, at a tiny hidden size."""
    from kvrelay.engine.config import PRESETS

    return PRESETS["tiny"].replace(
        name="tiny-attn64", head_dim=64, num_attention_heads=64, num_key_value_heads=8, hidden_size=256,
        intermediate_size=256, sliding_window=128, num_hidden_layers=layers, initial_context_length=4096,
        max_context=4096)


def dummy_weights(cfg, seed: int):
    """Dummy weights of cfg drawn once on the CPU (a CUDA generator draws other values), so a CPU reference
    and GPU models built from them hold the same weights."""
    from kvrelay.engine.layers.linear import TensorDictWeights
    from kvrelay.engine.weights import canonical_shapes, open_weights

    dummy = open_weights(None, cfg, dummy=True, seed=seed)
    return TensorDictWeights({n: dummy.get(n, device="cpu") for n in canonical_shapes(cfg)})


def prompts_and_feed(cfg, seed: int, lens, steps: int):
    """Random prompts of the given lengths and `steps` rows of one decode token per prompt (CPU draws)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    return prompts, torch.randint(0, cfg.vocab_size, (steps, len(lens)), generator=g).tolist()


def decode_logits(cfg, w, dev, prompts, feed, *, tail=(), **runner_kw):
    """A Runner of cfg on dev (page 16; runner_kw: quant, cuda_graphs, cuda_graph_batch_sizes, kv_tokens, ...):
    the batch prefill of `prompts` (sequence ids 0, 1, ...), a decode step of every sequence per row of `feed`,
    then one step per (ids, tokens) of `tail`. Each step's logits, fp32."""
    from kvrelay.engine.runner import Runner

    r = Runner(cfg, w, device=dev, page_size=16, **runner_kw)
    steps = [r.prefill_batch(list(enumerate(prompts)))]
    steps += [r.decode(list(range(len(prompts))), toks) for toks in feed]
    steps += [r.decode(ids, toks) for ids, toks in tail]
    return [s.float() for s in steps]


def assert_same_logits(a, b, what) -> None:
    """Two decode_logits runs equal step for step, bit for bit."""
    import torch

    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), (what, i, (x - y).abs().max())


def assert_logits_agree(on, off, label: str, median_rel: float = 2e-2, max_rel: float = 0.1,
                        top1: float = 0.85) -> None:
    """Two runs' per-step logits (lists of tensors) within the bounds of a decode fusion that changes an fp32
    summation order: the typical step's relative error under median_rel, every step's under max_rel, and the
    top-1 token the same in at least `top1` of the rows (a near-tie between two experts' router logits may
    route a token differently after a one-step difference, so no bound holds row by row)."""
    agree = total = 0
    rels = []
    for a, b in zip(on, off, strict=True):
        rels.append(float((a.float() - b.float()).norm() / b.float().norm()))
        same = a.argmax(-1) == b.argmax(-1)
        agree += int(same.sum())
        total += same.numel()
    rels.sort()
    print(f"{label}: relative error per step {rels}; top-1 {agree}/{total}")
    assert rels[len(rels) // 2] < median_rel and rels[-1] < max_rel, rels
    assert agree >= top1 * total, (agree, total)
