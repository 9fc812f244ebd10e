"""Tune the grouped FP8 (128x128 block-scale) expert GEMMs of kernels/moe.py on this GPU and write the
table kernels/moe_configs.py serves from (kernels/configs/moe_<device>.json, like vLLM's fused_moe configs).

For each model's expert shape (engine/config.py; both GEMMs: w1 with the fused clamped SwiGLU, w2 with
the routing weight) and each token count (decode 16..512 tokens x top-4; prefill 1024..16384), a
bounded space is swept in two phases: tiles (block_m x block_n, warps, stages) with the knobs off, then
the knobs (group_m program order for L2 reuse, unmasked clamped loads, TMA weight tiles) on the best
tiles of each point. block_m is pruned by the rows each expert gets. Each compiled candidate is checked
once against a float32 torch reference (NaN-poisoned outputs, relative error < 1e-2) before it is timed
(calls back to back in a CUDA graph, median of 5 replays; --timer bench: triton.testing.do_bench).
Inputs are random (never zero: zeros run faster on tensor cores) and routing is skewed as a trained
router's is (a per-expert logit bias).

Prints per point the best config against today's heuristic (TFLOP/s, TB/s of expert weights, share of
the H200 ceilings of bench/kernels.py); writes bench/results/tune-moe-<gpu>-<stamp>.json (+ .png) with
provenance and merges the winners into the config file. Compiles run ahead in worker processes.

    python -m kvrelay.bench.tune_moe --budget-s 270          # both models, every token count, one H200 call
    python -m kvrelay.bench.tune_moe --models gpt-oss-120b --tokens 4096 --budget-s 60
Token counts <= 8 (<= 32 pairs) run the GEMV path in serving, not this kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass

from kvrelay.bench import common as C
from kvrelay.bench import tune_moe_space as S
from kvrelay.kernels import moe_configs as MC
from kvrelay.kernels.moe_configs import GemmConfig, GroupedConfig

ALPHA, LIMIT = 1.702, 7.0
CEIL = {"TB/s": 4.19, "fp8": 1378.0}  # bench/kernels.py's measured H200 ceilings
DEFAULT_TOKENS = "16,32,64,128,256,512,1024,4096,8192,16384"
GEMMS = ("w1", "w2")


class BudgetSpent(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvrelay.bench.tune_moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt-oss-20b,gpt-oss-120b", help="engine/config.py presets or checkpoint dirs")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="token counts (pairs = tokens x top-k)")
    p.add_argument("--budget-s", type=float, default=270.0, help="wall-clock budget from start; stops early "
                   "and still writes what it has")
    p.add_argument("--candidates", default=None, help="explicit space instead of the default, ';'-separated, "
                   "e.g. '64x128-w8-s3;64x128-w8-s3-g8-clamp' (applied to both GEMMs, no knob phase)")
    p.add_argument("--top", type=int, default=2, help="phase-1 winners per point and GEMM that get the knobs")
    p.add_argument("--jobs", type=int, default=None, help="worker processes compiling ahead (default 8 on a GPU, "
                   "0 = compile in line, the default on CPU where the interpreter compiles nothing)")
    p.add_argument("--timer", default="graph", choices=["graph", "bench"], help="graph: calls back to back in a "
                   "CUDA graph (default); bench: triton.testing.do_bench with L2 flushes")
    p.add_argument("--warmup-ms", type=float, default=5.0, help="do_bench's warm-up (--timer bench)")
    p.add_argument("--rep-ms", type=float, default=20.0, help="GPU time to spend timing one config")
    p.add_argument("--check-tokens", type=int, default=64, help="tokens of the reference-check problem")
    p.add_argument("--skew", type=float, default=0.3, help="std of the per-expert routing-logit bias (x sqrt(32/E)); "
                   "0.3: max/mean expert load ~2-2.7x")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(C.DEFAULT_OUT), help="directory for the result JSON and PNG")
    p.add_argument("--config-out", default=None, help="config file or directory (default kernels/configs/); an "
                   "existing file there (or the tracked one) is merged into")
    p.add_argument("--no-config", action="store_true", help="do not write the config file")
    return p


@dataclass(frozen=True)
class Shape:
    model: str
    experts: int
    hidden: int
    inter: int
    top_k: int

    @property
    def key(self) -> str:
        return MC.shape_key(self.experts, self.hidden, self.inter)


def _shapes(models: str) -> list[Shape]:
    out = []
    for name in [m for m in models.split(",") if m]:
        cfg = C.resolve_config(name)
        out.append(Shape(cfg.name, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.experts_per_token))
    return out


def token_order(tokens: list[int]) -> list[int]:
    """Most important first, so a budget that runs out leaves the prefill points measured: 4096, 8192,
    16384, 1024, then the rest from large to small."""
    first = [t for t in (4096, 8192, 16384, 1024) if t in tokens]
    return first + sorted((t for t in tokens if t not in first), reverse=True)


# ---- one sweep ------------------------------------------------------------------------------------------
class Sweep:
    def __init__(self, args, shapes: list[Shape], tokens: list[int], device):
        import torch

        self.args, self.shapes, self.device = args, shapes, device
        self.t0 = time.perf_counter()
        self.budget = args.budget_s
        self.cuda = device.type == "cuda"
        self.explicit = S.parse_candidates(args.candidates) if args.candidates else None
        self.tma = self.cuda and S.tma_usable()
        self.points = [(s, t) for t in token_order(tokens) for s in shapes]
        self.problems: dict = {}
        self.experts = {}  # (hidden, inter) -> (MoEWeights of the most experts asked for, max E)
        gen = torch.Generator(device=device).manual_seed(args.seed)
        for s in shapes:
            key = (s.hidden, s.inter)
            e = max(x.experts for x in shapes if (x.hidden, x.inter) == key)
            if key not in self.experts:
                self.experts[key] = S.make_experts(e, s.hidden, s.inter, device, gen)
        self.checks = {key: S.CheckProblem(self.experts[key], min(16, e.num_experts), args.check_tokens,
                                           max(s.top_k for s in shapes), device, gen)
                       for key, e in self.experts.items()}
        self.gen = gen
        self.rows: list[dict] = []       # every measurement
        self.measured: dict = {}         # (model, tokens, gemm, bm, cfg) -> its row
        self.prep: dict = {}             # (model, tokens, gemm, bm) -> prep_delta's ms
        self.checked: dict = {}          # (hidden, inter, gemm, bm, cfg) -> (ok, err, note)
        self.compiles = 0
        self.skipped: list[dict] = []
        self.pool = None
        self.done_points = 0

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def _spend(self):
        if self.left() <= 0:
            raise BudgetSpent

    def problem(self, shape: Shape, tokens: int):
        key = (shape.model, tokens)
        if key not in self.problems:
            full = self.experts[(shape.hidden, shape.inter)]
            self.problems[key] = S.Problem(S.slice_experts(full, shape.experts), tokens, shape.top_k,
                                           self.args.skew, self.device, self.gen)
        return self.problems[key]

    # -- the candidate space --
    def phase1(self, shape: Shape, tokens: int) -> list[tuple[int, GemmConfig]]:
        rows = tokens * shape.top_k / shape.experts
        if self.explicit is not None:
            keep = [c for c in self.explicit if c[0] in S.allowed_block_m(rows)]
            return keep or list(self.explicit)
        allowed = S.allowed_block_m(rows)
        return ([(bm, GemmConfig(bn, nw, ns)) for bm in allowed for bn, nw, ns in S.TILES[bm]]
                + [(bm, c) for bm in allowed if self.tma for c in S.TMA_TILES.get(bm, ())])

    def phase2(self, shape: Shape, tokens: int, gemm: str) -> list[tuple[int, GemmConfig]]:
        if self.explicit is not None:
            return []
        done = sorted((r for r in self.rows if r["model"] == shape.model and r["tokens"] == tokens
                       and r["gemm"] == gemm and r["phase"] <= 1 and r["ms"] is not None), key=lambda r: r["ms"])
        out = []
        for r in done[: self.args.top]:
            base = GemmConfig(**r["config"])
            for g, masked, tma, sorted_a in S.KNOB_VARIANTS:
                if (tma or sorted_a) and not self.tma:
                    continue
                out.append((r["block_m"], dataclasses.replace(base, group_m=g, masked=masked, tma=tma,
                                                              sorted_a=sorted_a, ws=False)))
        return out

    # -- compiling, checking, timing --
    def submit(self, shape: Shape, gemm: str, bm: int, cfg: GemmConfig) -> None:
        """Queue a compile in the worker processes (CUDA only); the check of that config waits for it and
        then loads the kernel from Triton's cache."""
        if self.pool is not None and (shape.hidden, shape.inter, gemm, bm, cfg) not in self.checked:
            self.pool.submit((shape.hidden, shape.inter, gemm, bm, cfg.label()),
                             (shape.hidden, shape.inter, shape.top_k, gemm, bm, dataclasses.asdict(cfg),
                              str(self.device)))

    def check(self, shape: Shape, gemm: str, bm: int, cfg: GemmConfig) -> tuple[bool, float | None, str]:
        k = (shape.hidden, shape.inter, gemm, bm, cfg)
        if k not in self.checked:
            self._spend()
            hint, label = None, (shape.hidden, shape.inter, gemm, bm, cfg.label())
            if self.pool is not None:
                hint = self.pool.wait(label, timeout_s=max(5.0, min(120.0, self.left() - 5)))
            self.compiles += 1
            chk = self.checks[(shape.hidden, shape.inter)]
            try:  # a worker's error is only a hint (its environment may be at fault): this process decides
                if self.pool is not None and label in self.pool.hashes:  # did the worker compile this kernel?
                    self.pool.compare(label, chk.p.launcher(gemm, bm, cfg, warmup=True)())
                self.checked[k] = chk.check(gemm, bm, cfg)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or launch is recorded
                self.checked[k] = (False, None, f"{type(exc).__name__}: {str(exc)[:160]}"
                                   + (f" (worker: {hint[:80]})" if hint else ""))
        return self.checked[k]

    def measure(self, shape: Shape, tokens: int, gemm: str, bm: int, cfg: GemmConfig, phase: int) -> dict:
        key = (shape.model, tokens, gemm, bm, cfg)
        if key in self.measured:
            return self.measured[key]
        ok, err, note = self.check(shape, gemm, bm, cfg)
        prob = self.problem(shape, tokens)
        ms = prep = None
        if ok:
            self._spend()
            try:
                ms = S.time_ms(prob.launcher(gemm, bm, cfg), self.cuda, self.args.warmup_ms, self.args.rep_ms,
                               self.args.timer)
                if cfg.sorted_a:  # charged what its input preparation costs beyond the gathered path's
                    prep = self.prep_delta(shape, tokens, gemm, bm)
                    ms += prep
            except Exception as exc:  # noqa: BLE001
                ms, note = None, f"{type(exc).__name__}: {str(exc)[:160]}"
        row = {"model": shape.model, "tokens": tokens, "n_pairs": prob.n_pairs, "gemm": gemm, "phase": phase,
               "block_m": bm, "config": dataclasses.asdict(cfg), "label": cfg.label(),
               "ms": None if ms is None else round(ms, 6),
               "check_rel_err": err, "note": note}
        if prep is not None:
            row["prep_delta_ms"] = round(prep, 6)
        row.update(S.rates(prob, gemm, ms, CEIL))
        self.rows.append(row)
        self.measured[key] = row
        return row

    def prep_delta(self, shape: Shape, tokens: int, gemm: str, bm: int) -> float:
        """ms the sorted path's input quantisation takes beyond the gathered path's (Problem.prep_launchers;
        once per point, GEMM and M tile). Included in a sorted_a config's "ms" (and given apart as
        prep_delta_ms), so the table picks the faster MoE, not the faster GEMM alone."""
        key = (shape.model, tokens, gemm, bm)
        if key not in self.prep:
            plain, srt = self.problem(shape, tokens).prep_launchers(gemm, bm)
            args = (self.cuda, self.args.warmup_ms, self.args.rep_ms, self.args.timer)
            self.prep[key] = S.time_ms(srt, *args) - S.time_ms(plain, *args)
        return self.prep[key]

    # -- the whole run --
    def run(self, checkpoint=None) -> None:
        """Points in priority order; each point's knob phase runs after the next point's tile phase, so
        its compiles (queued when its tile phase ended) are ready by then. `checkpoint()` runs after each
        knob phase (the caller saves what there is: a run killed from outside still leaves it)."""
        jobs = self.args.jobs if self.args.jobs is not None else (8 if self.cuda else 0)
        if jobs > 0:
            try:
                self.pool = S.CompilePool(jobs)
            except Exception as exc:  # noqa: BLE001 - e.g. no semaphores in a sandbox: compile in line
                print(f"no compile pool ({type(exc).__name__}: {exc}); compiling in line", flush=True)
        try:
            heur = {(s.model, t): MC.heuristic_config(t * s.top_k, s.experts) for s, t in self.points}
            for s, t in self.points:  # every tile-phase compile up front: the pool works ahead
                h = heur[(s.model, t)]
                for bm, c in [(h.block_m, h.w1), (h.block_m, h.w2)] + self.phase1(s, t):
                    for g in GEMMS:
                        self.submit(s, g, bm, c)
            pending = None
            for s, t in self.points + [(None, None)]:
                knobs = None
                if s is not None:
                    knobs = self._guarded(s, t, self._tile_phase, s, t, heur[(s.model, t)])
                if pending:
                    self._guarded(pending[0], pending[1], self._knob_phase, *pending)
                    if checkpoint is not None:
                        checkpoint()
                pending = (s, t, knobs) if knobs else None
        except BudgetSpent:
            self.skipped.append({"reason": f"budget of {self.budget:.0f} s spent", "at_s": round(self.budget, 1)})
        finally:
            if self.pool is not None:
                self.pool.close()

    def _guarded(self, s: Shape, t: int, fn, *args):
        """fn(*args); anything but the budget running out is recorded against the point and the run goes on."""
        try:
            return fn(*args)
        except BudgetSpent:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory building one point's problem
            self.skipped.append({"model": s.model, "tokens": t, "reason": f"{type(exc).__name__}: {str(exc)[:200]}"})
            print(f"{s.model} {t} tokens: {type(exc).__name__}: {exc}", flush=True)
            return None

    def _tile_phase(self, s: Shape, t: int, h: GroupedConfig) -> dict:
        for g in GEMMS:
            self.measure(s, t, g, h.block_m, getattr(h, g), phase=0)
        for bm, c in self.phase1(s, t):
            for g in GEMMS:
                self.measure(s, t, g, bm, c, phase=1)
        knobs = {g: self.phase2(s, t, g) for g in GEMMS}
        for g, cands in knobs.items():
            for bm, c in cands:
                self.submit(s, g, bm, c)
        return knobs

    def _knob_phase(self, s: Shape, t: int, knobs: dict) -> None:
        self.done_points += 1
        for g, cands in knobs.items():
            for bm, c in cands:
                self.measure(s, t, g, bm, c, phase=2)

    def summary(self) -> list[dict]:
        """Per point: the heuristic, the best config (block_m shared by both GEMMs) and the speed-up."""
        out = []
        for s, t in self.points:
            rows = [r for r in self.rows if r["model"] == s.model and r["tokens"] == t and r["ms"] is not None]
            heur = MC.heuristic_config(t * s.top_k, s.experts)
            h = {g: next((r for r in rows if r["phase"] == 0 and r["gemm"] == g), None) for g in GEMMS}
            best = None
            for bm in sorted({r["block_m"] for r in rows}):
                pick = {g: min((r for r in rows if r["block_m"] == bm and r["gemm"] == g), key=lambda r: r["ms"],
                               default=None) for g in GEMMS}
                if all(pick.values()) and (best is None or sum(p["ms"] for p in pick.values()) <
                                           sum(p["ms"] for p in best.values())):
                    best = pick
            if best is None:
                continue
            prob = self.problems[(s.model, t)]
            cfg = GroupedConfig(best["w1"]["block_m"], GemmConfig(**best["w1"]["config"]),
                                GemmConfig(**best["w2"]["config"]))
            total = sum(p["ms"] for p in best.values())
            h_total = sum(p["ms"] for p in h.values()) if all(h.values()) else None
            out.append({"model": s.model, "shape": s.key, "tokens": t, "n_pairs": prob.n_pairs,
                        "rows_per_expert": round(prob.n_pairs / s.experts, 2), "load": prob.load_stats,
                        "heuristic": {"config": heur.to_json(), "label": heur.label(), "ms": h_total,
                                      **{g: h[g] and {"ms": h[g]["ms"], **S.rates(prob, g, h[g]["ms"], CEIL)}
                                         for g in GEMMS}},
                        "best": {"config": cfg.to_json(), "label": cfg.label(), "ms": total,
                                 **{g: {"ms": best[g]["ms"], **S.rates(prob, g, best[g]["ms"], CEIL)} for g in GEMMS},
                                 **S.rates(prob, "both", total, CEIL)},
                        "speedup": round(h_total / total, 3) if h_total else None})
        return out


