"""bench/RESULTS.md's tuning and profiling tables (bench/results_md.render calls these after the kernels):
the grouped FP8 expert GEMM tuner (bench/tune_moe.py) against today's heuristic and issue 11's target, the
decode GEMV launch sweeps (bench/sweep_gemv.py: the MoE GEMVs, and with --dense the FP8 attention-projection
GEMV against cuBLAS) against the copy ceiling, and the decode step profiles
(bench/profile_decode.py: where a step's time goes) and the prefill profiles (bench/profile_prefill.py: where a
batch-1 prefill's time goes, by kernel category). Every figure is read from the result JSONs; only
qualifying results (bench/provenance.py) are tabled, each row beside its commit and date.
"""

from __future__ import annotations

import functools
import subprocess

from kvrelay.bench import common as C
from kvrelay.bench.profile_prefill import CATEGORIES, OTHER
from kvrelay.bench.provenance import Collection, Result, newest_per_point
from kvrelay.bench.results_fmt import fmt, head, recheck_text, sub, table

TABLED_KINDS = ("tune-moe", "sweep-gemv", "sweep-gemv-dense", "profile", "profile-prefill")
# Issue 11: the grouped FP8 expert GEMMs (both, one MoE layer) at >= 600 TFLOP/s from 4,096 tokens on.
TARGET_MOE_TFLOPS = 600.0
TARGET_MOE_MIN_TOKENS = 4096
TOP_KERNELS = 5
# Before this commit profile_decode counted each aten op beside the kernels it launched (cuBLAS and aten
# kernels twice in kernel ms and launches); from it on, device events only.
PROFILE_COUNT_FIX = "12c5eaf"


def _gpu(r: Result) -> str:
    return r.data.get("gpu") or r.env.get("gpu") or r.env.get("device", "?")


def _runs_note(runs: list[Result], extra=lambda r: "") -> str:
    return "Runs: " + "; ".join(f"{r.name} at {r.source}{extra(r)}" for r in runs) + "."


# ---- MoE expert GEMM tuner ---------------------------------------------------------------------------
def tune_moe_points(col: Collection) -> dict:
    """(GPU, model, tokens) -> (newest qualifying tune_moe run with that point, the point)."""
    return newest_per_point(col.qualifying("tune-moe"), lambda r: r.data.get("points", []),
                            lambda r, p: (_gpu(r), p["model"], p["tokens"]))


def _target(tokens: int, tflops) -> str:
    if tokens < TARGET_MOE_MIN_TOKENS:
        return "-"
    if tflops is None:
        return "not measured"
    if tflops >= TARGET_MOE_TFLOPS:
        return f"met ({tflops / TARGET_MOE_TFLOPS:.0%})"
    return f"not met ({tflops / TARGET_MOE_TFLOPS:.0%}, {TARGET_MOE_TFLOPS - tflops:.0f} TFLOP/s short)"


