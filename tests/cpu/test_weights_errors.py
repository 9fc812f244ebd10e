"""Bad checkpoints fail at open time with a message naming the tensor, what was expected and what was found."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay.engine.config import load_model_config
from kvrelay.engine.weights import WeightError, open_weights

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "gpt-oss-tiny-original"


def _variant(tmp_path: Path, edit) -> Path:
    """A copy of the real fixture with `edit(tensors)` applied."""
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    edit(tensors)
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(FIXTURE / "config.json", d / "config.json")
    save_file(tensors, str(d / "model.safetensors"))
    return d


def _error(path: Path, cfg=None) -> str:
    with pytest.raises(WeightError) as info:
        open_weights(path, cfg or load_model_config(FIXTURE))
    return str(info.value)


def test_missing_tensor(tmp_path):
    d = _variant(tmp_path, lambda t: t.pop("block.1.attn.sinks"))
    assert _error(d) == f"checkpoint {d}: missing tensor 'block.1.attn.sinks' (for 'block.1.attn.sinks')"


def test_missing_mxfp4_scales(tmp_path):
    d = _variant(tmp_path, lambda t: t.pop("block.2.mlp.mlp2_weight.scales"))
    assert _error(d) == (f"checkpoint {d}: missing tensor 'block.2.mlp.mlp2_weight.scales' "
                         f"(for 'block.2.mlp.mlp2_weight')")


def test_wrong_shape(tmp_path):
    def edit(t):
        t["block.0.attn.qkv.weight"] = t["block.0.attn.qkv.weight"][:383].clone()
    d = _variant(tmp_path, edit)
    assert _error(d) == ("tensor 'block.0.attn.qkv.weight' in model.safetensors: "
                         "expected shape [384, 128], found [383, 128]")


def test_wrong_dtype_float_tensor(tmp_path):
    def edit(t):
        t["block.0.attn.sinks"] = t["block.0.attn.sinks"].to(torch.int64)
    d = _variant(tmp_path, edit)
    assert _error(d) == ("tensor 'block.0.attn.sinks' in model.safetensors: "
                         "expected dtype BF16|F16|F32, found I64")


def test_wrong_dtype_mxfp4_blocks(tmp_path):
    def edit(t):
        t["block.1.mlp.mlp1_weight.blocks"] = t["block.1.mlp.mlp1_weight.blocks"].to(torch.int16)
    d = _variant(tmp_path, edit)
    assert _error(d) == ("tensor 'block.1.mlp.mlp1_weight.blocks' in model.safetensors: "
                         "expected dtype U8, found I16")


def test_config_mismatch_is_a_shape_error():
    cfg = load_model_config(FIXTURE).replace(vocab_size=2048)
    assert _error(FIXTURE, cfg) == ("tensor 'embedding.weight' in model.safetensors: "
                                    "expected shape [2048, 128], found [1024, 128]")


def test_truncated_file(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(FIXTURE / "config.json", d / "config.json")
    data = (FIXTURE / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 1000])
    msg = _error(d)
    assert re.fullmatch(re.escape(f"{d / 'model.safetensors'}: corrupt or truncated safetensors file (") + r".+\)", msg)
    assert "incomplete metadata" in msg


def test_garbage_file(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\x00" * 4)
    assert _error(d).startswith(f"{d / 'model.safetensors'}: corrupt or truncated safetensors file (")


def test_hf_missing_k_proj_and_missing_shard(tmp_path):
    from test_weights import CFG, make_weights, write_hf  # same folder; pytest puts it on sys.path

    dense, packed = make_weights(CFG)
    d = write_hf(tmp_path / "hf", CFG, dense, packed, shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("model.layers.1.self_attn.k_proj.bias")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _error(d, CFG) == (f"checkpoint {d}: missing tensor 'model.layers.1.self_attn.k_proj.bias' "
                              f"(for 'block.1.attn.qkv.bias')")
    (d / "model-00001-of-00001.safetensors").unlink()
    assert _error(d, CFG) == (f"{d / 'model.safetensors.index.json'} names shard "
                              f"model-00001-of-00001.safetensors, which does not exist")


def test_not_a_checkpoint(tmp_path):
    assert _error(tmp_path / "nope") == f"checkpoint directory {tmp_path / 'nope'} does not exist"
    assert _error(tmp_path) == f"{tmp_path}: no *.safetensors files (nor in {tmp_path / 'original'})"
    save_file({"foo": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    assert _error(tmp_path) == (f"{tmp_path}: safetensors files hold no gpt-oss tensors "
                                f"(neither HF nor original names)")


def test_original_subfolder_is_found(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURE, repo / "original")
    ws = open_weights(repo, load_model_config(FIXTURE))
    assert ws.format == "original" and ws.path == repo / "original"
