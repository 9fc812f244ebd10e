"""RMSNorm with the gain and the reduction in fp32 (the activations stay bf16 between layers)."""

from __future__ import annotations

import torch

from kvrelay.engine.layers.linear import WeightGetter


class RMSNorm:
    def __init__(self, weights: WeightGetter, name: str, eps: float, device: torch.device | str):
        # The checkpoint stores the gain in bf16; holding it in fp32 is what transformers and the
        # reference do, so the product with the fp32-normalised row is not rounded twice.
        self.scale = weights.get(name, dtype=torch.float32, device=device)
        self.eps = eps
        from kvrelay.kernels import select

        # GPU: one fused Triton launch instead of eight torch ops (decode steps are launch-bound).
        self.fused = select.use_gpu_kernels(device) and torch.device(device).type != "meta"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from kvrelay.kernels.fused import rms_norm

            return rms_norm(x, self.scale, self.eps)
        t = x.float()
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.scale * t).to(x.dtype)
