"""Quick Runner timing on one GPU: decode steps (Runner.decode + greedy Runner.sample) at a fixed context
for a few batch sizes with CUDA graphs on and off, and one long prefill. Dummy weights.

    python -m kvrelay.bench.runner_timing --model gpt-oss-20b --quant fp8-block128 --ctx 2048 \\
        --batches 1,32,128 --prefill 8192 --out bench/results/runner-timing.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvrelay.engine.kv_geometry import FULL, SLIDING


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--quant", default="fp8-block128")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--prefill", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    from kvrelay.engine.config import load_model_config
    from kvrelay.engine.runner import Runner, open_model_weights
    from kvrelay.engine.sampling import SamplingParams

    cfg = load_model_config(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    per_seq = -(-(max(args.ctx, args.prefill) + args.steps + 8) // 16)
    pages = max(batches) * per_seq + 64
    t0 = time.perf_counter()
    r = Runner(cfg, open_model_weights(args.model, cfg, dummy=True, seed=0), device="cuda", quant=args.quant,
               num_pages={FULL: pages, SLIDING: pages})
    torch.cuda.synchronize()
    res = {"model": cfg.name, "quant": args.quant, "ctx": args.ctx, "attention": r.model.attention_backend,
           "load_s": time.perf_counter() - t0, "gpu": torch.cuda.get_device_name(), "decode": [], "prefill": {}}
    print(f"built in {res['load_s']:.1f} s, attention {res['attention']}", flush=True)
    gen = torch.Generator().manual_seed(0)
    for graphs in (True, False):
        sizes = r.cuda_graph_batch_sizes
        if not graphs:
            r.cuda_graph_batch_sizes = ()
        for b in batches:
            sids = [("d", b, i) for i in range(b)]
            for s in sids:
                r.import_sequence(s, args.ctx)
            toks = torch.randint(0, cfg.vocab_size, (b,), generator=gen).tolist()
            greedy = [SamplingParams(temperature=0)] * b
            times = []
            t_cap = time.perf_counter()
            for i in range(args.steps + 2):
                torch.cuda.synchronize()
                a = time.perf_counter()
                toks = [t for t, _ in r.sample(r.decode(sids, toks), greedy, [i] * b)]
                times.append(time.perf_counter() - a)
                if i == 0:
                    first = time.perf_counter() - t_cap
            for s in sids:
                r.free(s)
            med = statistics.median(times[2:])
            row = {"graphs": graphs, "batch": b, "step_ms": med * 1e3, "tokens_s": b / med, "first_step_s": first}
            res["decode"].append(row)
            print(json.dumps(row), flush=True)
        r.cuda_graph_batch_sizes = sizes
    if args.prefill:
        ids = torch.randint(0, cfg.vocab_size, (args.prefill,), generator=gen).tolist()
        times = []
        for i in range(4):
            torch.cuda.synchronize()
            a = time.perf_counter()
            r.prefill("p", ids)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - a)
            r.free("p")
        res["prefill"] = {"tokens": args.prefill, "first_s": times[0], "median_s": statistics.median(times[1:]),
                          "tokens_s": args.prefill / statistics.median(times[1:])}
        print(json.dumps(res["prefill"]), flush=True)
    res["max_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
