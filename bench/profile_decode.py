"""Where a decode step's GPU time goes: one batch of sequences at a given context, eager (no CUDA graph,
so each kernel shows up by name), profiled with torch.profiler; prints the kernels by total CUDA time and
the sum against the step's wall time. A large gap between the two means launch-bound; a few kernels far
above their share of the bytes they read are the ones to fuse or retune.

usage (H200): python -m kvrelay.bench.profile_decode --model gpt-oss-20b --dummy --quant fp8-block128 \
                 --device cuda --batch 1 --context 2048 [--graphs --chain 50] [--out DIR]

--chain N also times N chained steps the way the decode worker runs greedy rows (bench/decode_loop.py:
step N+1 launched on step N's tokens on the device before N is read back), so the wall time per step can
be set against the kernel time with the host work hidden; with --graphs only (an eager step waits for the
one before it: Runner.decode_launch).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from kvrelay.bench import decode_loop
from kvrelay.bench.common import Budget, add_common_args, build_runner, env_info, resolve_config
from kvrelay.engine.kv_geometry import FULL, SLIDING


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m kvrelay.bench.profile_decode", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--graphs", action="store_true",
                   help="profile a replayed CUDA-graph step (captured at --batch) instead of an eager one")
    p.add_argument("--chain", type=int, default=0, metavar="N",
                   help="also time N chained (pipelined) greedy steps, as the decode worker runs them")
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg = resolve_config(args.model)
    per_seq = -(-(args.context + 8 + args.chain + 5) // args.page_size)
    runner, build_s, _ = build_runner(args, num_pages={FULL: per_seq * args.batch + 8,
                                                       SLIDING: (cfg.sliding_window // args.page_size + 3)
                                                       * args.batch + 8},
                                      extra={"cuda_graphs": True, "cuda_graph_batch_sizes": (args.batch,)}
                                      if args.graphs else {"cuda_graphs": False})
    sids = [f"s{i}" for i in range(args.batch)]
    for sid in sids:
        runner.import_sequence(sid, args.context)
    for pool in runner.kv_pools.values():
        pool.normal_(0, 1)  # random KV: the attention kernels read real bytes, values do not matter here
    tokens = [1] * args.batch
    cuda = torch.device(args.device).type == "cuda"

    def step() -> None:
        runner.decode(sids, tokens)
        # decode appends a position; keep the context fixed so every profiled step is the same work
        for sid in sids:
            runner.free(sid)
            runner.import_sequence(sid, args.context)

    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.decode(sids, tokens)
    host_ms = (time.perf_counter() - t0) * 1e3  # until the step is queued (graphs: planned + replayed)
    if cuda:
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    for sid in sids:
        runner.free(sid)
        runner.import_sequence(sid, args.context)
    pipelined_ms = None
    if args.chain > 0:
        timed = decode_loop.run_pipelined(runner, sids, tokens, warmup=3, iters=args.chain, budget=Budget(None))
        pipelined_ms = sorted(timed.step_s)[len(timed.step_s) // 2] * 1e3
        for sid in sids:
            runner.free(sid)
            runner.import_sequence(sid, args.context)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        runner.decode(sids, tokens)
        if cuda:
            torch.cuda.synchronize()
    # On CUDA only the device's own events (kernels, memcpy/memset): the aten op that launched a kernel
    # carries its kernels' time as "self device time" too, and counting both (as this did until
    # 2026-12-01) doubled every cuBLAS/aten kernel in the launch count and the kernel time.
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if (getattr(e, attr, 0) or 0) > 0
              and (not cuda or e.device_type.name == "CUDA")]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    total_us = sum(getattr(e, attr) for e in events)
    rows = [{"kernel": e.key[:90], "calls": e.count, "total_us": round(getattr(e, attr), 1),
             "share": round(getattr(e, attr) / total_us, 3) if total_us else 0.0} for e in events[: args.top]]
    kind = "graph" if args.graphs else "eager"
    launches = sum(e.count for e in events)
    print(f"{args.model} {args.quant} decode batch {args.batch} context {args.context}: {kind} step "
          f"{wall_ms:.2f} ms wall ({host_ms:.2f} ms on the host until queued), {total_us / 1e3:.2f} ms of kernel "
          f"time in {launches} launches, {launches / cfg.num_hidden_layers:.1f} per layer "
          f"(model built in {build_s:.1f} s)")
    if pipelined_ms is not None:
        print(f"pipelined: {pipelined_ms:.2f} ms per step (median over {args.chain} chained steps, context "
              f"{args.context}..{args.context + args.chain + 5})")
    print(f"{'kernel':90s} {'calls':>6s} {'us':>9s} {'share':>6s}")
    for r in rows:
        print(f"{r['kernel']:90s} {r['calls']:6d} {r['total_us']:9.1f} {r['share']:6.1%}")
    result = {"env": env_info(args.device, "kvrelay.bench.profile_decode", argv), "wall_ms": wall_ms,
              "host_ms": host_ms, "graphs": args.graphs, "pipelined_ms": pipelined_ms, "chain": args.chain,
              "kernel_ms": total_us / 1e3, "launches": launches,
              "launches_per_layer": launches / cfg.num_hidden_layers, "fused": os.environ.get("KVRELAY_FUSED") != "0",
              "top": rows,
              "batch": args.batch, "context": args.context, "model": args.model, "quant": args.quant}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = (f"profile-decode-{args.model}-b{args.batch}{'-graph' if args.graphs else ''}"
                f"{'' if result['fused'] else '-unfused'}.json")
        (out / name).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
