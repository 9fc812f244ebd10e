"""quant="fp8-block128": the GEMM weights (qkv, out, experts) quantised to FP8 with 128x128 block scales,
computed with the reference FP8 GEMM. Close to bf16 on the MXFP4 fixture, and deterministic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.engine.config import load_model_config
from kvrelay.engine.runner import Runner
from kvrelay.engine.weights import open_weights

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "gpt-oss-tiny-original"
pytestmark = pytest.mark.usefixtures("model_single_thread")


def test_fp8_close_to_bf16():
    cfg = load_model_config(FIXTURE)
    w = open_weights(FIXTURE, cfg)
    bf16 = Runner(cfg, w, page_size=4, kv_tokens=256)
    fp8 = Runner(cfg, w, page_size=4, kv_tokens=256, quant="fp8-block128")
    assert fp8.model.blocks[0].attn.qkv.weight.dtype == torch.float8_e4m3fn
    assert fp8.model.blocks[0].mlp.mlp1.experts[0].weight.dtype == torch.float8_e4m3fn
    assert fp8.model.blocks[0].mlp.router.weight.dtype == torch.bfloat16  # the router stays bf16
    # Each FP8 GEMM on its own is within e4m3 precision (3 mantissa bits: ~2-4% relative error once both
    # the activation and the weight are rounded) of the bf16 product.
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for ours, ref in ((fp8.model.blocks[1].attn.qkv, bf16.model.blocks[1].attn.qkv),
                      (fp8.model.blocks[2].mlp.mlp1.experts[3], bf16.model.blocks[2].mlp.mlp1.experts[3])):
        ya, yb = ref(x).float(), ours(x).float()
        assert float((ya - yb).norm() / ya.norm()) < 0.06
    # End to end, a random 3-layer toy MoE amplifies that (router flips), so only a loose agreement is
    # meaningful here; the real-checkpoint accuracy check lives in tests/gpu.
    prompt = list(range(40, 80))
    a, b = bf16.score(prompt), fp8.score(prompt)
    mean_rel = float((a - b).abs().mean() / a.abs().mean())
    top1_agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    print(f"fp8-block128 vs bf16 on the fixture: mean relative logit error {mean_rel:.2e}, top-1 agreement "
          f"{top1_agree:.2f}")
    assert 0 < mean_rel < 0.35 and top1_agree >= 0.6
    assert torch.equal(fp8.score(prompt), b)


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
    prompt = list(range(40, 80))
    a, b = fp8.score(prompt), head.score(prompt)
    rel = float((a - b).norm() / a.norm())
    top1 = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    print(f"fp8-block128-lmhead vs fp8-block128 on the fixture: relative logit error {rel:.2e}, top-1 agreement "
          f"{top1:.2f}")
    assert 0 < rel < 0.06 and top1 >= 0.85
    assert torch.equal(head.score(prompt), b)
    assert cfg.weight_bytes("fp8-block128") - cfg.weight_bytes("fp8-block128-lmhead") == cfg.vocab_size * cfg.hidden_size
    assert cfg.weight_bytes("bf16") - cfg.weight_bytes("fp8-block128") == (
        cfg.num_hidden_layers * (cfg.hidden_size * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
                                 * cfg.head_dim + cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size
                                 + cfg.num_experts * 3 * cfg.hidden_size * cfg.intermediate_size))