def tune_moe_section(col: Collection) -> list[str]:
    chosen = tune_moe_points(col)
    out = head("MoE expert GEMMs: tuned against today's heuristic (`bench.tune_moe`)",
               "The grouped FP8 (128x128 block-scale) expert GEMMs of one MoE layer (w1 with the clamped SwiGLU, "
               "w2 with the routing weight) at each token count (pairs = tokens x top-4, skewed routing), the "
               "heuristic's config (kernels/moe_configs.heuristic_config) against the best config the tuner found "
               "(both GEMMs share block_m; us = w1 + w2). TFLOP/s over the real shapes, share of the run's fp8 "
               "ceiling (bench/kernels.py's measured H200 figure), TB/s of the expert weights touched. Target "
               f"(issue 11): both GEMMs >= {TARGET_MOE_TFLOPS:.0f} TFLOP/s at >= {TARGET_MOE_MIN_TOKENS:,} "
               "tokens. Newest qualifying run per (GPU, model, tokens).")
    if not chosen:
        return out + ["No qualifying tuner results.", ""]
    for gpu, model in sorted({k[:2] for k in chosen}):
        keys = sorted(k for k in chosen if k[:2] == (gpu, model))
        runs = sorted({chosen[k][0].name: chosen[k][0] for k in keys}.values(), key=lambda r: (r.date, r.name))
        ceil = "/".join(sorted({f"{r.data.get('ceilings', {}).get('fp8', C.CEILING_TFLOPS['fp8']):g}" for r in runs}))
        rows = []
        for key in keys:
            r, p = chosen[key]
            h, b = p["heuristic"], p["best"]
            rates = " / ".join(fmt((b.get(g) or {}).get("TFLOP/s"), ".0f") for g in ("w1", "w2")) + \
                f" / {fmt(b.get('TFLOP/s'), '.0f')}"
            rows.append([p["tokens"], f"{p['n_pairs']:,}", fmt(p.get("rows_per_expert"), "g"),
                         fmt(h.get("ms"), ",.1f", 1e3), fmt(b.get("ms"), ",.1f", 1e3),
                         "-" if p.get("speedup") is None else f"{p['speedup']:.2f}x", rates,
                         fmt(b.get("fp8_share"), ".0%"), fmt(b.get("TB/s"), ".2f"), f"`{b['label']}`",
                         _target(p["tokens"], b.get("TFLOP/s")), r.source])
        out += sub(f"{model} on {gpu}", ["tokens", "pairs", "rows/expert", "heuristic us", "best us", "speed-up",
                                         "best TFLOP/s w1 / w2 / both", f"of fp8 {ceil} TFLOP/s", "TB/s",
                                         "best config", f"target >= {TARGET_MOE_TFLOPS:.0f} TFLOP/s", "measured at"],
                   rows, _runs_note(runs, lambda r: f" (timer {r.data.get('args', {}).get('timer', '?')}, "
                                                    f"{r.data.get('checked_configs', '?')} configs checked"
                                                    f"{'' if r.data.get('complete', True) else ', budget ran out'})"))
        big = [(k[2], chosen[k][1]["best"].get("TFLOP/s")) for k in keys if k[2] >= TARGET_MOE_MIN_TOKENS]
        big = [(t, tf) for t, tf in big if tf is not None]
        if big:
            t, tf = max(big, key=lambda x: x[1])
            met = sum(tf_ >= TARGET_MOE_TFLOPS for _, tf_ in big)
            out += [f"At >= {TARGET_MOE_MIN_TOKENS:,} tokens: best {tf:.0f} TFLOP/s at {t:,} tokens; target >= "
                    f"{TARGET_MOE_TFLOPS:.0f} TFLOP/s met at {met} of {len(big)} token counts.", ""]
    return out


# ---- decode GEMV sweep -------------------------------------------------------------------------------
def sweep_gemv_points(col: Collection) -> dict:
    """(GPU, model, tokens, GEMM) -> (newest qualifying sweep_gemv run with that point, its GEMM entry)."""
    return newest_per_point(col.qualifying("sweep-gemv"),
                            lambda r: [(p, g, e) for p in r.data.get("points", [])
                                       for g, e in p.get("gemms", {}).items()],
                            lambda r, x: (_gpu(r), x[0]["model"], x[0]["tokens"], x[1]))


def _ceiling_tbs(row: dict | None) -> float | None:
    """The copy ceiling a row's share was taken of (TB/s / share)."""
    return row["tbs"] / row["floor_share"] if row and row.get("tbs") and row.get("floor_share") else None


def _measured(r: Result) -> int:
    return sum(len(e.get("measured", [])) for p in r.data.get("points", []) for e in p.get("gemms", {}).values())


