"""Checkpoint access under canonical names, one region at a time.

Canonical names are OpenAI's original ones with the experts dequantised (docs/contracts.md). Every format
(HF MXFP4 or bf16, OpenAI original, our converted FP8/bf16, seeded dummy) is served by the same `get`, which
reads only the requested region through `safe_open(...).get_slice`: a tensor-parallel rank asking for
experts 8..15 or a vocab slice never touches the rest of the file. All tensors are checked (name, shape,
dtype) from the headers when the source is opened, so a bad checkpoint fails before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvrelay.engine import mxfp4
from kvrelay.engine.config import ModelConfig, load_model_config
from kvrelay.engine.dummy_weights import DummySource
# the base every format subclasses, and the names the rest of the engine imports from here
from kvrelay.engine.weight_source import (  # noqa: F401
    EXPERT_WEIGHTS,
    FP8_SUFFIXES,
    Region,
    Slices,
    WeightError,
    WeightSource,
    canonical_shapes,
    is_expert_weight,
    is_fp8_target,
    normalise_slices,
)
from kvrelay.kernels.fp8 import BLOCK as FP8_BLOCK
from kvrelay.kernels.fp8 import dequantize_weight_block128

FLOAT = ("BF16", "F16", "F32")
INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "manifest.json"


def _py(region: Region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


class _Store:
    """Stored tensor name -> safetensors file, with lazily opened handles and header-only metadata."""

    def __init__(self, directory: Path, files: dict[str, Path]):
        self.directory = directory
        self.files = files
        self._handles: dict[Path, object] = {}

    @classmethod
    def scan(cls, directory: Path) -> "_Store":
        index = directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise WeightError(f"{index}: not a safetensors index ({e})") from e
            files = {k: directory / f for k, f in weight_map.items()}
            for path in sorted(set(files.values())):
                if not path.is_file():
                    raise WeightError(f"{index} names shard {path.name}, which does not exist")
            return cls(directory, files)
        store = cls(directory, {})
        for path in sorted(directory.glob("*.safetensors")):
            for key in store._open(path).keys():
                if key in store.files:
                    raise WeightError(f"tensor '{key}' is in both {store.files[key].name} and {path.name}")
                store.files[key] = path
        return store

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise WeightError(f"{path}: corrupt or truncated safetensors file ({e})") from e
        return self._handles[path]

    def has(self, name: str) -> bool:
        return name in self.files

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        handle = self._open(self.files[name])
        try:
            sl = handle.get_slice(name)
        except SafetensorError as e:
            raise WeightError(f"tensor '{name}' listed for {self.files[name].name} but not in it ({e})") from e
        return tuple(sl.get_shape()), sl.get_dtype()

    def check(self, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...], what: str) -> None:
        if not self.has(name):
            raise WeightError(f"checkpoint {self.directory}: missing tensor '{name}' (for {what})")
        found_shape, found_dtype = self.info(name)
        where = self.files[name].name
        if found_shape != tuple(shape):
            raise WeightError(f"tensor '{name}' in {where}: expected shape {list(shape)}, found {list(found_shape)}")
        if found_dtype not in dtypes:
            raise WeightError(f"tensor '{name}' in {where}: expected dtype {'|'.join(dtypes)}, found {found_dtype}")

    def read(self, name: str, region: Region) -> torch.Tensor:
        return self._open(self.files[name]).get_slice(name)[_py(region)]


def _read_mxfp4(store: _Store, blocks: str, scales: str, region: Region, device: torch.device) -> torch.Tensor:
    *lead, (c0, c1) = region
    g0, g1, off = mxfp4.block_range(c0, c1)
    b = store.read(blocks, (*lead, (g0, g1), (0, mxfp4.BYTES_PER_BLOCK))).to(device)
    s = store.read(scales, (*lead, (g0, g1))).to(device)
    return mxfp4.dequantize_mxfp4(b, s, torch.bfloat16)[..., off:off + c1 - c0]


def _raw_mxfp4(store: _Store, blocks: str, scales: str, groups: Region) -> tuple[torch.Tensor, torch.Tensor]:
    return store.read(blocks, (*groups, (0, mxfp4.BYTES_PER_BLOCK))), store.read(scales, groups)


def _check_mxfp4(store: _Store, name: str, shape: tuple[int, ...], blocks: str, scales: str) -> None:
    *lead, c = shape
    if c % mxfp4.BLOCK:
        raise WeightError(f"'{name}' input dim {c} is not a multiple of {mxfp4.BLOCK}; it cannot be MXFP4")
    g = c // mxfp4.BLOCK
    store.check(blocks, (*lead, g, mxfp4.BYTES_PER_BLOCK), ("U8",), f"'{name}'")
    store.check(scales, (*lead, g), ("U8",), f"'{name}'")


class OriginalSource(WeightSource):
    """OpenAI's original layout: canonical names, experts as `<name>.blocks` / `<name>.scales` MXFP4."""

    format = "original"

    def __init__(self, cfg: ModelConfig, path: Path):
        super().__init__(cfg, path)
        self.store = _Store.scan(path)

    def _check(self, name: str) -> None:
        if is_expert_weight(name):
            _check_mxfp4(self.store, name, self._shapes[name], name + ".blocks", name + ".scales")
        else:
            self.store.check(name, self._shapes[name], FLOAT, f"'{name}'")

    def _read(self, name: str, region: Region, device: torch.device) -> torch.Tensor:
        if is_expert_weight(name):
            return _read_mxfp4(self.store, name + ".blocks", name + ".scales", region, device)
        return self.store.read(name, region)

    def _read_mxfp4(self, name: str, groups: Region, device: torch.device):
        return _raw_mxfp4(self.store, name + ".blocks", name + ".scales", groups) if is_expert_weight(name) else None


