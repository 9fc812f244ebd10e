"""Backend choice by device: CPU -> kernels.reference (pure torch); CUDA -> the fast GPU kernels.

Attention: FlashInfer (FA3 sink prefill + tensor-core decode with the exact sink correction) on Hopper
when flashinfer imports and the head dim is one whose modules we ship prebuilt (64, gpt-oss); otherwise
the Triton kernels, which run on any CUDA GPU Triton supports. Prefill of sliding-window layers runs the
Triton kernel even next to FlashInfer: measured faster on the H200 (8192 tokens, window 128: 0.18 ms
Triton vs 0.29 ms FA3, bench/results/kernels-attn-20261129.json); full-causal prefill runs FA3 (1.28 ms
vs 2.91 ms Triton).
Decode (one query per sequence, CUDA graphs): the Triton split-KV decode for sliding layers, and for full
layers up to 64 sequences; FlashInfer's tensor-core decode for full layers above (DECODE_DEFAULT,
`decode_attention_backend`), as measured side by side by `python -m kvrelay.bench.kernels --only attndec`.
`KVRELAY_DECODE_ATTENTION=flashinfer|triton` picks the decode kernel of every layer,
`KVRELAY_DECODE_SLIDING=flashinfer|triton` that of the sliding layers only (it wins over the former).
`KVRELAY_ATTENTION=reference|triton|flashinfer` overrides (for A/B runs and debugging), and
`KVRELAY_KERNELS=reference` keeps a CUDA device on the pure-torch reference path altogether.
Every returned callable has the reference function's signature, so callers never branch on device.
"""

from __future__ import annotations

import functools
import os

import torch

# the decode fusions' switches sit below the kernels that read them; re-exported here, where callers look
from .switches import DECODE_FUSIONS, fusion_on  # noqa: F401
from . import fp8, reference

# The FA3 sink module's name does not encode the head dim, so a prebuilt module for 64 would be loaded
# for any other head dim too: only use FlashInfer where the shipped modules match.
FLASHINFER_HEAD_DIMS = (64,)


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


def use_gpu_kernels(device) -> bool:
    """True when the engine should run the GPU kernels (FlashInfer/Triton/cuBLAS FP8) on this device.
    `KVRELAY_KERNELS=triton` also selects them on a CPU device (Triton interpreter runs, tests)."""
    forced = os.environ.get("KVRELAY_KERNELS")
    if forced == "reference":
        return False
    if forced == "triton":
        return True
    return _device(device).type == "cuda"


def fuse_glue(device) -> bool:
    """True when the model runs the fused residual/norm/quantisation and rotary/KV-write kernels
    (kernels/fused.py) between the big kernels: wherever the GPU kernels run, unless
    `KVRELAY_FUSED=0` (A/B runs: the unfused GPU chain computes the same math in more launches)."""
    return use_gpu_kernels(device) and _device(device).type != "meta" and os.environ.get("KVRELAY_FUSED") != "0"


def attention_backend(device, head_dim: int | None = None) -> str:
    dev = _device(device)
    if not use_gpu_kernels(dev):
        # a device on the reference path keeps reference attention whatever KVRELAY_ATTENTION says: a CPU Runner
        # beside a GPU one (the GPU tests' float32 references) must not launch Triton on CPU tensors
        return "reference"
    forced = os.environ.get("KVRELAY_ATTENTION")
    if forced:
        return forced
    if dev.type != "cuda":
        return "triton"
    if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        return "triton"
    return "flashinfer" if _flashinfer_ok(dev.index or 0) else "triton"


def prefill_attention_backend(backend: str, window: int | None) -> str:
    """Which kernel runs the prefill of one layer kind under an attention backend."""
    if backend == "flashinfer" and window:
        return "triton"  # faster for windowed prefill (see module docstring)
    return backend


