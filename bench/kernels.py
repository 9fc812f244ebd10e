"""Kernel benchmarks on the H200: time (medians of triton.testing.do_bench, CUDA events), achieved
TFLOP/s or TB/s, and share of the measured ceilings (h200-notes: copy 4.19 TB/s, bf16 762, fp8 1378
TFLOP/s). Saves JSON (GPU, versions, git commit, command) and a PNG under bench/results/, prints a table.

usage (device machine, repo root): python3 -m kvrelay.bench.kernels [--only attn,attndec,fp8,fp8dec,moe,moedec,glue]
[--out DIR]; `attndec` (decode attention per layer kind and batch, FlashInfer vs Triton variants) is
bench/attn_decode.py.
Targets are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

CEIL = {"TB/s": 4.19, "bf16": 762.0, "fp8": 1378.0}
ROWS: list[dict] = []


def bench(fn, warmup=25, rep=100):
    import triton
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")  # ms


def record(group, name, ms, *, flops=None, nbytes=None, ceiling=None, target=None, note=""):
    row = {"group": group, "name": name, "ms": round(ms, 5), "note": note}
    if flops is not None:
        row["TFLOP/s"] = round(flops / ms / 1e9, 1)
        row["share"] = round(row["TFLOP/s"] / CEIL[ceiling], 3)
    if nbytes is not None:
        row["TB/s"] = round(nbytes / ms / 1e9, 3)
        row["share"] = round(row["TB/s"] / CEIL["TB/s"], 3)
    if target is not None:
        row["target"] = target
    ROWS.append(row)
    print(f"{group:6s} {name:52s} {ms*1e3:10.1f} us  " +
          (f"{row.get('TFLOP/s', row.get('TB/s'))} {'TFLOP/s' if flops else 'TB/s'} ({row['share']:.0%})"
           if "share" in row else "") + (f"  target {target}" if target else ""), flush=True)


def _paged(batch, kv_len, q_len, dev, page=16, hkv=8, d=64):
    n_pages = -(-kv_len // page)
    pool = torch.randn(batch * n_pages, 2, page, hkv, d, device=dev, dtype=torch.bfloat16)
    i32 = dict(dtype=torch.int32, device=dev)
    kv_indptr = torch.arange(batch + 1, **i32) * n_pages
    kv_indices = torch.randperm(batch * n_pages, device=dev).to(torch.int32)
    last = torch.full((batch,), kv_len - (n_pages - 1) * page, **i32)
    qo = torch.arange(batch + 1, **i32) * q_len
    return pool, qo, kv_indptr, kv_indices, last


def bench_attention(dev):
    from kvrelay.kernels import attention as fa
    from kvrelay.kernels import triton_attention as ta
    hq, hkv, d, page = 64, 8, 64, 16
    sinks = torch.randn(hq, device=dev).bfloat16()
    # prefill: one 8192-token sequence
    T = 8192
    pool, qo, ip, idx, last = _paged(1, T, T, dev)
    q = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16)
    causal_flops = 4 * hq * d * T * (T + 1) / 2
    for window in (None, 128):
        flops = causal_flops if window is None else 4 * hq * d * sum(min(i + 1, window) for i in range(T))
        att = fa.FlashInferSinkAttention(hq, hkv, d, page, window, 0.125, dev)
        att.plan_prefill(qo, ip, idx, last)
        record("attn", f"prefill 8192 FA3 sink window={window}", bench(lambda: att.prefill(q, pool, sinks)),
               flops=flops, ceiling="bf16", target=">=400 TFLOP/s" if window is None else None)
        tiles = ta.plan_prefill_tiles(qo, 16)
        for bn, nw, ns in ((64, 4, 2), (64, 8, 3), (128, 8, 2)):
            fn = lambda: ta.sink_prefill(q, pool, sinks, qo, ip, idx, last, sm_scale=0.125, window=window,
                                         tiles=tiles, block_q=16, block_n=bn, num_warps=nw, num_stages=ns)
            record("attn", f"prefill 8192 triton window={window} bn{bn} w{nw} s{ns}", bench(fn), flops=flops,
                   ceiling="bf16")
    del pool, q
    # decode: 64 sequences x 8192 context
    B, L = 64, 8192
    pool, qo, ip, idx, last = _paged(B, L, 1, dev)
    q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
    kv_bytes = B * L * hkv * d * 2 * 2
    att = fa.FlashInferSinkAttention(hq, hkv, d, page, None, 0.125, dev)
    att.plan_decode(ip, idx, last)
    record("attn", "decode 64x8192 FI TC no sink (floor)", bench(lambda: att.decode_nosink(q, pool)), nbytes=kv_bytes)
    record("attn", "decode 64x8192 FI TC + torch correction",
           bench(lambda: fa.apply_sink_correction_torch(*att.decode_nosink(q, pool), sinks)), nbytes=kv_bytes)
    record("attn", "decode 64x8192 FI TC + fused Triton correction", bench(lambda: att.decode(q, pool, sinks)),
           nbytes=kv_bytes, target=">=3.7 TB/s")
    # the same inside a CUDA graph (how the engine runs decode): no launch gaps
    gatt = fa.FlashInferSinkAttention(hq, hkv, d, page, None, 0.125, dev, graph_batch=B, graph_max_pages=idx.numel())
    gatt.plan_decode(ip, idx, last)
    import triton
    gatt.decode(q, pool, sinks)
    torch.cuda.synchronize()
    record("attn", "decode 64x8192 FI TC + fused corr, CUDA graph",
           triton.testing.do_bench_cudagraph(lambda: gatt.decode(q, pool, sinks), rep=100, return_mode="median"),
           nbytes=kv_bytes, target=">=3.7 TB/s")
    for splits, bn, nw, ns in ((None, 64, 4, 2), (2, 64, 4, 3), (4, 128, 4, 2), (4, 64, 4, 3), (8, 64, 4, 2)):
        ws = ta.decode_workspace(B, hq, d, splits or ta.default_num_splits(B, hkv, num_sms=132, block_n=bn), dev)
        fn = lambda: ta.sink_decode(q, pool, sinks, ip, idx, last, sm_scale=0.125, window=None, num_splits=splits,
                                    block_n=bn, num_warps=nw, num_stages=ns, workspace=ws)
        record("attn", f"decode 64x8192 triton split={splits} bn{bn} w{nw} s{ns}", bench(fn), nbytes=kv_bytes)


def bench_attention_decode(dev):
    from kvrelay.bench.attn_decode import bench_attention_decode as run
    run(dev, record)


def bench_fp8(dev):
    from kvrelay.kernels import fp8_gemm as fg
    M, K, N = 8192, 2880, 5120
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(N, K, device=dev) * 0.02)
    from kvrelay.kernels.fp8 import quantize_weight_block128
    wq, ws = quantize_weight_block128(w)
    bias = torch.randn(N, device=dev, dtype=torch.bfloat16)
    flops = 2 * M * N * K
    lin = fg.Fp8BlockLinear(wq, ws, bias, backend="cublas")
    xq, sx = fg.quantize_act_1x128(x, lin.kp)
    record("fp8", "act quant 1x128 (8192x2880)", bench(lambda: fg.quantize_act_1x128(x, lin.kp)),
           nbytes=M * K * 3 + M * 23 * 4)
    wb = w.bfloat16()
    record("fp8", "bf16 matmul + bias (baseline)", bench(lambda: torch.nn.functional.linear(x, wb, bias)),
           flops=flops, ceiling="bf16")
    record("fp8", "cuBLAS blockwise, no bias", bench(lambda: fg.cublas_fp8_gemm(xq, sx, lin.w, lin.sb_cols)),
           flops=flops, ceiling="fp8")
    record("fp8", "cuBLAS blockwise + separate bias pass",
           bench(lambda: fg.cublas_fp8_gemm(xq, sx, lin.w, lin.sb_cols, bias, bias_pass=True)), flops=flops, ceiling="fp8")
    try:
        fn = lambda: torch._scaled_mm(xq, lin.w.t(), scale_a=sx, scale_b=lin.sb_cols, bias=bias,
                                      out_dtype=torch.bfloat16)
        ok = (fn().float() - fg.cublas_fp8_gemm(xq, sx, lin.w, lin.sb_cols, bias, bias_pass=True).float()).abs().max().item()
        record("fp8", "cuBLAS blockwise bias= argument (served)", bench(fn), flops=flops, ceiling="fp8", target=">=800 TFLOP/s",
               note=f"max diff vs bias pass {ok:.3g}")
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        record("fp8", "cuBLAS blockwise bias= argument", float("nan"), note=f"unsupported: {str(exc)[:80]}")
    for bm, bn, gm, nw, ns in ((128, 128, 8, 8, 4), (128, 128, 8, 4, 4), (128, 256, 8, 8, 3), (64, 128, 8, 4, 5),
                               (256, 128, 8, 8, 3)):
        try:
            fn = lambda: fg.triton_fp8_gemm(xq, sx, lin.w, lin.w_scale, bias, block_m=bm, block_n=bn, group_m=gm,
                                            num_warps=nw, num_stages=ns)
            record("fp8", f"triton block-scaled + fused bias {bm}x{bn} w{nw} s{ns}", bench(fn), flops=flops,
                   ceiling="fp8", target=">=800 TFLOP/s")
        except Exception as exc:  # noqa: BLE001
            record("fp8", f"triton {bm}x{bn} w{nw} s{ns}", float("nan"), note=f"failed: {str(exc)[:80]}")


# gpt-oss-20b/120b attention (both models alike); the bytes each timed graph streams per candidate
FP8DEC_SHAPES = (("QKV 2880->5120", 2880, 5120), ("O 4096->2880", 4096, 2880))
FP8DEC_STREAM_BYTES = 256 << 20


def bench_fp8_decode(dev):
    """The attention projections at decode batch sizes (issue #11): cuBLAS blockwise (served, bias fused), the
    16-row Triton tiles and the FP8 GEMV tiles (kernels/fp8_gemv.py), in TB/s of the bytes one call reads and
    writes, under CUDA-graph replay as decode runs them. Each timed graph runs the projection over enough
    distinct weight copies (>= 256 MB, past the 50 MB L2) that every call streams its weights from HBM, as the
    24/36 layers of a decode step do; the time is per call. `auto` is what Fp8BlockLinear(backend="auto") keeps."""
    import triton
    from kvrelay.kernels import fp8_gemm as fg
    from kvrelay.kernels.fp8 import quantize_weight_block128
    for label, k, n in FP8DEC_SHAPES:
        wq, ws = quantize_weight_block128(torch.randn(n, k, device=dev) * 0.02)
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
        first = fg.Fp8BlockLinear(wq, ws, bias, backend="cublas")
        copies = max(2, -(-FP8DEC_STREAM_BYTES // first.w.numel()))
        # distinct weight memory per copy (same values: the kernels' bytes, not the numbers, are timed)
        lins = [first] + [fg.Fp8BlockLinear(wq.clone(), ws.clone(), bias.clone(), backend="cublas")
                          for _ in range(copies - 1)]
        kp = first.kp
        names = ["cublas", *(t for t in fg.Fp8BlockLinear.TRITON_TILES if t != "triton"),
                 *fg.Fp8BlockLinear.GEMV_TILES]
        for m in (1, 2, 4, 8):
            xq, sx = fg.quantize_act_1x128(torch.randn(m, k, device=dev, dtype=torch.bfloat16), kp)
            nbytes = n * kp + ws.numel() * 4 + xq.numel() + sx.numel() * 4 + n * 2 + m * n * 2
            floor_us = nbytes / (CEIL["TB/s"] * 1e6)
            auto = fg.Fp8BlockLinear(wq, ws, bias, backend="auto")
            auto.run_quantized(xq, sx, m)
            picked = auto._choice[1 << max(0, (m - 1).bit_length())]
            for name in names:
                def fn(name=name):
                    for lin in lins:
                        lin._run(name, xq, sx, m)
                try:
                    fn()
                    ms = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") / copies
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is skipped
                    record("fp8dec", f"{label} M={m} {name}", float("nan"), note=repr(exc)[:120])
                    continue
                record("fp8dec", f"{label} M={m} {name} (graph)", ms, nbytes=nbytes,
                       note=f"floor {floor_us:.2f} us" + ("; auto picks this" if name == picked else ""))
            print(f"fp8dec {label} M={m}: auto (eager do_bench) picked {picked}", flush=True)
        del lins, first
        torch.cuda.empty_cache()


def _fp8_experts(e, h, i, dev):
    from kvrelay.kernels.moe import MoEWeights
    f8 = torch.float8_e4m3fn
    w1 = (torch.randn(e, 2 * i, h, device=dev) * 64).clamp(-448, 448).to(f8)
    w2 = (torch.randn(e, h, i, device=dev) * 64).clamp(-448, 448).to(f8)
    s1 = torch.rand(e, 2 * i // 128, -(-h // 128), device=dev) * 1e-4 + 1e-4
    s2 = torch.rand(e, -(-h // 128), -(-i // 128), device=dev) * 1e-4 + 1e-4
    b1 = torch.randn(e, 2 * i, device=dev).bfloat16()
    b2 = torch.randn(e, h, device=dev).bfloat16()
    return MoEWeights.from_fp8(w1, s1, b1, w2, s2, b2)


def engine_moe_step(res, delta, norm_w, gate_w, gate_b, ex, k: int, counters, eps: float = 1e-5,
                    norm_counters=None, fused_counters=None):
    """One decode MoE layer at batch sizes the fused router takes, launched as engine/layers/moe.py and
    engine/model.py launch it: the residual add + norm + router + top-k in one kernel (fused_route_in), the
    expert GEMVs without their combine (routed_uncombined), and the combine inside the next residual add +
    RMSNorm, which also writes the next attention's 1x128 FP8 QKV input (K padded to 128). With norm_counters
    (kernels.moe_gemv.new_norm_counters; the engine's KVRELAY_MOE_NORM_FUSE=1) that add + norm runs inside the
    second GEMV's launch (MoePending.finish_norm): three launches instead of four. With fused_counters
    (kernels.moe_fused.new_fused_counters; KVRELAY_MOE_FUSED_GEMV=1) both GEMVs run in one launch. Returns the
    add + norm's (new residual, (fp8 input, scales))."""
    from kvrelay.kernels import fused, moe, router

    kp = -(-res.shape[1] // 128) * 128
    x, h, w, ids = router.add_rms_norm_route(res, delta, norm_w, eps, gate_w, gate_b, k, counters)
    pairs = moe.moe_experts(h, ids, w, ex, combine=False, norm_counters=norm_counters, fused_counters=fused_counters)
    if norm_counters is not None:
        return pairs.finish_norm(x, norm_w, eps, quant_k=kp)
    return fused.add_rms_norm(x, pairs, norm_w, eps, quant_k=kp)


def bench_moe(dev):
    import triton
    from kvrelay.kernels import moe, moe_gemv, router
    E, H, I, K = 128, 2880, 2880, 4
    ex = _fp8_experts(E, H, I, dev)
    gate_w = torch.randn(E, H, device=dev).bfloat16() * 0.02
    gate_b = torch.randn(E, device=dev).bfloat16()
    x1 = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    active = K * (ex.w1[0].numel() + ex.w2[0].numel())  # fp8 bytes of the 4 experts read
    floor_us = active / 4.19e12 * 1e6
    ids = torch.randperm(E, device=dev)[:K].view(1, K)
    rw = torch.softmax(torch.randn(1, K, device=dev), -1).bfloat16()
    for n1, n2, bk, nw, ns in ((32, 16, 512, 4, 3), (64, 32, 512, 4, 3), (32, 16, 256, 4, 3), (16, 16, 512, 4, 4),
                               (32, 32, 1024, 8, 2), (64, 64, 512, 8, 3)):
        fn = lambda: moe_gemv.moe_gemv(x1, ids, rw, ex, 1.702, 7.0, block_n1=n1, block_n2=n2, block_k=bk, num_warps=nw,
                                       num_stages=ns)
        fn()
        record("moe", f"120b decode experts gemv n1={n1} n2={n2} bk={bk} w{nw} s{ns} (graph)",
               triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"), nbytes=active,
               note=f"floor {floor_us:.1f} us")
    full = lambda: moe.moe_forward(x1, gate_w, gate_b, ex, K)
    full()
    record("moe", "120b decode full layer (router+route+experts, graph)",
           triton.testing.do_bench_cudagraph(full, rep=100, return_mode="median"), nbytes=active,
           target=f"<= {1.3 * floor_us:.1f} us (1.3x floor)", note=f"floor {floor_us:.1f} us")
    record("moe", "120b decode full layer (eager)", bench(full), nbytes=active)
    # The layer as the engine's decode step runs it (engine_moe_step): three launches with PDL instead of
    # moe_forward's four, the combine inside the next residual add + norm (whose own work is counted too)
    counters = router.new_counters(dev)
    res = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    delta = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(H, device=dev)).bfloat16()
    step = lambda: engine_moe_step(res, delta, norm_w, gate_w, gate_b, ex, K, counters)
    step()
    record("moe", "120b decode layer as the engine runs it (norm+router, 2 GEMVs, combine in next norm; graph)",
           triton.testing.do_bench_cudagraph(step, rep=100, return_mode="median"), nbytes=active,
           target="<= 35 us (issue 11)", note=f"floor {floor_us:.1f} us")
    # ... with KVRELAY_MOE_NORM_FUSE=1's launches: the next residual add + norm inside GEMV2's launch
    norm_counters = moe_gemv.new_norm_counters(dev)
    fused_step = lambda: engine_moe_step(res, delta, norm_w, gate_w, gate_b, ex, K, counters,
                                         norm_counters=norm_counters)
    fused_step()
    record("moe", "120b decode layer as the engine runs it with KVRELAY_MOE_NORM_FUSE=1 (next norm in GEMV2; graph)",
           triton.testing.do_bench_cudagraph(fused_step, rep=100, return_mode="median"), nbytes=active,
           target="<= 35 us (issue 11)", note=f"floor {floor_us:.1f} us")
    # ... with KVRELAY_MOE_FUSED_GEMV=1's launches: both GEMVs in one (kernels/moe_fused.py)
    from kvrelay.kernels import moe_fused

    fused_counters = moe_fused.new_fused_counters(dev)
    one_step = lambda: engine_moe_step(res, delta, norm_w, gate_w, gate_b, ex, K, counters,
                                       fused_counters=fused_counters)
    one_step()
    record("moe", "120b decode layer as the engine runs it with KVRELAY_MOE_FUSED_GEMV=1 (GEMVs in one launch; graph)",
           triton.testing.do_bench_cudagraph(one_step, rep=100, return_mode="median"), nbytes=active,
           target="<= 35 us (issue 11)", note=f"floor {floor_us:.1f} us")
    # batch 64 decode and 4096/16384-token prefill through the grouped path: the config the engine uses (the
    # GPU's tuned table when kernels/configs has one, bench/tune_moe.py) beside today's heuristic
    from kvrelay.kernels import moe_configs
    for T in (64, 4096, 16384):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        rw, ids = moe.route_topk(torch.randn(T, E, device=dev).bfloat16(), K)
        flops = 2 * T * K * (2 * I * H + H * I)
        served = moe.grouped_config(T * K, E, H, I, device=dev)
        record("moe", f"fp8 experts T={T} grouped triton", bench(lambda: moe.moe_experts(x, ids, rw, ex, path="grouped")),
               flops=flops, ceiling="fp8", target=">=600 TFLOP/s" if T >= 4096 else None,
               note=f"{served.source}: {served.label()}")
        if served.source != "heuristic":
            heur = moe_configs.heuristic_config(T * K, E)
            record("moe", f"fp8 experts T={T} grouped triton, heuristic config",
                   bench(lambda: moe._moe_grouped(x, ids, rw, ex, 1.702, 7.0, config=heur)), flops=flops,
                   ceiling="fp8", note=heur.label())
        if T <= 64:
            record("moe", f"fp8 experts T={T} gemv", bench(lambda: moe.moe_experts(x, ids, rw, ex, path="gemv")),
                   flops=flops, ceiling="fp8")
    del ex
    exb = moe.MoEWeights.from_bf16(torch.randn(32, 2 * I, H, device=dev).bfloat16() * 0.02,
                                   torch.randn(32, 2 * I, device=dev).bfloat16(),
                                   torch.randn(32, H, I, device=dev).bfloat16() * 0.02,
                                   torch.randn(32, H, device=dev).bfloat16())
    T = 4096
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    rw, ids = moe.route_topk(torch.randn(T, 32, device=dev).bfloat16(), K)
    flops = 2 * T * K * (2 * I * H + H * I)
    for path in ("torch", "grouped"):
        record("moe", f"bf16 experts (20b, E=32) T={T} {path}", bench(lambda: moe.moe_experts(x, ids, rw, exb, path=path)),
               flops=flops, ceiling="bf16")


def bench_moe_decode(dev):
    """The grouped expert path at decode batch sizes (every expert active, a few dozen rows each): launch
    configs side by side, in TB/s of the expert weights read, and the pair sort (one-program kernel vs the
    torch ops). What picks the grouped path's decode config."""
    import triton
    from kvrelay.kernels import moe
    K, H, I = 4, 2880, 2880
    configs = [(64, 128, 8, 3), (64, 128, 4, 4), (32, 128, 4, 4), (32, 64, 4, 4), (16, 128, 4, 4),
               (64, 64, 4, 4), (32, 256, 8, 3), (64, 256, 8, 3), (16, 64, 4, 5)]
    for E in (32, 128):
        ex = _fp8_experts(E, H, I, dev)
        per_expert = ex.w1[0].numel() + ex.w2[0].numel()
        for T in (128, 256, 512):
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
            rw, ids = moe.route_topk(torch.randn(T, E, device=dev).bfloat16(), K)
            touched = int(torch.unique(ids).numel()) * per_expert
            for bm, bn, nw, ns in configs:
                def fn():
                    return moe._moe_grouped(x, ids, rw, ex, 1.702, 7.0, block_m=bm, block_n=bn, num_warps=nw,
                                            num_stages=ns)
                try:
                    fn()
                    ms = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                    record("moedec", f"E={E} T={T} bm{bm} bn{bn} w{nw} s{ns}", float("nan"), note=repr(exc)[:120])
                    continue
                record("moedec", f"E={E} T={T} grouped bm{bm} bn{bn} w{nw} s{ns} (graph)", ms, nbytes=touched)
            for path in ("kernel", "torch"):
                fn = lambda: moe.sort_by_expert(ids, E, 64, path=path)  # noqa: E731
                fn()
                record("moedec", f"E={E} T={T} pair sort {path} (graph)",
                       triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))
        del ex
        torch.cuda.empty_cache()


def bench_glue(dev):
    """The glue kernels between the big GEMMs at prefill (8192 tokens of gpt-oss-20b, the MoE's 32768 pairs) and
    decode (1 token) sizes, in TB/s of the bytes each call must move (issue #11's prefill profile): the default
    launch (what the engine runs), today's decode geometry at the prefill sizes, and alternative tiles."""
    import triton
    from kvrelay.kernels import fp8_gemm as fg
    from kvrelay.kernels import fused
    from kvrelay.kernels.reference import rotary_cos_sin, yarn_inv_freq

    def timed(fn, small):  # decode sizes as the engine runs them: CUDA-graph replay
        fn()
        if small:
            return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")
        return bench(fn, warmup=5, rep=40)

    H, KP = 2880, 2944
    for m in (8192, 32768, 1):
        x = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
        for m_major in ((True, False) if m == 32768 else (True,)):
            mp = -(-m // 4) * 4 if m_major else m
            nbytes = m * H * 2 + mp * KP + mp * (KP // 128) * 4
            tiles = [None] + ([(1, 1), (32, 4), (128, 8), (16, 2)] if m > 1 else [])
            for tile in tiles:
                label = "default" if tile is None else f"tile {tile}"
                record("glue", f"quant_act_1x128 [{m}, {H}] {'m-major' if m_major else 'row-major'} {label}",
                       timed(lambda: fg.quantize_act_1x128(x, KP, m_major, tile=tile), m == 1), nbytes=nbytes,
                       note=f"floor {nbytes / CEIL['TB/s'] / 1e6:.1f} us")
        del x
    nq, nkv, d, page = 64, 8, 64, 16
    inv, conc = yarn_inv_freq(d, 150000.0, 32.0, 4096, beta_fast=32.0, beta_slow=1.0)
    for t in (8192, 1):
        qkv = torch.randn(t, (nq + 2 * nkv) * d, device=dev, dtype=torch.bfloat16)
        cos, sin = rotary_cos_sin(torch.arange(t, device=dev), inv, conc, torch.bfloat16)
        n_pages = -(-t // page) + 1
        pool = torch.zeros(n_pages, 2, page, nkv, d, device=dev, dtype=torch.bfloat16)
        slots = torch.randperm(n_pages * page, device=dev)[:t]
        pages, offsets = (slots // page).int(), (slots % page).int()
        nbytes = t * ((nq + 2 * nkv) * d * 2 + d * 2 + (nq + 2 * nkv) * d * 2 + 8)
        tiles = [None] + ([(1, 1, 4), (8, 8, 4), (32, 8, 8), (16, 16, 4), (4, 8, 2)] if t > 1 else [])
        for tile in tiles:
            label = "default" if tile is None else f"tile {tile}"
            record("glue", f"rotary_kv_write T={t} (20b: 64q/8kv x 64, page 16) {label}",
                   timed(lambda: fused.rotary_kv_write(qkv, cos, sin, nq, nkv, d, pool, pages, offsets, tile=tile),
                         t == 1), nbytes=nbytes, note=f"floor {nbytes / CEIL['TB/s'] / 1e6:.1f} us")
        del qkv, pool
    # add_rms_norm as the engine calls it (engine/model.py): attention-in (x + the MoE's uncombined fp32
    # [T, 4, H] outputs, norm, FP8 quantisation for QKV), MoE-in (x + the O projection, norm), the last
    # layer's add only, and the head's rows
    for t in (8192, 1):
        x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
        a = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
        y = torch.randn(t, 4, H, device=dev)
        w = torch.rand(H, device=dev) + 0.5
        tp = -(-t // 4) * 4
        rows = torch.tensor([t - 1], device=dev)
        cases = [("moe-out + norm + quant (attention in)", lambda: fused.add_rms_norm(x, y, w, 1e-5, quant_k=KP),
                  t * H * 2 * 2 + t * 4 * H * 4 + tp * KP + tp * (KP // 128) * 4),
                 ("bf16 delta + norm (MoE in)", lambda: fused.add_rms_norm(x, a, w, 1e-5), t * H * 2 * 4),
                 ("moe-out add only (last layer)", lambda: fused.add_rms_norm(x, y, None, 1e-5),
                  t * H * 2 * 2 + t * 4 * H * 4),
                 ("moe-out + norm, one row (head)", lambda: fused.add_rms_norm(x, y, w, 1e-5, rows=rows, store_x=False),
                  H * 2 * 2 + 4 * H * 4)]
        for name, fn, nbytes in cases:
            if t == 1 and "head" in name:
                continue
            record("glue", f"add_rms_norm [{t}, {H}] {name}", timed(fn, t == 1), nbytes=nbytes,
                   note=f"floor {nbytes / CEIL['TB/s'] / 1e6:.1f} us")
        del x, a, y


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if "share" in r]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1))
    ax.barh([f"{r['group']}: {r['name']}"[:70] for r in rows], [r["share"] for r in rows])
    ax.axvline(1.0, color="k", lw=0.5)
    ax.set_xlabel("share of measured H200 ceiling (copy 4.19 TB/s, bf16 762, fp8 1378 TFLOP/s)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="attn,fp8,fp8dec,moe")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    only = args.only.split(",")
    for name, fn in (("attn", bench_attention), ("attndec", bench_attention_decode), ("fp8", bench_fp8),
                     ("fp8dec", bench_fp8_decode), ("moe", bench_moe), ("moedec", bench_moe_decode),
                     ("glue", bench_glue)):
        if name in only:
            try:
                fn(dev)
            except Exception as exc:  # noqa: BLE001 - keep the other groups' numbers
                record(name, "GROUP FAILED", float("nan"), note=repr(exc)[:300])
            torch.cuda.empty_cache()
    try:
        import flashinfer
        fi_ver = flashinfer.__version__
    except Exception:
        fi_ver = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except Exception:
        commit = ""
    # The device machine gets a copy of the tree without .git: the caller passes the commit along.
    commit = (os.environ.get("KVRELAY_COMMIT") or os.environ.get("KVRELAY_GIT_COMMIT")
              or (commit if len(commit or "") == 40 else None))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": fi_ver,
            "triton": __import__("triton").__version__, "commit": commit, "command": " ".join(sys.argv),
            "ceilings": CEIL, "rows": ROWS}
    (out / f"kernels-{stamp}.json").write_text(json.dumps(meta, indent=1))
    try:
        plot(ROWS, out / f"kernels-{stamp}.png")
    except Exception as exc:  # noqa: BLE001
        print("plot failed:", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
