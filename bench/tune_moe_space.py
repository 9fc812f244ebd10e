"""The pieces of bench/tune_moe.py: the candidate space and its pruning, the random problems and their
float32 reference check, timing and rates, compiling ahead in worker processes, and the config file."""

from __future__ import annotations

import functools
import json
import math
import multiprocessing as mp
import os
import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrelay.kernels import moe
from kvrelay.kernels import moe_configs as MC
from kvrelay.kernels.fp8 import dequantize_weight_block128, quantize_act_1x128
from kvrelay.kernels.fp8_gemm import quantize_act_1x128 as quantize_act_1x128_engine
from kvrelay.kernels.moe_configs import GemmConfig
from kvrelay.kernels.reference import clamped_swiglu, route_topk

ALPHA, LIMIT = 1.702, 7.0
CHECK_TOL = 1e-2

# Phase 1: (block_n, num_warps, num_stages) per block_m. Shared memory per stage is (block_m + block_n) x
# 128 bytes of fp8, so every entry stays under ~150 KB; small M tiles (decode, memory-bound) get deeper
# pipelines, large ones (prefill, compute-bound) wider N tiles and 8 warps. Each K step waits for its MMA
# before scaling the block's sum into the accumulator (triton issues no MMA while a result is outstanding),
# so a CTA's tensor cores idle during its promotion; other CTAs on the SM fill that gap: 64x128 with 3 or 2
# stages (72 / 48 KB) fits 3 / 4 CTAs an SM where 4 stages (96 KB) fit 2.
TILES: dict[int, tuple[tuple[int, int, int], ...]] = {
    16: ((64, 4, 4), (128, 4, 4), (128, 4, 5), (64, 4, 6)),
    32: ((64, 4, 4), (128, 4, 4), (128, 4, 5), (128, 8, 4)),
    64: ((128, 4, 4), (128, 8, 3), (128, 8, 4), (256, 8, 3), (64, 4, 4), (128, 4, 3), (128, 4, 2)),
    128: ((128, 8, 3), (128, 8, 4), (256, 8, 3), (128, 4, 3)),
}
# Phase 1 too, where host TMA descriptors work: tiles whose occupancy needs the TMA weight path. 64x128 on 4
# warps with 3 stages takes 164 registers a thread and 74 KB with TMA weight tiles (3 CTAs an SM: 63 K of 64 K
# registers, 224 of 228 KB), but 185 registers with pointer loads (2 CTAs), so phase 1's knob-less form of it
# says nothing of the 3-CTA kernel and phase 2 would only reach it if that form ranked in the top (sm_90,
# triton 3.6, cuobjdump -res-usage; 2026-12-05).
TMA_TILES: dict[int, tuple[GemmConfig, ...]] = {
    64: (GemmConfig(128, 4, 3, group_m=16, masked=False, tma=True),
         GemmConfig(128, 4, 3, group_m=8, masked=False, tma=True)),
}
# (Not the warp-specialised kernel, kernels/moe_ws.py: it hung on the H200 at 806a8d7, 2026-12-05.)
# Phase 2, on each point's best phase-1 tiles: (group_m, masked, tma). A 20b prefill of 16k tokens gives each
# expert ~32 M blocks of 64 rows: a group of 8 still reads every weight tile 4 times from HBM, 16 twice.
# (group_m, masked, tma, sorted_a): sorted_a reads the input rows in the sort's slots as TMA tiles
# (kernels/moe_sort.quantize_sorted for GEMM1; GEMM1 then writes its output so for GEMM2).
KNOB_VARIANTS: tuple[tuple[int, bool, bool, bool], ...] = (
    (8, True, False, False), (8, False, False, False), (8, False, True, False), (16, False, True, False),
    (1, False, False, False), (16, False, True, True), (8, False, True, True))
_CAND = re.compile(r"^(\d+)x(\d+)-w(\d+)-s(\d+)(?:-g(\d+))?(-clamp)?(-tma)?(-sa)?(-ws)?$")


