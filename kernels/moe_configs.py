"""Launch configs of the grouped FP8 expert GEMMs (kernels/moe.py): the measured table of a GPU model when
one exists, else the hand heuristic.

`python -m kvrelay.bench.tune_moe` sweeps the kernel's tile sizes and knobs on a GPU and writes
kernels/configs/moe_<device>.json (device: torch.cuda.get_device_name, anything but [A-Za-z0-9_.-] as
"_"; e.g. moe_NVIDIA_H200.json), one entry per expert shape and per number of (token, expert) pairs it was
measured at, as vLLM's fused_moe configs do. $KVRELAY_MOE_CONFIG_DIR, when set, is searched first, so a
fresh tuning run can be tried before it is committed. A file is read once per process; a malformed one is
an error that names the file and the key, never a silent fallback.

    {"version": 1, "device": "NVIDIA H200", "kernel": "grouped-fp8-block128",
     "shapes": {"E32_H2880_I2880": {"model": "gpt-oss-20b", "provenance": {...},
        "buckets": {"16384": {"block_m": 64,
                              "w1": {"block_n": 128, "num_warps": 8, "num_stages": 3, "group_m": 8,
                                     "masked": false, "tma": false},
                              "w2": {...}}}}}}

Both GEMMs of a bucket share block_m (one expert sort serves both); each has its own tile and knobs.
A call takes the bucket nearest its pair count on a log scale (4,000 pairs -> the 4,096 bucket, 700 ->
512 rather than 1,024); a pair count more than 4x beyond the table's smallest or largest bucket uses the
heuristic (a table tuned for prefill alone says nothing about decode). Tables hold FP8 entries only:
bf16 experts use the heuristic.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

VERSION = 1
KERNEL = "grouped-fp8-block128"
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
ENV_DIR = "KVRELAY_MOE_CONFIG_DIR"
# Above this many pairs the prefill heuristic applies (the expert sort switches to torch ops there too).
HEURISTIC_PREFILL_PAIRS = 8192
_SHAPE = re.compile(r"^E(\d+)_H(\d+)_I(\d+)$")
_POW2 = (16, 32, 64, 128, 256)
MAX_BUCKET_RATIO = 4.0


class MoEConfigError(ValueError):
    """A tuned-config file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class GemmConfig:
    """One grouped GEMM's launch: N tile, warps, pipeline stages, and the kernel knobs the tuner selects:
    group_m (M blocks that walk the N tiles together so an expert's weight tiles are re-read from L2,
    1 = N tiles of one M block back to back), masked (False: padding rows and the N tail read clamped,
    in-bounds addresses and the K loop runs without masks), tma (weight tiles through a TMA descriptor),
    sorted_a (the input's rows laid out in the sort's slots, one TMA tile a K step, instead of gathered per
    row: kernels/moe_sort.quantize_sorted for GEMM1, GEMM1 writing its output so for GEMM2), ws (triton's warp
    specialisation of the K loop: a TMA producer and MMA consumer warp groups; needs tma and sorted_a)."""

    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 1
    masked: bool = True
    tma: bool = False
    sorted_a: bool = False
    ws: bool = False

    def label(self) -> str:
        return (f"bn{self.block_n}-w{self.num_warps}-s{self.num_stages}-g{self.group_m}"
                + ("" if self.masked else "-clamp") + ("-tma" if self.tma else "")
                + ("-sa" if self.sorted_a else "") + ("-ws" if self.ws else ""))


@dataclass(frozen=True)
class GroupedConfig:
    """block_m (shared by both GEMMs: one expert sort) and each GEMM's launch. `source` says where it came
    from ("heuristic", or file#shape/bucket)."""

    block_m: int
    w1: GemmConfig
    w2: GemmConfig
    source: str = field(default="heuristic", compare=False)

    def label(self) -> str:
        return f"bm{self.block_m} w1:{self.w1.label()} w2:{self.w2.label()}"

    def to_json(self) -> dict[str, Any]:
        return {"block_m": self.block_m, "w1": asdict(self.w1), "w2": asdict(self.w2)}


