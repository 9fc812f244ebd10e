"""Batch-1 prefill latency and cost on one device, through the engine Runner exactly as the prefill worker
calls it (`Runner.prefill` of a new sequence, then `Runner.sample` of the first token; the sequence is
freed outside the timed region), printed in the seed's table format next to the seed's EP1 DP1 TP1 row.

    python -m kvrelay.bench.prefill --model gpt-oss-120b --dummy --quant fp8-block128 --device cuda --quick
    python -m kvrelay.bench.prefill --model gpt-oss-tiny --dummy --device cpu --lengths 64,256
    python -m kvrelay.bench.prefill --model gpt-oss-120b --dummy --device cuda --lengths 128000 --chunk-tokens 32768
"""

from __future__ import annotations

import argparse
import sys

from kvrelay.bench import common as C
from kvrelay.engine.kv_geometry import FULL, SLIDING

CONFIG = "EP1 DP1 TP1"
FULL_LENGTHS = [8192, 32768, 65536, 128000]
QUICK_LENGTHS = [8192, 32768]
QUICK_BUDGET_S = 140.0  # measurement time; model build (~1 min for 120b dummy) comes on top


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvrelay.bench.prefill", description=__doc__.split("\n\n")[0])
    C.add_common_args(p)
    p.add_argument("--lengths", default=None, help=f"comma-separated input lengths (default {FULL_LENGTHS}, "
                   f"--quick {QUICK_LENGTHS})")
    p.add_argument("--chunk-tokens", type=int, default=0, metavar="N",
                   help="prefill prompts longer than N in forwards of N tokens (Runner.prefill, then Runner.extend), "
                        "as the prefill worker runs a prompt over its prefill.chunk_tokens; 0 (default): one forward")
    return p


