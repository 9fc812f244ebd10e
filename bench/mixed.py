"""A colocated worker's prompt-carrying step: `--rows` running sequences' decode tokens at `--context`
plus one prompt chunk of each `--chunks` size, in one ragged forward. Each point is timed three ways:
eager (the monolithic forward), piecewise CUDA graphs (engine/cuda_graph.PiecewiseGraphs), and the host
time until the step is queued (the GPU idles whenever that exceeds the kernels' time).

usage (H200): python -m kvrelay.bench.mixed --model gpt-oss-20b --dummy --quant fp8-block128 --device cuda
                 [--rows 64] [--context 1024] [--chunks 256,512,1024,2048,4096]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvrelay.bench.common import (add_common_args, build_runner, env_info, parse_ints, resolve_config,
                                  result_stem)
from kvrelay.engine.kv_geometry import FULL, SLIDING


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m kvrelay.bench.mixed", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--rows", type=int, default=64, help="running sequences (one decode token each)")
    p.add_argument("--context", type=int, default=1024, help="their context length")
    p.add_argument("--chunks", default="256,512,1024,2048,4096", help="prompt chunk sizes, one per point")
    args = p.parse_args(argv)
    import torch

    cfg = resolve_config(args.model)
    chunks = parse_ints(args.chunks)
    per = -(-(args.context + 8) // args.page_size)
    biggest = -(-(max(chunks) + 8) // args.page_size)
    win = cfg.sliding_window // args.page_size + 3
    runner, build_s, _ = build_runner(args, num_pages={FULL: per * args.rows + biggest + 16,
                                                       SLIDING: win * args.rows + biggest + 16},
                                      extra={"cuda_graph_batch_sizes": (1, 8, 64)})
    t0 = time.perf_counter()
    runner.warmup()
    capture_s = time.perf_counter() - t0
    sids = [f"s{i}" for i in range(args.rows)]
    for sid in sids:
        runner.import_sequence(sid, args.context)
    for pool in runner.kv_pools.values():
        pool.normal_(0, 1)  # random KV: the kernels read real bytes, values do not matter here
    pieces, sizes = runner._pieces, runner.piecewise_token_sizes  # None off CUDA: both timings eager
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)

    def step(chunk: int, use_pieces: bool) -> tuple[float, float]:
        # Off: no pieces and no sizes (the Runner would capture them again at the next forward).
        runner._pieces = pieces if use_pieces else None
        runner.piecewise_token_sizes = sizes if use_pieces else ()
        items = [(sid, [1]) for sid in sids] + [("p", [(i * 7919) % cfg.vocab_size for i in range(chunk)])]
        sync()
        t = time.perf_counter()
        runner.forward_mixed(items)
        host = time.perf_counter() - t
        sync()
        wall = time.perf_counter() - t
        runner.free("p")
        for sid in sids:  # keep every step the same work
            runner.free(sid)
            runner.import_sequence(sid, args.context)
        return host, wall

    def decode_step() -> float:
        """The same rows' plain decode step (a CUDA graph on the GPU): the engine's decode rate."""
        sync()
        t = time.perf_counter()
        runner.decode(sids, [1] * len(sids))
        sync()
        wall = time.perf_counter() - t
        for sid in sids:
            runner.free(sid)
            runner.import_sequence(sid, args.context)
        return wall

    for _ in range(3):
        decode_step()
    decode_ms = sorted(decode_step() for _ in range(7))[3] * 1e3
    rows = []
    for chunk in chunks:
        point = {"chunk": chunk, "tokens": chunk + args.rows}
        for name, on in (("eager", False), ("pieces", True)):
            for _ in range(2):
                step(chunk, on)
            samples = sorted(step(chunk, on) for _ in range(5))
            host, wall = samples[len(samples) // 2]
            point[f"{name}_ms"] = round(wall * 1e3, 2)
            point[f"{name}_host_ms"] = round(host * 1e3, 2)
        point["speedup"] = round(point["eager_ms"] / point["pieces_ms"], 2)
        point["prefill_tok_s_pieces"] = round(chunk / (point["pieces_ms"] / 1e3))
        rows.append(point)
    runner._pieces, runner.piecewise_token_sizes = pieces, sizes
    print(f"{args.model} {args.quant}: {args.rows} decode rows at context {args.context} + one prompt chunk "
          f"(model built in {build_s:.0f} s, graphs captured in {capture_s:.1f} s); their plain decode step "
          f"{decode_ms:.2f} ms = {args.rows / decode_ms * 1e3:,.0f} tok/s")
    print(f"| chunk | tokens | eager ms (host) | piecewise ms (host) | speedup | chunk tok/s (piecewise) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['chunk']} | {r['tokens']} | {r['eager_ms']} ({r['eager_host_ms']}) | {r['pieces_ms']} "
              f"({r['pieces_host_ms']}) | {r['speedup']}x | {r['prefill_tok_s_pieces']:,} |")
    result = {"env": env_info(args.device, "kvrelay.bench.mixed", argv), "model": args.model,
              "quant": args.quant, "rows": args.rows, "context": args.context, "capture_s": capture_s,
              "decode_step_ms": round(decode_ms, 3), "decode_tok_s": round(args.rows / decode_ms * 1e3),
              "points": rows}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{result_stem('mixed', args)}.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
