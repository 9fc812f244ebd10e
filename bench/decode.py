"""Decode speed (tokens/s per user) against cost ($ per 1M output tokens) on one device, over batch sizes,
at fixed context lengths: the seed's decode plots, EP1 DP1 TP1.

Each point admits B sequences of S positions with `Runner.import_sequence` (the decode worker's path for
a handed-off prefill: real lengths, real page tables), whose pages hold RANDOM KV written straight into
the pool instead of a prefill's output, then times greedy decode steps both ways the decode scheduler runs
them (bench/decode_loop.py): `--mode sync`, `Runner.decode` + `Runner.sample` with the tokens read back
before the next step; `--mode pipelined`, the worker's greedy path, step N+1 launched on step N's tokens
still on the device before step N is read back (host work of N+1 under the GPU work of N). `both` (the
default) runs the two on the same KV (the pipelined sequences are forks of the sync ones, taken before the
sync steps) and checks they produce the same tokens. The pipelined step is the headline (tok/s, $) where
measured: it is what the served worker does.

    python -m kvrelay.bench.decode --model gpt-oss-20b --dummy --quant fp8-block128 --device cuda --quick
    python -m kvrelay.bench.decode --model gpt-oss-tiny --dummy --device cpu --lengths 64,256 --batches 1,4
"""

from __future__ import annotations

import argparse
import math
import sys