_HF_RENAMES = {
    "attn.norm.scale": "input_layernorm.weight",
    "attn.sinks": "self_attn.sinks",
    "attn.out.weight": "self_attn.o_proj.weight",
    "attn.out.bias": "self_attn.o_proj.bias",
    "mlp.norm.scale": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.bias": "mlp.router.bias",
    "mlp.mlp1_bias": "mlp.experts.gate_up_proj_bias",
    "mlp.mlp2_bias": "mlp.experts.down_proj_bias",
}
_HF_TOP = {"embedding.weight": "model.embed_tokens.weight", "norm.scale": "model.norm.weight",
           "unembedding.weight": "lm_head.weight"}
_HF_EXPERTS = {"mlp.mlp1_weight": "mlp.experts.gate_up_proj", "mlp.mlp2_weight": "mlp.experts.down_proj"}


class HFSource(WeightSource):
    """transformers layout: renamed, q/k/v split, experts MXFP4 (`_blocks`/`_scales`) or bf16 [E, in, out]."""

    def __init__(self, cfg: ModelConfig, path: Path, store: _Store, mxfp4_experts: bool):
        super().__init__(cfg, path)
        self.store = store
        self.mxfp4_experts = mxfp4_experts
        self.format = "hf-mxfp4" if mxfp4_experts else "hf-bf16"

    @staticmethod
    def _split(name: str) -> tuple[str, str]:
        layer, rest = name[len("block."):].split(".", 1)
        return f"model.layers.{layer}.", rest

    def _qkv_parts(self, name: str) -> list[tuple[str, int, int]]:
        """(HF tensor, first canonical row, end row) for the three pieces of the fused qkv."""
        prefix, rest = self._split(name)
        kind = rest.rsplit(".", 1)[1]  # weight | bias
        q, kv = self.cfg.q_width, self.cfg.kv_width
        return [(f"{prefix}self_attn.{p}_proj.{kind}", a, b)
                for p, a, b in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv))]

    def _check(self, name: str) -> None:
        shape = self._shapes[name]
        if name in _HF_TOP:
            return self.store.check(_HF_TOP[name], shape, FLOAT, f"'{name}'")
        prefix, rest = self._split(name)
        if rest.startswith("attn.qkv."):
            for hf, a, b in self._qkv_parts(name):
                self.store.check(hf, (b - a, *shape[1:]), FLOAT, f"'{name}'")
        elif rest in _HF_EXPERTS:
            hf = prefix + _HF_EXPERTS[rest]
            if self.mxfp4_experts:
                _check_mxfp4(self.store, name, shape, hf + "_blocks", hf + "_scales")
            else:
                self.store.check(hf, (shape[0], shape[2], shape[1]), FLOAT, f"'{name}'")
        else:
            self.store.check(prefix + _HF_RENAMES[rest], shape, FLOAT, f"'{name}'")

    def _read(self, name: str, region: Region, device: torch.device) -> torch.Tensor:
        if name in _HF_TOP:
            return self.store.read(_HF_TOP[name], region)
        prefix, rest = self._split(name)
        if rest.startswith("attn.qkv."):
            (r0, r1), *tail = region
            parts = [self.store.read(hf, ((max(r0, a) - a, min(r1, b) - a), *tail))
                     for hf, a, b in self._qkv_parts(name) if max(r0, a) < min(r1, b)]
            if not parts:  # an empty row range still has the right trailing shape
                return self.store.read(self._qkv_parts(name)[0][0], ((0, 0), *tail))
            return torch.cat(parts, dim=0)
        if rest in _HF_EXPERTS:
            hf = prefix + _HF_EXPERTS[rest]
            if self.mxfp4_experts:
                return _read_mxfp4(self.store, hf + "_blocks", hf + "_scales", region, device)
            # HF keeps bf16 experts as [E, in, out] because it computes x @ W; canonical is [E, out, in].
            e, rows, cols = region
            return self.store.read(hf, (e, cols, rows)).transpose(-1, -2)
        return self.store.read(prefix + _HF_RENAMES[rest], region)

    def _read_mxfp4(self, name: str, groups: Region, device: torch.device):
        if not (self.mxfp4_experts and is_expert_weight(name)):
            return None
        prefix, rest = self._split(name)
        hf = prefix + _HF_EXPERTS[rest]
        return _raw_mxfp4(self.store, hf + "_blocks", hf + "_scales", groups)