def allowed_block_m(rows_per_expert: float) -> list[int]:
    """M tiles worth trying for this many rows per expert (on average): none larger than the rows
    rounded up to a power of two (a 128-row tile over 8 rows is 94% padding), and at prefill none under
    32 (>= 128 rows) or 64 (>= 512 rows), which re-read each expert's weights once per M block."""
    hi = max(16, 1 << max(0, math.ceil(math.log2(max(rows_per_expert, 1)))))
    lo = 16 if rows_per_expert < 128 else 32 if rows_per_expert < 512 else 64
    return [bm for bm in TILES if lo <= bm <= hi]


def parse_candidates(text: str) -> list[tuple[int, GemmConfig]]:
    """'64x128-w8-s3;64x128-w8-s3-g8-clamp-tma;128x128-w4-s3-g16-clamp-tma-sa-ws' -> [(block_m, GemmConfig), ...]
    (-sa: sorted_a, -ws: the warp-specialised kernel; GemmConfig.label's suffixes)."""
    out = []
    for part in [p.strip() for p in text.split(";") if p.strip()]:
        m = _CAND.match(part)
        if not m:
            raise SystemExit(f"--candidates: {part!r} is not BMxBN-wW-sS[-gG][-clamp][-tma][-sa][-ws]")
        bm, bn, nw, ns = (int(m[i]) for i in range(1, 5))
        out.append((bm, GemmConfig(bn, nw, ns, int(m[5] or 1), masked=not m[6], tma=bool(m[7]),
                                   sorted_a=bool(m[8]), ws=bool(m[9]))))
    return out


def tma_usable() -> bool:
    return moe.tma_available() and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def describe() -> dict:
    return {"tiles": {str(k): v for k, v in TILES.items()},
            "tma_tiles": {str(k): [c.label() for c in v] for k, v in TMA_TILES.items()},
            "knob_variants(group_m,masked,tma,sorted_a)": KNOB_VARIANTS,
            "block_m_rule": allowed_block_m.__doc__.split("\n")[0], "check_tol": CHECK_TOL}


