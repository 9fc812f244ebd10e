"""Tensor-parallel coordinates, the weight-source protocol, and the (optionally FP8) linear layers.

Every layer loads its weights only through `WeightGetter.get(name, slices)`, with the slices computed
from its `Shard`, so tensor/expert parallelism is a matter of passing another `Shard` rather than
rewriting the model. With the default `Shard()` (rank 0 of 1) the collectives are no-ops.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from kvrelay.engine.mxfp4 import dequantize_mxfp4
from kvrelay.engine.parallel import ParallelContext

QUANTS = ("bf16", "fp8-block128")  # what one layer's weights can be


class WeightGetter(Protocol):
    """What `engine.weights.WeightSource` provides: canonical (original-format) names, dequantised."""

    def get(
        self,
        name: str,
        slices: tuple[slice, ...] = (),
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor: ...


class TensorDictWeights:
    """A `WeightGetter` over an in-memory dict of canonical-name tensors (tests, converted models)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = tensors

    def get(self, name, slices=(), dtype=None, device=None):
        try:
            t = self._tensors[name]
        except KeyError:
            raise KeyError(f"weight {name!r} not found") from None
        t = t[tuple(slices)] if slices else t
        return t.to(device=device, dtype=dtype or t.dtype, copy=False).contiguous()


# This process's place in a tensor-parallel group. The layers use only `rank`, `world_size`,
# `expert_parallel`, `span`, `all_reduce` and `all_gather_last`; one type serves the layers and the
# process-group code (engine/parallel.py), so a worker's context is passed to the model as it is.
# `expert_parallel` True gives each rank whole experts ("EPn TPn"); False a slice of every expert's
# intermediate dimension ("EP1 TPn"). The default (rank 0 of 1) makes the collectives no-ops.
Shard = ParallelContext


def _check_quant(quant: str) -> None:
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")


# (out, in, has bias, device) -> {M bucket: backend}: Fp8BlockLinear's timed choice, shared by every
# layer of one shape so a model times each shape once.
_FP8_CHOICES: dict[tuple, dict[int, str]] = {}


class Linear:
    """y = x W^T + b with W [out, in]. For fp8-block128 the bf16 weight is quantised once at load
    (128x128 block scales) and the product runs through the reference FP8 GEMM (1x128 activation
    scales), i.e. exactly what the served FP8 kernels compute. On a CUDA device the FP8 product runs
    through kernels.fp8_gemm.Fp8BlockLinear (cuBLAS blockwise with the bias fused, or the Triton GEMM,
    whichever was measured faster per M bucket)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quant: str = "bf16"):
        _check_quant(quant)
        self.quant = quant
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self._gpu = None
        if quant == "bf16":
            self.weight = weight
        else:
            from kvrelay.kernels.fp8 import quantize_weight_block128

            self.weight, self.weight_scale = quantize_weight_block128(weight)
            if self.weight.device.type == "cuda":
                from kvrelay.kernels.fp8_gemm import Fp8BlockLinear

                key = (self.out_features, self.in_features, bias is not None, str(self.weight.device))
                self._gpu = Fp8BlockLinear(self.weight, self.weight_scale, bias, backend="auto",
                                           choice_cache=_FP8_CHOICES.setdefault(key, {}))
                # Keep one copy of the weight: the kernel's (K padded to 128) is the one held.
                self.weight = self._gpu.w[:, : self.in_features]

    @property
    def quant_k(self) -> int | None:
        """K padded to 128 when this layer runs the GPU FP8 GEMM (its input may come pre-quantised,
        `run_quantized`), else None."""
        return self._gpu.kp if self._gpu is not None else None

    def run_quantized(self, xq: torch.Tensor, sx: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
        """The GPU FP8 product of m rows quantised as kernels.fp8_gemm.quantize_act_1x128(x, quant_k)
        would quantise them: self(x) without the quantisation launch; `dtype` is x's."""
        return self._gpu.run_quantized(xq, sx, m).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant == "bf16":
            return F.linear(x, self.weight, self.bias)
        if self._gpu is not None:
            return self._gpu(x).to(x.dtype)
        from kvrelay.kernels.fp8 import fp8_block_linear_ref

        return fp8_block_linear_ref(x, self.weight, self.weight_scale, self.bias).to(x.dtype)


class Mxfp4Linear:
    """y = x W^T + b with W kept as MXFP4 blocks [out, in/32, 16] + scales [out, in/32] (the checkpoint's bytes),
    decoded to x's dtype at each call: exact in bf16 and float32 (every MXFP4 value is), so this is the bf16 or
    float32 linear of the checkpoint's own dequantised weight. The CPU path of model.quant mxfp4."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        self.blocks, self.scales, self.bias = blocks, scales, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, dequantize_mxfp4(self.blocks, self.scales, x.dtype), bias)


class ExpertLinears:
    """A stack of per-expert linears, weights [E_local, out, in], biases [E_local, out]; quant mxfp4: weight is
    (blocks [E_local, out, in/32, 16], scales [E_local, out, in/32])."""

    def __init__(self, weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor,
                 quant: str = "bf16"):
        if quant == "mxfp4":
            blocks, scales = weight
            self.experts = [Mxfp4Linear(blocks[e], scales[e], bias[e]) for e in range(blocks.shape[0])]
            return
        self.experts = [Linear(weight[e], bias[e], quant) for e in range(weight.shape[0])]

    def __call__(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.experts[e](x)

    def __len__(self) -> int:
        return len(self.experts)
