"""Where a call's HOST time goes: one extra call under cProfile (top functions by cumulative and by own time),
the CUDA caching allocator's counters over it (a cudaMalloc / cudaFree / alloc retry in a steady-state call
is allocator churn, and cudaFree synchronises the device), and one more call under torch's sync debug mode,
which names every torch op that made the host wait for the GPU (`.item()`, `.tolist()`, `nonzero`, a
boolean-mask index, a blocking copy) with the Python stack it ran under. Used by bench/profile_prefill.py
`--host-profile FILE`: the GPU-idle report says *that* the GPU waited for the host, this says *why*.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
import traceback
import warnings
from typing import Any, Callable

# torch.cuda.memory_stats() counters whose change over one steady-state call means allocator churn or a sync
ALLOC_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams",
                  "segment.all.allocated", "segment.all.freed", "num_ooms")
_OWN_FRAMES = ("host_profile.py", "warnings.py")


def _alloc_counters(torch) -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOC_COUNTERS}


def _sync_pass(call: Callable[[], Any], torch) -> list[dict]:
    """One call with torch.cuda.set_sync_debug_mode("warn"): each distinct synchronising op (message and
    the stack it was called from), with how often it fired."""
    seen: dict[tuple, dict] = {}
    old_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "synchroniz" not in text:
            return old_show(message, category, filename, lineno, file, line)
        stack = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                 if not f.filename.endswith(_OWN_FRAMES)][-12:]
        key = (text.splitlines()[0], tuple(stack))
        entry = seen.setdefault(key, {"message": key[0], "stack": stack[::-1], "count": 0})
        entry["count"] += 1
        return None

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    return sorted(seen.values(), key=lambda e: -e["count"])


def host_profile(call: Callable[[], Any], device, path, *, top: int = 40,
                 cleanup: Callable[[], Any] | None = None) -> dict:
    """Profile `call` (already warmed up) on the host; write the text report to `path`; return its summary
    (wall ms of the cProfiled call, allocator counter deltas and sync sites on CUDA)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = _alloc_counters(torch)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    call()
    prof.disable()
    host_s = time.perf_counter() - t0  # the host's time to issue everything (the GPU may still be running)
    if cuda:
        torch.cuda.synchronize()
    wall_s = time.perf_counter() - t0
    if cleanup is not None:
        cleanup()
    summary: dict[str, Any] = {"file": str(path), "host_ms": host_s * 1e3, "wall_ms": wall_s * 1e3}
    if cuda:
        after = _alloc_counters(torch)
        summary["alloc_deltas"] = {k: after[k] - before[k] for k in ALLOC_COUNTERS}
        summary["syncs"] = _sync_pass(call, torch)
        if cleanup is not None:
            cleanup()
    by_cum, by_own, callers = io.StringIO(), io.StringIO(), io.StringIO()
    pstats.Stats(prof, stream=by_cum).sort_stats("cumulative").print_stats(top)
    pstats.Stats(prof, stream=by_own).sort_stats("tottime").print_stats(top)
    # who called the heaviest own-time functions: a builtin that waits (torch.empty in a cudaMalloc/cudaFree,
    # a .tolist() on a device tensor) is a row of its own; this says from where
    pstats.Stats(prof, stream=callers).sort_stats("tottime").print_callers(10)
    lines = [f"host profile of one call: {summary['host_ms']:.2f} ms on the host until the call returned, "
             f"{summary['wall_ms']:.2f} ms until the device finished (cProfile adds host time)"]
    if cuda:
        lines.append("CUDA caching allocator over the call (a steady-state call should change none): "
                     + ", ".join(f"{k} {v:+d}" for k, v in summary["alloc_deltas"].items()))
        lines.append(f"synchronising torch ops in one more call (torch.cuda.set_sync_debug_mode): "
                     f"{sum(e['count'] for e in summary['syncs'])}")
        for e in summary["syncs"]:
            lines.append(f"  {e['count']}x {e['message']}")
            lines += [f"      {f}" for f in e["stack"]]
    lines += ["", f"top {top} by cumulative time", by_cum.getvalue(), f"top {top} by own time", by_own.getvalue(),
              "callers of the top 10 by own time", callers.getvalue()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return summary
