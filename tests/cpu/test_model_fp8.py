"""quant="fp8-block128": the GEMM weights (qkv, out, experts) quantised to FP8 e4m3 with 128x128 block scales,
activations 1x128, computed with the reference FP8 GEMM (kernels/fp8.py). Checked layer by layer against a
bound derived from e4m3's round-off (kernels.fp8.fp8_block_linear_bound), which every output element of every
GEMM must obey on the activations that really reach it; end to end only reproducibility is asserted (a
3-layer random MoE's router flips make any model-level threshold a guess)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.engine.config import load_model_config
from kvrelay.engine.runner import Runner
from kvrelay.engine.weights import open_weights
from kvrelay.kernels.fp8 import (BLOCK, E4M3_SUBNORMAL_HALF_STEP, FP8_VALUE_ROUNDOFF, fp8_block_linear_bound,
                                 quantize_act_1x128, quantize_weight_block128)

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "gpt-oss-tiny-original"
PROMPT = list(range(40, 80))
pytestmark = pytest.mark.usefixtures("model_single_thread")


class _Recorder:
    """Stands in for a Linear in the float32 model: records each input, then runs the layer. (A Linear is
    called as `obj(x)`, which looks __call__ up on the type, so the layer object itself is replaced.)"""

    def __init__(self, layer, inputs: list):
        self.layer, self.inputs = layer, inputs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x.detach().clone())
        return self.layer(x)


def _captured_gemms(cfg, w, fp8: Runner):
    """{name: (float32 layer, fp8 layer, its inputs [M, K] float32)} for every GEMM the fp8 model quantises: each
    block's qkv and out projection and every expert's mlp1 and mlp2, the inputs those layers get in a float32
    forward of the unquantised (bf16-quant) model over PROMPT."""
    ref = Runner(cfg, w, page_size=4, kv_tokens=256, dtype=torch.float32)
    layers = {}
    for i, (rb, fb) in enumerate(zip(ref.model.blocks, fp8.model.blocks)):
        for name in ("qkv", "out"):
            inputs: list = []
            layers[f"{i}.{name}"] = (getattr(rb.attn, name), getattr(fb.attn, name), inputs)
            setattr(rb.attn, name, _Recorder(getattr(rb.attn, name), inputs))
        for name in ("mlp1", "mlp2"):
            ours, theirs = getattr(rb.mlp, name).experts, getattr(fb.mlp, name).experts
            for e in range(len(ours)):
                inputs = []
                layers[f"{i}.{name}.{e}"] = (ours[e], theirs[e], inputs)
                ours[e] = _Recorder(ours[e], inputs)
    ref.score(PROMPT)
    # 40 tokens x top-4 of 8 experts: every expert of every layer gets some (else it would go unchecked)
    assert all(inputs for _, _, inputs in layers.values()), [k for k, v in layers.items() if not v[2]]
    return {k: (r, f, torch.cat(inputs)) for k, (r, f, inputs) in layers.items()}


def _rounding_ratio(v: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """|v^ - v| / (a |v| + eta s) per value, v^ = q s (float64: exact) with s each value's block scale (expanded
    to v's shape): <= 1 everywhere is the lemma fp8_block_linear_bound starts from; a max near u / (1 + u) / a =
    0.94 (a value halfway above a power of two) shows u = 2^-4 is e4m3's round-off, not an overestimate."""
    v, scale = v.double(), scale.double()
    return (q.double() * scale - v).abs() / (FP8_VALUE_ROUNDOFF * v.abs() + E4M3_SUBNORMAL_HALF_STEP * scale)