def heuristic_config(n_pairs: int, num_experts: int) -> GroupedConfig:
    """The hand heuristic (measured on the H200 under graph replay, bench.kernels --only moedec,
    2026-12-01): decode-sized batches are memory-bound, 4 warps x 4 stages beat 8 x 3 by 5-8%, and with
    <= 16 rows per expert on average a 16-row M tile beats 64 by up to 18% (120b, 256 tokens: 0.86 vs
    1.05 ms a layer) while it loses badly at 64 rows (20b, 512 tokens: 0.67 vs 0.40 ms). Prefill keeps
    64x128, 8 warps, 3 stages."""
    if n_pairs > HEURISTIC_PREFILL_PAIRS:
        bm, g = 64, GemmConfig(128, 8, 3)
    elif n_pairs <= 16 * num_experts:
        bm, g = 16, GemmConfig(128, 4, 4)
    else:
        bm, g = 64, GemmConfig(128, 4, 4)
    return GroupedConfig(bm, g, g)


def shape_key(num_experts: int, hidden: int, inter: int) -> str:
    return f"E{num_experts}_H{hidden}_I{inter}"


def file_name(device_name: str) -> str:
    return "moe_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name.strip()) + ".json"


# ---- reading and checking a file ------------------------------------------------------------------------
def _fail(path: Path, key: str, what: str):
    raise MoEConfigError(f"{path}: {key}: {what}" if key else f"{path}: {what}")


def _int(path, key, v, ok) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not ok(v):
        _fail(path, key, f"invalid value {v!r}")
    return v


def _gemm(path: Path, key: str, d: Any) -> GemmConfig:
    if not isinstance(d, dict):
        _fail(path, key, f"expected an object, got {type(d).__name__}")
    need = {"block_n", "num_warps", "num_stages"}
    known = need | {"group_m", "masked", "tma", "sorted_a", "ws"}
    if need - d.keys():
        _fail(path, key, f"missing {sorted(need - d.keys())}")
    if d.keys() - known:
        _fail(path, key, f"unknown keys {sorted(d.keys() - known)} (known: {sorted(known)})")
    for flag in ("masked", "tma", "sorted_a", "ws"):
        if flag in d and not isinstance(d[flag], bool):
            _fail(path, f"{key}.{flag}", f"expected true or false, got {d[flag]!r}")
    g = GemmConfig(block_n=_int(path, f"{key}.block_n", d["block_n"], lambda v: v in _POW2),
                      num_warps=_int(path, f"{key}.num_warps", d["num_warps"], lambda v: v in (1, 2, 4, 8, 16)),
                      num_stages=_int(path, f"{key}.num_stages", d["num_stages"], lambda v: 1 <= v <= 8),
                      group_m=_int(path, f"{key}.group_m", d.get("group_m", 1), lambda v: 1 <= v <= 64),
                      masked=d.get("masked", True), tma=d.get("tma", False),
                      sorted_a=d.get("sorted_a", False), ws=d.get("ws", False))
    if g.ws and not (g.tma and g.sorted_a):
        _fail(path, f"{key}.ws", "warp specialisation needs tma and sorted_a true")
    return g


