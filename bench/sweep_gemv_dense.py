"""`bench.sweep_gemv --dense`: the FP8 decode GEMV (kernels/fp8_gemv.py) on the dense attention projections
against cuBLAS, under CUDA graphs, at decode batch sizes.

gpt-oss-20b and -120b share both shapes (hidden 2880, 64 q heads, 8 kv heads, head_dim 64): QKV 2880 -> 5120
and O 4096 -> 2880, K padded to a multiple of 128 as Fp8BlockLinear pads it. At batch 1 they are pure weight
streams (14.7 / 11.8 MB) where cuBLAS reached ~2 TB/s, half the 4.19 TB/s copy ceiling (issue #11). For each
(shape, M): cuBLAS (Fp8BlockLinear backend "cublas", what decode runs today) and every GEMV launch of
Fp8BlockLinear.GEMV_TILES plus EXTRA (N tile x K step x split-K x warps), each checked against the float64
product of the same quantised operands (relative error < CHECK_TOL) before it is timed. Timing: the call over
enough distinct weight copies (>= --stream-mb, far past the 50 MB L2) that every call streams its weights
from HBM, back to back in a CUDA graph, median of 5 replays (bench/tune_moe_space.time_ms), per call.
Launches holding more than 128 weights a thread are skipped at M >= 2 (they spill there: ptxas on sm_90a);
that (54 compiles, shared by both shapes) and --budget-s bound the run (~60-90 s on an H200, most of it
Triton compiles; launches not reached in time are left out and the JSON says complete: false).

    python -m kvrelay.bench.sweep_gemv --dense --out bench/results
    python -m kvrelay.bench.sweep_gemv --dense --device cpu --dense-shapes QKV:256:160 --rows 1,3   # plumbing

A winner becomes an entry of Fp8BlockLinear.GEMV_TILES by hand (and GEMV_DEFAULT "1" when it beats cuBLAS).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch

from kvrelay.bench import common as C
from kvrelay.bench import tune_moe_space as S
from kvrelay.kernels import fp8_gemm as fg
from kvrelay.kernels.fp8 import quantize_weight_block128
from kvrelay.kernels.fp8_gemv import Fp8GemvLaunch, triton_fp8_gemv

CEIL_TBS = 4.19  # bench/kernels.py's measured H200 copy ceiling
CHECK_TOL = 1e-2  # the fp8 GEMM tests' bound (bf16 output rounding, fp32 order)
SHAPES = "QKV:2880:5120,O:4096:2880"
L = Fp8GemvLaunch
# Besides GEMV_TILES: moe_gemv's best (n32-k512-w2-s2) with more splits, narrower and wider tiles, one K step
# per program (k1024 s3 on 23 K blocks), 1 stage and 8 warps.
EXTRA = (L(32, 512, 3, 2), L(32, 512, 6, 2), L(32, 1024, 3, 4), L(16, 512, 2, 2), L(16, 512, 8, 2),
         L(16, 1024, 3, 4), L(64, 256, 4, 4), L(64, 512, 2, 8), L(32, 512, 4, 2, 1),
         L(8, 512, 4, 1), L(16, 256, 4, 2))
MAX_WEIGHTS_PER_THREAD_ROWS2 = 128
RESERVE_S = 15.0  # of the budget kept for each later shape (whose compiles are cached by then)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dense-shapes", default=SHAPES, help="label:K:N,... (default gpt-oss QKV and O)")
    p.add_argument("--rows", default="1,2,4,8", help="decode batch sizes M")
    p.add_argument("--stream-mb", type=float, default=256.0, help="distinct weight bytes per timed call chain")
    p.add_argument("--max-launches", type=int, default=0, help="GEMV launches per point (0: all)")


def launches(rows: int, limit: int = 0) -> list[Fp8GemvLaunch]:
    """GEMV_TILES first, then EXTRA, without duplicates; at M >= 2 only those without register spills."""
    out = list(dict.fromkeys([*fg.Fp8BlockLinear.GEMV_TILES.values(), *EXTRA]))
    if rows >= 2:
        out = [l for l in out if l.block_n * l.block_k / (32 * l.num_warps) <= MAX_WEIGHTS_PER_THREAD_ROWS2]
    return out[:limit] if limit else out


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _parse_shapes(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in text.split(","):
        label, k, n = item.split(":")
        out.append((label, int(k), int(n)))
    return out


def sweep_shape(label: str, k: int, n: int, rows: list[int], args, deadline: float, gen) -> list[dict]:
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    wq, ws = quantize_weight_block128(torch.randn(n, k, generator=gen, device=dev) * 0.02)
    bias = torch.randn(n, generator=gen, device=dev).bfloat16()
    first = fg.Fp8BlockLinear(wq, ws, bias, backend="cublas")
    copies = max(2, math.ceil(args.stream_mb * 2**20 / first.w.numel())) if cuda else 1
    # distinct weight memory per copy (same values: the kernels' bytes, not the numbers, are timed)
    lins = [first] + [fg.Fp8BlockLinear(wq.clone(), ws.clone(), bias.clone(), backend="cublas")
                      for _ in range(copies - 1)]
    wd = (first.w.double() * first.w_scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1))
    points = []
    for m in rows:
        x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
        xq, sx = fg.quantize_act_1x128(x, first.kp)
        ref = (xq[:m].double() * sx[:m].double().repeat_interleave(128, 1)) @ wd.t() + bias.double()
        nbytes = n * first.kp + ws.numel() * 4 + xq.numel() + sx.numel() * 4 + n * 2 + m * n * 2
        floor_us = nbytes / (CEIL_TBS * 1e6)

        def call(lin, launch):
            if launch is None:
                return lin._run("cublas", xq, sx, m)[:m]
            return triton_fp8_gemv(xq, sx, lin.w, lin.w_scale, lin.bias, m=m, launch=launch, counters=lin._counters)

        measured = []
        for launch in [None, *launches(m, args.max_launches)]:
            if launch is not None and time.monotonic() > deadline:
                break
            row = {"backend": "cublas" if launch is None else "gemv", "us": None,
                   "label": "cublas" if launch is None else launch.label(),
                   "launch": None if launch is None else dataclasses.asdict(launch)}
            try:
                row["rel_err"] = err = _rel_err(call(first, launch), ref)
                if not err < CHECK_TOL:
                    row["error"] = f"check failed: rel err {err:.3g}"
                else:
                    def chain(launch=launch):
                        for lin in lins:
                            call(lin, launch)
                    row["us"] = 1e3 * S.time_ms(chain, cuda, 5.0, args.rep_ms) / copies
                    row["tbs"] = nbytes / (row["us"] * 1e-6) / 1e12
                    row["floor_share"] = row["tbs"] / CEIL_TBS
            except Exception as exc:  # noqa: BLE001 - a launch that does not compile or run is recorded
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            measured.append(row)
        cublas = measured[0]
        timed = [r for r in measured[1:] if r["us"] is not None]
        best = min(timed, key=lambda r: r["us"]) if timed else None
        speedup = cublas["us"] / best["us"] if best and cublas["us"] else None
        points.append({"shape": label, "k": k, "n": n, "kp": first.kp, "rows": m, "bytes": nbytes,
                       "floor_us": floor_us, "copies": copies, "cublas": cublas, "best": best,
                       "speedup_vs_cublas": speedup, "measured": measured,
                       "complete": len(measured) == 1 + len(launches(m, args.max_launches))})
    del lins, first
    if cuda:
        torch.cuda.empty_cache()
    return points


def main(args, argv) -> dict:
    con = C.console()
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    deadline = time.monotonic() + args.budget_s
    shapes = _parse_shapes(args.dense_shapes)
    rows = C.parse_ints(args.rows)
    payload = {"env": C.env_info(args.device, "kvrelay.bench.sweep_gemv", argv), "kind": "sweep-gemv-dense",
               "ceiling_tbs": CEIL_TBS, "check_tol": CHECK_TOL, "gemv_default": fg.Fp8BlockLinear.GEMV_DEFAULT,
               "gemv_tiles": sorted(fg.Fp8BlockLinear.GEMV_TILES), "points": []}
    for i, (label, k, n) in enumerate(shapes):
        # the first shape pays the compiles: all of the budget but a reserve for each later shape
        shape_deadline = deadline - RESERVE_S * (len(shapes) - 1 - i)
        pts = sweep_shape(label, k, n, rows, args, shape_deadline, gen)
        payload["points"] += pts
        for p in pts:
            _print(con, p)
    payload["complete"] = all(p["complete"] for p in payload["points"])
    stem = f"sweep-gemv-dense-{C.slug(payload['env']['gpu'])}-{C.stamp()}"
    payload["files"] = C.save_result(args.out, stem, payload)
    con.print(f"saved {payload['files']}")
    return payload


def _print(con, p: dict) -> None:
    from rich.table import Table

    tab = Table(title=f"{p['shape']} {p['k']}->{p['n']} M={p['rows']}: floor {p['floor_us']:.2f} us "
                      f"({p['copies']} weight copies per chain)")
    for c in ("launch", "us", "TB/s", "of 4.19 TB/s", "rel err", "note"):
        tab.add_column(c)
    for r in p["measured"]:
        tab.add_row(r["label"], f"{r['us']:.2f}" if r["us"] else "-", f"{r['tbs']:.2f}" if r.get("tbs") else "-",
                    f"{r['floor_share']:.0%}" if r.get("floor_share") else "-",
                    f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-",
                    ("best" if r is p["best"] else "") + r.get("error", ""))
    con.print(tab)
