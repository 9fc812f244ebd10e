"""`kvrelay convert` and loading the converted checkpoint back."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvrelay.cluster.cli import main as cli_main
from kvrelay.engine.config import load_model_config
from kvrelay.engine.convert import convert_checkpoint, verify_checkpoint
from kvrelay.engine.weights import WeightError, is_fp8_target, open_weights
from kvrelay.kernels import fp8

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "gpt-oss-tiny-original"


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("conv") / "fp8"
    # A tiny shard bound forces several files (a weight and its scale still share one).
    assert cli_main(["convert", str(FIXTURE), str(dst), "--shard-size-gb", "0.0003", "--no-progress"]) == 0
    return dst


def test_manifest_index_and_hashes(fp8_ckpt):
    manifest = json.loads((fp8_ckpt / "manifest.json").read_text())
    assert manifest["format"] == "kvrelay" and manifest["quant"] == "fp8-block128"
    assert manifest["source_format"] == "original" and manifest["source"] == str(FIXTURE)
    assert manifest["kvrelay_version"] and manifest["config"]["num_experts"] == 8
    assert len(manifest["files"]) > 2
    for name, meta in manifest["files"].items():
        assert hashlib.sha256((fp8_ckpt / name).read_bytes()).hexdigest() == meta["sha256"]
        assert (fp8_ckpt / name).stat().st_size == meta["bytes"]
    t = manifest["tensors"]
    assert t["block.0.mlp.mlp1_weight"] == {"shape": [8, 192, 128], "dtype": "float8_e4m3fn",
                                            "file": t["block.0.mlp.mlp1_weight.scale"]["file"]}
    assert t["block.0.mlp.mlp1_weight.scale"]["shape"] == [8, 2, 1]
    assert t["block.0.attn.sinks"]["dtype"] == "bfloat16"
    weight_map = json.loads((fp8_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map) == set(t)
    assert load_model_config(fp8_ckpt) == load_model_config(FIXTURE).replace(name="fp8")
    assert verify_checkpoint(fp8_ckpt) == []
    victim = sorted(manifest["files"])[0]
    data = bytearray((fp8_ckpt / victim).read_bytes())
    (fp8_ckpt / victim).write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))
    try:
        assert verify_checkpoint(fp8_ckpt) == [victim]
    finally:
        (fp8_ckpt / victim).write_bytes(bytes(data))


def test_fp8_roundtrip_matches_source(fp8_ckpt):
    src, conv = open_weights(FIXTURE), open_weights(fp8_ckpt)
    assert conv.format == "kvrelay-fp8-block128"
    for name in src.names():
        ref = src.get(name)
        got = conv.get(name)
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape, name
        if not is_fp8_target(name):
            assert torch.equal(got, ref), name
            assert conv.get_fp8(name) is None
            continue
        # Stored values are exactly what the reference quantiser produces from the source weights.
        q_ref, s_ref = fp8.quantize_weight_block128(ref)
        q, s = conv.get_fp8(name)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref), name
        deq = fp8.dequantize_weight_block128(q_ref, s_ref, torch.bfloat16)
        assert torch.equal(got, deq), name
        rel = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert rel <= 2 ** -4, (name, rel)


def test_converted_slices_and_fp8_regions(fp8_ckpt):
    conv = open_weights(fp8_ckpt)
    cases = [("block.0.mlp.mlp1_weight", (slice(2, 5), slice(100, 150), slice(3, 97))),
             ("block.1.attn.qkv.weight", (slice(256, 320),)), ("embedding.weight", (slice(100, 200),)),
             ("block.2.mlp.mlp2_weight", (7,)), ("block.0.attn.out.weight", (slice(None), slice(130, 256)))]
    for name, sl in cases:
        assert torch.equal(conv.get(name, sl), conv.get(name)[sl]), name
    q, s = conv.get_fp8("block.0.mlp.mlp1_weight", (slice(1, 3), slice(128, 192)))
    q_all, s_all = conv.get_fp8("block.0.mlp.mlp1_weight")
    assert torch.equal(q.view(torch.uint8), q_all[1:3, 128:192].view(torch.uint8))
    assert torch.equal(s, s_all[1:3, 1:2])
    with pytest.raises(WeightError, match=r"not aligned to 128x128 scale blocks"):
        conv.get_fp8("block.1.attn.qkv.weight", (slice(256, 320),))


def test_bf16_conversion_is_lossless_from_hf(tmp_path):
    from test_weights import CFG, make_weights, write_hf  # same folder; pytest puts it on sys.path

    dense, packed = make_weights(CFG)
    src = write_hf(tmp_path / "hf", CFG, dense, packed, shards=2)
    assert load_model_config(src) == CFG.replace(name="hf")
    convert_checkpoint(src, tmp_path / "out", "bf16", progress=False)
    conv = open_weights(tmp_path / "out")
    assert conv.format == "kvrelay-bf16"
    for name, ref in dense.items():
        assert torch.equal(conv.get(name), ref), name
        assert conv.get_fp8(name) is None


def test_dummy_source_converts(tmp_path):
    convert_checkpoint("tiny", tmp_path / "d", dummy=True, seed=4, progress=False)
    conv, dummy = open_weights(tmp_path / "d"), open_weights("tiny", dummy=True, seed=4)
    assert torch.equal(conv.get("block.1.attn.sinks"), dummy.get("block.1.attn.sinks"))
    q, s = conv.get_fp8("block.2.mlp.mlp2_weight")
    q_ref, s_ref = fp8.quantize_weight_block128(dummy.get("block.2.mlp.mlp2_weight"))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_refuses_non_empty_destination(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert cli_main(["convert", str(FIXTURE), str(tmp_path), "--no-progress"]) == 1
    assert f"output directory {tmp_path} is not empty" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").exists() and not (tmp_path / "manifest.json").exists()


def test_console_script_on_fixture(tmp_path):
    exe = Path(sys.executable).parent / "kvrelay"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvrelay.cluster.cli"]
    proc = subprocess.run([*cmd, "convert", str(FIXTURE), str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "c" / "manifest.json").is_file()
    assert "convert" in proc.stderr  # the tqdm bar
    assert proc.stdout.strip() == f"wrote {tmp_path / 'c' / 'manifest.json'}"
