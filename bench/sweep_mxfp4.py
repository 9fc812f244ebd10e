"""Sweep the launches of the MXFP4 experts' decode GEMVs (kernels/moe_mxfp4.py) at batch 1 on one GPU and write
the winners as that GPU's table (kernels/configs/mxfp4_<GPU>.json, which kernels.moe_mxfp4 serves from).

Each GEMM alone (GEMM1 + SwiGLU; GEMM2 + routing weight) on experts of the real shape (random bytes and scales,
never zeros), consecutive calls on disjoint expert sets (bench/sweep_gemv.expert_sets: no call reads its
weights from L2), timed as calls back to back in a CUDA graph (bench/tune_moe_space.time_ms); every launch is
checked against today's output first (same math, another fp32 summation order: relative error < 2e-3).

    python -m kvrelay.bench.sweep_mxfp4 --out bench/results --config-out kernels/configs
    python -m kvrelay.bench.sweep_mxfp4 --device cpu --models gpt-oss-tiny --samples 2   # plumbing only
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import time
from pathlib import Path

import torch

from kvrelay.bench import common as C
from kvrelay.bench.sweep_gemv import expert_sets
from kvrelay.bench.tune_moe_space import rel_err, time_ms
from kvrelay.engine.config import load_model_config
from kvrelay.kernels import moe_mxfp4 as M
from kvrelay.kernels.moe import MoEWeights

SPACE = {"block_n": (16, 32, 64), "block_k": (128, 256, 512), "num_warps": (2, 4, 8), "num_stages": (2, 3, 4)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt-oss-120b")
    p.add_argument("--samples", type=int, default=40, help="random launches per GEMM besides today's")
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--config-out", default=None, help="folder for mxfp4_<GPU>.json (the served table)")
    return p


def _experts(cfg, dev, gen) -> MoEWeights:
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    byte = lambda *s: torch.randint(0, 256, s, generator=gen, device=dev, dtype=torch.uint8)  # noqa: E731
    scale = lambda *s: torch.randint(117, 123, s, generator=gen, device=dev, dtype=torch.uint8)  # noqa: E731
    bias = lambda *s: (torch.randn(*s, generator=gen, device=dev) * 0.1).bfloat16()  # noqa: E731
    return MoEWeights.from_mxfp4(byte(e, 2 * i, h // 32, 16), scale(e, 2 * i, h // 32), bias(e, 2 * i),
                                 byte(e, h, i // 32, 16), scale(e, h, i // 32), bias(e, h))


def _sweep_one(which: str, ex: MoEWeights, x, sets, rw, act, y, launches, args, deadline) -> list[dict]:
    k = 4
    run = (lambda ids, lc: M.gemv1(x, ids, k, ex, 1.702, 7.0, act, lc)) if which == "gemv1" else \
        (lambda ids, lc: M.gemv2(act, ids, rw, ex, y, lc))
    out = act if which == "gemv1" else y
    run(sets[0], launches[0])
    want = out.clone()
    nbytes = sets[0].numel() * (ex.w1[0].numel() + ex.s1[0].numel() if which == "gemv1"
                                else ex.w2[0].numel() + ex.s2[0].numel())
    rows = []
    for lc in launches:
        if time.monotonic() > deadline:
            break
        try:
            run(sets[0], lc)
            err = rel_err(out, want)
        except Exception as e:  # noqa: BLE001 - a launch the compiler refuses: recorded, not fatal
            rows.append({"launch": dataclasses.asdict(lc), "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        if err > 2e-3:
            rows.append({"launch": dataclasses.asdict(lc), "error": f"rel err {err:.2e}"})
            continue
        it = itertools.cycle(sets)
        ms = time_ms(lambda: run(next(it), lc), x.is_cuda, 5, args.rep_ms)
        rows.append({"launch": dataclasses.asdict(lc), "us": ms * 1e3, "gb_s": nbytes / ms / 1e6, "rel_err": err})
        print(f"{which} {lc}: {ms * 1e3:.2f} us ({nbytes / ms / 1e6:.0f} GB/s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dev = torch.device(args.device)
    rng = random.Random(args.seed)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    deadline = time.monotonic() + args.budget_s
    pool = [M.MxLaunch(*v) for v in itertools.product(*SPACE.values())]
    rng.shuffle(pool)
    result = {"kind": "sweep-mxfp4", "env": C.env_info(dev, "kvrelay.bench.sweep_mxfp4", argv), "models": {}}
    best = {}
    for model in args.models.split(","):
        cfg = load_model_config(model)
        ex = _experts(cfg, dev, gen)
        x = torch.randn(1, cfg.hidden_size, generator=gen, device=dev).bfloat16()
        sets = [s.to(torch.int64) for s in expert_sets(cfg.num_experts, 1, 4, gen, dev)]
        rw = torch.softmax(torch.randn(4, generator=gen, device=dev), -1).bfloat16()
        act = torch.empty(4, cfg.intermediate_size, dtype=torch.bfloat16, device=dev)
        y = torch.empty(4, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
        M.gemv1(x, sets[0], 4, ex, 1.702, 7.0, act)  # GEMM2's input
        per = {}
        for which, today in (("gemv1", M.GEMV1), ("gemv2", M.GEMV2)):
            n_rows = 2 * cfg.intermediate_size if which == "gemv1" else cfg.hidden_size
            ok = [lc for lc in pool if lc != today and n_rows % lc.block_n == 0][:args.samples]
            rows = _sweep_one(which, ex, x, sets, rw, act, y, [today, *ok], args, deadline)
            per[which] = {"today": dataclasses.asdict(today), "rows": rows}
            timed = [r for r in rows if "us" in r]
            if timed:
                win = min(timed, key=lambda r: r["us"])
                best.setdefault(which, win["launch"])
                print(f"{model} {which}: best {win['launch']} {win['us']:.2f} us, today {timed[0]['us']:.2f} us")
        result["models"][model] = per
    gpu = result["env"]["gpu"]
    saved = C.save_result(args.out, f"sweep-mxfp4-{C.slug(gpu)}-{C.stamp()}", result)
    print(f"saved {saved}")
    if args.config_out and best:
        path = Path(args.config_out) / M.config_file_name(gpu)
        path.write_text(json.dumps({"source": Path(saved["json"]).name, **best}, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
