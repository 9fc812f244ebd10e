"""The numbers a benchmark puts its measurements against: the cost arithmetic (US$ per 1M tokens at $3.00
per H200-hour, docs/seed-notes.md), the seed's prefill table, the H200's measured ceilings, and estimates
of the FLOPs and bytes the model needs (prefill FLOPs, the bytes one decode step reads, weight and KV page
sizes). Pure arithmetic on a ModelConfig: no torch, no device.

bench/common.py imports all of these back, so benchmarks keep reading them as `common.X`.
"""

from __future__ import annotations

import math

from kvrelay.engine import kv_geometry
from kvrelay.engine.config import expert_quant, head_quant, layer_quant

USD_PER_GPU_HOUR = 3.0
# Measured on the H200 (docs: h200-notes.md); used only to put achieved rates in context.
CEILING_TFLOPS = {"bf16": 762.0, "fp8": 1378.0}
COPY_BW_BYTES_S = 4.19e12
# Copy ceilings of other GPU kinds, by a substring of their name (bench/results_md.setup's "... on <GPU>"): the
# H100 SXM's 3.35 TB/s is NVIDIA's peak HBM3 figure, not measured here (the H200's 4.19 is measured, 4.8 peak).
COPY_BW_BY_GPU = {"H100": 3.35e12}


def copy_bw(where: str = "") -> float:
    """The copy ceiling of the GPU named in `where` (a result's setup); the H200's by default."""
    return next((bw for key, bw in COPY_BW_BY_GPU.items() if key in where), COPY_BW_BYTES_S)

# The seed's prefill table (latency s, $ per 1M input tokens), docs/seed-notes.md, keyed by input length.
SEED_PREFILL: dict[str, dict[str, dict[int, tuple[float, float]]]] = {
    "gpt-oss-120b": {
        "EP1 DP1 TP1": {8192: (0.364, 0.037), 32768: (2.421, 0.062), 65536: (7.375, 0.094), 128000: (23.902, 0.156)},
        "EP2 DP1 TP2": {8192: (0.190, 0.039), 32768: (1.245, 0.063), 65536: (3.786, 0.096), 128000: (12.116, 0.158)},
        "EP4 DP1 TP4": {8192: (0.165, 0.067), 32768: (0.900, 0.092), 65536: (2.449, 0.125), 128000: (7.165, 0.187)},
        "EP8 DP1 TP8": {8192: (0.179, 0.145), 32768: (0.839, 0.171), 65536: (2.003, 0.204), 128000: (5.119, 0.267)},
    },
    "gpt-oss-20b": {
        "EP1 DP1 TP1": {8192: (0.239, 0.024), 32768: (1.610, 0.041), 65536: (4.895, 0.062), 128000: (16.037, 0.104)},
        "EP2 DP1 TP2": {8192: (0.127, 0.026), 32768: (0.833, 0.042), 65536: (2.522, 0.064), 128000: (8.143, 0.106)},
        "EP4 DP1 TP4": {8192: (0.108, 0.044), 32768: (0.593, 0.060), 65536: (1.616, 0.082), 128000: (4.766, 0.124)},
        "EP8 DP1 TP8": {8192: (0.116, 0.094), 32768: (0.547, 0.111), 65536: (1.310, 0.133), 128000: (3.365, 0.175)},
    },
}

# ---- cost arithmetic -------------------------------------------------------------------------------
def prefill_usd_per_m_input(latency_s: float, input_len: int, gpus: int = 1,
                            usd_per_gpu_hour: float = USD_PER_GPU_HOUR) -> float:
    """$ per 1M input tokens = latency x GPUs x ($/3600) x 1e6 / input length (seed-notes)."""
    return latency_s * gpus * (usd_per_gpu_hour / 3600.0) * 1e6 / input_len


def decode_usd_per_m_output(aggregate_tokens_s: float, gpus: int = 1,
                            usd_per_gpu_hour: float = USD_PER_GPU_HOUR) -> float:
    """$ per 1M output tokens = (GPUs x $/3600) / (aggregate output tokens/s) x 1e6."""
    return gpus * (usd_per_gpu_hour / 3600.0) / aggregate_tokens_s * 1e6


def fmt_cell(latency_s: float, usd: float) -> str:
    """The seed table's cell format: '0.364 s, $0.037'."""
    return f"{latency_s:.3f} s, ${usd:.3f}"


# ---- FLOP and byte estimates -------------------------------------------------------------------------
def layer_active_params(cfg) -> int:
    """Weights one token multiplies through in one layer: QKV, output, router, and top-k experts."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    attn = cfg.qkv_width * h + h * cfg.q_width
    return attn + cfg.num_experts * h + cfg.experts_per_token * (2 * i * h + h * i)


def expert_flops(cfg, tokens: int) -> float:
    """The active experts' GEMMs over `tokens` tokens, all layers: top-k experts per token, each
    w1 [2*inter, hidden] and w2 [hidden, inter], 2 FLOPs per multiply-add."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return 2.0 * tokens * cfg.experts_per_token * (h * 2 * i + i * h) * cfg.num_hidden_layers