def sweep_gemv_section(col: Collection) -> list[str]:
    chosen = sweep_gemv_points(col)
    out = head("Decode MoE GEMVs: launch sweep (`bench.sweep_gemv`)",
               "Each decode GEMV of one MoE layer on its own (GEMM1 with the clamped SwiGLU, GEMM2 with the routing "
               "weight; kernels/moe_gemv.py) at decode batch sizes: today's launch (kernels.moe_gemv.gemv_config "
               "at the run's commit) against the fastest launch of the sampled space that passed the output "
               "check; TB/s of the expert weights read, share of the copy ceiling, and the floor (those bytes at "
               "the ceiling). Newest qualifying run per (GPU, model, tokens, GEMM).")
    if not chosen:
        return out + ["No qualifying GEMV sweep results.", ""]
    for gpu in sorted({k[0] for k in chosen}):
        keys = sorted(k for k in chosen if k[0] == gpu)
        runs = sorted({chosen[k][0].name: chosen[k][0] for k in keys}.values(), key=lambda r: (r.date, r.name))
        ceils = {c for k in keys for c in [_ceiling_tbs(chosen[k][1][2].get("best"))] if c is not None}
        ceil = "/".join(sorted({f"{c:.2f}" for c in ceils})) or "?"
        rows = []
        for key in keys:
            r, (p, gemm, e) = chosen[key]
            t, b = e.get("today") or {}, e.get("best")
            today_us = fmt(t.get("us"), ".1f") if t.get("us") is not None else t.get("error", "-")
            if b is None:
                best = [t.get("error", "no launch passed"), "-", "-", "-"]
                speed = "-"
            else:
                best = [f"`{b['label']}`", fmt(b["us"], ".1f"), fmt(b.get("tbs"), ".2f"),
                        fmt(b.get("floor_share"), ".0%")]
                speed = f"{t['us'] / b['us']:.2f}x" if t.get("us") else "-"
                rc = e.get("recheck")
                if rc:  # both timed again, alternately, after the sweep (bench.sweep_gemv.recheck)
                    speed += f" (rechecked {recheck_text(rc)})"
            rows.append([p["model"], p["tokens"], p["pairs"], gemm, f"`{t.get('label', '?')}`", today_us,
                         fmt(t.get("floor_share"), ".0%"), *best, fmt(e.get("floor_us"), ".1f"), speed, r.source])
        out += sub(f"On {gpu}", ["model", "tokens", "pairs", "GEMM", "today", "today us", "today of ceiling",
                                 "best", "best us", "best TB/s", f"best of {ceil} TB/s", "floor us", "speed-up",
                                 "measured at"], rows,
                   _runs_note(runs, lambda r: f" ({_measured(r)} launches measured)"))
    return out


# ---- dense FP8 GEMV sweep (bench/sweep_gemv_dense.py) ----------------------------------------------
def sweep_dense_points(col: Collection) -> dict:
    """(GPU, shape, K, N, M) -> (newest qualifying `sweep_gemv --dense` run with that point, the point)."""
    return newest_per_point(col.qualifying("sweep-gemv-dense"), lambda r: r.data.get("points", []),
                            lambda r, p: (_gpu(r), p["shape"], p["k"], p["n"], p["rows"]))


def _rate_cells(row: dict | None) -> list[str]:
    if not row or row.get("us") is None:
        return [(row or {}).get("error", "-"), "-", "-"]
    return [fmt(row["us"], ".2f"), fmt(row.get("tbs"), ".2f"), fmt(row.get("floor_share"), ".0%")]


def sweep_dense_section(col: Collection) -> list[str]:
    chosen = sweep_dense_points(col)
    out = head("Dense FP8 GEMV vs cuBLAS at decode sizes (`bench.sweep_gemv --dense`)",
               "The attention projections of gpt-oss-20b and -120b (the same shapes: QKV 2880 -> 5120, O 4096 -> "
               "2880, K padded to 128) at M decode rows, each call streaming its weights from HBM, under CUDA "
               "graphs: cuBLAS blockwise (what decode runs unless the GEMV is switched on) against the fastest "
               "launch of kernels/fp8_gemv.py that passed the output check; us per call, TB/s of the bytes one call "
               "reads and writes, share of the copy ceiling, the floor (those bytes at the ceiling). Newest "
               "qualifying run per (GPU, shape, M).")
    if not chosen:
        return out + ["No qualifying dense GEMV sweep results.", ""]
    for gpu in sorted({k[0] for k in chosen}):
        keys = sorted((k for k in chosen if k[0] == gpu), key=lambda k: (-k[3], k[1], k[4]))
        runs = sorted({chosen[k][0].name: chosen[k][0] for k in keys}.values(), key=lambda r: (r.date, r.name))
        ceil = "/".join(sorted({f"{chosen[k][0].data.get('ceiling_tbs', 4.19):g}" for k in keys}))
        rows = []
        for key in keys:
            r, p = chosen[key]
            b = p.get("best")
            speed = p.get("speedup_vs_cublas")
            rows.append([f"{p['shape']} {p['k']}->{p['n']}", p["rows"], *_rate_cells(p.get("cublas")),
                         f"`{b['label']}`" if b else "no launch passed", *_rate_cells(b), fmt(p.get("floor_us"), ".2f"),
                         f"{speed:.2f}x" if speed else "-", r.source])
        out += sub(f"On {gpu}", ["shape", "M", "cuBLAS us", "cuBLAS TB/s", f"cuBLAS of {ceil} TB/s", "best GEMV",
                                 "GEMV us", "GEMV TB/s", f"GEMV of {ceil} TB/s", "floor us", "GEMV speed-up",
                                 "measured at"], rows,
                   _runs_note(runs, lambda r: f" ({sum(len(p.get('measured', [])) for p in r.data.get('points', []))}"
                                              f" launches measured{'' if r.data.get('complete', True) else ', budget ran out'})"))
    return out


