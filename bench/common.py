"""Shared benchmark plumbing: environment record, timing, building the engine Runner the way the workers
do, the common CLI, and saving JSON + PNG results.

The cost arithmetic and FLOP/byte estimates are in bench/estimates.py (imported back here). Units follow
docs/seed-notes.md: latency in seconds, cost in US$ per 1M tokens at $3.00 per H200-hour.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import inspect
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

# The estimates are read as `common.X` by every benchmark and its tests; they live in bench/estimates.py.
from kvrelay.bench.estimates import (  # noqa: F401
    CEILING_TFLOPS,
    COPY_BW_BYTES_S,
    SEED_PREFILL,
    USD_PER_GPU_HOUR,
    active_params,
    attention_flops,
    causal_pairs,
    copy_bw,
    decode_bytes_per_step,
    decode_usd_per_m_output,
    expert_flops,
    fmt_cell,
    kv_bytes_per_page,
    layer_active_params,
    prefill_flops,
    prefill_usd_per_m_input,
    projection_flops,
    weight_bytes,
)
from kvrelay.engine.config import MODEL_QUANTS
from kvrelay.engine.kv_geometry import FULL

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "results"


# ---- timing ------------------------------------------------------------------------------------------
@dataclass
class Timing:
    times_s: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times_s)

    def summary(self) -> dict[str, float]:
        t = self.times_s
        return {"median_s": self.median, "min_s": min(t), "max_s": max(t), "mean_s": statistics.fmean(t),
                "n": len(t)}


class StopWatch:
    """CUDA events on a GPU (stream time between the marks, host gaps included, since the events sit
    on the stream the Runner launches on); perf_counter after a synchronize elsewhere."""

    def __init__(self, device):
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self._torch = torch

    def mark(self):
        if self.cuda:
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed(self, a, b) -> float:
        """Seconds from mark a to mark b (synchronizes on the GPU)."""
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a

    def sync(self) -> None:
        if self.cuda:
            self._torch.cuda.synchronize()


def time_call(fn: Callable[[], Any], device, *, warmup: int, iters: int, budget_s: float | None = None,
              cleanup: Callable[[], Any] | None = None) -> tuple[Timing, float]:
    """Median-friendly timing of fn(): `warmup` untimed calls, then up to `iters` timed ones, fewer when
    `budget_s` would be exceeded (always at least one). `cleanup` runs after each call, outside the
    timed region (e.g. freeing the sequence a prefill created). Returns (timing, first call's seconds)."""
    sw = StopWatch(device)
    t0 = time.perf_counter()
    first = None
    for _ in range(warmup):
        s = time.perf_counter()
        fn()
        sw.sync()
        first = first if first is not None else time.perf_counter() - s
        if cleanup is not None:
            cleanup()
    timing = Timing()
    for n in range(iters):
        a = sw.mark()
        fn()
        b = sw.mark()
        timing.times_s.append(sw.elapsed(a, b))
        if cleanup is not None:
            cleanup()
        first = first if first is not None else timing.times_s[0]
        spent = time.perf_counter() - t0
        if budget_s is not None and n + 1 < iters and spent + timing.median > budget_s:
            break
    return timing, float(first)


class Budget:
    """Wall-clock budget for a whole run: points beyond it are skipped and reported, never silently."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def exhausted(self) -> bool:
        return self.left() <= 0


# ---- environment ---------------------------------------------------------------------------------------
def git_commit(repo: Path = REPO_ROOT) -> str:
    """$KVRELAY_GIT_COMMIT when set (the GPU box's copy may carry a stale .git), else HEAD, else "unknown"
    (router/version.py: the one rule, which the server's /version follows too)."""
    from kvrelay.router.version import git_commit as commit

    return commit(repo)


def git_dirty(repo: Path = REPO_ROOT) -> bool | None:
    """A copy of a commit's tree (KVRELAY_GIT_COMMIT) is clean only when the launcher checked its own tree
    before copying it (KVRELAY_GIT_CLEAN=1), else unknown; a checkout asks git."""
    from kvrelay.router.version import git_dirty as dirty

    return dirty(repo)


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 - a missing or broken optional package is just "not present"
        return None
    return getattr(mod, "__version__", "present")


def env_info(device, module: str, argv: list[str] | None) -> dict[str, Any]:
    """Where and how a result was produced. `argv` None means this process's own command line."""
    import torch

    dev = torch.device(device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" and torch.cuda.is_available() else "cpu"
    return {
        "gpu": gpu,
        "device": str(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        # Importing flashinfer on a CPU box is pointless (and slow where it is installed).
        "flashinfer": _version("flashinfer") if dev.type == "cuda" else None,
        "python": platform.python_version(),
        "host": platform.node(),
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, "-m", module,
                                                      *(sys.argv[1:] if argv is None else argv)]),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        # the engine's switches (KVRELAY_FUSED=0, KVRELAY_ATTENTION, ...): an A/B run is told apart by them
        "kvrelay_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVRELAY_")},
        # kernels/pdl.py is on by default where supported: whether this run's Triton kernels used it
        "pdl": _pdl_on(dev),
    }


def _pdl_on(dev) -> bool:
    if dev.type != "cuda":
        return False
    try:
        from kvrelay.kernels import pdl
    except ImportError:  # a GPU box without triton runs no Triton kernels
        return False
    return pdl.enabled(dev)


# ---- model and Runner ------------------------------------------------------------------------------------
def resolve_config(model: str):
    from kvrelay.engine.config import load_model_config

    return load_model_config(model)


def _flashinfer_prebuilt() -> bool:
    """True when FlashInfer's modules need no JIT build (AOT tarball unpacked or a warm JIT cache): a
    fresh build costs ~3.5 minutes, more than a --quick run may take (h200-notes)."""
    try:
        import flashinfer
    except Exception:  # noqa: BLE001
        return False
    aot = Path(flashinfer.__file__).parent / "data" / "aot"
    jit = Path.home() / ".cache" / "flashinfer"
    return any(aot.glob("*/*.so")) or any(jit.glob("**/cached_ops/*/*.so"))


def choose_attention(name: str, device) -> tuple[Callable | None, str]:
    """The attention_fn to hand the Runner (None = leave the engine's own choice) and a label.

    `auto` leaves the choice to the engine as soon as its Runner defaults to something other than the
    CPU reference; until then it picks FlashInfer on a GPU when its modules are prebuilt, else Triton
    (the reference materialises [heads, T, T] scores: OOM at 32k tokens)."""
    import torch

    from kvrelay.engine.runner import Runner
    from kvrelay.kernels import reference

    param = inspect.signature(Runner.__init__).parameters.get("attention_fn")
    if name == "engine" or (name == "auto" and (param is None or param.default is not reference.paged_attention)):
        return None, "engine default"
    if name == "auto":
        if torch.device(device).type != "cuda":
            return None, "engine default (reference)"
        name = "flashinfer" if _flashinfer_prebuilt() else "triton"
    if param is None:
        raise SystemExit(f"--attention {name}: this engine's Runner takes no attention_fn")
    if name == "reference":
        return reference.paged_attention, "reference (torch)"
    if name == "triton":
        from kvrelay.kernels.triton_attention import paged_attention as fn
        return fn, "triton (kernels.triton_attention.paged_attention)"
    if name == "flashinfer":
        from kvrelay.kernels.attention import paged_attention as fn
        return fn, "flashinfer (kernels.attention.paged_attention, plans per layer call)"
    raise SystemExit(f"unknown --attention {name!r}")


def graph_kwargs(want: str, device, batch_sizes: list[int] | None = None) -> tuple[dict[str, Any], str]:
    """CUDA graphs for the Runner's decode, if its constructor offers them: a boolean parameter named
    *graph*, or a *graph*batch_sizes* one (given the sweep's batch sizes). Anything else is left at
    the engine's default and reported, never guessed."""
    import torch

    from kvrelay.engine.runner import Runner

    params = {n: p for n, p in inspect.signature(Runner.__init__).parameters.items() if "graph" in n}
    if not params:
        return {}, "not provided by the engine Runner"
    on = want == "on" or (want == "auto" and torch.device(device).type == "cuda")
    out: dict[str, Any] = {}
    for name, p in params.items():
        if isinstance(p.default, bool):
            out[name] = on
            break
    sizes_param = next((n for n in params if "batch_sizes" in n), None)
    if sizes_param and batch_sizes and on:
        # Every batch of the sweep gets its own graph, beside the engine's default sizes: a batch past the
        # largest graph would otherwise be timed on the piecewise path (2026-12-03: 20b batch 256 at 8192
        # 37.4 ms against 14.3 at 128), while the served 20b topology captures up to 512.
        default = params[sizes_param].default
        default = tuple(default) if isinstance(default, (tuple, list)) else ()
        out[sizes_param] = tuple(sorted({int(b) for b in (*default, *batch_sizes)}))
    if not out:
        return {}, f"engine parameters {sorted(params)} left at their defaults"
    label = ", ".join(f"{k}={v}" for k, v in out.items())
    return out, label


def build_runner(args, *, num_pages: dict[str, int], attention_fn=None, extra: dict | None = None,
                 min_full_pages: int = 1, retries: int = 2):
    """A Runner exactly as the workers build one (dummy or real weights, quant, page size), with the
    benchmark's pool size. On a GPU OOM (the weights took more than estimated) it retries with half the
    full-attention pool, down to `min_full_pages`. Returns (runner, seconds to build, pages used)."""
    import gc

    import torch

    from kvrelay.engine.runner import Runner, open_model_weights

    cfg = resolve_config(args.model)
    pages = dict(num_pages)
    for attempt in range(retries + 1):
        kwargs: dict[str, Any] = dict(device=args.device, dtype=torch.bfloat16, quant=args.quant,
                                      page_size=args.page_size, num_pages=pages)
        if attention_fn is not None:
            kwargs["attention_fn"] = attention_fn
        kwargs.update(extra or {})
        t0 = time.perf_counter()
        try:
            runner = Runner(cfg, open_model_weights(args.model, cfg, dummy=args.dummy, seed=args.seed), **kwargs)
        except Exception as e:  # noqa: BLE001
            smaller = max(min_full_pages, pages[FULL] // 2)
            if not is_oom(e) or attempt == retries or smaller == pages[FULL]:
                raise
            gc.collect()
            torch.cuda.empty_cache()
            print(f"OOM building the Runner with {pages}; retrying with {smaller} full pages")
            pages = dict(pages, **{FULL: smaller})
            continue
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()
        return runner, time.perf_counter() - t0, pages
    raise AssertionError("unreachable")


# ---- CLI and output ----------------------------------------------------------------------------------------
def parse_ints(text: str) -> list[int]:
    """'8192,32768' -> [8192, 32768] (commas or spaces)."""
    return [int(part) for part in re.split(r"[,\s]+", text.strip()) if part]


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-oss-20b", help="preset name (gpt-oss-20b, gpt-oss-120b, "
                   "gpt-oss-tiny, tiny) or a checkpoint directory")
    p.add_argument("--dummy", action="store_true", help="seeded random weights of the model's shape")
    p.add_argument("--quant", default="fp8-block128", choices=list(MODEL_QUANTS),
                   help="fp8-block128-lmhead: the unembedding in FP8 too; mxfp4: the experts as shipped "
                        "(engine/config.MODEL_QUANTS)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--attention", default="auto", choices=["auto", "engine", "reference", "triton", "flashinfer"],
                   help="attention_fn passed to the Runner (auto: see bench/common.choose_attention)")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="decode CUDA graphs, when the Runner offers a switch (auto: on for cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop measuring new points after this many seconds (skipped points are listed)")
    p.add_argument("--quick", action="store_true", help="fewer points/iterations; < 4 minutes on one H200")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="directory for the JSON and PNG")
    p.add_argument("--usd-per-gpu-hour", type=float, default=USD_PER_GPU_HOUR)