def projection_flops(cfg, tokens: int) -> float:
    """The attention's QKV and output projections over `tokens` tokens, all layers."""
    h = cfg.hidden_size
    return 2.0 * tokens * (cfg.qkv_width * h + h * cfg.q_width) * cfg.num_hidden_layers


def active_params(cfg) -> int:
    """Per-token active parameters incl. the unembedding (the embedding is a lookup, no FLOPs)."""
    return cfg.num_hidden_layers * layer_active_params(cfg) + cfg.vocab_size * cfg.hidden_size


def causal_pairs(n_new: int, start: int, window: int | None) -> int:
    """Visible (query, key) pairs when n_new tokens at positions start.. attend causally (window keys
    including the query itself on sliding layers)."""
    total = 0
    if window is None:
        # sum over positions p in [start, start+n_new) of (p + 1)
        return n_new * start + n_new * (n_new + 1) // 2
    # Positions below the window see p+1 keys, the rest see `window`.
    ramp_end = min(start + n_new, window)
    if ramp_end > start:
        total += sum(range(start + 1, ramp_end + 1))
    total += max(0, start + n_new - max(start, window)) * window
    return total


def attention_flops(cfg, n_new: int, start: int = 0) -> float:
    """QK^T and PV: 2 matmuls x 2 FLOPs per multiply-add x head_dim x query heads, per visible pair."""
    per_pair = 4 * cfg.head_dim * cfg.num_attention_heads
    total = 0
    for layer in range(cfg.num_hidden_layers):
        window = cfg.sliding_window if cfg.layer_is_sliding(layer) else None
        total += per_pair * causal_pairs(n_new, start, window)
    return float(total)


def prefill_flops(cfg, length: int) -> dict[str, float]:
    """Batch-1 prefill of `length` tokens: linear layers for every token, unembedding for the last one
    (the Runner computes logits only for each sequence's last position), plus attention."""
    linear = 2.0 * length * cfg.num_hidden_layers * layer_active_params(cfg)
    unembed = 2.0 * cfg.vocab_size * cfg.hidden_size
    attn = attention_flops(cfg, length)
    return {"linear": linear + unembed, "attention": attn, "total": linear + unembed + attn}


def decode_bytes_per_step(cfg, batch: int, context: int, quant: str) -> float:
    """Rough HBM bytes one decode step must read: dense weights, the experts the batch touches (expected
    distinct experts of `batch` x top-k uniform picks), and the KV of every sequence."""
    wbytes = 1.0 if layer_quant(quant) != "bf16" else 2.0
    xbytes = {"mxfp4": 17 / 32, "fp8-block128": 1.0}.get(expert_quant(quant), 2.0)  # MXFP4: 4 bits + a scale byte / 32
    h, i, e, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.experts_per_token
    dense = cfg.qkv_width * h + h * cfg.q_width
    touched = e * (1.0 - (1.0 - k / e) ** batch)
    per_layer = wbytes * dense + xbytes * touched * 3 * i * h + 2.0 * e * h  # router stays bf16
    kv_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16
    kv = 0.0
    for layer in range(cfg.num_hidden_layers):
        seen = min(context + 1, cfg.sliding_window) if cfg.layer_is_sliding(layer) else context + 1
        kv += batch * seen * kv_token
    head = 1.0 if head_quant(quant) == "fp8-block128" else 2.0  # the unembedding (engine/config.MODEL_QUANTS)
    return cfg.num_hidden_layers * per_layer + head * cfg.vocab_size * h + kv


def weight_bytes(cfg, quant: str, *, resident: bool = False) -> float:
    """Bytes of the weights as served: the four GEMM weights in fp8 (+ tiny scales) or bf16. resident=True:
    what they hold in GPU memory, an FP8 weight's K (its last dim) padded to a multiple of 128 as the kernels
    keep it (2880 -> 2944: +2.2%) and its fp32 128x128 block scales counted."""
    from kvrelay.engine.weights import canonical_shapes, is_expert_weight, is_fp8_target

    total = 0.0
    for name, shape in canonical_shapes(cfg).items():
        if expert_quant(quant) == "mxfp4" and is_expert_weight(name):
            total += math.prod(shape) * 17 / 32  # kept as shipped: blocks + one scale byte a 32 weights
            continue
        fp8 = head_quant(quant) != "bf16" if name == "unembedding.weight" else (
            layer_quant(quant) != "bf16" and is_fp8_target(name))
        if fp8 and resident:
            *lead, n_rows, k = shape
            kp = -(-k // 128) * 128
            blocks = -(-n_rows // 128) * (kp // 128)
            total += math.prod(lead) * (n_rows * kp + 4 * blocks)
        else:
            total += math.prod(shape) * (1.0 if fp8 else 2.0)
    return total


def kv_bytes_per_page(cfg, page_size: int, layers: int) -> int:
    """One page of `layers` layers, every KV head, bf16 (engine/kv_geometry.py's page)."""
    return layers * kv_geometry.page_bytes(page_size, cfg.num_key_value_heads, cfg.head_dim, 2)