def _settings(args) -> None:
    if args.lengths is None:
        args.lengths = ",".join(map(str, QUICK_LENGTHS if args.quick else FULL_LENGTHS))
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.iters is None:
        args.iters = 3 if args.quick else 5
    if args.budget_s is None and args.quick:
        args.budget_s = QUICK_BUDGET_S


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    _settings(args)
    import torch
    from tqdm import tqdm

    from kvrelay.engine.sampling import SamplingParams

    console = C.console()
    cfg = C.resolve_config(args.model)
    lengths = C.parse_ints(args.lengths)
    skipped: list[dict] = []
    for n in [n for n in lengths if n > cfg.max_context]:
        skipped.append({"length": n, "reason": f"longer than max_context {cfg.max_context}"})
    lengths = sorted(n for n in lengths if n <= cfg.max_context)

    attention_fn, attention_label = C.choose_attention(args.attention, args.device)
    # Prefill runs eagerly in every engine we know (graphs are a decode-step device): none are requested.
    graphs_label = "not used for prefill"
    payload: dict = {
        "kind": "prefill", "env": C.env_info(args.device, "kvrelay.bench.prefill", argv),
        "model": cfg.name, "quant": args.quant,
        "dummy": args.dummy, "config": CONFIG, "gpus": 1, "usd_per_gpu_hour": args.usd_per_gpu_hour,
        "attention": attention_label, "cuda_graphs": graphs_label, "warmup": args.warmup, "iters": args.iters,
        "budget_s": args.budget_s, "sampling": "greedy (Runner.sample, temperature 0)",
        "chunk_tokens": args.chunk_tokens,
        "ceilings_tflops": C.CEILING_TFLOPS, "points": [], "skipped": skipped,
    }
    console.print(f"[bold]prefill[/] {cfg.name} quant={args.quant} device={args.device} "
                  f"attention={attention_label} cuda_graphs={graphs_label}")

    # One sequence at a time: each group needs the pages of the longest prompt (+1 spare).
    pages = -(-max(lengths, default=1) // args.page_size) + 1
    try:
        runner, load_s, _ = C.build_runner(args, num_pages={FULL: pages, SLIDING: pages},
                                           attention_fn=attention_fn, retries=0)
    except Exception as e:  # noqa: BLE001 - e.g. 120b in bf16 does not fit one H200: say so, keep the record
        payload["error"] = f"building the Runner failed: {type(e).__name__}: {e}"
        console.print(f"[red]{payload['error']}[/]")
        payload["files"] = C.save_result(args.out, C.result_stem("prefill", args), payload)
        return payload
    payload["load_s"] = load_s
    console.print(f"model built in {load_s:.1f} s ({'dummy' if args.dummy else 'checkpoint'} weights)")

    gen = torch.Generator().manual_seed(args.seed)
    all_ids = torch.randint(0, cfg.vocab_size, (max(lengths, default=1),), generator=gen).tolist()
    greedy = [SamplingParams(max_tokens=1, temperature=0.0)]
    budget = C.Budget(args.budget_s)
    cuda = torch.device(args.device).type == "cuda"
    prev: tuple[int, float] | None = None  # (length, seconds of one call) to forecast the next point

    for n in tqdm(lengths, desc="prefill lengths", unit="len"):
        if prev is not None:
            forecast = prev[1] * (n / prev[0]) ** 1.3 * (args.warmup + 1)
            if forecast > budget.left():
                skipped.append({"length": n, "reason": f"budget: ~{forecast:.0f} s needed, {budget.left():.0f} s left"})
                continue
        prompt = all_ids[:n]
        sid = ("bench-prefill", n)
        chunk = args.chunk_tokens if 0 < args.chunk_tokens < n else n

        def call():
            logits = runner.prefill(sid, prompt[:chunk])
            for c0 in range(chunk, n, chunk):  # the worker's chunked prefill: later chunks extend the sequence
                logits = runner.extend(sid, prompt[c0:c0 + chunk])
            runner.sample(logits, greedy, [0])

        def cleanup():
            if runner.has_sequence(sid):
                runner.free(sid)

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            timing, first = C.time_call(call, args.device, warmup=args.warmup, iters=args.iters,
                                        budget_s=max(budget.left(), 0.0), cleanup=cleanup)
        except Exception as e:  # noqa: BLE001 - an OOM at 128k should not lose the shorter lengths
            cleanup()
            if cuda:
                torch.cuda.empty_cache()
            if not C.is_oom(e):
                raise
            skipped.append({"length": n, "reason": f"OOM: {str(e).splitlines()[0][:200]}"})
            continue
        prev = (n, timing.median)
        payload["points"].append(_point(cfg, n, timing, first, args, cuda) | {"chunks": -(-n // chunk)})

    payload["table_markdown"] = seed_table_markdown(payload)
    _print(console, payload)
    fig = _plot(payload) if payload["points"] else None
    payload["files"] = C.save_result(args.out, C.result_stem("prefill", args), payload, fig)
    console.print(f"saved {payload['files']}")
    return payload


def _point(cfg, n: int, timing: C.Timing, first: float, args, cuda: bool) -> dict:
    import torch

    lat = timing.median
    flops = C.prefill_flops(cfg, n)
    tflops = flops["total"] / lat / 1e12
    pt = {
        "length": n, **timing.summary(), "first_call_s": first, "times_s": timing.times_s,
        "usd_per_m_input": C.prefill_usd_per_m_input(lat, n, 1, args.usd_per_gpu_hour),
        "tokens_per_s": n / lat, "flops": flops, "tflops": tflops,
        "pct_bf16_ceiling": 100 * tflops / C.CEILING_TFLOPS["bf16"],
        "pct_fp8_ceiling": 100 * tflops / C.CEILING_TFLOPS["fp8"],
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    seed = C.SEED_PREFILL.get(cfg.name, {}).get(CONFIG, {}).get(n)
    if seed:
        pt["seed_latency_s"], pt["seed_usd_per_m_input"] = seed
        pt["ratio_vs_seed"] = lat / seed[0]  # > 1 means slower than the seed
    return pt


def seed_table_markdown(payload: dict) -> str:
    """The seed-notes table: our row, the seed's EP1 DP1 TP1 row, and our/seed latency ratio."""
    pts = payload["points"]
    if not pts:
        return ""
    lens = [p["length"] for p in pts]
    rows = [f"| config | {' | '.join(map(str, lens))} |", "|---" * (len(lens) + 1) + "|"]
    rows.append(f"| {CONFIG} (kvrelay, {payload['quant']}) | "
                + " | ".join(C.fmt_cell(p["median_s"], p["usd_per_m_input"]) for p in pts) + " |")
    if any("seed_latency_s" in p for p in pts):
        rows.append(f"| {CONFIG} (seed) | " + " | ".join(
            C.fmt_cell(p["seed_latency_s"], p["seed_usd_per_m_input"]) if "seed_latency_s" in p else "-"
            for p in pts) + " |")
        rows.append("| kvrelay / seed latency | " + " | ".join(
            f"{p['ratio_vs_seed']:.2f}x" if "ratio_vs_seed" in p else "-" for p in pts) + " |")
    return "\n".join(rows)


def _print(console, payload: dict) -> None:
    from rich.table import Table

    pts = payload["points"]
    if pts:
        t = Table(title=f"{payload['model']} prefill, batch 1, {CONFIG} on 1 x {payload['env']['gpu']} "
                        f"(latency, $ per 1M input tokens at ${payload['usd_per_gpu_hour']:.2f}/GPU-h)")
        t.add_column("config")
        for p in pts:
            t.add_column(str(p["length"]), justify="right")
        t.add_row(f"{CONFIG} (kvrelay)", *[C.fmt_cell(p["median_s"], p["usd_per_m_input"]) for p in pts])
        if any("seed_latency_s" in p for p in pts):
            t.add_row(f"{CONFIG} (seed)", *[C.fmt_cell(p["seed_latency_s"], p["seed_usd_per_m_input"])
                                            if "seed_latency_s" in p else "-" for p in pts])
            t.add_row("kvrelay / seed", *[f"{p['ratio_vs_seed']:.2f}x" if "ratio_vs_seed" in p else "-"
                                          for p in pts])
        console.print(t)

        d = Table(title="detail (FLOPs = 2 x active params x tokens + attention; ceilings bf16 762, fp8 1378 TFLOP/s)")
        for col in ("length", "median s", "min s", "tokens/s", "TFLOP/s", "% bf16", "% fp8", "attn FLOP share",
                    "iters", "peak GiB"):
            d.add_column(col, justify="right")
        for p in pts:
            d.add_row(str(p["length"]), f"{p['median_s']:.4f}", f"{p['min_s']:.4f}", f"{p['tokens_per_s']:,.0f}",
                      f"{p['tflops']:.1f}", f"{p['pct_bf16_ceiling']:.1f}", f"{p['pct_fp8_ceiling']:.1f}",
                      f"{p['flops']['attention'] / p['flops']['total']:.0%}", str(p["n"]),
                      "-" if p["peak_mem_gib"] is None else f"{p['peak_mem_gib']:.1f}")
        console.print(d)
        console.print(payload["table_markdown"], markup=False, highlight=False)
    for s in payload["skipped"]:
        console.print(f"[yellow]skipped length {s['length']}: {s['reason']}[/]")


def _plot(payload: dict):
    fig, (a1, a2) = C.new_figure(ncols=2, figsize=(11, 4))
    pts = payload["points"]
    lens = [p["length"] for p in pts]
    a1.plot(lens, [p["median_s"] for p in pts], "o-", label=f"kvrelay {payload['quant']}")
    a2.plot(lens, [p["usd_per_m_input"] for p in pts], "o-", label=f"kvrelay {payload['quant']}")
    seed = C.SEED_PREFILL.get(payload["model"], {}).get(CONFIG)
    if seed:
        sl = sorted(seed)
        a1.plot(sl, [seed[n][0] for n in sl], "s--", label=f"seed {CONFIG}")
        a2.plot(sl, [seed[n][1] for n in sl], "s--", label=f"seed {CONFIG}")
    for ax, ylab in ((a1, "latency (s)"), (a2, "$ per 1M input tokens")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("input length (tokens)")
        ax.set_ylabel(ylab)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{payload['model']} prefill, batch 1, {CONFIG}, {payload['env']['gpu']} "
                 f"({payload['attention'].split(' ')[0]} attention)")
    return fig


if __name__ == "__main__":
    sys.exit(C.run_cli(main))