def _expand(scale: torch.Tensor, rows: int, n: int, k: int) -> torch.Tensor:
    """Block scales [ceil(n/rows), ceil(k/128)] -> one per element [n, k]."""
    return scale.repeat_interleave(rows, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def test_fp8_gemms_within_e4m3_bound_per_layer():
    """Every FP8 GEMM of the fixture model, called on the activations a float32 forward feeds it, is within
    kernels.fp8.fp8_block_linear_bound of the exact product of its unquantised weight, element by element.
    The bound is a theorem (its docstring derives it), so no element may exceed it. It is not vacuous: in
    every layer the largest error reaches a fair part of it (random-sign round-offs mostly cancel: a tenth
    to a third here), and the per-value round-off it starts from is attained almost exactly. Being worst
    case, it alone would pass a weight scale off by 10%; so each GEMM is also held to bound_q around the
    exact product of its quantised operands (its fp32 arithmetic and bf16 output only, ~2^-8 relative), and
    each operand's quantisation, value by value, to the lemma: together the same theorem, in two sharp halves."""
    cfg = load_model_config(FIXTURE)
    w = open_weights(FIXTURE, cfg)
    fp8 = Runner(cfg, w, page_size=4, kv_tokens=256, quant="fp8-block128")
    assert fp8.model.blocks[0].attn.qkv.weight.dtype == torch.float8_e4m3fn
    assert fp8.model.blocks[0].mlp.mlp1.experts[0].weight.dtype == torch.float8_e4m3fn
    assert fp8.model.blocks[0].mlp.router.weight.dtype == torch.bfloat16  # the router stays bf16
    layers = _captured_gemms(cfg, w, fp8)
    assert len(layers) == cfg.num_hidden_layers * (2 + 2 * cfg.num_experts)
    # layer kind -> max over its layers of [err / bound, err / bound_q, relative error, value round-off ratio]
    worst: dict[str, list[float]] = {}
    for name, (ref, ours, x) in layers.items():
        n, k = ref.weight.shape
        wq, ws = quantize_weight_block128(ref.weight)
        # the fp8 layer holds exactly the weight the bound assumes (quantised from the same bf16 values)
        assert torch.equal(ours.weight.float(), wq.float()) and torch.equal(ours.weight_scale, ws), name
        got = ours(x).double()
        y, bound, y_q, bound_q = fp8_block_linear_bound(x, ref.weight, ref.bias)
        err, err_q = (got - y).abs(), (got - y_q).abs()
        for e, b, what in ((err, bound, "e4m3 bound"), (err_q, bound_q, "arithmetic bound")):
            over = e > b
            assert not over.any(), (f"{name}: {int(over.sum())} of {e.numel()} elements past the {what}, "
                                    f"worst err/bound {float((e / b).max()):.3f}")
        ratio, ratio_q = float((err / bound).max()), float((err_q / bound_q).max())
        assert ratio > 0.05 and ratio_q > 0.5, f"{name}: a vacuous bound ({ratio:.3f}, {ratio_q:.3f} of it)"
        # the per-value lemma on both operands, with the scales the GEMM uses
        xq, sx = quantize_act_1x128(x)
        value = max(float(_rounding_ratio(x, xq, _expand(sx, 1, x.shape[0], k)).max()),
                    float(_rounding_ratio(ref.weight, wq, _expand(ws, BLOCK, n, k)).max()))
        assert value <= 1, f"{name}: a value rounded past e4m3's round-off ({value:.3f} of it)"
        kind, rel = name.split(".")[1], float((got - y).norm() / y.norm())
        worst[kind] = [max(p, c) for p, c in zip(worst.get(kind, [0.0] * 4), (ratio, ratio_q, rel, value))]
    for kind, (ratio, ratio_q, rel, value) in worst.items():
        print(f"fp8-block128 {kind}: max err / e4m3 bound {ratio:.3f}, / arithmetic bound {ratio_q:.3f}; relative "
              f"error up to {rel:.2e}; per-value round-off up to {value:.3f} of its bound")
        assert value > 0.9, f"{kind}: no value came near e4m3's round-off ({value:.3f} of it)"
    # End to end: no threshold (see the module docstring), a summary, and the same bits twice.
    bf16 = Runner(cfg, w, page_size=4, kv_tokens=256)
    a, b = bf16.score(PROMPT), fp8.score(PROMPT)
    print(f"fp8-block128 vs bf16 on the fixture: mean relative logit error "
          f"{float((a - b).abs().mean() / a.abs().mean()):.2e}, top-1 agreement "
          f"{float((a.argmax(-1) == b.argmax(-1)).float().mean()):.2f}")
    assert torch.equal(fp8.score(PROMPT), b)


def test_fp8_lm_head_is_the_fp8_product_of_the_bf16_head():
    """quant="fp8-block128-lmhead": the blocks exactly as fp8-block128, the unembedding quantised too (the
    reference FP8 GEMM of the bf16 head's weight, bit for bit), logits within FP8 rounding of fp8-block128's,
    one byte per unembedding weight in the sizing estimate."""
    from kvrelay.kernels.fp8 import fp8_block_linear_ref, quantize_weight_block128

    cfg = load_model_config(FIXTURE)
    w = open_weights(FIXTURE, cfg)
    fp8 = Runner(cfg, w, page_size=4, kv_tokens=256, quant="fp8-block128")
    head = Runner(cfg, w, page_size=4, kv_tokens=256, quant="fp8-block128-lmhead")
    assert fp8.model.unembedding.weight.dtype == torch.bfloat16
    assert head.model.unembedding.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(head.model.blocks[1].attn.qkv.weight.float(), fp8.model.blocks[1].attn.qkv.weight.float())
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = fp8_block_linear_ref(x, *quantize_weight_block128(fp8.model.unembedding.weight), None).bfloat16()
    assert torch.equal(head.model.unembedding(x), want)
    a, b = fp8.score(PROMPT), head.score(PROMPT)
    rel = float((a - b).norm() / a.norm())
    top1 = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    print(f"fp8-block128-lmhead vs fp8-block128 on the fixture: relative logit error {rel:.2e}, top-1 agreement "
          f"{top1:.2f}")
    assert 0 < rel < 0.06 and top1 >= 0.85
    assert torch.equal(head.score(PROMPT), b)
    assert cfg.weight_bytes("fp8-block128") - cfg.weight_bytes("fp8-block128-lmhead") == cfg.vocab_size * cfg.hidden_size
    assert cfg.weight_bytes("bf16") - cfg.weight_bytes("fp8-block128") == (
        cfg.num_hidden_layers * (cfg.hidden_size * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
                                 * cfg.head_dim + cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size
                                 + cfg.num_experts * 3 * cfg.hidden_size * cfg.intermediate_size))