# ---- problems -------------------------------------------------------------------------------------------
def make_experts(num_experts: int, hidden: int, inter: int, device, gen) -> moe.MoEWeights:
    """Random FP8 experts of the real shape (e4m3 values ~N(0, 64) clamped, block scales in [1e-4, 2e-4],
    so dequantised weights ~0.01 and GEMM outputs O(1)), generated a few experts at a time."""
    f8 = torch.float8_e4m3fn

    def fp8_stack(n, k):
        w = torch.empty(num_experts, n, k, dtype=f8, device=device)
        for e0 in range(0, num_experts, 8):
            e1 = min(e0 + 8, num_experts)
            w[e0:e1] = (torch.randn(e1 - e0, n, k, generator=gen, device=device) * 64).clamp(-448, 448).to(f8)
        return w

    def scales(n, k):
        return torch.rand(num_experts, -(-n // 128), -(-k // 128), generator=gen, device=device) * 1e-4 + 1e-4

    w1, w2 = fp8_stack(2 * inter, hidden), fp8_stack(hidden, inter)
    b1 = torch.randn(num_experts, 2 * inter, generator=gen, device=device).bfloat16()
    b2 = torch.randn(num_experts, hidden, generator=gen, device=device).bfloat16()
    return moe.MoEWeights.from_fp8(w1, scales(2 * inter, hidden), b1, w2, scales(hidden, inter), b2)


def slice_experts(ex: moe.MoEWeights, n: int) -> moe.MoEWeights:
    """The first n experts (views: one set of random weights serves both models)."""
    return moe.MoEWeights(ex.w1[:n], ex.b1[:n], ex.w2[:n], ex.b2[:n], ex.s1[:n], ex.s2[:n], ex.hidden, ex.inter)


def _quant(v: torch.Tensor, kp: int):
    return quantize_act_1x128(torch.nn.functional.pad(v, (0, kp - v.shape[1])))


class Problem:
    """One (experts, token count): skewed routing, quantised GEMM inputs, outputs, sorts per block_m."""

    def __init__(self, ex: moe.MoEWeights, tokens: int, top_k: int, skew: float, device, gen):
        e, h, i = ex.num_experts, ex.hidden, ex.inter
        self.ex, self.tokens, self.k, self.n_pairs = ex, tokens, top_k, tokens * top_k
        # A trained (load-balanced) router still favours some experts: a fixed per-expert bias on the logits
        # (the same for every token count of a model), scaled by sqrt(32 / E) since a top-4 of more experts
        # is a sharper pick: skew 0.3 gives a max/mean expert load of ~2x (E=32) to ~2.7x (E=128) at
        # 4096 tokens, reported in load_stats.
        bias = torch.randn(e, generator=torch.Generator().manual_seed(e)).to(device) * skew * (32 / e) ** 0.5
        logits = torch.randn(tokens, e, generator=gen, device=device) + bias
        self.rw, self.ids = route_topk(logits.bfloat16(), top_k)
        self.rw_flat = self.rw.reshape(-1)
        counts = torch.bincount(self.ids.reshape(-1), minlength=e).float()
        self.touched = int((counts > 0).sum())
        self.load_stats = {"max_over_mean": round(float(counts.max() / counts.mean()), 2),
                           "active_experts": self.touched}
        self.x = x = torch.randn(tokens, h, generator=gen, device=device).bfloat16()
        self.xq, self.xs = _quant(x, ex.w1.shape[2])
        a = torch.randn(self.n_pairs, i, generator=gen, device=device).bfloat16()
        self.aq, self.as_ = _quant(a, ex.w2.shape[2])
        self.act = torch.empty(self.n_pairs, i, dtype=torch.bfloat16, device=device)
        self.y = torch.empty(self.n_pairs, h, dtype=torch.float32, device=device)
        self._sorts: dict[int, tuple] = {}

    def sort(self, block_m: int):
        if block_m not in self._sorts:
            self._sorts[block_m] = moe.sort_by_expert(self.ids, self.ex.num_experts, block_m)[:2]
        return self._sorts[block_m]

    def sorted_inputs(self, gemm: str, block_m: int):
        """A GEMM's FP8 input in the sort's slots (GemmConfig.sorted_a), from the same rows as the gathered
        input: GEMM1's quantised straight into the slots as the engine does (the same bits as xq's rows),
        GEMM2's rows of aq placed in them (what GEMM1's sorted output then quantised holds), padding zeros."""
        key = (gemm, block_m)
        if key not in self._sorts:
            sid, be = self.sort(block_m)
            if gemm == "w1":
                self._sorts[key] = moe.quantize_sorted(self.x, sid, be, self.ex.num_experts, self.n_pairs, self.k,
                                                       self.ex.w1.shape[2])
            else:
                live = sid < self.n_pairs
                src = torch.where(live, sid, 0).long()
                q = torch.where(live[:, None], self.aq[src].view(torch.uint8), 0).view(self.aq.dtype)
                self._sorts[key] = (q.contiguous(), torch.where(live[:, None], self.as_[src], 1e-12 / 448))
        return self._sorts[key]

    def prep_launchers(self, gemm: str, block_m: int):
        """(the gathered path's input quantisation, the sorted path's) of one GEMM, as the engine runs them
        (kernels/moe._moe_grouped): GEMM1's tokens' rows, plain or into the slots; GEMM2's bf16 rows, one per
        pair or one per slot (GEMM1's sorted output, the used blocks only). The tuner charges a sorted_a config
        the difference, so GEMM-only timings do not favour it for work moved out of the GEMM."""
        sid, be = self.sort(block_m)
        ex = self.ex
        if gemm == "w1":
            return (lambda: quantize_act_1x128_engine(self.x, ex.w1.shape[2], m_major=False),
                    lambda: moe.quantize_sorted(self.x, sid, be, ex.num_experts, self.n_pairs, self.k, ex.w1.shape[2]))
        key = ("act_slots", block_m)
        if key not in self._sorts:
            self._sorts[key] = torch.zeros(sid.numel(), ex.inter, dtype=torch.bfloat16, device=sid.device)
        slots = self._sorts[key]
        return (lambda: quantize_act_1x128_engine(self.act, ex.w2.shape[2], m_major=False),
                lambda: moe.quantize_sorted(slots, sid, be, ex.num_experts, self.n_pairs, 1, ex.w2.shape[2],
                                            slot_rows=True))

    def launcher(self, gemm: str, block_m: int, cfg: GemmConfig, *, warmup: bool = False):
        sid, be = self.sort(block_m)
        ex = self.ex
        if gemm == "w1":
            xq, xs = self.sorted_inputs("w1", block_m) if cfg.sorted_a else (self.xq, self.xs)
            args = (xq, xs, ex.w1, ex.s1, ex.b1, None, self.act, sid, be, self.n_pairs, self.k,
                    ex.w1.shape[1], ex.w1.shape[2], True, True)
        else:
            aq, as_ = self.sorted_inputs("w2", block_m) if cfg.sorted_a else (self.aq, self.as_)
            args = (aq, as_, ex.w2, ex.s2, ex.b2, self.rw_flat, self.y, sid, be, self.n_pairs, 1,
                    ex.hidden, ex.w2.shape[2], True, False)
        return lambda: moe._grouped_gemm(*args, ALPHA, LIMIT, block_m, cfg, warmup=warmup)

    def output(self, gemm: str) -> torch.Tensor:
        return self.act if gemm == "w1" else self.y


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-12))


