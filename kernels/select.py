"""Backend choice by device: CPU -> kernels.reference (pure torch); CUDA -> the fast GPU kernels.

Attention: FlashInfer (FA3 sink prefill + tensor-core decode with the exact sink correction) on Hopper
when flashinfer imports; otherwise the Triton kernels, which run on any CUDA GPU Triton supports.
`KVRELAY_ATTENTION=reference|triton|flashinfer` overrides (for A/B runs and debugging).
Every returned callable has the reference function's signature, so callers never branch on device.
"""

from __future__ import annotations

import functools
import os

import torch


def _device(device) -> torch.device:
    return torch.device(device) if not isinstance(device, torch.device) else device


@functools.lru_cache(maxsize=None)
def _flashinfer_ok(index: int) -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    major, _ = torch.cuda.get_device_capability(index)
    return major >= 9  # the FA3 sink variant needs Hopper


def attention_backend(device) -> str:
    dev = _device(device)
    forced = os.environ.get("KVRELAY_ATTENTION")
    if forced:
        return forced
    if dev.type != "cuda":
        return "reference"
    return "flashinfer" if _flashinfer_ok(dev.index or 0) else "triton"


def paged_attention(device):
    """-> fn(q, pool, qo_indptr, kv: PagedKV, sinks, sm_scale, window) for this device."""
    backend = attention_backend(device)
    if backend == "reference":
        from . import reference
        return reference.paged_attention
    if backend == "flashinfer":
        from . import attention
        return attention.paged_attention
    from . import triton_attention
    return triton_attention.paged_attention


def route_topk(device):
    """-> fn(router_logits, k) -> (weights bf16 [T, k], ids int64 [T, k])."""
    if _device(device).type != "cuda":
        from . import reference
        return reference.route_topk
    from . import moe
    return moe.route_topk


def fp8_linear(device):
    """-> fn(x, w_fp8, w_scale, bias) with fp8_block_linear_ref's meaning. On CUDA the engine should
    hold a kernels.fp8_gemm.Fp8BlockLinear per layer instead (weights prepared once, backend timed)."""
    if _device(device).type != "cuda":
        from . import fp8
        return fp8.fp8_block_linear_ref
    from . import fp8_gemm
    return fp8_gemm.fp8_block_linear


def moe_experts(device):
    """-> fn(x, ids, weights, MoEWeights) on CUDA; None on CPU, where the engine's reference MoE runs."""
    if _device(device).type != "cuda":
        return None
    from . import moe
    return moe.moe_experts
