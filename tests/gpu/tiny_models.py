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
