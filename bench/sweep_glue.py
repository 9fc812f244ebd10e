"""Sweep the launches of the decode step's small glue kernels (H200, CUDA-graph replay) and print each beside
the engine's default: kernels.fused.add_rms_norm as the attention's input (x + the MoE's 4 bf16 pair rows,
RMSNorm, 1x128 FP8 quantisation for QKV) over row counts and warps, and kernels/router.add_rms_norm_route
(residual add + the MoE's norm + router + top-4) over experts a program and warps, for 20b's 32 and 120b's
128 experts, beside the two-launch paths it replaced (add_rms_norm, then router_route or cuBLAS + route_topk:
which is faster at 8-64 tokens decides kernels/router.ROUTE_MAX_TOKENS). At batch 1 these are latency-bound single-row programs (3-4.5 us each in a 1.9 ms step, one of
each per layer): what they take is mostly loads in flight and reduction steps, which the warps change.

Every variant is checked against the default launch before it is timed: add_rms_norm bit for bit (the
warps change no math), the router's expert ids equal and its logits within 2^-8 relative of float32 (their
fp32 sum order depends on the warps; kernels/router.py's docstring). Timing: triton's do_bench_cudagraph,
median, of one launch per replay.

    python -m kvrelay.bench.sweep_glue --out bench/results
    TRITON_INTERPRET=1 python -m kvrelay.bench.sweep_glue --device cpu --rows 1 --route-rows 1   # plumbing only
"""

from __future__ import annotations

import argparse
import time

import torch

from kvrelay.bench import common as C

H, KP, TOP_K = 2880, 2944, 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,64,128,512", help="add_rms_norm row counts")
    p.add_argument("--warps", default="4,8,16")
    p.add_argument("--route-rows", default="1,8,64")
    p.add_argument("--route-warps", default="2,4,8")
    p.add_argument("--route-block-e", default="2,4,8")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="bench/results")
    return p


def _us(fn) -> float:
    import triton

    fn()
    if not torch.cuda.is_available():  # CPU (TRITON_INTERPRET=1): the plumbing only, one timed call
        t0 = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def sweep_norm(dev, rows: list[int], warps: list[int]) -> list[dict]:
    from kvrelay.kernels import fused

    out = []
    for t in rows:
        g = torch.Generator(device=dev).manual_seed(t)
        x = torch.randn(t, H, device=dev, generator=g).bfloat16()
        d = torch.randn(t, TOP_K, H, device=dev, generator=g).bfloat16()
        w = (torch.rand(H, device=dev, generator=g) + 0.5).bfloat16()
        want_x, (want_q, want_s) = fused.add_rms_norm(x, d, w, 1e-5, quant_k=KP)
        base = {"kernel": "add_rms_norm attention-in", "rows": t}
        out.append({**base, "launch": "default", "us": _us(lambda: fused.add_rms_norm(x, d, w, 1e-5, quant_k=KP))})
        for nw in warps:
            got_x, (q, s) = fused.add_rms_norm(x, d, w, 1e-5, quant_k=KP, num_warps=nw)
            exact = torch.equal(got_x, want_x) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) \
                and torch.equal(s, want_s)
            row = {**base, "launch": f"warps {nw}", "exact": exact}
            if exact:
                row["us"] = _us(lambda: fused.add_rms_norm(x, d, w, 1e-5, quant_k=KP, num_warps=nw))
            out.append(row)
    return out