def stamp() -> str:
    """Local time as the result files name it: 20261129-124638."""
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def slug(text: str) -> str:
    """`text` made safe for a file name (a model path keeps its last component)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(text).name or text)


def result_stem(kind: str, args) -> str:
    return f"{kind}-{slug(args.model)}-{args.quant}-{torch_device_type(args.device)}-{stamp()}"


def torch_device_type(device: str) -> str:
    return str(device).split(":")[0]


def save_result(out_dir: str | Path, stem: str, payload: dict, fig=None) -> dict[str, str]:
    """Write <stem>.json (and <stem>.png when a figure is given); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / f"{stem}.json")}
    if fig is not None:
        paths["png"] = str(out / f"{stem}.png")
        fig.savefig(paths["png"], dpi=120, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(fig)
    payload = dict(payload, files=paths)
    Path(paths["json"]).write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    return paths


def _json_default(o):
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def new_figure(**kw):
    import matplotlib

    matplotlib.use("Agg")  # headless machines (the H200 box, CI)
    import matplotlib.pyplot as plt

    return plt.subplots(layout="constrained", **kw)


def console():
    """A rich console wide enough that logs captured from the GPU box keep whole table cells."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=180)


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run_cli(main: Callable[[], dict], ok: Callable[[dict], bool] | None = None) -> int:
    """Entry point shared by the benchmarks: run, print the total time, exit 1 when no point was measured
    (or, where given, when `ok(payload)` says the run produced nothing usable: a benchmark whose payload
    has no "points" list says what counts)."""
    t0 = time.perf_counter()
    payload = main()
    print(f"total {time.perf_counter() - t0:.1f} s")
    if ok is not None:
        return 0 if ok(payload) else 1
    return 0 if payload.get("points") else 1
