"""Decode speed (tokens/s per user) against cost ($ per 1M output tokens) on one device, over batch sizes,
at fixed context lengths: the seed's decode plots, EP1 DP1 TP1.

Each point admits B sequences of S positions with `Runner.import_sequence` (the decode worker's path for
a handed-off prefill: real lengths, real page tables), whose pages hold RANDOM KV written straight into
the pool instead of a prefill's output, then times decode steps as the decode scheduler runs them:
`Runner.decode` of the batch + `Runner.sample` (greedy), feeding the sampled tokens back.

    python -m kvrelay.bench.decode --model gpt-oss-20b --dummy --quant fp8-block128 --device cuda --quick
    python -m kvrelay.bench.decode --model gpt-oss-tiny --dummy --device cpu --lengths 64,256 --batches 1,4
"""

from __future__ import annotations

import argparse
import math
import sys

from kvrelay.bench import common as C
from kvrelay.engine.kv_geometry import FULL, SLIDING, pages_spanned, window_pages

CONFIG = "EP1 DP1 TP1"
FULL_LENGTHS = [8192, 32768]
FULL_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]
QUICK_LENGTHS = [8192, 32768]
QUICK_BATCHES = [1, 8, 32, 128]
QUICK_BUDGET_S = 140.0
KV_NOTE = ("KV pages were filled with random values (not computed by a prefill); sequence lengths and page "
           "tables are real (Runner.import_sequence)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvrelay.bench.decode", description=__doc__.split("\n\n")[0])
    C.add_common_args(p)
    p.add_argument("--lengths", default=None, help=f"context lengths (default {FULL_LENGTHS})")
    p.add_argument("--batches", default=None, help=f"batch sizes (default {FULL_BATCHES}, --quick {QUICK_BATCHES})")
    p.add_argument("--mem-headroom-gib", type=float, default=6.0,
                   help="GPU memory kept free for activations when sizing the KV pool")
    return p


def _settings(args) -> None:
    if args.lengths is None:
        args.lengths = ",".join(map(str, QUICK_LENGTHS if args.quick else FULL_LENGTHS))
    if args.batches is None:
        args.batches = ",".join(map(str, QUICK_BATCHES if args.quick else FULL_BATCHES))
    if args.warmup is None:
        args.warmup = 2 if args.quick else 3
    if args.iters is None:
        args.iters = 5 if args.quick else 10
    if args.budget_s is None and args.quick:
        args.budget_s = QUICK_BUDGET_S


