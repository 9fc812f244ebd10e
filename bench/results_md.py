"""bench/RESULTS.md: the tables of every qualifying result under bench/results (bench/provenance.py says
which qualify), in the seed write-up's layouts, each figure beside the commit and date it was measured at.

    python -m kvrelay.bench.report --results-md          # writes bench/RESULTS.md + bench/RESULTS-decode.png

Sections: prefill against the seed's EP1 DP1 TP1 row, decode curves with the bytes-per-step floor,
kernels with the share of each H200 ceiling, the MoE tuner / decode GEMV sweep / step profiles
(bench/results_tuning.py), the serve benchmark's tables, the multi-turn workload (prefix
cache off / on / on with the host tier, and the ratio of turn 2+'s TTFT), the sources, the exclusions.
"""

from __future__ import annotations

from pathlib import Path

from kvrelay.bench import common as C
from kvrelay.bench import results_tuning
from kvrelay.bench.decode_loop import headline
from kvrelay.bench.provenance import Collection, Result, newest_per_point
from kvrelay.bench.results_fmt import fmt as _f, head as _head, sub as _sub, table as _table

COMMAND = "python -m kvrelay.bench.report --results-md"
SEED_LENGTHS = [8192, 32768, 65536, 128000]
SEED_MODELS = ["gpt-oss-20b", "gpt-oss-120b"]
DECODE_LENGTHS = [8192, 32768]
FLOOR_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# Published TensorRT-LLM output tok/s per H200 at 1k in / 1k out, and our targets (issue 11).
TRT_LLM_1K1K = {"gpt-oss-20b": 13858.0, "gpt-oss-120b": 6868.0}
TARGET_1K1K = {"gpt-oss-20b": 10000.0, "gpt-oss-120b": 5000.0}
TABLED_KINDS = ("prefill", "decode", "kernels", *results_tuning.TABLED_KINDS, "serve", "serve-multiturn", "structured")


# The GPU every table and the decode plot are of unless a row says otherwise: a result on another GPU kind is
# its own group ("EP1 DP1 TP1 on NVIDIA H100 80GB HBM3"), never the newest point of an H200 row.
REFERENCE_GPU = "NVIDIA H200"


def setup(r: Result) -> str:
    """A result's parallel layout, and its GPU where that is not the reference H200 (results without one: H200)."""
    config = r.data.get("config", "EP1 DP1 TP1")
    gpu = r.env.get("gpu") or REFERENCE_GPU
    return config if gpu == REFERENCE_GPU or gpu == "cpu" else f"{config} on {gpu}"


# ---- prefill ------------------------------------------------------------------------------------------
def prefill_points(col: Collection) -> dict:
    return newest_per_point(col.qualifying("prefill"), lambda r: r.data.get("points", []),
                            lambda r, p: (r.data["model"], r.data["quant"], setup(r), p["length"]))


def prefill_section(col: Collection) -> list[str]:
    chosen = prefill_points(col)
    out = _head("Prefill, batch 1 (latency, $ per 1M input tokens at $3/GPU-hour), against the seed",
                "The seed's layout (docs/seed-notes.md); kvrelay's row from `bench.prefill` on one GPU, the newest "
                "qualifying result per length; ratio = kvrelay latency / seed latency (< 1 is faster and cheaper).")
    groups = sorted({k[:3] for k in chosen} | {(m, "fp8-block128", "EP1 DP1 TP1") for m in SEED_MODELS},
                    key=lambda g: (g[0] not in SEED_MODELS, g))
    for model, quant, config in groups:
        mine = {k[3]: v for k, v in chosen.items() if k[:3] == (model, quant, config)}
        seed = C.SEED_PREFILL.get(model, {}).get(config, {})
        lengths = sorted(set(mine) | (set(SEED_LENGTHS) if seed else set()))
        rows = [[f"{config} kvrelay ({quant})"] + [_prefill_cell(mine[n][1]) if n in mine else "not run"
                                                  for n in lengths]]
        if seed:
            rows.append([f"{config} seed"] + [C.fmt_cell(*seed[n]) if n in seed else "-" for n in lengths])
            rows.append(["kvrelay / seed"] + [f"{mine[n][1]['median_s'] / seed[n][0]:.2f}x"
                                              if n in mine and n in seed else "-" for n in lengths])
        rows.append(["measured at"] + [mine[n][0].source if n in mine else "-" for n in lengths])
        out += _sub(model, ["config", *map(str, lengths)], rows)
    return out


