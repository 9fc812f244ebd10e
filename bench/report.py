"""Collect benchmark JSONs into one Markdown report (and one decode plot with every model/length curve).

    python -m kvrelay.bench.report                      # every *.json under bench/results, one section per run
    python -m kvrelay.bench.report DIR_OR_FILES... --out report.md
    python -m kvrelay.bench.report --results-md         # bench/RESULTS.md: the tables (bench/results_md.py)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvrelay.bench import common as C
from kvrelay.bench.decode_loop import headline

RESULTS_MD_REL = "bench/RESULTS.md"
RESULTS_MD = C.REPO_ROOT / RESULTS_MD_REL


def load(paths: list[str]) -> list[dict]:
    files: list[Path] = []
    for p in map(Path, paths or [str(C.DEFAULT_OUT)]):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    out = []
    for f in files:
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if d.get("kind") in ("prefill", "decode"):
            d["_file"] = str(f)
            out.append(d)
    return sorted(out, key=lambda d: (d["kind"], d["model"], d["quant"], d["env"]["timestamp"]))


def _header(d: dict) -> str:
    e = d["env"]
    return (f"### {d['kind']}: {d['model']} {d['quant']} on {e['gpu']} ({e['timestamp']})\n\n"
            f"commit `{e['git_commit']}`{' (dirty)' if e.get('git_dirty') else ''}, torch {e['torch']}, "
            f"triton {e['triton']}, flashinfer {e['flashinfer']}; attention: {d['attention']}; "
            f"CUDA graphs: {d['cuda_graphs']}\n\n`{e['command']}`\n")


def prefill_section(d: dict) -> str:
    parts = [_header(d)]
    if d.get("error"):
        parts.append(f"**error:** {d['error']}\n")
    if d.get("table_markdown"):
        parts.append(d["table_markdown"] + "\n")
        parts.append("| length | tokens/s | TFLOP/s | % bf16 ceiling | % fp8 ceiling |\n|---|---|---|---|---|")
        for p in d["points"]:
            parts.append(f"| {p['length']} | {p['tokens_per_s']:,.0f} | {p['tflops']:.1f} | "
                         f"{p['pct_bf16_ceiling']:.1f} | {p['pct_fp8_ceiling']:.1f} |")
        parts.append("")
    parts += [f"- skipped {s['length']}: {s['reason']}" for s in d.get("skipped", [])]
    return "\n".join(parts) + "\n"


def decode_section(d: dict) -> str:
    parts = [_header(d), f"{d.get('kv_fill', '')}\n"]
    if d.get("error"):
        parts.append(f"**error:** {d['error']}\n")
    if d["points"]:
        # The headline step: pipelined (the decode worker's greedy path) where measured, else sync.
        parts.append("| seq len | batch | step ms | timed as | sync step ms | tok/s/user | tok/s total "
                     "| $/1M output |\n|---|---|---|---|---|---|---|---|")
        for p in sorted(d["points"], key=lambda p: (p["length"], p["batch"])):
            h = headline(p)
            sync = "-" if p.get("step_median_s") is None else f"{p['step_median_s'] * 1e3:.2f}"
            parts.append(f"| {p['length']} | {p['batch']} | {h['step_s'] * 1e3:.2f} | {h['timing']} | {sync} | "
                         f"{h['tokens_per_s_per_user']:.1f} | {h['tokens_per_s_aggregate']:,.0f} | "
                         f"${h['usd_per_m_output']:.3f} |")
        parts.append("")
    parts += [f"- skipped S={s['length']} B={s['batch']}: {s['reason']}" for s in d.get("skipped", [])]
    return "\n".join(parts) + "\n"


def decode_plot(runs: list[dict]):
    runs = [d for d in runs if d["kind"] == "decode" and d["points"]]
    if not runs:
        return None
    fig, ax = C.new_figure(figsize=(8, 5.5))
    for d in runs:
        for s in sorted({p["length"] for p in d["points"]}):
            pts = sorted((p for p in d["points"] if p["length"] == s), key=lambda p: p["batch"])
            hs = [headline(p) for p in pts]
            ax.plot([h["usd_per_m_output"] for h in hs], [h["tokens_per_s_per_user"] for h in hs], "o-",
                    label=f"{d['model']} {d['quant']} S={s} ({'/'.join(sorted({h['timing'] for h in hs}))})")
    ax.set_xscale("log")
    ax.invert_xaxis()
    ax.set_xlabel("$ per 1M output tokens (log, cheaper to the right)")
    ax.set_ylabel("tokens/s per user")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("decode, EP1 DP1 TP1, one GPU")
    return fig


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m kvrelay.bench.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", help="result directories or JSON files (default bench/results)")
    ap.add_argument("--out", default=None, help="Markdown file to write (default: print only)")
    ap.add_argument("--results-md", nargs="?", const=str(RESULTS_MD), default=None, metavar="PATH",
                    help=f"write the tables of every qualifying result instead (default {RESULTS_MD_REL}) and "
                         "its decode plot beside it")
    args = ap.parse_args(argv)
    if args.results_md is not None:
        from kvrelay.bench import provenance, results_md

        col = provenance.collect([Path(p) for p in args.paths or [str(C.DEFAULT_OUT)]])
        text, png = results_md.write(col, Path(args.results_md))
        print(f"wrote {args.results_md}" + (f" and {png}" if png else "") +
              f" ({sum(r.excluded is None for r in col.results)} qualifying results, {len(col.excluded)} excluded)")
        return text
    runs = load(args.paths)
    text = "# kvrelay benchmark report\n\n" + "\n".join(
        prefill_section(d) if d["kind"] == "prefill" else decode_section(d) for d in runs)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        fig = decode_plot(runs)
        if fig is not None:
            fig.savefig(out.with_suffix(".decode.png"), dpi=120, bbox_inches="tight")
    print(text)
    return text


if __name__ == "__main__":
    main()
    sys.exit(0)
