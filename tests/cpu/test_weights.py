"""Checkpoint loading: the same random weights written in three published layouts load identically.

The files are written here with safetensors in the layouts of gpt-oss-spec §5 (original) and §6 (HF,
MXFP4 and bf16 experts), and expert values are checked against a numpy MXFP4 decoder written from the
spec's formula (not the LUT the engine uses).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kvrelay.engine import mxfp4
from kvrelay.engine.config import PRESETS, ModelConfig
from kvrelay.engine.weights import WeightError, canonical_shapes, open_weights

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "gpt-oss-tiny-original"

# Small but not degenerate: MXFP4 needs H and I multiples of 32; H=96 gives 3 blocks per row.
CFG: ModelConfig = PRESETS["tiny"].replace(
    name="unit", num_hidden_layers=2, num_experts=4, vocab_size=80, hidden_size=96, intermediate_size=64,
    head_dim=16, num_attention_heads=4, num_key_value_heads=2,
)


def np_decode_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Independent decoder: E2M1 from sign/exponent/mantissa bits, scale 2^(s-127), low nibble first."""
    lo, hi = blocks & 0x0F, blocks >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32).astype(np.int64)
    sign = np.where(codes & 8, -1.0, 1.0)
    exp, man = (codes >> 1) & 3, codes & 1
    mag = np.where(exp == 0, 0.5 * man, (1.0 + 0.5 * man) * np.exp2(exp - 1.0))
    vals = sign * mag * np.exp2(scales.astype(np.float64) - 127.0)[..., None]
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def make_weights(cfg: ModelConfig, seed: int = 0) -> tuple[dict, dict]:
    """(canonical float tensors, raw MXFP4 {expert name: (blocks, scales)})."""
    g = torch.Generator().manual_seed(seed)
    dense, packed = {}, {}
    for name, shape in canonical_shapes(cfg).items():
        if name.endswith(("mlp1_weight", "mlp2_weight")):
            *lead, c = shape
            blocks = torch.randint(0, 256, (*lead, c // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
            scales = torch.randint(118, 130, (*lead, c // 32), generator=g, dtype=torch.int32).to(torch.uint8)
            packed[name] = (blocks, scales)
            dense[name] = torch.from_numpy(np_decode_mxfp4(blocks.numpy(), scales.numpy())).to(torch.bfloat16)
        else:
            dense[name] = (torch.randn(shape, generator=g) * 0.5).to(torch.bfloat16)
    return dense, packed


def write_original(d: Path, cfg: ModelConfig, dense: dict, packed: dict) -> Path:
    d.mkdir(parents=True)
    tensors = {}
    for name, t in dense.items():
        if name in packed:
            tensors[name + ".blocks"], tensors[name + ".scales"] = packed[name]
        else:
            tensors[name] = t
    keys = sorted(tensors)  # two files, no index: the loader has to scan both
    save_file({k: tensors[k] for k in keys[::2]}, str(d / "a.safetensors"))
    save_file({k: tensors[k] for k in keys[1::2]}, str(d / "b.safetensors"))
    cfg_json = {k: v for k, v in vars(cfg).items() if k not in ("name", "swiglu_alpha", "rms_norm_eps", "max_context")}
    (d / "config.json").write_text(json.dumps(cfg_json))
    return d


def hf_tensors(cfg: ModelConfig, dense: dict, packed: dict | None) -> dict:
    q, kv = cfg.q_width, cfg.kv_width
    out = {"model.embed_tokens.weight": dense["embedding.weight"], "model.norm.weight": dense["norm.scale"],
           "lm_head.weight": dense["unembedding.weight"]}
    for n in range(cfg.num_hidden_layers):
        b, p = f"block.{n}.", f"model.layers.{n}."
        for kind in ("weight", "bias"):
            qkv = dense[b + f"attn.qkv.{kind}"]
            out[p + f"self_attn.q_proj.{kind}"] = qkv[:q].clone()
            out[p + f"self_attn.k_proj.{kind}"] = qkv[q:q + kv].clone()
            out[p + f"self_attn.v_proj.{kind}"] = qkv[q + kv:].clone()
        out[p + "self_attn.o_proj.weight"] = dense[b + "attn.out.weight"]
        out[p + "self_attn.o_proj.bias"] = dense[b + "attn.out.bias"]
        out[p + "self_attn.sinks"] = dense[b + "attn.sinks"]
        out[p + "input_layernorm.weight"] = dense[b + "attn.norm.scale"]
        out[p + "post_attention_layernorm.weight"] = dense[b + "mlp.norm.scale"]
        out[p + "mlp.router.weight"] = dense[b + "mlp.gate.weight"]
        out[p + "mlp.router.bias"] = dense[b + "mlp.gate.bias"]
        out[p + "mlp.experts.gate_up_proj_bias"] = dense[b + "mlp.mlp1_bias"]
        out[p + "mlp.experts.down_proj_bias"] = dense[b + "mlp.mlp2_bias"]
        for ours, hf in (("mlp.mlp1_weight", "gate_up_proj"), ("mlp.mlp2_weight", "down_proj")):
            if packed is not None:
                out[p + f"mlp.experts.{hf}_blocks"], out[p + f"mlp.experts.{hf}_scales"] = packed[b + ours]
            else:  # transformers' bf16 layout: [E, in, out]
                out[p + f"mlp.experts.{hf}"] = dense[b + ours].transpose(1, 2).contiguous()
    return out


def write_hf(d: Path, cfg: ModelConfig, dense: dict, packed: dict | None, shards: int) -> Path:
    d.mkdir(parents=True)
    tensors = hf_tensors(cfg, dense, packed)
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"))
    else:
        keys, weight_map = sorted(tensors), {}
        for i in range(shards):
            fname = f"model-{i:05d}-of-{shards - 1:05d}.safetensors"
            part = {k: tensors[k] for k in keys[i::shards]}
            save_file(part, str(d / fname))
            weight_map.update({k: fname for k in part})
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "num_hidden_layers": cfg.num_hidden_layers, "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "head_dim": cfg.head_dim,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "sliding_window": cfg.sliding_window, "rope_theta": cfg.rope_theta, "swiglu_limit": cfg.swiglu_limit,
        "rope_scaling": {"rope_type": "yarn", "factor": cfg.rope_scaling_factor, "beta_fast": cfg.rope_ntk_beta,
                         "beta_slow": cfg.rope_ntk_alpha, "truncate": False,
                         "original_max_position_embeddings": cfg.initial_context_length}}))
    return d


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    dense, packed = make_weights(CFG)
    return {
        "dense": dense,
        "packed": packed,
        "original": write_original(root / "orig", CFG, dense, packed),
        "hf-mxfp4": write_hf(root / "hf4", CFG, dense, packed, shards=3),
        "hf-bf16": write_hf(root / "hf16", CFG, dense, None, shards=1),
    }


@pytest.mark.parametrize("fmt", ["original", "hf-mxfp4", "hf-bf16"])
def test_formats_load_identical_canonical_tensors(checkpoints, fmt):
    ws = open_weights(checkpoints[fmt], CFG)
    assert ws.format == fmt
    assert set(ws.names()) == set(checkpoints["dense"])
    for name, expected in checkpoints["dense"].items():
        got = ws.get(name)
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == tuple(expected.shape), name
        assert torch.equal(got, expected), name


def test_mxfp4_dequant_exact_against_numpy_over_all_codes_and_scales():
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (7, 5, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    blocks[0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code in both nibbles
    # Up to 2^(200-127): 6 * 2^127 would overflow float32 (real checkpoints keep scales below 240).
    scales = torch.randint(1, 201, (7, 5), generator=g, dtype=torch.int32).to(torch.uint8)
    scales[0, :3] = torch.tensor([1, 127, 200], dtype=torch.uint8)
    got = mxfp4.dequantize_mxfp4(blocks, scales, torch.float32).double().numpy()
    np.testing.assert_array_equal(got, np_decode_mxfp4(blocks.numpy(), scales.numpy()))
    assert got.shape == (7, 160)
    # Low nibble first: byte 0x71 holds +0.5 (code 1) then +6 (code 7).
    one = mxfp4.dequantize_mxfp4(torch.tensor([[0x71] + [0] * 15], dtype=torch.uint8),
                                 torch.tensor([127], dtype=torch.uint8), torch.float32)
    assert one[:2].tolist() == [0.5, 6.0]


def test_mxfp4_chunked_path_matches_unchunked(monkeypatch):
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (5, 6, 3, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(120, 135, (5, 6, 3), generator=g, dtype=torch.int32).to(torch.uint8)
    whole = mxfp4.dequantize_mxfp4(blocks, scales)
    monkeypatch.setattr(mxfp4, "_CHUNK_ELEMENTS", 200)
    assert torch.equal(mxfp4.dequantize_mxfp4(blocks, scales), whole)


def test_mxfp4_quantize_roundtrip_is_exact_on_grid(checkpoints):
    w = checkpoints["dense"]["block.0.mlp.mlp1_weight"]
    b, s = mxfp4.quantize_mxfp4(w)
    assert torch.equal(mxfp4.dequantize_mxfp4(b, s), w)
    with pytest.raises(TypeError, match="uint8"):
        mxfp4.dequantize_mxfp4(b.to(torch.int32), s)


SLICE_CASES = [
    ("block.0.attn.qkv.weight", (slice(0, 16),)),  # one q head
    ("block.0.attn.qkv.weight", (slice(60, 84),)),  # straddles q|k
    ("block.1.attn.qkv.weight", (slice(64, 96), slice(5, 50))),  # k and v, some columns
    ("block.1.attn.qkv.bias", (slice(80, 128),)),  # v only
    ("block.0.mlp.mlp1_weight", (slice(1, 3),)),  # experts 1..2
    ("block.0.mlp.mlp1_weight", (2, slice(7, 40), slice(20, 70))),  # columns across MXFP4 blocks
    ("block.1.mlp.mlp2_weight", (slice(3, 4), slice(None), slice(31, 33))),
    ("block.1.mlp.mlp1_bias", (slice(1, 3), slice(4, 9))),
    ("embedding.weight", (slice(40, 80),)),  # vocab shard
    ("unembedding.weight", (slice(0, 1), slice(10, 11))),
    ("block.0.attn.sinks", (slice(1, 3),)),
    ("block.0.attn.out.weight", (slice(None), slice(32, 48))),  # a tensor-parallel column shard
    ("norm.scale", (-1,)),
]


@pytest.mark.parametrize("fmt", ["original", "hf-mxfp4", "hf-bf16", "dummy"])
def test_slices_equal_slicing_the_full_tensor(checkpoints, fmt):
    ws = open_weights(None, CFG, dummy=True, seed=3) if fmt == "dummy" else open_weights(checkpoints[fmt], CFG)
    for name, sl in SLICE_CASES:
        full = ws.get(name)
        assert torch.equal(ws.get(name, sl), full[sl]), (name, sl)
    assert ws.get("embedding.weight", (slice(5, 5),)).shape == (0, CFG.hidden_size)
    assert ws.get("block.0.mlp.mlp1_weight", (1,), dtype=torch.float32).dtype == torch.float32


def test_slice_reads_only_the_requested_region(checkpoints, monkeypatch):
    ws = open_weights(checkpoints["hf-mxfp4"], CFG)
    reads = []
    original_read = ws.store.read
    monkeypatch.setattr(ws.store, "read", lambda n, r: reads.append((n, r)) or original_read(n, r))
    ws.get("block.0.mlp.mlp1_weight", (slice(2, 4),))
    assert {n for n, _ in reads} == {"model.layers.0.mlp.experts.gate_up_proj_blocks",
                                     "model.layers.0.mlp.experts.gate_up_proj_scales"}
    assert all(r[0] == (2, 4) for _, r in reads)
    reads.clear()
    ws.get("block.0.attn.qkv.weight", (slice(64, 80),))  # KV head 0 of k only
    assert reads == [("model.layers.0.self_attn.k_proj.weight", ((0, 16), (0, CFG.hidden_size)))]


def test_bad_slices_raise():
    ws = open_weights(None, CFG, dummy=True)
    with pytest.raises(WeightError, match="only ints and contiguous slices"):
        ws.get("embedding.weight", (slice(0, 10, 2),))
    with pytest.raises(WeightError, match=r"tensor 'norm.scale' has 1 dims but 2 slices were given"):
        ws.get("norm.scale", (0, 0))
    with pytest.raises(WeightError, match=r"index 96 out of range for dim 0 of size 96"):
        ws.get("norm.scale", (96,))
    with pytest.raises(WeightError, match=r"unknown tensor 'block.9.attn.sinks'"):
        ws.get("block.9.attn.sinks")


def test_dummy_is_deterministic_realistic_and_seeded():
    a, b = open_weights("tiny", dummy=True, seed=5), open_weights("tiny", dummy=True, seed=5)
    c = open_weights("tiny", dummy=True, seed=6)
    for name in ("block.0.attn.qkv.weight", "block.2.mlp.mlp2_weight", "block.1.attn.sinks"):
        assert torch.equal(a.get(name), b.get(name))
        assert not torch.equal(a.get(name), c.get(name))
    w = a.get("block.0.mlp.mlp1_weight").float()
    assert 0.018 < w.std().item() < 0.022 and abs(w.mean().item()) < 1e-3
    g = a.get("block.1.mlp.norm.scale").float()
    assert abs(g.mean().item() - 1.0) < 0.01
    assert a.get("block.0.mlp.mlp1_bias").float().abs().max().item() < 0.1
    s = a.get("block.0.attn.sinks").float()
    assert s.abs().max().item() < 5
    # Different tensors are not copies of each other.
    assert not torch.equal(a.get("embedding.weight"), a.get("unembedding.weight"))


def test_dummy_full_size_slices_without_materialising():
    ws = open_weights("gpt-oss-120b", dummy=True)
    assert ws.shape("block.35.mlp.mlp1_weight") == (128, 5760, 2880)
    part = ws.get("block.35.mlp.mlp1_weight", (slice(8, 9), slice(1000, 1004)))
    assert part.shape == (1, 4, 2880) and part.dtype == torch.bfloat16
    rows = ws.get("embedding.weight", (slice(201080, 201088),))
    assert rows.shape == (8, 2880)
    again = ws.get("embedding.weight", (slice(201087, 201088), slice(100, 110)))
    assert torch.equal(again, rows[7:8, 100:110])


def test_real_fixture_shapes_and_dtypes():
    ws = open_weights(FIXTURE)
    cfg = ws.cfg
    assert ws.format == "original" and cfg.num_experts == 8 and cfg.hidden_size == 128
    assert ws.get("block.0.mlp.mlp1_weight").shape == (8, 192, 128)
    assert ws.get("block.2.mlp.mlp2_weight").shape == (8, 128, 96)
    assert ws.get("block.1.attn.qkv.weight").shape == (384, 128)
    assert ws.get("block.1.attn.out.weight").shape == (128, 256)
    assert ws.get("unembedding.weight").shape == (1024, 128)
    for name in ws.names():
        t = ws.get(name)
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == ws.shape(name), name
        assert torch.isfinite(t.float()).all(), name
    # The experts in the fixture are genuine MXFP4: every value is a grid value times a power of two.
    w = ws.get("block.0.mlp.mlp1_weight").float()
    nz = w[w != 0].abs()
    mant = nz / torch.exp2(torch.floor(torch.log2(nz)))
    assert set(mant.unique().tolist()) <= {1.0, 1.5}


def test_hf_bf16_expert_layout_matches_transformers(checkpoints):
    """Our reading of HF's [E, in, out] experts agrees with transformers' own GptOssExperts forward."""
    from safetensors.torch import load_file
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hf = load_file(str(checkpoints["hf-bf16"] / "model.safetensors"))
    experts = GptOssExperts(GptOssConfig(hidden_size=CFG.hidden_size, intermediate_size=CFG.intermediate_size,
                                         num_local_experts=CFG.num_experts, num_experts_per_tok=1))
    p = "model.layers.1.mlp.experts."
    with torch.no_grad():
        for attr in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            getattr(experts, attr).copy_(hf[p + attr].float())
    x = torch.randn(5, CFG.hidden_size, generator=torch.Generator().manual_seed(9))
    idx = torch.tensor([[0], [1], [2], [3], [1]])
    y_hf = experts(x, idx, torch.ones(5, 1))

    ws = open_weights(checkpoints["hf-bf16"], CFG)
    w1, b1, w2, b2 = (ws.get(f"block.1.mlp.{n}", dtype=torch.float32)
                      for n in ("mlp1_weight", "mlp1_bias", "mlp2_weight", "mlp2_bias"))
    e = idx[:, 0]
    u = torch.einsum("th,toh->to", x, w1[e]) + b1[e]  # canonical [out, in]: y = W x + b
    gate, up = u[:, 0::2].clamp(max=7.0), u[:, 1::2].clamp(-7.0, 7.0)
    act = gate * torch.sigmoid(1.702 * gate) * (up + 1)
    y = torch.einsum("ti,thi->th", act, w2[e]) + b2[e]
    torch.testing.assert_close(y, y_hf, rtol=1e-3, atol=1e-3)
