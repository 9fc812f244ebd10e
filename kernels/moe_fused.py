"""The decode MoE's two GEMVs in ONE launch (KVRELAY_MOE_FUSED_GEMV, a decode fusion of kernels.select).

Why: at batch 1 each of kernels/moe_gemv.py's GEMVs runs ~4.3 us longer than its bytes take at the copy ceiling
(H200, b5ee1b4's PDL-off profile: GEMM1 20.1 us for 66 MB, GEMM2 12.25 us for 33 MB), the same few microseconds
for a GEMV twice the size of the other: a cost per launch (the first loads' latency, the programs' ramp and the
tail where the last programs run alone), not per byte. One launch pays it once, and its GEMM2 programs stream
their first W2 tile while the last GEMM1 programs finish.

Layout: the experts' rows are cut into units (pair, j), j < J: GEMM1 rows j*R1 .. of the pair (R1 = 2I/J: bias +
clamped SwiGLU into act, as _gemv1_kernel) and GEMM2 rows j*R2 .. (R2 = H/J: bias and routing weight into y, as
_gemv2_kernel). G programs take units g, g + G, ...: first the GEMM1 part of each, then the GEMM2 parts. GEMM2
needs the pair's whole act row, i.e. all J GEMM1 parts: a GEMM1 part counts itself in the pair's counter once its
act rows are stored (barrier, then a gpu-scope release), and a GEMM2 part first loads its W2 tile, bias and
scales (weights: no kernel writes them), then polls the counter (acquire) until it reads J, then reads act from
L2 (.cg). The pair's last GEMM2 part past its poll zeroes the pair's counters for the next launch. A program
polls only after all of its GEMM1 parts are counted, so the launch completes when its G programs can all be
resident at once: G is at most what the compiled kernel's occupancy (registers, shared memory, warps) holds on the GPU's
SMs (at batch 1 with the default launch every unit has a program of its own: 360 of the H200's 396). (A PDL
successor takes SM slots only once every program here passed its launch_dependents, i.e. is resident.)

The math is the two GEMVs' (moe_gemv.gemv1_tile, gemv2_tile): per-row fp32 sums in one program, rounded to act's bf16
between the GEMMs; the tiles differ, so the fp32 summation order may too. On CPU (the Triton interpreter runs
programs one after another, so a poll would wait forever) the same kernel runs as two launches, GEMM1's parts
then GEMM2's (PHASES 1, then 2: the counters and their reset still run), which is what the CPU tests check.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .moe_gemv import GEMV_MAX_PAIRS, gemv1_tile, gemv2_tile
from .pdl import enter, interpreting, pdl_kwargs

FUSED_MAX_PAIRS = GEMV_MAX_PAIRS  # the counters' size: the most pairs the GEMV path takes


@triton.jit
def _moe_fused_kernel(x, ids, route_w, w1, s1, b1, act, w2, s2, b2, y, cnt, K_TOP, H, INTER, MAXP, PARTS, UNITS,
                      s_xt, s_w1e, s_w1n, s_s1e, s_s1n, s_b1e, s_at, s_w2e, s_w2n, s_s2e, s_s2n, s_b2e, s_yt,
                      FP8: tl.constexpr, ROWS1: tl.constexpr, BLOCK_N1: tl.constexpr, ROWS2: tl.constexpr,
                      BLOCK_K: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, LATE: tl.constexpr,
                      PHASES: tl.constexpr, USE_PDL: tl.constexpr = False):
    # Unit u = (pair u // PARTS, part j = u % PARTS) of UNITS = pairs * PARTS; program g takes units g, g + G, ...
    # (G programs): first all its GEMM1 parts, then its GEMM2 parts.
    # kernels/pdl.py: before any load (ids and route_w come from the router kernel just before) or store
    enter(USE_PDL)
    g = tl.program_id(0)
    step = tl.num_programs(0)
    if PHASES % 2 == 1:
        for u in range(g, UNITS, step):
            pair = u // PARTS
            j = u % PARTS
            e = tl.load(ids + pair).to(tl.int64)
            tok = pair // K_TOP
            for t in tl.static_range(ROWS1 // BLOCK_N1):
                gemv1_tile(x + tok * s_xt, e, j * ROWS1 + t * BLOCK_N1, act + pair.to(tl.int64) * s_at, w1, s1, b1,
                           H, s_w1e, s_w1n, s_s1e, s_s1n, s_b1e, FP8, BLOCK_N1, BLOCK_K, ALPHA, LIMIT, LATE)
            # every thread's act stores are done before the one release below (barrier, then the gpu-scope atomic)
            tl.debug_barrier()
            tl.atomic_add(cnt + pair, 1, sem="release", scope="gpu")  # GEMM1 parts of this pair stored
    if PHASES >= 2:
        for u in range(g, UNITS, step):
            pair = u // PARTS
            j = u % PARTS
            e = tl.load(ids + pair).to(tl.int64)
            rw = tl.load(route_w + pair).to(tl.float32)
            # EARLY + SPIN: the first W2 tile, scales and bias are loaded, then the poll on the pair's GEMM1
            # parts, then act (.cg)
            gemv2_tile(act + pair.to(tl.int64) * s_at, e, rw, j * ROWS2, w2, s2, b2, y + pair.to(tl.int64) * s_yt,
                       INTER, H, s_w2e, s_w2n, s_s2e, s_s2n, s_b2e, FP8, ROWS2, BLOCK_K, LATE, True, USE_PDL,
                       cnt + pair, PARTS, True)
            # past the poll (acquire-ordered after it), counted: the pair's last part resets both counters for
            # the next launch (every part of the pair has read the first by then)
            if tl.atomic_add(cnt + MAXP + pair, 1, sem="relaxed", scope="gpu") == PARTS - 1:
                tl.atomic_xchg(cnt + pair, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(cnt + MAXP + pair, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class FusedLaunch:
    """One fused launch: rows2 GEMM2 rows a program (J = H / rows2 programs a pair, each also 2I / J GEMM1 rows,
    in tiles of block_n1), the K step, warps, stages and the LATE reduction of kernels/moe_gemv.py."""

    rows2: int = 32
    block_n1: int = 32
    block_k: int = 256
    num_warps: int = 8
    num_stages: int = 3
    late: bool = True
    # ptxas' register cap (None: its own choice). The default launch needs 95 registers uncapped (sm_90, triton
    # 3.6), which leaves room for 2 programs an SM, 264 on an H200, fewer than batch 1's 360 units; at 80 it
    # needs 79, spills nothing, and 3 an SM fit: a program for each unit.
    maxnreg: int | None = 80

    def label(self) -> str:
        return (f"fused-r{self.rows2}-n{self.block_n1}-k{self.block_k}-w{self.num_warps}-s{self.num_stages}"
                + ("-late" if self.late else "") + (f"-r{self.maxnreg}" if self.maxnreg else ""))

    def rows1(self, hidden: int, inter: int) -> tuple[int, int] | None:
        """(GEMM1 rows a program, its tile) for experts (hidden, inter), or None where this launch cannot tile
        them: J = hidden / rows2 programs a pair split GEMM1's 2I rows in whole tiles (block_n1, or all of a
        program's rows where fewer), each tile and GEMM2's inside one 128-row block scale."""
        if hidden % self.rows2 or 128 % min(self.rows2, 128):
            return None
        parts = hidden // self.rows2
        if (2 * inter) % parts:
            return None
        r1 = 2 * inter // parts
        bn1 = min(self.block_n1, r1)
        return (r1, bn1) if r1 % bn1 == 0 and 128 % bn1 == 0 else None


DEFAULT_LAUNCH = FusedLaunch()
# Measured per expert shape (hidden, inter) on the H200 (bench/sweep_gemv.py --gemms fused); other shapes use
# DEFAULT_LAUNCH (the tuned GEMV2's tile, GEMM1 in the same tiles). gpt-oss 20b and 120b share (2880, 2880):
# 2026-12-05 at 6788b29, 1 token, 4 pairs, 24 random launches: GEMM1 in one 64-row tile a program (rows1 caps
# block_n1 at a program's rows), a 512 K step, no LATE reduction: 30.5 us against today's two GEMVs' 36.8 us,
# where DEFAULT_LAUNCH lost in the model (kmoe's engine layer: 40.9 against 36.3 us).
TUNED: dict[tuple[int, int], FusedLaunch] = {
    (2880, 2880): FusedLaunch(rows2=32, block_n1=128, block_k=512, num_warps=8, num_stages=4, late=False,
                              maxnreg=80),
}


def fused_launch(hidden: int, inter: int) -> FusedLaunch:
    return TUNED.get((hidden, inter), DEFAULT_LAUNCH)


def new_fused_counters(device) -> torch.Tensor:
    """The fused launch's per-pair counters (zero; each launch leaves them zero). Allocate before any CUDA-graph
    capture (engine/layers/moe.py: one set per layer)."""
    return torch.zeros(2 * FUSED_MAX_PAIRS, dtype=torch.int32, device=device)


@functools.cache
def _sm_room(index: int) -> tuple[int, int, int, int]:
    p = torch.cuda.get_device_properties(index)
    return p.multi_processor_count, p.regs_per_multiprocessor, p.max_threads_per_multi_processor, \
        p.shared_memory_per_multiprocessor


def resident_programs(n_regs: int, shared: int, num_warps: int, index: int) -> int:
    """fit_programs on GPU `index`."""
    return fit_programs(n_regs, shared, num_warps, *_sm_room(index))


def fit_programs(n_regs: int, shared: int, num_warps: int, sms: int, regs: int, threads: int, smem: int) -> int:
    """How many programs of a compiled kernel the GPU holds at once, from its registers (allocated per warp in
    units of 256, from one of the SM's four register-file quarters), shared memory (+1 KB the driver reserves a
    block) and warps; conservative (the quarters' rounding can only lower the CUDA occupancy calculator's
    figure, never raise it): the fused launch's grid stays within it, since its polls could otherwise wait for
    programs that are never resident. sms, regs, threads, smem: the GPU's SMs and each one's registers, threads, shared
    memory."""
    per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = 4 * ((regs // 4) // per_warp) // num_warps
    by_warps = threads // (32 * num_warps)
    by_smem = smem // (shared + 1024) if shared else by_warps
    return sms * max(0, min(by_regs, by_warps, by_smem, 32))


def fused_gemvs(counters: torch.Tensor):
    """moe_gemv.moe_gemv's `fused` hook over these counters (new_fused_counters()): both GEMVs in one launch at
    the expert shape's launch (fused_launch), or False. A hook, so that moe_gemv needs nothing from here."""
    def run(x, ids_flat, k, route_w_flat, ex, alpha, limit, act, y) -> bool:
        return moe_gemv_fused(x, ids_flat, k, route_w_flat, ex, alpha, limit, act, y, counters,
                              fused_launch(ex.hidden, ex.w1.shape[1] // 2))
    return run


def moe_gemv_fused(x, ids_flat, k: int, route_w_flat, ex, alpha: float, limit: float, act: torch.Tensor,
                   y: torch.Tensor, counters: torch.Tensor, launch: FusedLaunch) -> bool:
    """act = GEMV1 (clamped SwiGLU) and y = GEMV2 (route_w * (W2 act + b2)) of every pair (token = pair // k) in
    one launch of at most as many programs as the GPU holds at once (see the module docstring), on CPU (the
    interpreter) as two launches of the same kernel. False, with nothing launched, where this launch cannot tile
    the experts (or no program of it fits an SM): the caller then runs kernels.moe_gemv's two GEMVs."""
    pairs = ids_flat.numel()
    h, inter = ex.hidden, ex.w1.shape[1] // 2
    tiles = launch.rows1(h, inter)
    if tiles is None or pairs > FUSED_MAX_PAIRS or counters.numel() < 2 * FUSED_MAX_PAIRS:
        return False
    parts = h // launch.rows2
    units = pairs * parts
    s1 = ex.s1 if ex.fp8 else ex.w1
    s2 = ex.s2 if ex.fp8 else ex.w2
    args = (x, ids_flat, route_w_flat, ex.w1, s1, ex.b1, act, ex.w2, s2, ex.b2, y, counters, k, h, inter,
            FUSED_MAX_PAIRS, parts, units, x.stride(0), ex.w1.stride(0), ex.w1.stride(1), s1.stride(0), s1.stride(1),
            ex.b1.stride(0), act.stride(0), ex.w2.stride(0), ex.w2.stride(1), s2.stride(0), s2.stride(1),
            ex.b2.stride(0), y.stride(0))
    meta = dict(FP8=ex.fp8, ROWS1=tiles[0], BLOCK_N1=tiles[1], ROWS2=launch.rows2,
                BLOCK_K=launch.block_k, ALPHA=alpha, LIMIT=limit, LATE=launch.late,
                num_warps=launch.num_warps, num_stages=launch.num_stages)
    if x.device.type != "cuda" or interpreting():
        grid = (min(units, CPU_PROGRAMS),)
        _moe_fused_kernel[grid](*args, **meta, PHASES=1)
        _moe_fused_kernel[grid](*args, **meta, PHASES=2)
        return True
    pdl = pdl_kwargs(x.device)
    if launch.maxnreg:
        meta["maxnreg"] = launch.maxnreg
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    key = (index, ex.fp8, x.dtype, act.dtype, y.dtype, tuple(sorted(meta.items())), tuple(pdl))
    room = _ROOM.get(key)
    if room is None:  # compiled once per variant: its registers and shared memory bound the resident programs
        compiled = _moe_fused_kernel.warmup(*args, grid=(1,), **meta, PHASES=3, **pdl)
        compiled._init_handles()  # loads the binary: its register count
        room = _ROOM[key] = resident_programs(compiled.n_regs, compiled.metadata.shared, launch.num_warps, index)
    if room < 1:
        return False
    _moe_fused_kernel[(min(units, room),)](*args, **meta, PHASES=3, **pdl)
    return True


# Programs of the two-phase launches on CPU (the interpreter): fewer than the units, so programs loop over
# several units as on a GPU whose resident programs are fewer than the units (larger decode batches).
CPU_PROGRAMS = 7


_ROOM: dict[tuple, int] = {}  # moe_gemv_fused's variants -> how many of their programs the GPU holds at once