class CheckProblem:
    """A small problem of the real N and K (few experts, skewed routing: empty experts, several M blocks
    and partial tiles) with float32 references of both GEMMs from the same quantised inputs, computed
    apart from the kernel: dequantised operands, one matmul per expert, kernels/reference.py's SwiGLU."""

    def __init__(self, ex_full: moe.MoEWeights, experts: int, tokens: int, top_k: int, device, gen):
        self.p = p = Problem(slice_experts(ex_full, experts), tokens, top_k, 1.0, device, gen)
        ex = p.ex
        w1 = dequantize_weight_block128(ex.w1, ex.s1, torch.float32)
        w2 = dequantize_weight_block128(ex.w2, ex.s2, torch.float32)
        x = p.xq.float() * p.xs.repeat_interleave(128, 1)
        a = p.aq.float() * p.as_.repeat_interleave(128, 1)
        flat = p.ids.reshape(-1)
        self.ref = {"w1": torch.zeros(p.act.shape, device=device), "w2": torch.zeros(p.y.shape, device=device)}
        for e in range(ex.num_experts):
            pairs = (flat == e).nonzero().flatten()
            if pairs.numel():
                h = x[pairs // top_k] @ w1[e].T + ex.b1[e].float()
                self.ref["w1"][pairs] = clamped_swiglu(h, ALPHA, LIMIT)
                self.ref["w2"][pairs] = p.rw_flat[pairs].float()[:, None] * (a[pairs] @ w2[e].T + ex.b2[e].float())

    def check(self, gemm: str, block_m: int, cfg: GemmConfig) -> tuple[bool, float, str]:
        out = self.p.output(gemm)
        out.fill_(float("nan"))  # a tile the kernel skips stays NaN and fails the check
        self.p.launcher(gemm, block_m, cfg)()
        err = rel_err(out, self.ref[gemm])
        return err < CHECK_TOL, err, "" if err < CHECK_TOL else f"check failed: rel err {err:.3g} >= {CHECK_TOL}"


def time_ms(fn, cuda: bool, warmup_ms: float, rep_ms: float, timer: str = "graph") -> float:
    """Milliseconds per call. "graph": calls back to back inside a CUDA graph, median of 5 replays (what
    decode runs; no launch overhead in the number, so a config with a costlier host-side launch is not
    penalised for it). "bench" (also the fallback): triton.testing.do_bench, median, L2 flushed between
    calls. Either way the weights of every point (>= 0.2 GB) are far larger than the 60 MB L2."""
    if not cuda:
        t0 = time.perf_counter()  # the interpreter (CPU tests): plumbing only, the number means nothing
        fn()
        return (time.perf_counter() - t0) * 1e3
    if timer == "graph":
        try:
            return _graph_ms(fn, rep_ms)
        except Exception as exc:  # noqa: BLE001 - e.g. a capture error: time it eagerly instead
            torch.cuda.synchronize()
            print(f"graph timing failed ({type(exc).__name__}: {str(exc)[:100]}); do_bench instead", flush=True)
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _graph_ms(fn, target_ms: float, replays: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    est = max(start.elapsed_time(end) / 3, 1e-3)
    calls = max(1, min(256, math.ceil(target_ms / 4 / est)))  # one replay ~ a quarter of the target
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[len(times) // 2]


def rates(p: Problem, gemm: str, ms: float | None, ceil: dict) -> dict:
    """TFLOP/s (real H and I, no padding) and TB/s of the touched experts' fp8 weights, with shares."""
    h, i = p.ex.hidden, p.ex.inter
    flops = {"w1": 2 * p.n_pairs * 2 * i * h, "w2": 2 * p.n_pairs * h * i}
    nbytes = {"w1": p.touched * p.ex.w1[0].numel(), "w2": p.touched * p.ex.w2[0].numel()}
    f = flops["w1"] + flops["w2"] if gemm == "both" else flops[gemm]
    b = nbytes["w1"] + nbytes["w2"] if gemm == "both" else nbytes[gemm]
    if not ms:
        return {"TFLOP/s": None, "fp8_share": None, "TB/s": None, "bw_share": None}
    tf, tb = f / ms / 1e9, b / ms / 1e9
    return {"TFLOP/s": round(tf, 1), "fp8_share": round(tf / ceil["fp8"], 3), "TB/s": round(tb, 3),
            "bw_share": round(tb / ceil["TB/s"], 3)}


# ---- compiling ahead ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def warm_problem(hidden: int, inter: int, top_k: int, device: str) -> Problem:
    """The compile workers' problem: the tuner's dtypes and strides at the smallest size, top_k experts
    (a top-k routing needs at least k to pick from) and 4 tokens. The kernel does not specialise on the
    expert count or the pair and block counts (do_not_specialize), and no stride depends on them, so a
    config compiled for this problem is the one the parent loads from Triton's cache."""
    gen = torch.Generator(device=device).manual_seed(0)
    return Problem(make_experts(top_k, hidden, inter, device, gen), 4, top_k, 0.0, device, gen)


@dataclass(frozen=True)
class WarmResult:
    """What a compile worker sends back: the error (None: compiled) with its traceback's tail, and the
    compiled kernel's hash (None under the interpreter), which the parent compares with its own."""

    key: tuple
    error: str | None
    seconds: float
    traceback: str = ""
    kernel_hash: str | None = None


def _tb_tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def warm(job: tuple) -> WarmResult:
    """CompilePool worker: compile one config for the tuner's exact argument types and strides into
    Triton's disk cache (warmup: nothing is launched)."""
    hidden, inter, top_k, gemm, bm, cfg_d, device = job
    cfg = GemmConfig(**cfg_d)
    key = (hidden, inter, gemm, bm, cfg.label())
    t0 = time.perf_counter()
    try:
        if device.startswith("cuda:"):
            torch.cuda.set_device(device)  # Triton compiles for the current device: the parent's
        kernel = warm_problem(hidden, inter, top_k, device).launcher(gemm, bm, cfg, warmup=True)()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which skips the config
        return WarmResult(key, f"{type(exc).__name__}: {str(exc)[:160]}", time.perf_counter() - t0,
                          _tb_tail(traceback.format_exc()))
    return WarmResult(key, None, time.perf_counter() - t0, kernel_hash=getattr(kernel, "hash", None))


class CompilePool:
    """Triton compiles are single-threaded: `n` spawned processes compile queued configs into Triton's disk
    cache while the parent measures, and the parent's first launch of a config loads it from there. If
    anything goes wrong here (a hung or dead pool), the pool is dropped and configs compile in line."""

    def __init__(self, n: int):
        self.n = min(n, os.cpu_count() or 1)
        self.pool = mp.get_context("spawn").Pool(self.n)
        self.futures: dict = {}
        self.hashes: dict = {}  # key -> the worker's kernel hash
        self.ok = True
        self.done = self.failed = self.not_reused = 0
        self.t0 = time.perf_counter()

    def _drop(self, why: str, tb: str) -> None:
        tail = "\n  worker traceback (tail):\n    " + tb.replace("\n", "\n    ") if tb else ""
        print(f"compile pool dropped: {why}; compiling in line{tail}", flush=True)
        self.ok = False

    def submit(self, key: tuple, job: tuple) -> None:
        if self.ok and key not in self.futures:
            try:
                self.futures[key] = self.pool.apply_async(warm, (job,))
            except Exception as exc:  # noqa: BLE001 - a broken pool: compile in line from here on
                self._drop(f"{type(exc).__name__}: {exc}", "")

    def wait(self, key: tuple, timeout_s: float) -> str | None:
        """The compile error of `key`, or None (compiled, or not compiled here: the parent compiles it)."""
        fut = self.futures.get(key)
        if fut is None or not self.ok:
            return None
        try:
            res: WarmResult = fut.get(timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - incl. multiprocessing.TimeoutError
            # an exception raised in the worker outside warm() carries the worker's traceback as its cause
            self._drop(f"after {self.done} compiles ({type(exc).__name__}: {exc})",
                       _tb_tail(str(getattr(exc.__cause__, "tb", ""))))
            return None
        self.done += 1
        self.failed += bool(res.error)
        if res.kernel_hash:
            self.hashes[key] = res.kernel_hash
        if self.failed == self.done >= 4:
            self._drop(f"its first {self.done} compiles all failed ({res.error})", res.traceback)
        return res.error

    def compare(self, key: tuple, kernel) -> None:
        """`kernel`: what this process compiled (or loaded) for `key`. A different hash than the worker's
        means a specialisation differs between their problems: the pool's compiles are wasted."""
        mine, theirs = getattr(kernel, "hash", None), self.hashes.get(key)
        if mine and theirs and mine != theirs:
            self.not_reused += 1
            if self.not_reused == 1:
                print(f"compile pool: the workers' kernel for {key} is not this process's ({theirs[:12]} != "
                      f"{mine[:12]}): their compiles are not reused", flush=True)

    def close(self) -> None:
        print(f"compile pool: {self.done} configs ({self.failed} failed"
              + (f", {self.not_reused} not reused" if self.not_reused else "")
              + f") in {self.n} processes, {time.perf_counter() - self.t0:.0f} s", flush=True)
        try:
            self.pool.terminate()
        except Exception as exc:  # noqa: BLE001 - results are in hand; a pool that will not stop is not fatal
            print(f"compile pool did not terminate cleanly: {exc}", flush=True)


# ---- the config file ------------------------------------------------------------------------------------
def _dump(o, indent: int = 0) -> str:
    """JSON with one line per innermost object (a GEMM config): a re-tuned file diffs bucket by bucket."""
    if isinstance(o, dict) and any(isinstance(v, (dict, list)) for v in o.values()):
        pad = " " * (indent + 1)
        body = ",\n".join(f"{pad}{json.dumps(k)}: {_dump(v, indent + 1)}" for k, v in o.items())
        return "{\n" + body + "\n" + " " * indent + "}"
    return json.dumps(o)


def write_config(config_out: str | None, gpu: str, shapes, points: list[dict], env: dict, stem: str) -> Path:
    """Merge the points' winners into the config file (per shape, per pair-count bucket; buckets not
    re-measured are kept) and write it; the result is checked by the reader before it is written."""
    name = MC.file_name(gpu)
    if config_out is None:
        target = MC.CONFIG_DIR / name
    else:
        target = Path(config_out)
        if target.is_dir() or config_out.endswith("/"):
            target = target / name
    base_path = next((p for p in (target, MC.CONFIG_DIR / name) if p.is_file()), None)
    data = {"version": MC.VERSION, "device": gpu, "kernel": MC.KERNEL, "shapes": {}}
    if base_path is not None:
        try:
            raw = json.loads(base_path.read_text())
            MC.parse(base_path, raw)
            data = raw
        except (ValueError, MC.MoEConfigError) as exc:
            print(f"config: not merging into {base_path} ({exc}); writing a fresh file", flush=True)
    prov = {k: env.get(k) for k in ("git_commit", "git_dirty", "timestamp", "torch", "triton", "gpu", "command")}
    for s in shapes:
        mine = [p for p in points if p["model"] == s.model]
        if not mine:
            continue
        entry = data["shapes"].setdefault(s.key, {"buckets": {}})
        entry.update(model=s.model, provenance=dict(prov, result=f"{stem}.json"))
        for p in mine:
            entry["buckets"][str(p["n_pairs"])] = {
                **p["best"]["config"],
                "ms": {"w1": p["best"]["w1"]["ms"], "w2": p["best"]["w2"]["ms"], "heuristic": p["heuristic"]["ms"]},
                "note": f"{p['tokens']} tokens; {str(prov['git_commit'])[:7]} {prov['timestamp']}"}
        entry["buckets"] = dict(sorted(entry["buckets"].items(), key=lambda kv: int(kv[0])))
    MC.parse(target, data)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(_dump(data) + "\n")
    MC.clear_cache()
    return target
