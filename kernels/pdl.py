"""Programmatic Dependent Launch (PDL) for the decode step's Triton kernels: the switch and the two calls.

A batch-1 decode step is ~290 kernels replayed from a CUDA graph, most of them a few microseconds long, so
each boundary's launch latency, ramp-up and tail is a visible share of the step (issue #11). With PDL
(Hopper and later) kernel N+1 is launched while kernel N still runs: its programs become resident, do
what needs nothing of N (index math, loads of weights, which no decode kernel writes), then block in
`griddepcontrol.wait` until N has COMPLETED and its writes are visible. Kernel N's
`griddepcontrol.launch_dependents` (or its end) is what lets N+1 launch.

Rules every kernel here follows (kernels/fused.py, router.py, moe_gemv.py, fp8_gemv.py, fp8_gemm.py, attention.py, moe.py,
triton_attention.py):
- `wait(USE_PDL)` runs in every program, before its first load of anything an earlier kernel may write
  and before its first store or atomic (a store could overwrite what the previous kernel still reads);
  no program returns before it. Because every program waits for its predecessor's completion, the chain
  is transitive: a kernel two launches later sees everything the first one wrote.
  One exception, argued where it is made: the MoE's GEMV2 (kernels/moe_gemv.py) reads the router's outputs,
  written TWO kernels back, before its wait. A kernel launches only once every program of the one before
  has passed its own wait, so the kernel before that has completed and its writes are visible by then.
- `launch_dependents(USE_PDL)` right after the wait (`enter` does both). The next kernel then launches
  once every program of this one is past its wait, i.e. once the previous kernel has finished: at most
  two kernels overlap, and the next one's programs only take SM slots after all of this kernel's
  programs are already resident (the trigger counts every program), so they cannot starve it. Its waiting
  programs hold registers/slots while this kernel runs; its early loads share the bandwidth.
- The launch passes `**pdl_kwargs(device)`: {"USE_PDL": True, "launch_pdl": True} or {} (USE_PDL defaults
  to False in every kernel), so the constexpr and the launch attribute always agree: a kernel launched
  with PDL always waits, and nothing changes where PDL is off (CPU, the Triton interpreter, pre-Hopper
  GPUs, a triton without it, KVRELAY_PDL=0).
- The wait stays outside loops: Triton's pipeliner may hoist a loop's loads above a wait placed inside
  the loop (triton-lang/triton#11905).
Kernels of other libraries (cuBLAS, FlashInfer) are launched without the attribute and wait as usual; a
PDL kernel after one of them simply waits for it.

`KVRELAY_PDL=0` turns it off (A/B runs); it is read at each launch, so a CUDA graph holds the setting
of the moment it was captured. Default: on wherever supported.

`KVRELAY_PDL_LATE_TRIGGER` (a comma list of the names `late_trigger` is asked for, e.g. "fp8_gemv,decode"; A/B
runs, default none) moves that kernel's launch_dependents from right after its wait to after its main loop: the
next kernel then launches as this one's last programs finish their work instead of as they start. Why it may
matter (a hypothesis, 2026-12-04): an early-launched kernel of many heavy programs is placed on whichever SMs free
up first while this one still runs, so its programs can pile onto few SMs (the split-KV decode after the QKV
GEMV, bench/results/ab: every GEMV tiling of the QKV projection lost ~3.5 us a layer against cuBLAS, after which
the decode kernel launches unoverlapped). The same bits either way; only launch timing moves.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def triton_supports_pdl() -> bool:
    """The installed triton has the launch option and the two GDC calls (triton >= 3.4)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # noqa: BLE001 - a triton without the NVIDIA backend
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return ("launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
            and hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents"))


def interpreting() -> bool:
    """Triton runs kernels in its interpreter (TRITON_INTERPRET=1): programs one after another, on CPU tensors."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(index)
    return major >= 9 and triton_supports_pdl()


def enabled(device) -> bool:
    """True when kernels launched for `device` use PDL: a CUDA device of compute capability >= 9, a triton
    that supports it, not the interpreter, and KVRELAY_PDL not "0"."""
    if os.environ.get("KVRELAY_PDL") == "0" or interpreting():
        return False
    dev = device if isinstance(device, torch.device) else torch.device(device)
    if dev.type != "cuda":
        return False
    return _device_supports(dev.index if dev.index is not None else torch.cuda.current_device())


_ON = {"USE_PDL": True, "launch_pdl": True}


def pdl_kwargs(device) -> dict:
    """Launch keywords for a kernel taking `USE_PDL: tl.constexpr = False`: the constexpr and the launch
    attribute together, or nothing."""
    return dict(_ON) if enabled(device) else {}


@triton.jit
def wait(USE_PDL: tl.constexpr):
    """griddepcontrol.wait: the previous kernel has completed and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    """griddepcontrol.launch_dependents: the next kernel may launch once every program got here."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def late_trigger(name: str) -> bool:
    """Whether kernel `name` triggers its dependents after its main loop (KVRELAY_PDL_LATE_TRIGGER, above)."""
    return name in {n.strip() for n in os.environ.get("KVRELAY_PDL_LATE_TRIGGER", "").split(",")}


@triton.jit
def enter(USE_PDL: tl.constexpr):
    """wait, then let the next kernel launch (the placement the module docstring explains)."""
    wait(USE_PDL)
    launch_dependents(USE_PDL)