# ---- output ---------------------------------------------------------------------------------------------
def print_table(points: list[dict]) -> None:
    from rich.table import Table

    t = Table(title="grouped FP8 expert GEMMs: tuned vs heuristic (w1 = SwiGLU GEMM, w2 = routing-weight GEMM)")
    for col in ("model", "tokens", "pairs", "rows/E", "GEMM", "heuristic us", "best us", "TFLOP/s", "fp8 share",
                "TB/s", "bw share", "speed-up", "best config"):
        t.add_column(col)
    for p in points:
        for g in (*GEMMS, "both"):
            b = p["best"] if g == "both" else p["best"][g]
            h = p["heuristic"]["ms"] if g == "both" else (p["heuristic"][g] or {}).get("ms")
            t.add_row(p["model"], str(p["tokens"]), str(p["n_pairs"]), str(p["rows_per_expert"]), g,
                      f"{h * 1e3:.1f}" if h else "-", f"{b['ms'] * 1e3:.1f}", f"{b['TFLOP/s']:.0f}",
                      f"{b['fp8_share']:.0%}", f"{b['TB/s']:.2f}", f"{b['bw_share']:.0%}",
                      f"{h / b['ms']:.2f}x" if h else "-",
                      p["best"]["label"] if g == "both" else GemmConfig(**p["best"]["config"][g]).label())
    C.console().print(t)