def sweep_route(dev, rows: list[int], warps: list[int], block_es: list[int]) -> list[dict]:
    from kvrelay.kernels import fused as fused_mod, moe, router

    out = []
    for e in (32, 128):
        for t in rows:
            g = torch.Generator(device=dev).manual_seed(1000 * e + t)
            x = torch.randn(t, H, device=dev, generator=g).bfloat16()
            d = torch.randn(t, H, device=dev, generator=g).bfloat16()
            nw_ = (1 + 0.1 * torch.randn(H, device=dev, generator=g)).bfloat16()
            rw = (torch.randn(e, H, device=dev, generator=g) * H ** -0.5).bfloat16()
            rb = torch.randn(e, device=dev, generator=g).bfloat16()
            cnt = router.new_counters(dev)
            lg, want = (torch.empty(t, e, dtype=torch.bfloat16, device=dev) for _ in range(2))
            want_ids = router.add_rms_norm_route(x, d, nw_, 1e-5, rw, rb, TOP_K, cnt, logits=want)[3]
            want = want.float()
            base = {"kernel": f"add_rms_norm_route E={e}", "rows": t}
            out.append({**base, "launch": "default",
                        "us": _us(lambda: router.add_rms_norm_route(x, d, nw_, 1e-5, rw, rb, TOP_K, cnt))})
            # the two-launch paths the fused kernel replaced (add_rms_norm, then the router in one launch as
            # router_route, or cuBLAS's GEMM + route_topk as above ROUTE_MAX_TOKENS), same ids expected
            def two_launch(fused_router: bool):
                _, hn = fused_mod.add_rms_norm(x, d, nw_, 1e-5)
                if fused_router:
                    return router.router_route(hn, rw, rb, TOP_K, cnt)[1]
                return moe.route_topk(torch.nn.functional.linear(hn, rw, rb), TOP_K)[1]
            for name, fr in (("add_rms_norm + router_route", True), ("add_rms_norm + GEMM + route_topk", False)):
                # timed whatever the ids: their logits are summed in another order, so a near-tie may differ
                out.append({**base, "launch": name, "same_ids": torch.equal(two_launch(fr), want_ids),
                            "us": _us(lambda: two_launch(fr))})
            for be in block_es:
                for nw in warps:
                    kw = dict(block_e=be, num_warps=nw)
                    _, _, _, ids = router.add_rms_norm_route(x, d, nw_, 1e-5, rw, rb, TOP_K, cnt, logits=lg, **kw)
                    # one bf16 step of the default's logits: only their fp32 sum order differs
                    ok = torch.equal(ids, want_ids) and bool(((lg.float() - want).abs() <= want.abs() * 2 ** -7
                                                               + 1e-6).all()) and not cnt.any()
                    row = {**base, "launch": f"{be} experts/program, warps {nw}", "exact": ok}
                    if ok:
                        row["us"] = _us(lambda: router.add_rms_norm_route(x, d, nw_, 1e-5, rw, rb, TOP_K, cnt, **kw))
                    out.append(row)
    return out


def _print(con, points: list[dict]) -> None:
    from rich.table import Table

    tab = Table(title="decode glue launches (CUDA-graph replay, median)")
    for col in ("kernel", "rows", "launch", "us", "vs default", "checked"):
        tab.add_column(col, justify="left" if col in ("kernel", "launch") else "right")
    default = {}
    for p in points:
        key = (p["kernel"], p["rows"])
        if p["launch"] == "default":
            default[key] = p["us"]
        us = p.get("us")
        ratio = f"{us / default[key]:.2f}x" if us is not None and key in default else "-"
        tab.add_row(p["kernel"], str(p["rows"]), p["launch"], "-" if us is None else f"{us:.2f}", ratio,
                    {True: "ok", False: "DIFFERS", None: "-"}[p.get("exact")])
    con.print(tab)


def _plot(points: list[dict]):
    fig, ax = C.new_figure(figsize=(10, 0.22 * len(points) + 1))
    timed = [p for p in points if p.get("us") is not None]
    ax.barh([f"{p['kernel']} T={p['rows']} {p['launch']}" for p in timed], [p["us"] for p in timed],
            color=["tab:gray" if p["launch"] == "default" else "tab:blue" for p in timed])
    ax.invert_yaxis()
    ax.set_xlabel("us per launch (H200, CUDA-graph replay)")
    ax.tick_params(axis="y", labelsize=6)
    return fig


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    dev = torch.device(args.device)
    con = C.console()
    points = sweep_norm(dev, C.parse_ints(args.rows), C.parse_ints(args.warps))
    points += sweep_route(dev, C.parse_ints(args.route_rows), C.parse_ints(args.route_warps),
                          C.parse_ints(args.route_block_e))
    payload = {"env": C.env_info(args.device, "kvrelay.bench.sweep_glue", argv), "kind": "sweep-glue",
               "points": points}
    _print(con, points)
    payload["files"] = C.save_result(args.out, f"sweep-glue-{C.slug(payload['env']['gpu'])}-{C.stamp()}", payload,
                                     _plot(points))
    con.print(f"saved {payload['files']}")
    return payload


if __name__ == "__main__":
    raise SystemExit(C.run_cli(main))