# The decode kernel of each layer kind where FlashInfer is the backend, from the H200 measurement
# (bench/results/kernels-20261201-195526.json, `--only attndec`, CUDA graphs, 8k context, us a layer):
#   full     b1 7.9 Triton vs 11.3 FlashInfer, b8 42.5 vs 44.3, b64 255.6 vs 261.5
#   sliding  b1 4.2 vs 7.4,                    b8 4.6 vs 7.7,   b64 10.2 vs 15.2
# Triton wins every point measured. Full layers above DECODE_TRITON_MAX_BATCH (and an eager step of a size
# not known in advance) keep FlashInfer: Triton's split count falls to 1 there, where it was measured 12%
# slower than 2 splits at b64, and no point above b64 was measured.
DECODE_DEFAULT = {"full": "triton", "sliding": "triton"}
DECODE_TRITON_MAX_BATCH = {"full": 64, "sliding": None}
DECODE_KERNELS = ("flashinfer", "triton")


def _decode_env(name: str) -> str | None:
    value = os.environ.get(name)
    if not value:
        return None
    if value not in DECODE_KERNELS:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(DECODE_KERNELS)}")
    return value


def decode_attention_backend(backend: str, window: int | None, batch: int | None = None) -> str:
    """Which kernel runs the decode of one layer kind (window None = full, else sliding) at `batch`
    sequences under an attention backend. Only a "flashinfer" backend has a choice ("flashinfer" or
    "triton"): the Triton backend has no FlashInfer to send anything to, the reference stays the
    reference. `batch` (None: any) lets a default depend on the batch size; a CUDA graph asks once per
    graph size, an eager step per planned batch. Env overrides: see the module docstring."""
    if backend != "flashinfer":
        return backend
    forced = (_decode_env("KVRELAY_DECODE_SLIDING") if window else None) or _decode_env("KVRELAY_DECODE_ATTENTION")
    if forced:
        return forced
    return default_decode_kernel("sliding" if window else "full", batch)


def default_decode_kernel(kind: str, batch: int | None) -> str:
    """DECODE_DEFAULT[kind], except FlashInfer where a Triton default is limited to DECODE_TRITON_MAX_BATCH
    and the batch is above it or unknown (None)."""
    kernel = DECODE_DEFAULT[kind]
    cap = DECODE_TRITON_MAX_BATCH.get(kind)
    if kernel == "triton" and cap is not None and (batch is None or batch > cap):
        return "flashinfer"
    return kernel


def paged_attention(device, head_dim: int | None = None):
    """-> fn(q, pool, qo_indptr, kv: PagedKV, sinks, sm_scale, window) for this device."""
    backend = attention_backend(device, head_dim)
    if backend == "reference":
        return reference.paged_attention
    # imported on first use: FlashInfer and Triton are the `gpu` extra's, absent on a CPU-only install
    if backend == "flashinfer":
        from . import attention
        return attention.paged_attention
    from . import triton_attention
    return triton_attention.paged_attention


def route_topk(device):
    """-> fn(router_logits, k) -> (weights bf16 [T, k], ids int64 [T, k])."""
    if not use_gpu_kernels(device):
        return reference.route_topk
    from . import moe  # Triton, the `gpu` extra's: imported on first use
    return moe.route_topk


def fp8_linear(device):
    """-> fn(x, w_fp8, w_scale, bias) with fp8_block_linear_ref's meaning. On CUDA the engine holds a
    kernels.fp8_gemm.Fp8BlockLinear per layer instead (weights prepared once, backend timed)."""
    if _device(device).type != "cuda":
        return fp8.fp8_block_linear_ref
    from . import fp8_gemm  # Triton, the `gpu` extra's: imported on first use
    return fp8_gemm.fp8_block_linear


def moe_experts(device):
    """-> fn(x, ids, weights, MoEWeights) on CUDA; None on CPU, where the engine's reference MoE runs."""
    if not use_gpu_kernels(device):
        return None
    from . import moe  # Triton, the `gpu` extra's: imported on first use
    return moe.moe_experts
