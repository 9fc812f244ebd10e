"""L2 prefetch of the next weight-streaming kernel's weights while a latency-bound kernel runs (decode, Hopper).

A batch-1 decode layer alternates weight-streaming kernels (QKV, O projection, the MoE's two GEMVs: ~126 MB a
20b layer) with short latency-bound ones (norms, the router, the attention of a window-128 layer, the split-KV
merge), during which HBM is mostly idle; the streaming kernels themselves run at 50-80% of the copy ceiling
(bench/results/profile-decode-*: the QKV projection 7.1 us for 14.7 MB). `l2_prefetch` launches one small kernel
whose programs hand contiguous byte ranges to the TMA unit as `cp.async.bulk.prefetch.L2` requests (sm_90; no
registers, no shared memory, no completion to wait for) with an evict-last L2 policy, so the lines survive the
expert GEMVs' streaming until their reader arrives. Results are unchanged by construction: a prefetch moves
no data anywhere but L2 (the GPU tests check bits anyway).

PDL (kernels/pdl.py): the prefetch kernel triggers its dependents BEFORE its wait, the one exception to the
"wait, then trigger" rule. It writes nothing and reads nothing an earlier kernel writes (in `rows` form: the
router's expert ids, written at least two kernels back, under the same argument as the MoE's GEMV2 EARLY loads:
this kernel launches only once every program of the kernel before it has passed its wait). Triggering first
keeps the next kernel's early launch: it launches while the kernel before the prefetch still runs, as it would
without the prefetch in between, and its wait (the prefetch's completion, which follows the prefetch's own wait
for the kernel before) still orders it after every earlier kernel. At most three kernels overlap then: the
running one, this one (one warp a program, waiting), the next one (waiting).

`KVRELAY_L2_PREFETCH` names the prefetch points, a comma list of: `qkv` (the attention's QKV weights, launched
before the attention's input norm, so the fetch runs under the previous MoE GEMV2's tail and the norm), `o` (the
output projection's weights, before the attention kernel), `moe` (the chosen experts' GEMV2 weights, between the
two GEMVs), `all`, or empty/`0` for none. Read at each launch (a CUDA graph keeps the setting it was captured
with). Only decode batches of up to MAX_TOKENS tokens prefetch; elsewhere the weights are streamed at full
bandwidth by compute-bound GEMMs anyway.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .pdl import _interpreting, launch_dependents, pdl_kwargs, wait

POINTS = ("qkv", "o", "moe")
DEFAULT = ""  # off until measured in the model on the H200 (bench/h200_steps.sh envab)
MAX_TOKENS = 16
# At most this many bytes a prefetch point: about half the H200's 50 MB L2, so the lines last until read (the
# MoE point at batch 1: 4 experts' GEMV2 weights, 33 MB; at larger batches it covers most experts and is skipped)
MAX_BYTES = 40 << 20
CHUNK = 8192  # bytes a prefetch request (a multiple of 16); one warp a program issues 32 of them
PROGRAM_BYTES = 32 * CHUNK


@triton.jit
def _bulk_prefetch(addr, nbytes, EVICT_LAST: tl.constexpr):
    # one cp.async.bulk.prefetch.L2 per element (address 16-byte aligned, size a multiple of 16; 0 issues none)
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .b64 pol; .reg .pred p; setp.ne.u32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(base, ids, row_bytes, row_stride, CHUNK: tl.constexpr, ROWS: tl.constexpr,
                        EVICT_LAST: tl.constexpr, USE_PDL: tl.constexpr = False):
    # program (r, c): bytes [c * 32 CHUNK, (c + 1) * 32 CHUNK) of row r, row r at base + ids[r] * row_stride
    # (ROWS) or base (one range). The row size is a multiple of 16 (the launcher checks).
    r = tl.program_id(0)
    start = tl.program_id(1).to(tl.int64) * (32 * CHUNK) + tl.arange(0, 32).to(tl.int64) * CHUNK
    row = base
    if ROWS:
        row = base + tl.load(ids + r).to(tl.int64) * row_stride
    size = tl.minimum(tl.maximum(row_bytes - start, 0), CHUNK).to(tl.int32)
    _bulk_prefetch(row + start, size, EVICT_LAST)
    launch_dependents(USE_PDL)  # before the wait: the module docstring
    wait(USE_PDL)


def points() -> frozenset[str]:
    """The prefetch points KVRELAY_L2_PREFETCH turns on (module docstring)."""
    raw = os.environ.get("KVRELAY_L2_PREFETCH", DEFAULT).strip()
    if raw in ("", "0", "off", "none"):
        return frozenset()
    names = {n.strip() for n in raw.split(",") if n.strip()}
    if "all" in names:
        return frozenset(POINTS)
    bad = names - set(POINTS)
    if bad:
        raise ValueError(f"KVRELAY_L2_PREFETCH: unknown point(s) {sorted(bad)}; use a comma list of {POINTS} or all")
    return frozenset(names)


def evict_last() -> bool:
    """The evict-last L2 policy on the requests (KVRELAY_L2_PREFETCH_POLICY=normal for A/B runs)."""
    return os.environ.get("KVRELAY_L2_PREFETCH_POLICY", "last") != "normal"


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def wanted(point: str, tensor: torch.Tensor, tokens: int) -> bool:
    """Whether to prefetch at `point` for a launch of `tokens` tokens whose weights are `tensor`: the point is
    on, a Hopper-or-later CUDA device (the bulk prefetch is sm_90), no interpreter, a small decode batch."""
    if tokens > MAX_TOKENS or tensor.device.type != "cuda" or _interpreting() or point not in points():
        return False
    return _supported(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


def _check(t: torch.Tensor) -> int:
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(f"l2_prefetch: a contiguous, 16-byte aligned tensor (got strides {t.stride()}, "
                         f"address {t.data_ptr():#x})")
    return t.numel() * t.element_size()


def l2_prefetch(t: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Prefetch `t`'s bytes into L2 (one launch); with `rows` (int ids [P]) only rows t[rows[i]] (t [R, ...], each
    row's bytes a multiple of 16): the chosen experts' weights."""
    nbytes, n_rows = _check(t), t.shape[0] if t.dim() else 1
    t = t.reshape(-1).view(torch.uint8)  # byte addressing in the kernel
    if rows is None:
        row_bytes, row_stride, ids, grid0 = nbytes, 0, t, 1
    else:
        row_bytes = nbytes // n_rows
        row_stride, ids, grid0 = row_bytes, rows, rows.numel()
        if row_bytes % 16:
            raise ValueError(f"l2_prefetch: rows of {row_bytes} bytes (a multiple of 16 is needed)")
    if row_bytes % 16:
        raise ValueError(f"l2_prefetch: {row_bytes} bytes (a multiple of 16 is needed)")
    grid = (grid0, triton.cdiv(row_bytes, PROGRAM_BYTES))
    _l2_prefetch_kernel[grid](t, ids, row_bytes, row_stride, CHUNK=CHUNK, ROWS=rows is not None,
                              EVICT_LAST=evict_last(), num_warps=1, **pdl_kwargs(t.device))


def maybe_prefetch(point: str, tensors, tokens: int, rows: torch.Tensor | None = None) -> None:
    """l2_prefetch each of `tensors` (weights; None entries skipped; with `rows`, those rows of each) where
    `wanted(point, ...)` and their bytes stay within MAX_BYTES."""
    tensors = [t for t in tensors if t is not None]
    if not tensors or not wanted(point, tensors[0], tokens):
        return
    share = 1.0 if rows is None else rows.numel() / tensors[0].shape[0]
    if sum(t.numel() * t.element_size() for t in tensors) * share > MAX_BYTES:
        return
    for t in tensors:
        l2_prefetch(t, rows)
