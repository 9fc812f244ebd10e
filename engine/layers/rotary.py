"""YaRN rotary tables for the whole context, looked up by absolute position."""

from __future__ import annotations

import torch

from kvrelay.kernels.reference import rotary_cos_sin, yarn_inv_freq


class YarnRotary:
    def __init__(self, cfg, *, device, dtype: torch.dtype):
        inv_freq, self.concentration = yarn_inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor, cfg.initial_context_length,
            beta_fast=cfg.rope_ntk_beta, beta_slow=cfg.rope_ntk_alpha,
        )
        self.inv_freq = inv_freq.to(device)
        # One table for every position the model accepts: a lookup is cheap and graph-capturable,
        # and computing it here in fp32 gives bit-identical values to computing it per step.
        positions = torch.arange(cfg.max_context, device=device)
        self.cos, self.sin = rotary_cos_sin(positions, self.inv_freq, self.concentration, dtype)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def gather_in_attention() -> bool:
    """A decode forward whose every layer's rotary runs inside the split-KV decode kernel passes it the whole
    tables and the positions, so the two row lookups (two launches a step) are not made: KVRELAY_ROTARY_GATHER,
    a decode fusion of kernels.select.DECODE_FUSIONS. The same bits either way."""
    from kvrelay.kernels.select import fusion_on

    return fusion_on("KVRELAY_ROTARY_GATHER")