class ConvertedSource(WeightSource):
    """Our converted checkpoint: canonical names; GEMM weights optionally FP8 with `<name>.scale` blocks."""

    def __init__(self, cfg: ModelConfig, path: Path, manifest: dict):
        super().__init__(cfg, path)
        self.store = _Store.scan(path)
        self.manifest = manifest
        self.format = f"kvrelay-{manifest.get('quant', 'bf16')}"

    def _is_fp8(self, name: str) -> bool:
        return self.store.has(name + ".scale")

    def _scale_shape(self, name: str) -> tuple[int, ...]:
        *lead, n, k = self._shapes[name]
        return (*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))

    def _check(self, name: str) -> None:
        if self._is_fp8(name):
            self.store.check(name, self._shapes[name], ("F8_E4M3",), f"'{name}'")
            self.store.check(name + ".scale", self._scale_shape(name), ("F32",), f"'{name}'")
        else:
            self.store.check(name, self._shapes[name], FLOAT, f"'{name}'")

    @staticmethod
    def _block_cover(region: Region, shape: tuple[int, ...]) -> tuple[Region, Region]:
        """The block-aligned region of the last two dims covering `region`, and the matching scale region."""
        *lead, (r0, r1), (c0, c1) = region
        n, k = shape[-2:]
        rb, cb = (r0 // FP8_BLOCK, -(-r1 // FP8_BLOCK)), (c0 // FP8_BLOCK, -(-c1 // FP8_BLOCK))
        data = (*lead, (rb[0] * FP8_BLOCK, min(rb[1] * FP8_BLOCK, n)), (cb[0] * FP8_BLOCK, min(cb[1] * FP8_BLOCK, k)))
        return data, (*lead, rb, cb)

    def _read(self, name: str, region: Region, device: torch.device) -> torch.Tensor:
        if not self._is_fp8(name):
            return self.store.read(name, region)
        data, sregion = self._block_cover(region, self._shapes[name])
        w = self.store.read(name, data).to(device)
        s = self.store.read(name + ".scale", sregion).to(device)
        deq = dequantize_weight_block128(w, s, torch.bfloat16)
        (r0, r1), (c0, c1) = region[-2:]
        dr, dc = r0 - data[-2][0], c0 - data[-1][0]
        return deq[..., dr:dr + r1 - r0, dc:dc + c1 - c0]

    def get_fp8(self, name: str, slices: Slices = ()) -> tuple[torch.Tensor, torch.Tensor] | None:
        shape = self.shape(name)
        if not self._is_fp8(name):
            return None
        region, squeeze = normalise_slices(name, shape, slices)
        data, sregion = self._block_cover(region, shape)
        if data[-2:] != region[-2:]:
            raise WeightError(f"get_fp8('{name}'): region {list(region[-2:])} of the last two dims is not "
                              f"aligned to {FP8_BLOCK}x{FP8_BLOCK} scale blocks (use get() to dequantise)")
        w, s = self.store.read(name, region), self.store.read(name + ".scale", sregion)
        for d in reversed(squeeze):
            w, s = w.squeeze(d), s.squeeze(d)
        return w.contiguous(), s.contiguous()


@dataclass(frozen=True)
class DetectedFormat:
    kind: str  # "kvrelay" | "hf" | "original"
    directory: Path


def _read_manifest(directory: Path) -> dict:
    try:
        return json.loads((directory / MANIFEST_FILE).read_text())
    except ValueError as e:
        raise WeightError(f"{directory / MANIFEST_FILE}: not valid JSON ({e})") from e


def detect_format(source: str | Path) -> DetectedFormat:
    """Which layout a directory holds, from its files (manifest, HF index/names, original names)."""
    root = Path(source)
    if not root.is_dir():
        raise WeightError(f"checkpoint directory {root} does not exist")
    if (root / MANIFEST_FILE).is_file() and _read_manifest(root).get("format") == "kvrelay":
        return DetectedFormat("kvrelay", root)
    candidates = [root] + ([root / "original"] if (root / "original").is_dir() else [])
    for directory in candidates:
        if (directory / INDEX_FILE).is_file():
            return DetectedFormat("hf", directory)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            continue
        keys = _Store.scan(directory).files
        if "model.embed_tokens.weight" in keys or any(k.startswith("model.layers.") for k in keys):
            return DetectedFormat("hf", directory)
        if "embedding.weight" in keys or any(k.startswith("block.") for k in keys):
            return DetectedFormat("original", directory)
        raise WeightError(f"{directory}: safetensors files hold no gpt-oss tensors (neither HF nor original names)")
    raise WeightError(f"{root}: no *.safetensors files (nor in {root / 'original'})")


def open_weights(source: str | Path | None, cfg: ModelConfig | None = None, *, dummy: bool = False,
                 seed: int = 0) -> WeightSource:
    """Open a checkpoint directory (format detected from its files), or seeded dummy weights.

    With dummy=True, `source` may be a preset name or a model directory (only its config is read) when
    cfg is None. Every tensor's name, shape and dtype is checked against `cfg` before this returns.
    """
    if cfg is None:
        if source is None:
            raise WeightError("open_weights needs a model config or a source to read one from")
        cfg = load_model_config(source)
    if dummy:
        return DummySource(cfg, seed)
    if source is None:
        raise WeightError("open_weights: no checkpoint directory given (pass dummy=True for random weights)")
    fmt = detect_format(source)
    if fmt.kind == "kvrelay":
        ws: WeightSource = ConvertedSource(cfg, fmt.directory, _read_manifest(fmt.directory))
    elif fmt.kind == "hf":
        store = _Store.scan(fmt.directory)
        probe = "model.layers.0.mlp.experts.gate_up_proj_blocks"
        ws = HFSource(cfg, fmt.directory, store, mxfp4_experts=store.has(probe))
    else:
        ws = OriginalSource(cfg, fmt.directory)
    ws.validate()
    return ws