# ---- decode step profiles ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _counts_device_only(commit: str) -> bool | None:
    """Whether the profiler at `commit` counted device events only (PROFILE_COUNT_FIX is an ancestor)."""
    try:
        out = subprocess.run(["git", "merge-base", "--is-ancestor", PROFILE_COUNT_FIX, commit], cwd=C.REPO_ROOT,
                             capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: True, 1: False}.get(out.returncode)


def _env_switches(r: Result) -> str:
    """The KVRELAY_* switches the run set (non-empty; the git provenance ones left out)."""
    if "kvrelay_env" not in r.env:
        return "not recorded"
    sw = [f"{k}={v}" for k, v in sorted(r.env["kvrelay_env"].items()) if v != "" and not k.startswith("KVRELAY_GIT_")]
    return ", ".join(f"`{s}`" for s in sw) or "none"


def _kernel_name(name: str) -> str:
    """A kernel's name without `void ` and template arguments (profile_decode cuts names at 90 characters)."""
    name = name.removeprefix("void ").split("<", 1)[0].strip()
    return name.replace("|", "/").replace("`", "'")


def _graphs(r: Result) -> bool:
    g = r.data.get("graphs")
    return g if isinstance(g, bool) else "--graphs" in r.env.get("command", "").split()


def profile_results(col: Collection) -> list[Result]:
    return sorted(col.qualifying("profile"), key=lambda r: (r.env.get("gpu", "?"), r.data.get("model", "?"),
                                                           r.data.get("batch", 0), r.data.get("context", 0), r.date))


def profile_section(col: Collection) -> list[str]:
    chosen = profile_results(col)
    out = head("Decode step profiles (`bench.profile_decode`): where a step goes",
               "One decode step of `batch` sequences at `context` tokens under torch.profiler, a replayed CUDA "
               "graph or eager (each kernel launched on its own); wall ms = one such step timed on the host clock "
               "outside the profiler (launch to synchronize), pipelined ms = the median step of `--chain` chained "
               "steps where run, kernel ms and launches = the profiler's events, the top "
               f"{TOP_KERNELS} kernels by total time (us over the step, calls). Env: the `KVRELAY_*` switches the "
               "run set to a non-empty value (`KVRELAY_FUSED=0`: the unfused glue). Counted: profiles from "
               f"before {PROFILE_COUNT_FIX} "
               "counted each aten op beside the kernels it launched, so their kernel ms and launches count "
               "cuBLAS/aten work twice. Every qualifying profile, one row each.")
    if not chosen:
        return out + ["No qualifying profiles.", ""]
    rows = []
    for r in chosen:
        d = r.data
        top = "; ".join(f"`{_kernel_name(k['kernel'])}` {k['total_us']:,.1f} ({k['calls']})"
                        for k in d.get("top", [])[:TOP_KERNELS])
        launches = str(d["launches"]) if "launches" in d else "-"
        if d.get("launches_per_layer") is not None:
            launches += f" ({d['launches_per_layer']:.1f}/layer)"
        device_only = _counts_device_only(r.commit) if r.commit else None
        counted = {True: "device events", False: "ops + kernels (2x)", None: "?"}[device_only]
        rows.append([f"{d.get('model', '?')} ({d.get('quant', '?')})", r.env.get("gpu") or r.env.get("device", "?"),
                     d.get("batch", "-"), d.get("context", "-"), "graph" if _graphs(r) else "eager", _env_switches(r),
                     fmt(d.get("wall_ms"), ".2f"), fmt(d.get("pipelined_ms"), ".2f"), fmt(d.get("kernel_ms"), ".2f"),
                     launches, counted, top or "-", f"{r.source} ({r.name})"])
    return out + table(["model", "device", "batch", "context", "step", "env", "wall ms", "pipelined ms",
                        "kernel ms", "launches", "counted", f"top {TOP_KERNELS} kernels: us (calls)", "measured at"],
                       rows)