def plot(points: list[dict]):
    fig, axes = C.new_figure(ncols=3, figsize=(17, 4.5))
    for model in dict.fromkeys(p["model"] for p in points):
        ps = sorted((p for p in points if p["model"] == model), key=lambda p: p["tokens"])
        x = [p["tokens"] for p in ps]
        slow = [p["heuristic"]["ms"] and p["best"]["ms"] / p["heuristic"]["ms"] for p in ps]  # heuristic's rate
        for ax, unit in ((axes[0], "TFLOP/s"), (axes[1], "TB/s")):
            ax.plot(x, [p["best"][unit] for p in ps], "o-", label=f"{model} tuned")
            ax.plot(x, [f and p["best"][unit] * f for p, f in zip(ps, slow)], "x--", label=f"{model} heuristic")
        axes[2].plot(x, [p["speedup"] for p in ps], "o-", label=model)
    axes[0].axhline(CEIL["fp8"], color="k", lw=0.6, label="fp8 ceiling")
    axes[0].axhline(600, color="r", lw=0.6, ls=":", label="issue 11 target (600)")
    axes[1].axhline(CEIL["TB/s"], color="k", lw=0.6, label="copy ceiling")
    axes[0].set(ylabel="TFLOP/s (w1 + w2)", title="grouped FP8 expert GEMMs: compute")
    axes[1].set(ylabel="TB/s of touched expert weights", title="memory (decode sizes)")
    axes[2].set(ylabel="tuned / heuristic speed-up", title="speed-up")
    for ax in axes:
        ax.set(xscale="log", xlabel="tokens (x top-k pairs)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return fig


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    sweep = Sweep(args, _shapes(args.models), C.parse_ints(args.tokens), device)
    print(f"tune_moe on {gpu}: {len(sweep.points)} points, budget {args.budget_s:.0f} s, "
          f"{'explicit' if sweep.explicit else 'default'} space, TMA {'on' if sweep.tma else 'off'}", flush=True)
    env = C.env_info(device, "kvrelay.bench.tune_moe", argv)
    stem = f"tune-moe-{C.slug(gpu)}-{C.stamp()}"

    def save(final: bool) -> dict:
        points = sweep.summary()
        payload = {"kind": "tune-moe", "env": env, "ceilings": CEIL, "gpu": gpu, "args": dict(vars(args)),
                   "wall_s": round(time.perf_counter() - sweep.t0, 1), "complete": final,
                   "checked_configs": sweep.compiles, "points": points, "measurements": sweep.rows,
                   "skipped": sweep.skipped, "space": S.describe(), "config_file": None}
        if points and not args.no_config:
            try:
                payload["config_file"] = str(S.write_config(args.config_out, gpu, sweep.shapes, points, env, stem))
            except Exception as exc:  # noqa: BLE001 - the result JSON still holds every winner
                payload["config_error"] = f"{type(exc).__name__}: {exc}"
                print(f"config not written: {payload['config_error']}", flush=True)
        fig = None
        if final and points:
            try:
                fig = plot(points)
            except Exception as exc:  # noqa: BLE001
                print(f"plot failed: {exc}", flush=True)
        payload["files"] = C.save_result(args.out, stem, payload, fig)
        return payload

    def checkpoint():
        try:
            save(final=False)
        except Exception as exc:  # noqa: BLE001 - the final save tries again
            print(f"checkpoint not saved: {exc}", flush=True)

    sweep.run(checkpoint)
    payload = save(final=True)
    if payload["points"]:
        try:
            print_table(payload["points"])
        except Exception as exc:  # noqa: BLE001
            print(f"table failed: {exc}", flush=True)
    if payload["config_file"]:
        print(f"config: {payload['config_file']}")
    print(f"results: {payload['files']}  ({payload['wall_s']} s, {sweep.compiles} configs compiled and checked"
          + "".join(f"; {x['reason']}" for x in sweep.skipped) + ")")
    return payload


if __name__ == "__main__":
    sys.exit(C.run_cli(main))