def _prefill_cell(point: dict) -> str:
    """Latency and cost; a point run in several forwards (bench.prefill --chunk-tokens) says how many."""
    cell = C.fmt_cell(point["median_s"], point["usd_per_m_input"])
    chunks = point.get("chunks", 1)
    return cell if chunks <= 1 else f"{cell} ({chunks} chunks)"


# ---- decode -------------------------------------------------------------------------------------------
def _floor_step_s(model: str, batch: int, context: int, quant: str, config: str = "") -> float | None:
    """The step time if the bytes one step must read (bench/common.decode_bytes_per_step) moved at the GPU's
    copy ceiling (the H200's measured 4.19 TB/s; an H100's in bench/estimates.copy_bw)."""
    try:
        cfg = C.resolve_config(model)
    except Exception:  # noqa: BLE001 - a model this checkout has no config for: no floor
        return None
    return C.decode_bytes_per_step(cfg, batch, context, quant) / C.copy_bw(config)


def decode_points(col: Collection) -> dict:
    return newest_per_point(col.qualifying("decode"), lambda r: r.data.get("points", []),
                            lambda r, p: (r.data["model"], r.data["quant"], setup(r), p["length"], p["batch"]))


def decode_section(col: Collection, png: str | None) -> list[str]:
    chosen = decode_points(col)
    out = ["## Decode: tokens/s per user against $ per 1M output tokens", "",
           "`bench.decode`, one GPU, KV pages filled with random values (real lengths and page tables), the "
           "newest qualifying result per (context, batch). Floor: the step time if the bytes one step must "
           "read (weights touched + KV, `bench/common.decode_bytes_per_step`) moved at the 4.19 TB/s copy "
           "ceiling (an H100's: its 3.35 TB/s peak, not measured); 'of floor' = floor step / measured step. Step ms (and tok/s, $, the curves): the "
           "pipelined step where the run measured it ('timed as' pipelined: step N+1 launched on step N's tokens "
           "still on the device before N is read back, as the decode worker runs greedy rows), else the "
           "synchronous step (decode + sample, tokens read back each step; runs before both were measured); "
           "'sync step ms' is the synchronous step of the same run.", ""]
    if png:
        out += [f"![decode curves]({png})", ""]
    if not chosen:
        return out + ["No qualifying decode results.", ""]
    for group in sorted({k[:3] for k in chosen}):
        model, quant, config = group
        rows = []
        for key in sorted(k for k in chosen if k[:3] == group):
            r, p = chosen[key]
            floor = _floor_step_s(model, p["batch"], p["length"], quant, config)
            h = headline(p)
            rows.append([p["length"], p["batch"], _f(h["step_s"], ".2f", 1e3),
                         _f(h["tokens_per_s_per_user"], ".1f"), _f(h["tokens_per_s_aggregate"], ",.0f"),
                         "$" + _f(h["usd_per_m_output"], ".3f"),
                         _f(None if floor is None else 1 / floor, ",.0f"),
                         _f(None if floor is None else floor / h["step_s"], ".0%"), h["timing"],
                         _f(p.get("step_median_s"), ".2f", 1e3), r.source])
        out += [f"### {model}, {quant}, {config}", ""]
        out += _table(["context", "batch", "step ms", "tok/s/user", "tok/s total", "$/1M output",
                       "floor tok/s/user", "of floor", "timed as", "sync step ms", "measured at"], rows)
    return out