from kvrelay.bench import common as C
from kvrelay.bench import decode_loop as L
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
    p.add_argument("--mode", choices=("pipelined", "sync", "both"), default="both",
                   help="how decode steps are timed (bench/decode_loop.py): pipelined (the decode worker's "
                        "greedy path, the headline), sync (decode + sample, tokens read back each step), or "
                        "both on the same KV (default)")
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
    steps = _steps(args)
    fork = _fork_pages(args, lengths)
    full_seq = pages_spanned(max(lengths) + steps, ps) + fork
    # Sliding layers keep `window` positions, straddling one more page, plus pages the steps open.
    slide_seq = min(full_seq, window_pages(cfg.sliding_window, ps) + pages_spanned(steps, ps) + fork)
    # +1 per group: the Runner keeps one scratch page for CUDA-graph padding rows.
    want = {FULL: max(batches) * full_seq + 1, SLIDING: max(batches) * slide_seq + 1}
    if torch.device(args.device).type != "cuda":
        return want, "sized to the largest point"
    free, _ = torch.cuda.mem_get_info(torch.device(args.device))
    page_full = C.kv_bytes_per_page(cfg, ps, len(cfg.full_layers))
    page_slide = C.kv_bytes_per_page(cfg, ps, len(cfg.sliding_layers))
    # The weights as they sit in memory (K padded to 128, scales), + 1% for the allocator's rounding. The
    # old 5% on the unpadded bytes was ~3 GB too many on 120b, where that decided whether batch 64 at 8192
    # fits one H200 (2026-12-03: one page group short).
    spare = free - 1.01 * C.weight_bytes(cfg, args.quant, resident=True) - args.mem_headroom_gib * 2**30
    if want[FULL] * page_full + want[SLIDING] * page_slide <= spare:
        return want, "sized to the largest point"
    # Not every point fits: the sliding group is sized for the largest batch that fits at the shortest
    # length (not reserved for a batch skipped anyway), the full group takes the rest; the points it cannot
    # hold are skipped as "KV pool too small".
    short_seq = pages_spanned(min(lengths) + steps, ps) + fork
    fits = [b for b in sorted(set(batches)) if (b * short_seq + 1) * page_full + (b * slide_seq + 1) * page_slide
            <= spare]
    slide = (fits[-1] if fits else 1) * slide_seq + 1
    cap = max(int((spare - slide * page_slide) // page_full), full_seq + 1)
    return {FULL: cap, SLIDING: slide}, (
        f"capped by GPU memory at {cap} full pages ({cap * ps:,} positions); larger points are marked")


def _steps(args) -> int:
    """Positions a point appends (sized for): the warmup and timed steps, + the pipelined chain's two
    untimed launches (one spare position for sync alone, as sized before both modes)."""
    return args.warmup + args.iters + max(1, L.extra_positions(args.mode))


def _fork_pages(args, lengths: list[int]) -> int:
    """Pages per sequence a `both` run needs beyond one mode's: the fork copies a partial last page (the
    next token writes there) in each group while the original still holds its own."""
    return int(args.mode == "both" and any(s % args.page_size for s in lengths))


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
    steps = _steps(args)
    modes = L.MODES if args.mode == "both" else (args.mode,)
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
        "pool_note": pool_note, "sampling": "greedy (temperature 0), tokens fed back",
        "modes": list(modes), "headline": modes[0],
        "timing": {m: L.PIPELINED_NOTE if m == "pipelined" else L.SYNC_NOTE for m in modes},
        "points": [], "skipped": skipped,
    }
    console.print(f"[bold]decode[/] {cfg.name} quant={args.quant} device={args.device} attention={attention_label} "
                  f"cuda_graphs={graphs_label} modes={','.join(modes)}\n"
                  f"KV pool {num_pages} pages of {args.page_size}: {pool_note}\n{KV_NOTE}")
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
            forecast = pt * max(1.0, b / pb) * steps * len(modes)
            if forecast > budget.left():
                skipped.append({"length": s, "batch": b,
                                "reason": f"budget: ~{forecast:.0f} s needed, {budget.left():.0f} s left"})
                continue
        elif budget.exhausted():
            skipped.append({"length": s, "batch": b, "reason": "budget exhausted"})
            continue
        sids = [("bench-decode", s, b, i) for i in range(b)]
        need = b * (pages_spanned(s + steps, args.page_size) + _fork_pages(args, [s]))
        if need > runner.free_pages()[FULL]:
            too_big.add(s)
            skipped.append({"length": s, "batch": b, "reason": f"KV pool too small: {need} full pages needed, "
                            f"{runner.free_pages()[FULL]} in the pool ({pool_note})"})
            continue
        forks = [("bench-decode-pipelined", s, b, i) for i in range(b)] if len(modes) == 2 else sids
        runs: dict[str, L.Timed] = {}
        try:
            for sid in sids:
                runner.import_sequence(sid, s)
            if forks is not sids:  # the same KV for both modes, whatever the sync steps write
                for sid, fork in zip(sids, forks):
                    runner.fork_sequence(sid, fork)
        except OutOfPages as e:
            _free(runner, sids + forks)
            too_big.add(s)
            skipped.append({"length": s, "batch": b, "reason": f"KV pool too small: {e}"})
            continue
        tokens = torch.randint(0, cfg.vocab_size, (b,), generator=gen).tolist()
        greedy = [SamplingParams(max_tokens=steps + 1, temperature=0.0)] * b
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            if "sync" in modes:
                runs["sync"] = L.run_sync(runner, sids, tokens, warmup=args.warmup, iters=args.iters,
                                          greedy=greedy, sw=sw, budget=budget)
                _free(runner, sids if forks is not sids else [])
            if "pipelined" in modes:
                runs["pipelined"] = L.run_pipelined(runner, forks, tokens, warmup=args.warmup, iters=args.iters,
                                                    budget=budget)
        except Exception as e:  # noqa: BLE001
            _free(runner, sids + forks)
            if cuda:
                torch.cuda.empty_cache()
            if not (C.is_oom(e) or isinstance(e, OutOfPages)):
                raise
            too_big.add(s)
            skipped.append({"length": s, "batch": b, "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
            continue
        _free(runner, sids + forks)
        if not all(r.step_s for r in runs.values()):
            skipped.append({"length": s, "batch": b, "reason": "no timed step (warmup used the budget)"})
            continue
        pt = _point(cfg, s, b, runs, args, cuda)
        prev[s] = (b, L.headline(pt)["step_s"])
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


def _point(cfg, s: int, b: int, runs: dict, args, cuda: bool) -> dict:
    """A point's record: the sync keys (as before both modes existed) when sync ran, the pipelined_* keys
    when pipelined ran, and `headline`, which of the two its tok/s and $ are reported by."""
    import statistics

    import torch

    est_bytes = C.decode_bytes_per_step(cfg, b, s, args.quant)
    pt: dict = {"length": s, "batch": b, "est_bytes_per_step": est_bytes,
                "headline": "pipelined" if "pipelined" in runs else "sync"}
    if "sync" in runs:
        r = runs["sync"]
        step, fwd = statistics.median(r.step_s), statistics.median(r.forward_s)
        agg = b / step
        pt.update({
            "step_median_s": step, "step_min_s": min(r.step_s), "forward_median_s": fwd,
            "sample_median_s": max(0.0, step - fwd), "steps_timed": len(r.step_s), "step_times_s": r.step_s,
            "tokens_per_s_per_user": 1.0 / step, "tokens_per_s_aggregate": agg,
            "usd_per_m_output": C.decode_usd_per_m_output(agg, 1, args.usd_per_gpu_hour),
            "est_bandwidth_tb_s": est_bytes / fwd / 1e12, "pct_copy_ceiling": 100 * est_bytes / fwd / C.COPY_BW_BYTES_S,
        })
    if "pipelined" in runs:
        r = runs["pipelined"]
        step = statistics.median(r.step_s)
        agg = b / step
        pt.update({
            "pipelined_step_median_s": step, "pipelined_step_min_s": min(r.step_s),
            "pipelined_step_mean_s": sum(r.step_s) / len(r.step_s),  # = wall time over the chain / steps
            "pipelined_steps_timed": len(r.step_s), "pipelined_step_times_s": r.step_s,
            "pipelined_tokens_per_s_per_user": 1.0 / step, "pipelined_tokens_per_s_aggregate": agg,
            "pipelined_usd_per_m_output": C.decode_usd_per_m_output(agg, 1, args.usd_per_gpu_hour),
            "pipelined_est_bandwidth_tb_s": est_bytes / step / 1e12,
            "pipelined_pct_copy_ceiling": 100 * est_bytes / step / C.COPY_BW_BYTES_S,
        })
    if len(runs) == 2:
        # Greedy on the same KV from the same tokens: the chain must feed each step the token the step
        # before sampled, so every step's tokens match (steps the sync loop ran; its budget may cut it).
        sync_toks = runs["sync"].tokens
        pt["pipelined_tokens_match_sync"] = runs["pipelined"].tokens[:len(sync_toks)] == sync_toks
        pt["tokens_compared_steps"] = len(sync_toks)
    pt["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return pt


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _print(console, payload: dict) -> None:
    from rich.table import Table

    for s in sorted({p["length"] for p in payload["points"]}):
        t = Table(title=f"{payload['model']} decode at context {s}, {CONFIG} on 1 x {payload['env']['gpu']}, "
                        f"{payload['quant']} (${payload['usd_per_gpu_hour']:.2f}/GPU-h); * = headline step")
        for col in ("batch", "pipelined ms", "sync ms", "forward ms", "sample ms", "tok/s/user", "tok/s total",
                    "$/1M out", "est. GB/s read", "% of 4.19 TB/s", "steps", "same tokens", "peak GiB"):
            t.add_column(col, justify="right")
        for p in (p for p in payload["points"] if p["length"] == s):
            h = L.headline(p)
            pipe, sync = _ms(p.get("pipelined_step_median_s")), _ms(p.get("step_median_s"))
            pipe, sync = (pipe + "*", sync) if h["timing"] == "pipelined" else (pipe, sync + "*")
            bw = p.get("pipelined_est_bandwidth_tb_s") if h["timing"] == "pipelined" else p["est_bandwidth_tb_s"]
            pct = p.get("pipelined_pct_copy_ceiling") if h["timing"] == "pipelined" else p["pct_copy_ceiling"]
            same = p.get("pipelined_tokens_match_sync")
            t.add_row(str(p["batch"]), pipe, sync, _ms(p.get("forward_median_s")), _ms(p.get("sample_median_s")),
                      f"{h['tokens_per_s_per_user']:.1f}", f"{h['tokens_per_s_aggregate']:,.0f}",
                      f"${h['usd_per_m_output']:.3f}", f"{bw * 1e3:,.0f}", f"{pct:.0f}",
                      str(p.get("pipelined_steps_timed", p.get("steps_timed"))),
                      "-" if same is None else ("yes" if same else "[red]NO[/]"),
                      "-" if p["peak_mem_gib"] is None else f"{p['peak_mem_gib']:.1f}")
        console.print(t)
    for m, note in payload["timing"].items():
        console.print(f"[dim]{note}[/]")
    console.print(f"[dim]{payload['kv_fill']}. Bytes: weights touched (expected distinct experts) + KV, over the "
                  f"headline step (sync: over the forward); the seed published decode only as plots.[/]")
    for s in payload["skipped"]:
        console.print(f"[yellow]skipped S={s['length']} B={s['batch']}: {s['reason']}[/]")


def _plot(payload: dict):
    fig, ax = C.new_figure(figsize=(7, 5))
    for s in sorted({p["length"] for p in payload["points"]}):
        pts = sorted((p for p in payload["points"] if p["length"] == s), key=lambda p: p["batch"])
        xs = [L.headline(p)["usd_per_m_output"] for p in pts]
        ys = [L.headline(p)["tokens_per_s_per_user"] for p in pts]
        ax.plot(xs, ys, "o-", label=f"seq len {s}")
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(f"B={p['batch']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    if all(math.isfinite(L.headline(p)["usd_per_m_output"]) for p in payload["points"]):
        ax.invert_xaxis()  # cheaper to the right, as "better" is up and to the right
    ax.set_xlabel("$ per 1M output tokens (log, cheaper to the right)")
    ax.set_ylabel("decode speed (tokens/s per user)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(f"{payload['model']} decode, {CONFIG}, {payload['quant']}, {payload['env']['gpu']}\n"
                 f"batch 1..{max(p['batch'] for p in payload['points'])}, random KV fill, {payload['headline']} step",
                 fontsize=10)
    return fig


if __name__ == "__main__":
    sys.exit(C.run_cli(main))