def parse(path: Path, data: Any) -> dict[str, list[tuple[int, GroupedConfig]]]:
    """A file's JSON -> {shape key: [(n_pairs bucket, config), ...] ascending}. Raises MoEConfigError."""
    if not isinstance(data, dict):
        _fail(path, "", "expected a JSON object at the top")
    if data.get("version") != VERSION:
        _fail(path, "version", f"expected {VERSION}, got {data.get('version')!r}")
    if data.get("kernel", KERNEL) != KERNEL:
        _fail(path, "kernel", f"expected {KERNEL!r}, got {data.get('kernel')!r}")
    shapes = data.get("shapes")
    if not isinstance(shapes, dict):
        _fail(path, "shapes", "missing or not an object")
    out: dict[str, list[tuple[int, GroupedConfig]]] = {}
    for skey, entry in shapes.items():
        if not _SHAPE.match(skey):
            _fail(path, f"shapes.{skey}", "shape keys look like E32_H2880_I2880")
        buckets = entry.get("buckets") if isinstance(entry, dict) else None
        if not isinstance(buckets, dict) or not buckets:
            _fail(path, f"shapes.{skey}.buckets", "missing, empty or not an object")
        rows = []
        for bkey, b in buckets.items():
            key = f"shapes.{skey}.buckets.{bkey}"
            if not (isinstance(bkey, str) and bkey.isdigit() and int(bkey) > 0):
                _fail(path, key, "bucket keys are positive pair counts")
            if not isinstance(b, dict):
                _fail(path, key, f"expected an object, got {type(b).__name__}")
            if b.keys() - {"block_m", "w1", "w2", "ms", "note"} or not {"block_m", "w1", "w2"} <= b.keys():
                _fail(path, key, f"expected keys block_m, w1, w2 (and optional ms, note), got {sorted(b)}")
            bm = _int(path, f"{key}.block_m", b["block_m"], lambda v: v in _POW2)
            rows.append((int(bkey), GroupedConfig(bm, _gemm(path, f"{key}.w1", b["w1"]),
                                                  _gemm(path, f"{key}.w2", b["w2"]),
                                                  source=f"{path.name}#{skey}/{bkey}")))
        out[skey] = sorted(rows, key=lambda r: r[0])
    return out


@functools.lru_cache(maxsize=None)
def load_file(path: str) -> dict[str, list[tuple[int, GroupedConfig]]]:
    """Read and check one file (cached per path for the life of the process)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise MoEConfigError(f"{p}: cannot read: {e}") from e
    except ValueError as e:
        raise MoEConfigError(f"{p}: not valid JSON: {e}") from e
    return parse(p, data)


def find_file(device_name: str) -> Path | None:
    """The table for this GPU model: $KVRELAY_MOE_CONFIG_DIR first, then kernels/configs/."""
    dirs = [Path(os.environ[ENV_DIR])] if os.environ.get(ENV_DIR) else []
    for d in dirs + [CONFIG_DIR]:
        p = d / file_name(device_name)
        if p.is_file():
            return p
    return None


def nearest(rows: list[tuple[int, GroupedConfig]], n_pairs: int) -> GroupedConfig | None:
    """The bucket nearest n_pairs on a log scale (ties: the smaller bucket); None beyond MAX_BUCKET_RATIO
    of the table's ends. `rows` ascending."""
    n = max(n_pairs, 1)
    if n < rows[0][0] / MAX_BUCKET_RATIO or n > rows[-1][0] * MAX_BUCKET_RATIO:
        return None
    x = math.log(n)
    return min(rows, key=lambda r: (abs(math.log(r[0]) - x), r[0]))[1]


@functools.lru_cache(maxsize=4096)
def _lookup(device_name: str, env_dir: str | None, shape: str, n_pairs: int) -> GroupedConfig | None:
    path = find_file(device_name)
    if path is None:
        return None
    rows = load_file(str(path)).get(shape)
    return nearest(rows, n_pairs) if rows else None


def tuned_config(device_name: str, num_experts: int, hidden: int, inter: int, n_pairs: int) -> GroupedConfig | None:
    """The measured config for this GPU model and expert shape, or None (no file, or shape not in it)."""
    return _lookup(device_name, os.environ.get(ENV_DIR), shape_key(num_experts, hidden, inter), n_pairs)


def clear_cache() -> None:
    """Forget files already read (tests, or a tuning run that just wrote one)."""
    load_file.cache_clear()
    _lookup.cache_clear()