def decode_plot(col: Collection):
    """One panel per model: a measured curve per context over the batches, the floor dashed beside it."""
    chosen = decode_points(col)
    models = sorted({k[0] for k in chosen if k[2] == "EP1 DP1 TP1"})
    if not models:
        return None
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = C.new_figure(ncols=len(models), figsize=(6.5 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models):
        keys = [k for k in chosen if k[0] == model and k[2] == "EP1 DP1 TP1"]  # the reference GPU's curves only
        if not keys:
            continue
        quant = sorted({k[1] for k in keys})[0]
        contexts = sorted({k[3] for k in keys} | set(DECODE_LENGTHS))
        for i, s in enumerate(contexts):
            color = f"C{i}"
            pts = sorted((chosen[k][1] for k in keys if k[3] == s and k[1] == quant), key=lambda p: p["batch"])
            if pts:
                hs = [headline(p) for p in pts]
                timing = "/".join(sorted({h["timing"] for h in hs}))
                ax.plot([h["usd_per_m_output"] for h in hs], [h["tokens_per_s_per_user"] for h in hs], "o-",
                        color=color, label=f"measured ({timing} step), context {s}")
                for p, h in zip(pts, hs):
                    ax.annotate(f"B={p['batch']}", (h["usd_per_m_output"], h["tokens_per_s_per_user"]),
                                textcoords="offset points", xytext=(4, 4), fontsize=7)
            floor = [(b, _floor_step_s(model, b, s, quant)) for b in FLOOR_BATCHES]
            floor = [(b, t) for b, t in floor if t is not None]
            if floor:
                ax.plot([C.decode_usd_per_m_output(b / t) for b, t in floor], [1 / t for _, t in floor], "--",
                        color=color, alpha=0.6, label=f"floor (4.19 TB/s), context {s}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"${x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())  # log minor labels overlap on a short range
        ax.invert_xaxis()  # cheaper to the right, faster up: better is up and to the right
        ax.set_xlabel("$ per 1M output tokens (log, cheaper to the right)")
        ax.set_ylabel("tokens/s per user (log)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(f"{model} {quant} decode, EP1 DP1 TP1, batch 1..{FLOOR_BATCHES[-1]}", fontsize=10)
    return fig


# ---- kernels ------------------------------------------------------------------------------------------
def _ceiling(row: dict, ceilings: dict) -> str:
    if "TB/s" in row:
        return f"copy {ceilings.get('TB/s', C.COPY_BW_BYTES_S / 1e12)} TB/s"
    if "TFLOP/s" in row and row.get("share"):
        implied = row["TFLOP/s"] / row["share"]
        name = min(("bf16", "fp8"), key=lambda c: abs(ceilings.get(c, C.CEILING_TFLOPS[c]) - implied))
        return f"{name} {ceilings.get(name, C.CEILING_TFLOPS[name]):g} TFLOP/s"
    return "-"


def kernel_points(col: Collection) -> dict:
    return newest_per_point(col.qualifying("kernels"), lambda r: r.data.get("rows", []),
                            lambda r, p: (p["group"], p["name"]))


def kernels_section(col: Collection) -> list[str]:
    chosen = kernel_points(col)
    out = _head("Kernels: share of each H200 ceiling",
                "`bench.kernels`; ceilings measured on the H200 (h200-notes): 4.19 TB/s device copy, 762 TFLOP/s "
                "bf16, 1378 TFLOP/s fp8 tensor-wise (cuBLAS blockwise 128x128 reached 822). Newest qualifying row "
                "per kernel.")
    if not chosen:
        return out + ["No qualifying kernel results.", ""]
    for group in sorted({k[0] for k in chosen}):
        rows = []
        for key in [k for k in chosen if k[0] == group]:  # the run's own order
            r, row = chosen[key]
            rate = (f"{row['TFLOP/s']:g} TFLOP/s" if "TFLOP/s" in row else
                    f"{row['TB/s']:g} TB/s" if "TB/s" in row else "-")
            rows.append([row["name"], _f(row.get("ms"), ",.1f", 1e3), rate, _ceiling(row, r.data.get("ceilings", {})),
                         _f(row.get("share"), ".0%"), row.get("target", ""), row.get("note", ""), r.source])
        out += _sub(group, ["kernel", "time us", "rate", "ceiling", "share", "target", "note", "measured at"], rows)
    return out


# ---- serve --------------------------------------------------------------------------------------------
def _wl(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def serve_choice(col: Collection) -> dict:
    """(model, topology, gpus, input_len, output_len) -> the newest qualifying run with that workload."""
    newest: dict = {}
    for r in col.qualifying("serve"):
        for p in r.data.get("points", []):
            newest[(r.data["model"], r.data.get("topology") or r.data.get("base_url"), r.data.get("gpus", 1),
                    p["input_len"], p["output_len"])] = r
    return newest


def _serve_row(p: dict, gpus: int, model: str) -> list:
    row = [f"{_wl(p['input_len'])}/{_wl(p['output_len'])}", p["concurrency"], f"{p['requests']} ({p['failed']})",
           _f(p.get("ttft_p50_s"), ".3f"), _f(p.get("ttft_p99_s"), ".3f"), _f(p.get("itl_p50_s"), ".2f", 1e3),
           _f(p.get("out_tok_s_aggregate"), ",.0f"), _f(p.get("out_tok_s_steady"), ",.0f"),
           _f(p.get("out_tok_s_per_user_p50"), ".1f"),
           "-" if p.get("usd_per_m_output") is None else f"${p['usd_per_m_output']:.3f}",
           _f(p.get("queue_s"), ".3f"), _f(p.get("prefill_compute_s"), ".3f"), _f(p.get("kv_handoff_s"), ".3f"),
           _f(p.get("delivery_s"), ".3f")]
    anchor = TRT_LLM_1K1K.get(model) if (p["input_len"], p["output_len"]) == (1024, 1024) else None
    agg = p.get("out_tok_s_aggregate")
    if anchor is None or agg is None:
        return row + ["", ""]
    per = agg / gpus
    return row + [f"{per / anchor:.0%}", f"{per / TARGET_1K1K[model]:.0%}"]


def serve_section(col: Collection) -> list[str]:
    newest = serve_choice(col)
    out = _head("Serving (`bench.serve` against `kvrelay serve`)",
                "Per model / topology / workload, every point of the newest qualifying run (workloads whose newest "
                "run is the same share a table). Streamed `/v1/completions` with token-id prompts and `ignore_eos`; "
                "TTFT breakdown (queue .. delivery) = p50s of the server's `kvrelay_timings`. At 1k/1k: aggregate "
                "output tok/s per GPU against the published TensorRT-LLM figure per H200 (13,858 for 20b, 6,868 "
                "for 120b) and against our targets (20b >= 10,000, 120b >= 5,000).")
    if not newest:
        return out + ["No qualifying serve results.", ""]
    tables: dict = {}  # (model, topology, gpus, run name) -> [workloads]
    for key in sorted(newest):
        tables.setdefault((*key[:3], newest[key].name), []).append(key[3:])
    head = ["workload", "C", "requests (failed)", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "tok/s aggregate",
            "tok/s steady", "tok/s/user p50", "$/1M out", "queue s", "prefill s", "KV handoff s", "delivery s",
            "per GPU / TRT-LLM", "per GPU / target"]
    for (model, topo, gpus, name), workloads in sorted(tables.items(), key=lambda kv: (kv[0][:3], min(kv[1]))):
        r = next(x for x in col.results if x.name == name)
        pts = sorted((p for p in r.data["points"] if (p["input_len"], p["output_len"]) in workloads),
                     key=lambda p: (p["input_len"], p["output_len"], p["concurrency"]))
        wl = ", ".join(f"{_wl(a)}/{_wl(b)}" for a, b in workloads)
        out += _sub(f"{model}, {topo} ({gpus} GPU{'s' if gpus != 1 else ''}): {wl}", head,
                    [_serve_row(p, gpus, model) for p in pts],
                    f"Run `{r.data.get('label') or r.name}` ({r.name}) at {r.source}.")
        if (1024, 1024) in workloads and model in TRT_LLM_1K1K:
            best = max((p for p in pts if (p["input_len"], p["output_len"]) == (1024, 1024)
                        and p.get("out_tok_s_aggregate") is not None),
                       key=lambda p: p["out_tok_s_aggregate"], default=None)
            if best is not None:
                per, anchor, target = best["out_tok_s_aggregate"] / gpus, TRT_LLM_1K1K[model], TARGET_1K1K[model]
                out += [f"1k/1k best: {per:,.0f} tok/s per GPU at C={best['concurrency']}: {per / anchor:.0%} of "
                        f"TensorRT-LLM's {anchor:,.0f}; target >= {target:,.0f}: "
                        f"{'met' if per >= target else 'not met'} ({per / target:.0%}).", ""]
    return out


# ---- multi-turn serve ---------------------------------------------------------------------------------
MULTITURN_MODES = ("off", "on", "on+small", "on+host")
MODE_NAMES = {"off": "cache off", "on": "cache on", "on+small": "cache on, small KV pool",
              "on+host": "cache on + host tier, small KV pool", "unknown": "cache ?"}
TARGET_RATIO_32K = 0.25  # issue 16: turn 2+ TTFT p50 with the cache <= 25% of cache off at 32k


def multiturn_choice(col: Collection) -> dict:
    """(model, gpus, workload, prompt format) -> {prefix-cache mode: the newest qualifying run}."""
    out: dict = {}
    for r in col.qualifying("serve-multiturn"):
        s = r.data.get("settings", {})
        wl = tuple(s.get(k) for k in ("conversations", "turns", "system_len", "first_user_len", "user_len",
                                      "answer_len"))
        key = (r.data["model"], r.data.get("gpus", 1), wl, r.data.get("prompt_format"))
        out.setdefault(key, {})[r.data.get("prefix_cache", "unknown")] = r
    return out


def _turn(r: Result, label: str) -> dict | None:
    return next((p for p in r.data.get("points", []) if p.get("turn") == label), None)


def _same_length(a: dict | None, b: dict | None) -> bool:
    la, lb = (a or {}).get("prompt_tokens_p50"), (b or {}).get("prompt_tokens_p50")
    return la is not None and lb is not None and abs(la - lb) <= 0.02 * max(la, lb)


def _ratio(base: dict | None, p: dict | None, same_length: bool = True) -> float | None:
    """TTFT p50 of `p` / of `base` (cache off), None unless both exist and (`same_length`) their prompts
    are the same length."""
    if not base or not p or not base.get("ttft_p50_s") or p.get("ttft_p50_s") is None:
        return None
    if same_length and not _same_length(base, p):
        return None
    return p["ttft_p50_s"] / base["ttft_p50_s"]


def multiturn_section(col: Collection) -> list[str]:
    chosen = multiturn_choice(col)
    out = _head("Multi-turn serving (`bench.serve_multiturn`): prefix cache off, on, on with the host tier",
                "C conversations at once over one shared system prompt; turn t's prompt = turn t-1's prompt + its "
                "answer + a new user message (token-exact: token-id prompts, answers returned as ids). Per run the "
                "newest qualifying result per cache mode, rows turn 1, turns 2+ together, and the longest turn; "
                "cached = `usage.prompt_tokens_details.cached_tokens`; in/out tok/s over the span from the rows' "
                "first request to their last answer. Ratio: TTFT p50 with the cache / cache off at the same turn "
                f"(same length); issue 16's target at 32k: <= {TARGET_RATIO_32K:.0%}.")
    if not chosen:
        return out + ["No qualifying multi-turn results.", ""]
    head = ["cache", "turn", "prompt tokens p50", "requests (failed)", "cached tokens p50", "cached share",
            "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "in tok/s", "out tok/s", "measured at"]
    for (model, gpus, wl, fmt), runs in sorted(chosen.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]))):
        convs, turns, system, first, user, answer = wl
        last = str(turns)
        rows = []
        order = {m: i for i, m in enumerate(MULTITURN_MODES)}
        for mode, r in sorted(runs.items(), key=lambda kv: order.get(kv[0], len(order))):
            for label in dict.fromkeys(("1", "2+", last)):  # one turn: "1" is the longest too
                p = _turn(r, label)
                if p is None:
                    continue
                rows.append([MODE_NAMES.get(mode, mode), f"{label} (longest)" if label == last != "1" else label,
                             _f(p.get("prompt_tokens_p50"), ",.0f"), f"{p['requests']} ({p['failed']})",
                             _f(p.get("cached_tokens_p50"), ",.0f"), _f(p.get("cached_frac"), ".0%"),
                             _f(p.get("ttft_p50_s"), ".3f"), _f(p.get("ttft_p99_s"), ".3f"),
                             _f(p.get("itl_p50_s"), ".2f", 1e3), _f(p.get("in_tok_s"), ",.0f"),
                             _f(p.get("out_tok_s"), ",.0f"), r.source])
        out += _sub(f"{model} ({gpus} GPU{'s' if gpus != 1 else ''}): {convs} conversations x {turns} turns, "
                    f"system {_wl(system)} + user {_wl(first)}, then +{_wl(answer)} answer +{_wl(user)} user per "
                    f"turn ({fmt} prompts)", head, rows,
                    "Runs: " + "; ".join(f"{MODE_NAMES.get(m, m)} `{r.data.get('label') or r.name}` ({r.name})"
                                         for m, r in sorted(runs.items())) + ".")
        off = runs.get("off")
        cached_modes = [m for m in ("on", "on+small", "on+host") if m in runs]
        if off is None or not cached_modes:
            out += ["No cache-off and cache-on pair of this workload yet: no ratio.", ""]
            continue
        labels = [str(t) for t in range(2, turns + 1)] + ["2+"]
        ratio_rows = []
        for label in labels:
            base = _turn(off, label)
            row = [label, _f((base or {}).get("prompt_tokens_p50"), ",.0f"), _f((base or {}).get("ttft_p50_s"), ".3f")]
            for m in cached_modes:
                p = _turn(runs[m], label)
                # "2+" mixes lengths, the same mix in both runs of one workload
                row += [_f((p or {}).get("ttft_p50_s"), ".3f"), _f(_ratio(base, p, label != "2+"), ".0%")]
            ratio_rows.append(row)
        rhead = ["turn", "prompt tokens p50", "TTFT p50 s, cache off"]
        for m in cached_modes:
            rhead += [f"TTFT p50 s, {MODE_NAMES[m]}", f"{MODE_NAMES[m]} / off"]
        out += _table(rhead, ratio_rows)
        base = _turn(off, last)
        length = (base or {}).get("prompt_tokens_p50")
        for m in cached_modes:
            ratio = _ratio(base, _turn(runs[m], last))
            if ratio is None:
                continue
            verdict = (f"target <= {TARGET_RATIO_32K:.0%} at 32k: {'met' if ratio <= TARGET_RATIO_32K else 'not met'}"
                       if abs(length - 32768) <= 0.05 * 32768 else "the target is stated at 32k: not judged here")
            out += [f"Longest turn ({length:,.0f} tokens), {MODE_NAMES[m]}: TTFT p50 {ratio:.0%} of cache off; "
                    f"{verdict}.", ""]
    return out


# ---- structured outputs ------------------------------------------------------------------------------
def _arg(command: str, flag: str, default: str) -> str:
    words = command.split()
    return words[words.index(flag) + 1] if flag in words[:-1] else default


def structured_choice(col: Collection) -> dict:
    """(device, model, quant) -> the newest qualifying `bench.structured` run with decode steps."""
    out: dict = {}
    for r in col.qualifying("structured"):
        if not r.data.get("decode_steps"):
            continue
        cmd = r.env.get("command", "")
        key = (r.env.get("gpu") or r.env.get("device", "cpu"), r.data.get("model") or _arg(cmd, "--model", "gpt-oss-tiny"),
               r.data.get("quant") or _arg(cmd, "--quant", "bf16"))
        out[key] = r
    return out


def structured_section(col: Collection) -> list[str]:
    chosen = structured_choice(col)
    out = _head("Structured outputs (`bench.structured`): what a json_schema mask costs a decode step",
                "B greedy requests inside a long JSON body against B unconstrained ones on the same Runner. Mask "
                "fill: kvrelay's harmony state machine over llguidance, all B rows, per token. Synchronous: single "
                "steps, each timed alone. Hot path (what serving runs): overlapped steps back to back, the mask "
                "filled while the forward runs; 'overlapped' = share of the constrained steps that took that path "
                "('not measured': a run from before it was benched). Added = json_schema - plain, p50.")
    if not chosen:
        return out + ["No qualifying result yet.", ""]
    rows = []
    for (device, model, quant), r in sorted(chosen.items()):
        for b, v in sorted(r.data["decode_steps"].items(), key=lambda kv: int(kv[0][1:])):
            n = int(b[1:])
            fill = r.data.get("state_machine", {}).get(b, {}).get("per_token_ms")
            hot = v.get("hot_path")
            hot_cells = ([_f(hot["plain"]["p50_ms"], ".2f"), _f(hot["json_schema"]["p50_ms"], ".2f"),
                          _f(hot["added_per_step_ms"], "+.2f"), _f(hot["added_per_token_ms"], "+.3f"),
                          _f(hot["json_schema"].get("overlapped_share"), ".0%")] if hot else ["not measured"] + ["-"] * 4)
            rows.append([f"{model} ({quant}), {device}", n, _f(fill, ".4f"), _f(v["plain_sync"]["p50_ms"], ".2f"),
                         _f(v["json_schema"]["p50_ms"], ".2f"), _f(v["added_per_step_ms"], "+.2f"),
                         _f(v["added_per_token_ms"], "+.3f"), *hot_cells, r.source])
    return out + _table(["model, device", "B", "mask fill ms/token", "sync plain ms", "sync json ms",
                         "sync added ms/step", "sync added ms/token", "hot plain ms", "hot json ms",
                         "hot added ms/step", "hot added ms/token", "overlapped", "measured at"], rows)


# ---- provenance -----------------------------------------------------------------------------------------
def _used(col: Collection) -> dict[str, int]:
    """Result file -> how many of its points are tabled."""
    used: dict[str, int] = {}
    for c in (decode_points(col), prefill_points(col), kernel_points(col)):  # the sections' own choices
        for r, _ in c.values():
            used[r.name] = used.get(r.name, 0) + 1
    for key, r in serve_choice(col).items():
        used[r.name] = used.get(r.name, 0) + sum(1 for p in r.data["points"]
                                                   if (p["input_len"], p["output_len"]) == key[3:])
    for runs in multiturn_choice(col).values():
        for r in runs.values():
            used[r.name] = len(r.data.get("points", []))
    for r in structured_choice(col).values():
        used[r.name] = len(r.data["decode_steps"])
    for name, n in results_tuning.used(col).items():
        used[name] = used.get(name, 0) + n
    return used


def sources_section(col: Collection) -> list[str]:
    used = _used(col)
    rows = []
    for kind in TABLED_KINDS:
        for r in col.qualifying(kind):
            cmd = r.env.get("command") or r.data.get("command", "")
            rows.append([r.name, kind, f"`{r.short}`", r.tree, r.date,
                         f"{used[r.name]} tabled" if r.name in used else "superseded", f"`{cmd}`" if cmd else "-"])
    out = ["## Sources", "",
           "Qualifying results (commit of this repository, tree not dirty). Tree 'not recorded': the run was on "
           "a copy of that commit's tree without its .git (`KVRELAY_GIT_COMMIT`, bench/common.git_commit).", ""]
    out += _table(["file", "kind", "commit", "tree", "date", "points", "command"], rows)
    out += ["## Excluded", "", "Never tabled: the code they measured is not known.", ""]
    out += _table(["file", "kind", "reason"], [[r.name, r.kind, r.excluded] for r in col.excluded]) \
        if col.excluded else ["None.", ""]
    other = [r for r in col.results if r.excluded is None and r.kind not in TABLED_KINDS]
    if other:
        out += ["Other qualifying results this report has no table for: " +
                ", ".join(f"{r.name} ({r.kind})" for r in other) + ".", ""]
    return out


def render(col: Collection, png: str | None) -> str:
    """The whole Markdown; `png` is the decode plot's path relative to the Markdown file (None: no plot)."""
    lines = ["# kvrelay benchmark results", "",
             f"Generated by `{COMMAND}` from the JSON files in bench/results: do not edit by hand "
             "(tests/cpu/test_bench_report.py fails when this file is not what the generator writes). "
             "Every figure comes from a result whose recorded commit is a commit of this repository and whose "
             "tree was not dirty, and stands beside that commit and the run's date (UTC). Weights are the "
             "benchmarks' dummy (random) weights of the full model shapes; cost at $3.00 per H200-hour.", ""]
    for section in (prefill_section(col), decode_section(col, png), kernels_section(col),
                    results_tuning.sections(col), serve_section(col), multiturn_section(col), structured_section(col),
                    sources_section(col)):
        lines += section
    return "\n".join(lines).rstrip("\n") + "\n"


def png_path(col: Collection, md_path: Path) -> Path | None:
    """Where the decode plot goes (`<stem>-decode.png` beside the Markdown), None when nothing to plot."""
    return md_path.with_name(md_path.stem + "-decode.png") if decode_points(col) else None


def expected(col: Collection, md_path: Path) -> str:
    """The Markdown that `write` would put at `md_path` (the freshness test compares against it)."""
    png = png_path(col, md_path)
    return render(col, png.name if png else None)


def write(col: Collection, md_path: Path) -> tuple[str, Path | None]:
    """Write the Markdown and its decode plot; returns (text, png path)."""
    png = png_path(col, md_path)
    fig = decode_plot(col) if png else None
    text = render(col, png.name if png else None)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text)
    if fig is not None:
        import matplotlib.pyplot as plt

        fig.savefig(png, dpi=110, metadata={"Software": None})
        plt.close(fig)
    return text, png