# ---- prefill profiles --------------------------------------------------------------------------------
def prefill_profile_results(col: Collection) -> list[Result]:
    return sorted(col.qualifying("profile-prefill"), key=lambda r: (r.env.get("gpu", "?"), r.data.get("model", "?"),
                                                                   r.data.get("length", 0), r.date))


def _rate(d: dict, category: str) -> str:
    return fmt(((d.get("tflops") or {}).get(category) or {}).get("tflops"), ".0f")


def prefill_profile_section(col: Collection) -> list[str]:
    """Absent (no heading) until a prefill profile exists: RESULTS.md stays as it was before the profiler."""
    chosen = prefill_profile_results(col)
    if not chosen:
        return []
    cats = [c for c, _ in CATEGORIES] + [OTHER]
    out = head("Prefill profiles (`bench.profile_prefill`): where a batch-1 prefill goes",
               "One `Runner.prefill` of `length` tokens + the first token's `Runner.sample` under torch.profiler "
               "(after two warm-up calls); wall ms = the same call timed without the profiler, kernel ms and "
               "launches = the profiler's device events, GPU idle ms = the profiled call's time with no device "
               "event running (bench/gpu_idle.py; `-`: profiled before it was recorded), then each category's share of the kernel time "
               "(kernel names grouped by bench/profile_prefill.CATEGORIES) and the achieved TFLOP/s of the MoE "
               "expert GEMMs, the attention projections (`dense linear`) and attention over the model's FLOPs "
               "(bench/estimates.py). Env: the `KVRELAY_*` switches set. Every qualifying profile, one row each.")
    rows = []
    for r in chosen:
        d = r.data
        share = {c["category"]: c.get("share") for c in d.get("categories", [])}
        rows.append([f"{d.get('model', '?')} ({d.get('quant', '?')})", r.env.get("gpu") or r.env.get("device", "?"),
                     d.get("length", "-"), _env_switches(r), fmt(d.get("wall_ms"), ",.1f"),
                     fmt(d.get("kernel_ms"), ",.1f"), fmt((d.get("idle") or {}).get("idle_ms"), ",.1f"),
                     d.get("launches", "-"),
                     *(fmt(share.get(c, 0.0 if share else None), ".1%") for c in cats),
                     _rate(d, "MoE expert GEMM"), _rate(d, "dense linear"), _rate(d, "attention"),
                     f"{r.source} ({r.name})"])
    return out + table(["model", "device", "length", "env", "wall ms", "kernel ms", "GPU idle ms", "launches",
                        *cats, "MoE GEMM TFLOP/s", "dense TFLOP/s", "attention TFLOP/s", "measured at"], rows)


def sections(col: Collection) -> list[str]:
    return (tune_moe_section(col) + sweep_gemv_section(col) + sweep_dense_section(col) + profile_section(col)
            + prefill_profile_section(col))


def used(col: Collection) -> dict[str, int]:
    """Result file -> how many of its points these tables show (bench/results_md's sources count)."""
    out: dict[str, int] = {}
    for c in (tune_moe_points(col), sweep_gemv_points(col), sweep_dense_points(col)):
        for r, _ in c.values():
            out[r.name] = out.get(r.name, 0) + 1
    for r in profile_results(col) + prefill_profile_results(col):
        out[r.name] = 1
    return out
