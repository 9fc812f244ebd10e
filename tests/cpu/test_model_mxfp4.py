"""model.quant mxfp4 / mxfp4-bf16: the experts served from the MXFP4 blocks as the checkpoint stores them.

In float32 on the CPU the path is the checkpoint's own dequantised weights (every MXFP4 value is exact in bf16
and float32), so it must be token-identical to OpenAI's reference tokens (original layout) and to transformers
(HF layout) on those weights: the same tests as test_model_tiny_reference.py / test_model_hf.py, with the quant.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_hf import CASES, _first_divergence, _hf_config, _hf_greedy, _our_greedy, _prompt, _randomise, _rel

import transformers  # noqa: E402  (test dependency)

from kvrelay.engine.config import load_model_config
from kvrelay.engine.llm import LLM
from kvrelay.engine.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from kvrelay.engine.runner import Runner
from kvrelay.engine.sampling import SamplingParams
from kvrelay.engine.weights import WeightError, open_weights

pytestmark = pytest.mark.usefixtures("model_single_thread")

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "gpt-oss-tiny-original"
RUNS = json.loads((FIXTURE / "reference.json").read_text())["runs"]


def test_original_layout_fp32_reproduces_openai_reference_exactly():
    llm = LLM(FIXTURE, dtype=torch.float32, quant="mxfp4-bf16", page_size=4, kv_tokens=2048)
    greedy = SamplingParams(max_tokens=len(RUNS[0]["greedy"]), temperature=0)
    for run in RUNS:
        assert [o.token_id for o in llm.generate(run["prompt"], greedy)] == run["greedy"]
    # the experts are the file's bytes, not a dequantised copy
    expert = llm.runner.model.blocks[1].mlp.mlp1.experts[3]
    stored = load_file(str(next(FIXTURE.glob("*.safetensors"))))
    assert expert.blocks.dtype == torch.uint8
    assert torch.equal(expert.blocks, stored["block.1.mlp.mlp1_weight.blocks"][3])
    assert torch.equal(expert.scales, stored["block.1.mlp.mlp1_weight.scales"][3])


def _snap(w_in_out: torch.Tensor) -> torch.Tensor:
    """HF experts [E, in, out] moved onto the MXFP4 grid along `in` (the blocks' axis)."""
    b, s = quantize_mxfp4(w_in_out.float().transpose(-1, -2))
    return dequantize_mxfp4(b, s, torch.float32).transpose(-1, -2).to(w_in_out.dtype)


@pytest.fixture(scope="module")
def hf_mxfp4(tmp_path_factory):
    """One test_model_hf case (dims that are multiples of 32) with its experts on the MXFP4 grid: HF reads the
    bf16 save (exact values), we read a copy whose experts are stored as `_blocks` / `_scales` (HF's MXFP4 names)."""
    c = next(c for c in CASES if c.hidden % 32 == 0 and c.inter % 32 == 0)
    hf = transformers.GptOssForCausalLM(_hf_config(c))
    _randomise(hf, seed=7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")):
                p.copy_(_snap(p.data))
    bf16_dir, mx_dir = tmp_path_factory.mktemp("hf-bf16"), tmp_path_factory.mktemp("hf-mxfp4")
    hf.to(torch.bfloat16).save_pretrained(bf16_dir, safe_serialization=True)
    for f in bf16_dir.iterdir():
        if f.suffix != ".safetensors":
            (mx_dir / f.name).write_bytes(f.read_bytes())
            continue
        tensors = {}
        for k, v in load_file(str(f)).items():
            if k.endswith(("gate_up_proj", "down_proj")):
                tensors[k + "_blocks"], tensors[k + "_scales"] = quantize_mxfp4(v.float().transpose(-1, -2))
            else:
                tensors[k] = v
        save_file(tensors, str(mx_dir / f.name), metadata={"format": "pt"})
    ref = transformers.GptOssForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32, attn_implementation="eager")
    cfg = load_model_config(mx_dir)
    ws = open_weights(mx_dir, cfg)
    assert ws.format == "hf-mxfp4"
    return c, ref.eval(), Runner(cfg, ws, page_size=4, kv_tokens=4096, dtype=torch.float32, quant="mxfp4-bf16")


def test_hf_layout_fp32_logits_and_greedy_match_transformers(hf_mxfp4):
    c, ref, ours = hf_mxfp4
    prompt = _prompt(3 * c.window + 5, c.vocab, seed=1)
    with torch.inference_mode():
        truth = ref(torch.tensor([prompt])).logits[0].float()
    assert _rel(ours.score(prompt), truth) < 1e-5
    for i, n in enumerate((1, c.window + 1, 2 * c.window + 3)):
        prompt = _prompt(n, c.vocab, seed=100 + i)
        want, _, margins = _hf_greedy(ref, prompt, 24)
        got = _our_greedy(ours, prompt, 24)
        d = _first_divergence(got, want)
        assert d is None or margins[d] < 1e-4, (n, d, got, want)


def test_raw_blocks_are_the_files_and_slices_stay_on_blocks():
    ws = open_weights(FIXTURE)
    stored = load_file(str(next(FIXTURE.glob("*.safetensors"))))
    blocks, scales = ws.get_mxfp4("block.0.mlp.mlp2_weight", (slice(2, 5), slice(None), slice(32, 64)))
    assert torch.equal(blocks, stored["block.0.mlp.mlp2_weight.blocks"][2:5, :, 1:2])
    assert torch.equal(scales, stored["block.0.mlp.mlp2_weight.scales"][2:5, :, 1:2])
    with pytest.raises(WeightError, match="do not lie on 32-column MXFP4 blocks"):
        ws.get_mxfp4("block.0.mlp.mlp2_weight", (slice(None), slice(None), slice(0, 48)))
    assert ws.get_mxfp4("block.0.attn.qkv.weight") is None  # only the experts are MXFP4


def test_dummy_mxfp4_experts_are_seeded_sliceable_and_serve():
    cfg = load_model_config("gpt-oss-tiny")
    ws = open_weights(None, cfg, dummy=True, seed=3)
    name = "block.1.mlp.mlp1_weight"
    full = ws.get_mxfp4(name)
    e, rows, cols = cfg.num_experts, 2 * cfg.intermediate_size, cfg.hidden_size
    assert full[0].shape == (e, rows, cols // 32, 16) and full[1].shape == (e, rows, cols // 32)
    part = ws.get_mxfp4(name, (slice(1, 3), slice(5, 40)))
    assert torch.equal(part[0], full[0][1:3, 5:40]) and torch.equal(part[1], full[1][1:3, 5:40])
    assert torch.equal(open_weights(None, cfg, dummy=True, seed=3).get_mxfp4(name)[0], full[0])
    w = dequantize_mxfp4(*full, torch.float32)
    assert 0.01 < float(w.std()) < 0.04 and len(torch.unique(full[0])) > 200
    runner = Runner(cfg, ws, page_size=4, kv_tokens=256, dtype=torch.float32, quant="mxfp4")
    assert torch.isfinite(runner.score(list(range(1, 9)))).all()


def test_weight_bytes_count_mxfp4_experts_as_shipped():
    big = load_model_config("gpt-oss-120b")
    # OpenAI's 120b checkpoint is ~61 GiB with its experts in MXFP4; with FP8 dense layers ~ the same
    assert 60e9 < big.weight_bytes("mxfp4") < 66e9
    assert big.weight_bytes("fp8-block128") > 1.7 * big.weight_bytes("mxfp4")
    small = load_model_config("gpt-oss-20b")
    assert small.weight_bytes("mxfp4-bf16") > small.weight_bytes("mxfp4")