def _pool_pages(cfg, args, lengths: list[int], batches: list[int]) -> tuple[dict[str, int], str]:
    """Pages per group for the largest point, capped on a GPU by the memory the weights leave free."""
    import torch

    ps = args.page_size
    steps = args.warmup + args.iters + 1
    full_seq = pages_spanned(max(lengths) + steps, ps)
    # Sliding layers keep `window` positions, straddling one more page, plus pages the steps open.
    slide_seq = min(full_seq, window_pages(cfg.sliding_window, ps) + pages_spanned(steps, ps))
    # +1 per group: the Runner keeps one scratch page for CUDA-graph padding rows.
    want = {FULL: max(batches) * full_seq + 1, SLIDING: max(batches) * slide_seq + 1}
    if torch.device(args.device).type != "cuda":
        return want, "sized to the largest point"
    free, _ = torch.cuda.mem_get_info(torch.device(args.device))
    page_full = C.kv_bytes_per_page(cfg, ps, len(cfg.full_layers))
    page_slide = C.kv_bytes_per_page(cfg, ps, len(cfg.sliding_layers))
    # 5% on top of the weight estimate: scales, padding and the allocator's rounding are not counted.
    weights = 1.05 * C.weight_bytes(cfg, args.quant)
    spare = free - weights - args.mem_headroom_gib * 2**30 - want[SLIDING] * page_slide
    cap = max(int(spare // page_full), full_seq)
    if cap >= want[FULL]:
        return want, "sized to the largest point"
    return {FULL: cap, SLIDING: want[SLIDING]}, (
        f"capped by GPU memory at {cap} full pages ({cap * ps:,} positions); larger points are marked")


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    _settings(args)
    import torch
    from tqdm import tqdm

    from kvrelay.engine.kv_cache import OutOfPages
    from kvrelay.engine.kv_geometry import GROUPS
    from kvrelay.engine.sampling import SamplingParams

    console = C.console()
    cfg = C.resolve_config(args.model)
    steps = args.warmup + args.iters + 1
    skipped: list[dict] = []
    lengths = []
    for s in C.parse_ints(args.lengths):
        if s + steps > cfg.max_context:
            skipped.append({"length": s, "batch": None, "reason": f"S + {steps} steps > max_context {cfg.max_context}"})
        else:
            lengths.append(s)
    batches = sorted(C.parse_ints(args.batches))
    attention_fn, attention_label = C.choose_attention(args.attention, args.device)
    graphs, graphs_label = C.graph_kwargs(args.cuda_graphs, args.device, batches)
    num_pages, pool_note = _pool_pages(cfg, args, lengths or [1], batches)
    payload: dict = {
        "kind": "decode", "env": C.env_info(args.device, "kvrelay.bench.decode", argv),
        "model": cfg.name, "quant": args.quant,
        "dummy": args.dummy, "config": CONFIG, "gpus": 1, "usd_per_gpu_hour": args.usd_per_gpu_hour,
        "attention": attention_label, "cuda_graphs": graphs_label, "warmup_steps": args.warmup,
        "timed_steps": args.iters, "budget_s": args.budget_s, "kv_fill": KV_NOTE, "pool_pages": num_pages,
        "pool_note": pool_note, "sampling": "greedy (Runner.sample, temperature 0), tokens fed back",
        "points": [], "skipped": skipped,
    }
    console.print(f"[bold]decode[/] {cfg.name} quant={args.quant} device={args.device} attention={attention_label} "
                  f"cuda_graphs={graphs_label}\nKV pool {num_pages} pages of {args.page_size}: {pool_note}\n{KV_NOTE}")
    try:
        min_pages = -(-(min(lengths or [1]) + steps) // args.page_size)
        runner, load_s, used = C.build_runner(args, num_pages=num_pages, attention_fn=attention_fn, extra=graphs,
                                              min_full_pages=min_pages)
    except Exception as e:  # noqa: BLE001 - keep a record of why (e.g. 120b bf16 does not fit one GPU)
        payload["error"] = f"building the Runner failed: {type(e).__name__}: {e}"
        console.print(f"[red]{payload['error']}[/]")
        payload["files"] = C.save_result(args.out, C.result_stem("decode", args), payload)
        return payload
    payload["load_s"] = load_s
    if used != num_pages:
        pool_note = f"reduced to {used} after an OOM while building"
        payload["pool_pages"], payload["pool_note"] = used, pool_note
    console.print(f"model built in {load_s:.1f} s; KV pool {used}")
    _fill_random(runner, GROUPS, args.seed)

    cuda = torch.device(args.device).type == "cuda"
    sw = C.StopWatch(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    budget = C.Budget(args.budget_s)
    grid = [(s, b) for s in lengths for b in batches]
    too_big: set[int] = set()
    prev: dict[int, tuple[int, float]] = {}  # S -> (B, step seconds) of the last point measured

    for s, b in tqdm(grid, desc="decode points", unit="pt"):
        if s in too_big:
            skipped.append({"length": s, "batch": b, "reason": "KV pool too small (a smaller batch already was)"})
            continue
        if s in prev:
            pb, pt = prev[s]
            forecast = pt * max(1.0, b / pb) * steps
            if forecast > budget.left():
                skipped.append({"length": s, "batch": b,
                                "reason": f"budget: ~{forecast:.0f} s needed, {budget.left():.0f} s left"})
                continue
        elif budget.exhausted():
            skipped.append({"length": s, "batch": b, "reason": "budget exhausted"})
            continue
        sids = [("bench-decode", s, b, i) for i in range(b)]
        need = b * pages_spanned(s + steps, args.page_size)
        if need > runner.free_pages()[FULL]:
            too_big.add(s)
            skipped.append({"length": s, "batch": b, "reason": f"KV pool too small: {need} full pages needed, "
                            f"{runner.free_pages()[FULL]} in the pool ({pool_note})"})
            continue
        try:
            for sid in sids:
                runner.import_sequence(sid, s)
        except OutOfPages as e:
            _free(runner, sids)
            too_big.add(s)
            skipped.append({"length": s, "batch": b, "reason": f"KV pool too small: {e}"})
            continue
        tokens = torch.randint(0, cfg.vocab_size, (b,), generator=gen).tolist()
        greedy = [SamplingParams(max_tokens=steps + 1, temperature=0.0)] * b
        step_t, fwd_t = [], []
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            for i in range(steps - 1):
                a = sw.mark()
                logits = runner.decode(sids, tokens)
                m = sw.mark()
                tokens = [t for t, _ in runner.sample(logits, greedy, [i + 1] * b)]
                z = sw.mark()
                if i >= args.warmup:
                    step_t.append(sw.elapsed(a, z))
                    fwd_t.append(sw.elapsed(a, m))
                if i >= args.warmup and budget.left() < 0 and step_t:
                    break  # over budget: keep the steps timed so far (at least one)
        except Exception as e:  # noqa: BLE001
            _free(runner, sids)
            if cuda:
                torch.cuda.empty_cache()
            if not (C.is_oom(e) or isinstance(e, OutOfPages)):
                raise
            too_big.add(s)
            skipped.append({"length": s, "batch": b, "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
            continue
        _free(runner, sids)
        if not step_t:
            skipped.append({"length": s, "batch": b, "reason": "no timed step (warmup used the budget)"})
            continue
        pt = _point(cfg, s, b, step_t, fwd_t, args, cuda)
        prev[s] = (b, pt["step_median_s"])
        payload["points"].append(pt)

    _print(console, payload)
    fig = _plot(payload) if payload["points"] else None
    payload["files"] = C.save_result(args.out, C.result_stem("decode", args), payload, fig)
    console.print(f"saved {payload['files']}")
    return payload


def _fill_random(runner, groups, seed: int) -> None:
    """Random KV in every page of the pool, once (a prefill would have written these pages). Chunked so a
    100 GB pool never needs a same-sized temporary."""
    import torch

    torch.manual_seed(seed)
    for g in groups:
        pool = runner.kv_pools[g]  # [layers, pages, 2, page, kv_heads, head_dim]
        chunk = max(1, (256 << 20) // max(1, pool[0, :1].numel() * pool.element_size()))
        for layer in range(pool.shape[0]):
            for p0 in range(0, pool.shape[1], chunk):
                pool[layer, p0:p0 + chunk].normal_()


def _free(runner, sids) -> None:
    for sid in sids:
        if runner.has_sequence(sid):
            runner.free(sid)


def _point(cfg, s: int, b: int, step_t: list[float], fwd_t: list[float], args, cuda: bool) -> dict:
    import statistics

    import torch

    step = statistics.median(step_t)
    fwd = statistics.median(fwd_t)
    agg = b / step
    est_bytes = C.decode_bytes_per_step(cfg, b, s, args.quant)
    return {
        "length": s, "batch": b, "step_median_s": step, "step_min_s": min(step_t), "forward_median_s": fwd,
        "sample_median_s": max(0.0, step - fwd), "steps_timed": len(step_t), "step_times_s": step_t,
        "tokens_per_s_per_user": 1.0 / step, "tokens_per_s_aggregate": agg,
        "usd_per_m_output": C.decode_usd_per_m_output(agg, 1, args.usd_per_gpu_hour),
        "est_bytes_per_step": est_bytes, "est_bandwidth_tb_s": est_bytes / fwd / 1e12,
        "pct_copy_ceiling": 100 * est_bytes / fwd / C.COPY_BW_BYTES_S,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def _print(console, payload: dict) -> None:
    from rich.table import Table

    for s in sorted({p["length"] for p in payload["points"]}):
        t = Table(title=f"{payload['model']} decode at context {s}, {CONFIG} on 1 x {payload['env']['gpu']}, "
                        f"{payload['quant']} (${payload['usd_per_gpu_hour']:.2f}/GPU-h)")
        for col in ("batch", "step ms", "forward ms", "sample ms", "tok/s/user", "tok/s total", "$/1M out",
                    "est. GB/s read", "% of 4.19 TB/s", "steps", "peak GiB"):
            t.add_column(col, justify="right")
        for p in (p for p in payload["points"] if p["length"] == s):
            t.add_row(str(p["batch"]), f"{p['step_median_s'] * 1e3:.2f}", f"{p['forward_median_s'] * 1e3:.2f}",
                      f"{p['sample_median_s'] * 1e3:.2f}", f"{p['tokens_per_s_per_user']:.1f}",
                      f"{p['tokens_per_s_aggregate']:,.0f}", f"${p['usd_per_m_output']:.3f}",
                      f"{p['est_bandwidth_tb_s'] * 1e3:,.0f}", f"{p['pct_copy_ceiling']:.0f}", str(p["steps_timed"]),
                      "-" if p["peak_mem_gib"] is None else f"{p['peak_mem_gib']:.1f}")
        console.print(t)
    console.print(f"[dim]{payload['kv_fill']}. Bytes: weights touched (expected distinct experts) + KV; "
                  f"the seed published decode only as plots (no numbers to compare).[/]")
    for s in payload["skipped"]:
        console.print(f"[yellow]skipped S={s['length']} B={s['batch']}: {s['reason']}[/]")


def _plot(payload: dict):
    fig, ax = C.new_figure(figsize=(7, 5))
    for s in sorted({p["length"] for p in payload["points"]}):
        pts = sorted((p for p in payload["points"] if p["length"] == s), key=lambda p: p["batch"])
        xs = [p["usd_per_m_output"] for p in pts]
        ys = [p["tokens_per_s_per_user"] for p in pts]
        ax.plot(xs, ys, "o-", label=f"seq len {s}")
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(f"B={p['batch']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    if all(math.isfinite(p["usd_per_m_output"]) for p in payload["points"]):
        ax.invert_xaxis()  # cheaper to the right, as "better" is up and to the right
    ax.set_xlabel("$ per 1M output tokens (log, cheaper to the right)")
    ax.set_ylabel("decode speed (tokens/s per user)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(f"{payload['model']} decode, {CONFIG}, {payload['quant']}, {payload['env']['gpu']}\n"
                 f"batch 1..{max(p['batch'] for p in payload['points'])}, random KV fill", fontsize=10)
    return fig


if __name__ == "__main__":
    sys.exit(C.run_cli(main))
