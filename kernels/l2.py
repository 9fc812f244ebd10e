"""L2 prefetch of the next GEMM's weights from the small kernel that runs before it (decode steps).

At batch-1 decode the dense projections (QKV, output) are cuBLAS FP8 GEMVs of 12-15 MB each that take
~7 us on the H200, about twice those bytes at the copy ceiling: a short kernel never reaches full bandwidth
(ramp-up, tail), while the glue kernels between the GEMMs (norms, rotary, the attention of one token)
leave HBM nearly idle. Those weights are at fixed addresses that no kernel writes, so the kernel before a
GEMM can ask the memory system for them: `cp.async.bulk.prefetch.L2` (sm_90) is a fire-and-forget hint
that pulls a byte range into L2 without occupying registers or shared memory, and the GEMM's loads then
hit L2 (50 MB on an H200; a layer's QKV or output weights fit several times over).

How a kernel uses it (kernels/fused.py): its launch gets `parts` extra programs; each of them issues its
share of the prefetch (`issue`) before `enter` (kernels/pdl.py: the weights need nothing of the previous
kernel, so under PDL the prefetch already overlaps that kernel's tail), then waits like every program and
returns. The prefetch changes no result, only where the GEMM's bytes come from.

`KVRELAY_L2_PREFETCH=0` turns it off (A/B runs); off on CPU, in the Triton interpreter (no inline PTX)
and before Hopper. Read at each launch: a CUDA graph keeps the setting it was captured with.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import _interpreting

# Above this many rows the decode GEMMs are no longer bound by streaming their weights once (prefill
# chunks reuse each weight tile across many rows), so the kernels launch no prefetch programs.
MAX_ROWS = 256
# Extra programs per prefetching launch and lanes each: PARTS x LANES bulk requests cover the range. 32 x
# 128 requests of ~3.6 KB for a 15 MB weight: spread over many SMs so no one SM's request queue is the limit.
PARTS = 32
LANES = 128


def enabled(device, rows: int) -> bool:
    """True when a kernel launched on `device` for `rows` rows should prefetch: a CUDA device of compute
    capability >= 9, not the interpreter, rows <= MAX_ROWS, KVRELAY_L2_PREFETCH not "0"."""
    if os.environ.get("KVRELAY_L2_PREFETCH") == "0" or rows > MAX_ROWS or _interpreting():
        return False
    dev = device if isinstance(device, torch.device) else torch.device(device)
    if dev.type != "cuda":
        return False
    return _sm90(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@dataclass(frozen=True)
class Target:
    """A byte range to prefetch: a contiguous tensor's storage (weights: nothing writes them)."""

    tensor: torch.Tensor

    @staticmethod
    def of(t: torch.Tensor | None) -> "Target | None":
        """A Target for a CUDA tensor that one bulk range covers (contiguous, 16-byte aligned, a multiple
        of 16 bytes: the instruction's unit), else None (nothing is prefetched for it)."""
        if t is None or not t.is_cuda or not t.is_contiguous():
            return None
        if t.data_ptr() % 16 or (t.numel() * t.element_size()) % 16:
            return None
        return Target(t)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def launch_args(target: Target | None, dummy: torch.Tensor, rows: int) -> tuple[int, dict]:
    """(extra programs, kernel keywords) for a launch on dummy's device that may prefetch `target`:
    (0, {..., PF_PARTS: 0}) when it should not (`dummy`, any tensor of the launch, fills the pointer
    then). The keywords are the kernel's pf_ptr / pf_bytes / PF_PARTS / PF_LANES parameters."""
    if target is None or not enabled(dummy.device, rows):
        return 0, {"pf_ptr": dummy, "pf_bytes": 0, "PF_PARTS": 0, "PF_LANES": LANES}
    return PARTS, {"pf_ptr": target.tensor.view(torch.uint8), "pf_bytes": target.nbytes, "PF_PARTS": PARTS,
                   "PF_LANES": LANES}


def shares(nbytes: int, parts: int, lanes: int) -> list[tuple[int, int]]:
    """The (offset, size) of every bulk request `issue` makes for a range of nbytes, in order (host mirror
    of the kernel's arithmetic, for tests): parts x lanes requests of one 16-byte-aligned chunk size."""
    chunk = _chunk(nbytes, parts * lanes)
    out = []
    for i in range(parts * lanes):
        off = i * chunk
        if off < nbytes:
            out.append((off, min(chunk, nbytes - off)))
    return out


def _chunk(nbytes: int, requests: int) -> int:
    # a multiple of 16 (the instruction's size unit and address alignment)
    return -(-(-(-nbytes // requests)) // 16) * 16


@triton.jit
def issue(pf_ptr, pf_bytes, part, PF_PARTS: tl.constexpr, PF_LANES: tl.constexpr):
    """Program `part` of PF_PARTS: bulk L2 prefetches of its PF_LANES chunks of the pf_bytes at pf_ptr
    (16-byte aligned; the last chunk is cut at pf_bytes, which must be a multiple of 16)."""
    requests = PF_PARTS * PF_LANES
    chunk = ((pf_bytes + requests - 1) // requests + 15) // 16 * 16
    lane = tl.arange(0, PF_LANES)
    off = (part * PF_LANES + lane).to(tl.int64) * chunk
    ok = off < pf_bytes
    size = tl.where(ok, tl.minimum(pf_bytes - off, chunk), 0).to(tl.int32)
    addr = tl.cast(pf_ptr + off, tl.int64)  # pf_ptr is a byte pointer (launch_args passes a uint8 view)
    tl.inline_asm_elementwise(
        "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\n@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
