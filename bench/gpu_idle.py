"""Where a profiled call leaves the GPU idle: from the device events' (start, end) timestamps on the profiler's
timeline, the time from the call's start to its first kernel, the gaps between kernels and the time after the
last one to the call's end, with the largest gaps and the kernels on either side of each.

A prefill's wall time minus its kernel time is GPU idle time (bench/profile_prefill.py: 145.4 ms wall, 133.3 ms
of kernels for 20b at 8192 tokens); this says where in the call it sits: host work before the first launch,
launch latency or host syncs between kernels (which kernel pair), the tail after the last one (the first
token's copy to the host, Python).

Device events may overlap (kernels on two streams, a memcpy beside a kernel): the GPU is busy while any event
runs, so each gap is the next event's start minus the latest end so far, and the kernel "before" a gap is the
one that ended last.
"""

from __future__ import annotations

import re

# The window is the profiled call's bracket of bench.common.StopWatch marks: its CUDA runtime calls (the
# first and the last cudaEventRecord of the profile) sit on the profiler's CPU clock. (A record_function range
# around the call would say the same, but with with_stack it made torch 2.13's event parsing fail on a
# garbled name in about one CPU run in four, seemingly the Python tracer's dangling frame names of
# pytorch/pytorch#136040.)
MARK = "cudaEventRecord"
LARGEST = 15


def short_name(name: str, width: int = 56) -> str:
    """A kernel name for a table: no leading `void `, no C++ argument list, library namespaces dropped, cut to
    `width` characters ("Memcpy HtoD (Pinned -> Device)" keeps its parenthesis: a space precedes it)."""
    n = name[5:] if name.startswith("void ") else name
    depth = 0
    for i, ch in enumerate(n):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0 and not n[i - 1].isspace():
            n = n[:i]
            break
    n = re.sub(r"\b(at::native::|cutlass::|flashinfer::|cublasLt::|std::)", "", n).strip()
    return n if len(n) <= width else n[: width - 3] + "..."


def idle_report(intervals: list[tuple[float, float, str]], window: tuple[float, float] | None,
                largest: int = LARGEST) -> dict | None:
    """intervals: (start_us, end_us, name) of the device events; window: the call's (start_us, end_us) on the
    same clock (None: the events' own span, so nothing before the first or after the last). None when there
    are no device events. Times in ms; `largest` gaps, longest first."""
    if not intervals:
        return None
    ivs = sorted(intervals, key=lambda iv: (iv[0], iv[1]))
    first = ivs[0][0]
    gaps = []  # (us, starts at, name before, name after)
    end, last = ivs[0][1], ivs[0][2]
    for start, stop, name in ivs[1:]:
        if start > end:
            gaps.append((start - end, end, last, name))
        if stop > end:
            end, last = stop, name
    t0, t1 = window if window is not None else (first, end)
    before = max(0.0, first - t0)
    after = max(0.0, t1 - end)  # 0 when the call returned before its last kernel ended
    between = sum(g[0] for g in gaps)
    span = max(t1, end) - min(t0, first)
    top = sorted(gaps, key=lambda g: -g[0])[:largest]
    return {"window_ms": span / 1e3, "busy_ms": (end - first - between) / 1e3, "device_events": len(ivs),
            "before_first_ms": before / 1e3, "between_ms": between / 1e3, "gaps": len(gaps),
            "after_last_ms": after / 1e3, "idle_ms": (before + between + after) / 1e3,
            "largest": [{"gap_us": round(us, 2), "at_ms": round((at - min(t0, first)) / 1e3, 3),
                         "prev": short_name(a), "next": short_name(b)} for us, at, a, b in top]}


def profiler_intervals(prof) -> tuple[list[tuple[float, float, str]], tuple[float, float] | None]:
    """The device events (kernels, memcpy/memset: device_type CUDA, no record_function's GPU range) of a
    torch.profiler run as (start_us, end_us, name), and the window from the start of its first cudaEventRecord
    call to the end of its last (None without any). FunctionEvent.time_range is the public API for both, on
    one clock (kineto's, from the trace start)."""
    events = list(prof.events())
    device = [(float(e.time_range.start), float(e.time_range.end), e.name) for e in events
              if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)
              and e.time_range.end > e.time_range.start]
    marks = [e.time_range for e in events if e.device_type.name == "CPU" and e.name.startswith(MARK)]
    window = (float(min(m.start for m in marks)), float(max(m.end for m in marks))) if marks else None
    return device, window


def print_idle(idle: dict | None) -> None:
    if idle is None:
        print("\nGPU idle: no device events in the profile (a CPU run profiles CPU ops only)")
        return
    print(f"\nGPU idle in the profiled call: {idle['idle_ms']:.2f} of {idle['window_ms']:.2f} ms "
          f"(busy {idle['busy_ms']:.2f} ms, {idle['device_events']} device events)")
    print(f"  before the first kernel {idle['before_first_ms']:9.3f} ms")
    print(f"  between kernels         {idle['between_ms']:9.3f} ms in {idle['gaps']} gaps")
    print(f"  after the last kernel   {idle['after_last_ms']:9.3f} ms")
    if idle["largest"]:
        print(f"  {'gap us':>9s} {'at ms':>9s}  {'kernel before the gap':56s}  kernel after it")
        for g in idle["largest"]:
            print(f"  {g['gap_us']:9.1f} {g['at_ms']:9.3f}  {g['prev']:56s}  {g['next']}")
