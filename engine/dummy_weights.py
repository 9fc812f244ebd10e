"""Seeded random weights of a model's real shapes (`--dummy`): benchmarks and tests without a checkpoint.

Expert weights can also be read as MXFP4 (`get_mxfp4`, for model.quant mxfp4): random codes with block scales
around the bf16 weights' magnitude, generated as such (no bf16 copy), so a dummy 120b serves at its real 61 GB.
"""

from __future__ import annotations

import hashlib
import itertools

import torch

from kvrelay.engine import mxfp4
from kvrelay.engine.config import ModelConfig
from kvrelay.engine.weight_source import Region, WeightSource, is_expert_weight

_DUMMY_ROWS = 512  # rows per independently seeded chunk; a slice regenerates only the chunks it touches


def _dummy_init(name: str) -> tuple[float, float]:
    """(mean, std) giving realistic magnitudes, so benchmarks see plausible activations and routing."""
    if name.endswith("norm.scale"):
        return 1.0, 0.02
    if name.endswith("sinks"):
        return 0.0, 1.0
    if name.endswith("bias"):
        return 0.0, 0.01
    return 0.0, 0.02


class DummySource(WeightSource):
    """Seeded random weights generated on the target device, deterministic per (name, chunk of rows).

    A tensor [*lead, R, C] is produced in chunks of `_DUMMY_ROWS` rows for each leading index, each from its
    own generator seeded by (seed, name, index, chunk), so any slice equals the same region of the full
    tensor and no rank materialises more than the chunks it needs. Values depend on the device type
    (CPU and CUDA generators differ); all ranks of one deployment use the same type.
    """

    format = "dummy"

    def __init__(self, cfg: ModelConfig, seed: int):
        super().__init__(cfg, None)
        self.seed = seed

    def _check(self, name: str) -> None:
        return None

    def _chunk_seed(self, name: str, lead: tuple[int, ...], chunk: int) -> int:
        key = f"{self.seed}|{name}|{lead}|{chunk}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)

    def _read(self, name: str, region: Region, device: torch.device) -> torch.Tensor:
        shape = self._shapes[name]
        full = shape if len(shape) >= 2 else (1, *shape)
        reg = region if len(shape) >= 2 else ((0, 1), *region)
        *lead_reg, (r0, r1), (c0, c1) = reg
        rows, cols = full[-2], full[-1]
        mean, std = _dummy_init(name)
        out = torch.empty([b - a for a, b in reg], dtype=torch.bfloat16, device=device)
        for li in itertools.product(*(range(a, b) for a, b in lead_reg)):
            dst = out[tuple(i - a for i, (a, _) in zip(li, lead_reg))]
            for k in range(r0 // _DUMMY_ROWS, -(-r1 // _DUMMY_ROWS)):
                k0, k1 = k * _DUMMY_ROWS, min((k + 1) * _DUMMY_ROWS, rows)
                gen = torch.Generator(device=device)
                gen.manual_seed(self._chunk_seed(name, li, k))
                chunk = torch.randn(k1 - k0, cols, generator=gen, device=device, dtype=torch.float32)
                lo, hi = max(r0, k0), min(r1, k1)
                dst[lo - r0:hi - r0] = (chunk[lo - k0:hi - k0, c0:c1] * std + mean).to(torch.bfloat16)
        return out if len(shape) >= 2 else out[0]

    def _generator(self, name: str, lead: tuple[int, ...], chunk: int, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(self._chunk_seed(name, lead, chunk))
        return gen

    def _read_mxfp4(self, name: str, groups: Region, device: torch.device):
        """Random E2M1 codes (every code equally likely: rms 2.9) under scale bytes 118..121 (2^-9..2^-6): weights
        of rms ~0.02 like the bf16 dummies', each (expert, chunk of rows) from its own generator as `_read`."""
        if not is_expert_weight(name):
            return None
        (e0, e1), (r0, r1), (g0, g1) = groups
        cols = self._shapes[name][-1] // mxfp4.BLOCK
        u8 = dict(dtype=torch.uint8, device=device)  # generated where they are served, as `_read`'s (CPU and CUDA differ)
        blocks = torch.empty(e1 - e0, r1 - r0, g1 - g0, mxfp4.BYTES_PER_BLOCK, **u8)
        scales = torch.empty(e1 - e0, r1 - r0, g1 - g0, **u8)
        for e in range(e0, e1):
            for k in range(r0 // _DUMMY_ROWS, -(-r1 // _DUMMY_ROWS)):
                k0, k1 = k * _DUMMY_ROWS, min((k + 1) * _DUMMY_ROWS, self._shapes[name][-2])
                gen = self._generator(name + ".mxfp4", (e,), k, device)
                b = torch.randint(0, 256, (k1 - k0, cols, mxfp4.BYTES_PER_BLOCK), generator=gen, **u8)
                s = torch.randint(118, 122, (k1 - k0, cols), generator=gen, **u8)
                lo, hi = max(r0, k0), min(r1, k1)
                blocks[e - e0, lo - r0:hi - r0] = b[lo - k0:hi - k0, g0:g1]
                scales[e - e0, lo - r0:hi - r0] = s[lo - k0:hi - k0, g0:g1]
        return blocks, scales

