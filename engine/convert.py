"""`kvrelay convert SRC DST --quant fp8-block128|bf16`: write a checkpoint in our serving layout.

Output: canonical tensor names; with fp8-block128 the four GEMM weights per layer (qkv, out, mlp1, mlp2)
are e4m3 with a float32 `<name>.scale` per 128x128 block, everything else bf16. Tensors go to
`model-NNNNN.safetensors` shards of bounded size plus `model.safetensors.index.json`, an original-format
`config.json` (so `load_model_config(DST)` works) and `manifest.json`. The manifest is written last: a
conversion that died half-way has none, and `open_weights` does not mistake the folder for a checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

QUANTS = ("fp8-block128", "bf16")
MANIFEST_VERSION = 1
_HASH_CHUNK = 16 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="checkpoint directory (HF, OpenAI original, or converted), or a preset "
                                    "name with --dummy")
    parser.add_argument("dst", help="output directory (created; must be empty unless --overwrite)")
    parser.add_argument("--quant", choices=QUANTS, default="fp8-block128",
                        help="fp8-block128: GEMM weights e4m3 with 128x128 block scales; bf16: all bf16")
    parser.add_argument("--shard-size-gb", type=float, default=4.0, help="upper bound per shard file (GiB)")
    parser.add_argument("--dummy", action="store_true", help="convert seeded random weights (SRC = preset)")
    parser.add_argument("--seed", type=int, default=0, help="seed for --dummy")
    parser.add_argument("--overwrite", action="store_true", help="allow a non-empty DST")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvrelay")
    except PackageNotFoundError:
        return "unknown"


class _ShardWriter:
    """Accumulates tensors and flushes a safetensors shard whenever the next group would exceed the bound.

    A weight and its `.scale` are added as one group so they always share a file.
    """

    def __init__(self, dst: Path, max_bytes: int):
        self.dst, self.max_bytes = dst, max_bytes
        self.pending: dict[str, Any] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.files: list[str] = []
        self.total_bytes = 0

    def add(self, group: dict[str, Any]) -> None:
        size = sum(t.numel() * t.element_size() for t in group.values())
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending.update({k: v.contiguous() for k, v in group.items()})
        self.pending_bytes += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(self.dst / name), metadata={"format": "pt"})
        self.files.append(name)
        self.weight_map.update({k: name for k in self.pending})
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0


def convert_checkpoint(src: str | Path, dst: str | Path, quant: str = "fp8-block128", *,
                       shard_bytes: int = 4 << 30, dummy: bool = False, seed: int = 0,
                       overwrite: bool = False, progress: bool = True) -> Path:
    """Convert `src` into `dst`; returns the manifest path."""
    import torch
    from tqdm import tqdm

    from kvrelay.engine.config import load_model_config
    from kvrelay.engine.weights import (INDEX_FILE, MANIFEST_FILE, WeightError, is_expert_weight,
                                        is_fp8_target, open_weights)
    from kvrelay.kernels.fp8 import quantize_weight_block128

    if quant not in QUANTS:
        raise WeightError(f"unknown quantisation {quant!r}; choose one of {', '.join(QUANTS)}")
    out = Path(dst)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise WeightError(f"output directory {out} is not empty (pass --overwrite to replace its contents)")
    out.mkdir(parents=True, exist_ok=True)
    for stale in (MANIFEST_FILE, INDEX_FILE, *[p.name for p in out.glob("model-*.safetensors")]):
        (out / stale).unlink(missing_ok=True)

    cfg = load_model_config(src)
    ws = open_weights(src, cfg, dummy=dummy, seed=seed)
    writer = _ShardWriter(out, shard_bytes)
    tensors: dict[str, dict[str, Any]] = {}
    names = ws.names()
    for name in tqdm(names, desc="convert", unit="tensor", disable=not progress):
        if quant == "fp8-block128" and is_fp8_target(name):
            if is_expert_weight(name):
                # One expert at a time: the bf16 copy of a whole 120b mlp1 would be 4 GiB on its own.
                parts = [quantize_weight_block128(ws.get(name, (e,), dtype=torch.bfloat16))
                         for e in range(ws.shape(name)[0])]
                group = {name: torch.stack([p[0] for p in parts]),
                         name + ".scale": torch.stack([p[1] for p in parts])}
            else:
                w_fp8, scale = quantize_weight_block128(ws.get(name, dtype=torch.bfloat16))
                group = {name: w_fp8, name + ".scale": scale}
        else:
            group = {name: ws.get(name, dtype=torch.bfloat16)}
        for k, t in group.items():
            tensors[k] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        writer.add(group)
    writer.flush()
    for k, f in writer.weight_map.items():
        tensors[k]["file"] = f

    (out / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": writer.total_bytes}, "weight_map": writer.weight_map}, indent=1))
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "name"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    manifest = {
        "format": "kvrelay",
        "format_version": MANIFEST_VERSION,
        "quant": quant,
        "source": f"dummy:{cfg.name}:seed={seed}" if dummy else str(Path(src).resolve()),
        "source_format": ws.format,
        "kvrelay_version": _version(),
        "config": {"name": cfg.name, **config},
        "tensors": tensors,
        "files": {f: {"sha256": _sha256(out / f), "bytes": (out / f).stat().st_size} for f in writer.files},
    }
    path = out / MANIFEST_FILE
    path.write_text(json.dumps(manifest, indent=1))
    return path


def verify_checkpoint(dst: str | Path) -> list[str]:
    """Files of a converted checkpoint whose sha256 no longer matches its manifest (empty = intact)."""
    root = Path(dst)
    manifest = json.loads((root / "manifest.json").read_text())
    bad = []
    for name, meta in manifest["files"].items():
        path = root / name
        if not path.is_file() or _sha256(path) != meta["sha256"]:
            bad.append(name)
    return bad


def run(args: argparse.Namespace) -> int:
    import sys

    from kvrelay.engine.weights import WeightError

    try:
        path = convert_checkpoint(args.src, args.dst, args.quant, shard_bytes=int(args.shard_size_gb * (1 << 30)),
                                  dummy=args.dummy, seed=args.seed, overwrite=args.overwrite,
                                  progress=not args.no_progress)
    except (WeightError, FileNotFoundError, ValueError) as e:
        print(f"kvrelay convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0
