"""The canonical names and shapes of a gpt-oss checkpoint and the base of every weight source (engine/weights.py's
formats, engine/dummy_weights.py's seeded random weights): one region of one tensor at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Union

import torch

from kvrelay.engine import mxfp4
from kvrelay.engine.config import ModelConfig

# Canonical tensors stored as FP8 (+ `<name>.scale`) by the converter: the four GEMM weights per layer.
FP8_SUFFIXES = ("attn.qkv.weight", "attn.out.weight", "mlp.mlp1_weight", "mlp.mlp2_weight")
EXPERT_WEIGHTS = ("mlp.mlp1_weight", "mlp.mlp2_weight")

Slices = Union[slice, int, tuple[Union[slice, int], ...]]
Region = tuple[tuple[int, int], ...]


class WeightError(Exception):
    """A checkpoint is missing, malformed, or does not match the model config."""


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, e, i, v = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embedding.weight": (v, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"block.{n}."
        shapes.update({
            p + "attn.norm.scale": (h,),
            p + "attn.qkv.weight": (cfg.qkv_width, h),
            p + "attn.qkv.bias": (cfg.qkv_width,),
            p + "attn.sinks": (cfg.num_attention_heads,),
            p + "attn.out.weight": (h, cfg.q_width),
            p + "attn.out.bias": (h,),
            p + "mlp.norm.scale": (h,),
            p + "mlp.gate.weight": (e, h),
            p + "mlp.gate.bias": (e,),
            p + "mlp.mlp1_weight": (e, 2 * i, h),
            p + "mlp.mlp1_bias": (e, 2 * i),
            p + "mlp.mlp2_weight": (e, h, i),
            p + "mlp.mlp2_bias": (e, h),
        })
    shapes["norm.scale"] = (h,)
    shapes["unembedding.weight"] = (v, h)
    return shapes


def is_fp8_target(name: str) -> bool:
    return name.endswith(FP8_SUFFIXES)


def is_expert_weight(name: str) -> bool:
    return name.endswith(EXPERT_WEIGHTS)


def normalise_slices(name: str, shape: tuple[int, ...], slices: Slices) -> tuple[Region, tuple[int, ...]]:
    """Slices over the leading dims -> a full (start, stop) region and the dims an int index removes."""
    items = slices if isinstance(slices, tuple) else (slices,)
    if len(items) > len(shape):
        raise WeightError(f"tensor '{name}' has {len(shape)} dims but {len(items)} slices were given")
    region, squeeze = [], []
    for d, size in enumerate(shape):
        s = items[d] if d < len(items) else slice(None)
        if isinstance(s, int):
            if not -size <= s < size:
                raise WeightError(f"tensor '{name}': index {s} out of range for dim {d} of size {size}")
            s = s % size
            squeeze.append(d)
            region.append((s, s + 1))
            continue
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise WeightError(f"tensor '{name}': only ints and contiguous slices are supported, got {s!r}")
        start, stop, _ = s.indices(size)
        region.append((start, max(start, stop)))
    return tuple(region), tuple(squeeze)


class WeightSource:
    """Canonical-name access to one checkpoint; subclasses implement `_read` for their layout."""

    format: str = "abstract"

    def __init__(self, cfg: ModelConfig, path: Path | None):
        self.cfg = cfg
        self.path = path
        self._shapes = canonical_shapes(cfg)

    def names(self) -> tuple[str, ...]:
        return tuple(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            raise WeightError(f"unknown tensor '{name}' (not a canonical gpt-oss name for {self.cfg.name})")
        return self._shapes[name]

    def get(self, name: str, slices: Slices = (), dtype: torch.dtype | None = None,
            device: torch.device | str | None = None) -> torch.Tensor:
        """The region `slices` of canonical tensor `name`; dtype None keeps the stored dtype (bf16 for
        dequantised experts/FP8)."""
        region, squeeze = normalise_slices(name, self.shape(name), slices)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        t = self._read(name, region, dev)
        t = t.to(device=dev, dtype=dtype or t.dtype)
        for d in reversed(squeeze):
            t = t.squeeze(d)
        return t.contiguous()

    def get_fp8(self, name: str, slices: Slices = ()) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(fp8, 128x128 block scale) of a region when the tensor is stored FP8, else None."""
        self.shape(name)
        return None

    def get_mxfp4(self, name: str, slices: Slices = (),
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An expert weight's region as the checkpoint stores it in MXFP4: (blocks uint8 [..., R, C/32, 16], scales
        uint8 [..., R, C/32]), no decoding; None where it is not stored so (bf16, FP8, converted checkpoints).
        The region's columns must lie on 32-column blocks (a tensor-parallel slice of the intermediate size)."""
        region, squeeze = normalise_slices(name, self.shape(name), slices)
        *lead, (c0, c1) = region
        if c0 % mxfp4.BLOCK or c1 % mxfp4.BLOCK:
            raise WeightError(f"'{name}': columns [{c0}, {c1}) do not lie on {mxfp4.BLOCK}-column MXFP4 blocks (a "
                              "tensor-parallel split of the experts that MXFP4 weights cannot take)")
        dev = torch.device(device) if device is not None else torch.device("cpu")
        got = self._read_mxfp4(name, (*lead, (c0 // mxfp4.BLOCK, c1 // mxfp4.BLOCK)), dev)
        if got is None:
            return None
        blocks, scales = (t.to(dev) for t in got)
        for d in reversed(squeeze):
            blocks, scales = blocks.squeeze(d), scales.squeeze(d)
        return blocks.contiguous(), scales.contiguous()

    def _read_mxfp4(self, name: str, groups: Region,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(blocks, scales) of the 32-column groups `groups` (the region with its last dim in groups), on the CPU
        or on `device`."""
        return None

    def validate(self) -> None:
        for name in self._shapes:
            self._check(name)

    def _check(self, name: str) -> None:
        raise NotImplementedError

    def _read(self, name: str, region: Region, device: torch.device) -> torch.Tensor:
        raise NotImplementedError
