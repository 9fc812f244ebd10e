"""ModelConfig readers and presets, and the YaRN table against the constants in gpt-oss-spec.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvrelay.engine.config import PRESETS, ModelConfig, load_model_config
from kvrelay.kernels.reference import yarn_inv_freq

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "gpt-oss-tiny-original"

HF_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
    "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "num_experts_per_tok": 4,
    "experts_per_token": 4, "vocab_size": 201088, "max_position_embeddings": 131072,
    "initial_context_length": 4096, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "sliding_window": 128, "swiglu_limit": 7.0, "num_hidden_layers": 24, "num_local_experts": 32,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "tie_word_embeddings": False,
}


def test_hf_json_matches_preset_in_both_rope_spellings():
    cfg = ModelConfig.from_hf_json(HF_20B, name="gpt-oss-20b")
    assert cfg == PRESETS["gpt-oss-20b"]
    new_style = dict(HF_20B)
    rope = dict(new_style.pop("rope_scaling"), rope_theta=new_style.pop("rope_theta"))
    new_style["rope_parameters"] = rope
    assert ModelConfig.from_hf_json(new_style, name="gpt-oss-20b") == cfg


def test_hf_json_refuses_what_the_model_cannot_run():
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_json(dict(HF_20B, layer_types=["full_attention"] * 24))
    with pytest.raises(ValueError, match="truncate"):
        ModelConfig.from_hf_json(dict(HF_20B, rope_scaling=dict(HF_20B["rope_scaling"], truncate=True)))


def test_derived_values():
    c = PRESETS["gpt-oss-120b"]
    assert (c.q_width, c.kv_width, c.qkv_width, c.gqa_group) == (4096, 512, 5120, 8)
    assert c.max_context == 131072 and c.sm_scale == 0.125
    assert c.sliding_layers == tuple(range(0, 36, 2)) and c.full_layers == tuple(range(1, 36, 2))


def test_original_dir_and_presets():
    cfg = load_model_config(FIXTURE)
    assert cfg.replace(name="tiny") == PRESETS["tiny"]
    assert load_model_config("gpt-oss-tiny").vocab_size == 201088
    with pytest.raises(ValueError, match="unknown keys"):
        ModelConfig.from_original_json(dict(json.loads((FIXTURE / "config.json").read_text()), bogus=1))
    with pytest.raises(FileNotFoundError):
        load_model_config("no-such-model")
    with pytest.raises(ValueError, match="multiple"):
        PRESETS["tiny"].replace(num_key_value_heads=3)


def test_yarn_constants_from_the_spec():
    c = PRESETS["gpt-oss-20b"]
    inv_freq, conc = yarn_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling_factor, c.initial_context_length,
                                   c.rope_ntk_beta, c.rope_ntk_alpha)
    assert conc == pytest.approx(1.346574, abs=1e-6)
    assert float(inv_freq[0]) == 1.0
    assert float(inv_freq[1]) == pytest.approx(0.689044, rel=1e-5)
    assert float(inv_freq[31]) == pytest.approx(3.0235e-7, rel=1e-3)
    base = 1.0 / (c.rope_theta ** (torch.arange(0, 64, 2) / 64))
    assert torch.allclose(inv_freq[:9], base[:9])  # below the ramp (low ~ 8.09): original frequencies
    assert torch.allclose(inv_freq[18:], base[18:] / 32)  # above it (high ~ 17.40): interpolated
