"""Where a batch-1 prefill's GPU time goes: one `Runner.prefill` of a new sequence of --length tokens and
`Runner.sample` of its first token (exactly what bench/prefill.py times), profiled with torch.profiler;
prints the kernels by total device time, the same time grouped into categories (MoE expert GEMMs, routing,
dense linears, attention, ...), the achieved TFLOP/s of the MoE GEMMs, the projections and attention, and
where the GPU sat idle during the call (bench/gpu_idle.py: before the first kernel, between kernels with the
largest gaps and their neighbours, after the last). The prefill counterpart of bench/profile_decode.py.

usage (H200): python -m kvrelay.bench.profile_prefill --model gpt-oss-20b --dummy --quant fp8-block128 \
                 --device cuda --length 8192 [--top 30] [--out DIR] [--host-profile FILE]
--host-profile FILE: one more call, unprofiled by torch.profiler, under cProfile; its top functions, the CUDA
allocator's counters over it and the torch ops that synchronised (bench/host_profile.py) go to FILE.
CPU (plumbing only: CPU ops, not kernels): --model gpt-oss-tiny --dummy --device cpu --length 64
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from kvrelay.bench import common as C
from kvrelay.bench import gpu_idle, host_profile
from kvrelay.engine.kv_geometry import FULL, SLIDING

# Kernel name -> category, first match wins (case-sensitive regex searched anywhere in the name). Our own
# kernels are the @triton.jit functions named *_kernel in kernels/*.py, listed by name so none of them
# falls into "other" (tests/cpu/test_bench_profile_prefill.py checks every one); they come before the
# generic cuBLAS/CUTLASS names ("gemm", "gemv") that e.g. `_gemv1_kernel` would also match.
CATEGORIES: tuple[tuple[str, str], ...] = (
    # kernels/moe.py's grouped FP8 expert GEMMs (prefill) and kernels/moe_gemv.py's (decode sizes)
    ("MoE expert GEMM", r"_grouped_kernel|_grouped_ws_kernel|_gemv[12]_kernel|_moe_fused_kernel"),
    # kernels/moe.py routing + sort, kernels/router.py (the fused residual+norm+router of decode sizes
    # counts here: its router GEMV is most of its bytes), kernels/fused.py's router GEMV, moe_gemv's combine
    ("MoE routing/sort/permute/combine",
     r"_route_kernel|_router_route_kernel|_add_norm_route_kernel|_router_gemv_kernel"
     r"|_sort_pairs_kernel|_sort_count_kernel|_sort_place_kernel|combine_kernel"),
    # kernels/fp8_gemm.py's 1x128 quantisation of a GEMM's input (one row per program, or prefill's row tiles)
    ("activation quantisation", r"_quant_act_kernel|_quant_act_tile_kernel|_quant_sorted_kernel"),
    # kernels/fused.py: rotary on q/k, and rotary + the paged KV write in one launch (+ its prefill tiles)
    ("rotary/KV write", r"_rotary_qk_kernel|_rotary_kv_write_kernel|_rotary_kv_write_tile_kernel"),
    # Runner.sample's greedy argmax (aten's reduce kernel over ArgMaxOps), sampling's multinomial and
    # FlashInfer's sampling kernels (before "attention", which takes every other flashinfer name)
    ("LM head/sampling", r"ArgMaxOps|ArgMinOps|multinomial|flashinfer::sampling"),
    # FlashInfer's kernels, kernels/triton_attention.py's, the sink corrections (kernels/attention.py, and
    # kernels/fused.py's correction fused with the O projection's quantisation; the split-KV merge fused
    # with it, triton_attention.py; the split-KV decode with the rotary + KV write inside, decode_rotary.py)
    ("attention", r"flashinfer|_sink_prefill_kernel|_sink_decode_split_kernel|_sink_decode_merge_kernel"
                  r"|_sink_decode_rotary_split_kernel"
                  r"|_sink_decode_merge_quant_kernel|_sink_correction_kernel|_sink_quant_kernel"),
    # kernels/fused.py: RMSNorm, and the residual add (+ MoE combine, + next GEMM's quantisation) + RMSNorm
    ("norms/residual", r"_rms_norm_kernel|_add_rms_norm_kernel"),
    # kernels/fp8_gemm.py / fp8_gemv.py's Triton GEMMs, cuBLAS (nvjet*, sm90_xmma_gemm*, gemv*, splitK),
    # CUTLASS; the LM head's bf16 GEMM too (a name does not say which layer launched it)
    ("dense linear", r"_fp8_gemm_kernel|_fp8_gemv_kernel|nvjet|cutlass|[Gg]emm|[Gg]emv|splitKreduce"),
    ("memcpy/memset", r"^Memcpy|^Memset|[Mm]emcpy|[Mm]emset"),
)
OTHER = "other"
_COMPILED = tuple((cat, re.compile(rx)) for cat, rx in CATEGORIES)


def categorise(name: str) -> str:
    """The category of one kernel (or CPU op) name: the first rule of CATEGORIES it matches, else "other"."""
    for cat, rx in _COMPILED:
        if rx.search(name):
            return cat
    return OTHER


# Where a kernel was launched from decides for the kernels whose name says only what library ran them (aten's
# elementwise/reduce/sort/scan kernels, cuBLAS GEMMs): the router's bf16 GEMM and MoE sort (torch ops on
# a path="torch" sort), the LM head's GEMM, the first token's argmax.
# (category, regex searched in the Python frames "path(def line): function" of the op that launched the
# kernel, innermost first); the first rule any frame matches wins, so a rule above beats one below whatever
# the frames' depth. Our Triton kernels keep their name's category (they are named for what they do).
CALL_SITES: tuple[tuple[str, str], ...] = (
    ("LM head/sampling", r"engine/model\.py\(\d+\): head$|engine/runner\.py\(\d+\): sample$|engine/sampling\.py"),
    ("MoE routing/sort/permute/combine",
     r"kernels/moe(_sort)?\.py\(\d+\): (sort_by_expert|route_topk|_moe_grouped)$|kernels/reference\.py\(\d+\): route_topk$"
     r"|engine/layers/moe\.py\(\d+\): (_gpu_forward|fused_route_in)$"),
    ("rotary/KV write", r"engine/layers/rotary\.py|engine/layers/attention\.py\(\d+\): rotate_and_write$"),
    ("attention", r"engine/layers/attention\.py\(\d+\): (run|apply)$|kernels/(attention|triton_attention)\.py"
                  r"|kernels/reference\.py\(\d+\): paged_attention$"),
    ("norms/residual", r"engine/layers/norm\.py|engine/model\.py\(\d+\): add_delta$"),
)
# The name categories a call site may replace: what a library kernel's name cannot tell apart.
GENERIC = (OTHER, "dense linear")
_SITES = tuple((cat, re.compile(rx)) for cat, rx in CALL_SITES)
_PY_FRAME = re.compile(r"\.py\(\d+\): |^<built-in")


def _is_python(e) -> bool:
    """A Python function event of the profiler's stack tracer (with_stack), not an op."""
    return bool(getattr(e, "is_python_function", False)) or bool(_PY_FRAME.search(e.name))


def site_category(frames: list[str]) -> str | None:
    """The CALL_SITES category of a launch from `frames` (innermost first), None when no rule matches."""
    for cat, rx in _SITES:
        if any(rx.search(f) for f in frames):
            return cat
    return None


def _frames(op) -> list[str]:
    """The Python frames an op ran under (its parents of the stack tracer), innermost first."""
    out, p = [], getattr(op, "cpu_parent", None)
    while p is not None:
        if _is_python(p):
            out.append(p.name)
        p = p.cpu_parent
    return out


def _launchers(events, device: list) -> list:
    """The CPU op that launched each of `device` (None: none known, e.g. a Triton kernel, launched by
    Triton's own launcher outside any op). The profiler links a kernel to the op by correlation id; a torch
    without FunctionEvent.linked_correlation_id has each op's kernels listed (name, us) in launch order."""
    # Ops only: CUDA runtime events (cudaLaunchKernel, linked to their op) have ids of CUPTI's own count
    ops = [e for e in events if e.device_type.name == "CPU" and not _is_python(e)
           and not getattr(e, "linked_correlation_id", 0)]
    if all(hasattr(d, "linked_correlation_id") for d in device):
        by_id = {op.id: op for op in ops if op.id}
        return [by_id.get(d.linked_correlation_id) for d in device]
    queue: dict[tuple, list] = {}
    for op in sorted(ops, key=lambda e: e.time_range.start, reverse=True):
        for k in reversed(getattr(op, "kernels", [])):
            queue.setdefault((k.name, round(k.duration, 1)), []).append(op)
    return [(queue.get((d.name, round(d.self_device_time_total, 1))) or [None]).pop() for d in device]


def device_events(prof, cuda: bool) -> list[tuple[str, float, str | None]]:
    """(name, us, call-site category or None) of every event the kernel time is made of. On CUDA only the
    device's own events (kernels, memcpy/memset): the aten op that launched a kernel carries its kernels'
    time as "self device time" too, and counting both would count every cuBLAS/aten kernel twice
    (bench/profile_decode.py's note). On CPU each op's self CPU time (the stack tracer's Python function
    events left out: their self time is the interpreter's)."""
    events = list(prof.events())
    # a record_function range spans the kernels under it: counting it would count them twice
    events = [e for e in events if not getattr(e, "is_user_annotation", False)]
    if cuda:
        device = [e for e in events if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
        device.sort(key=lambda e: e.time_range.start)
        return [(d.name, float(d.self_device_time_total), site_category(_frames(op)) if op is not None else None)
                for d, op in zip(device, _launchers(events, device))]
    return [(e.name, float(e.self_cpu_time_total), site_category(_frames(e))) for e in events
            if e.device_type.name == "CPU" and not _is_python(e) and e.self_cpu_time_total > 0]


def event_category(name: str, site: str | None) -> str:
    cat = categorise(name)
    return site if site is not None and cat in GENERIC else cat


def summarise(events: list[tuple[str, float, str | None]], top: int) -> dict:
    """Kernel total, launches, the top kernels by total time (each with the category most of its time
    went to) and the per-category table."""
    by_name: dict[str, dict[str, list]] = {}  # name -> category -> [calls, us]
    for name, us, site in events:
        acc = by_name.setdefault(name, {}).setdefault(event_category(name, site), [0, 0.0])
        acc[0] += 1
        acc[1] += us
    total = sum(us for _, us, _ in events)
    share = (lambda us: round(us / total, 4) if total else 0.0)
    named = {name: (sum(n for n, _ in c.values()), sum(us for _, us in c.values()),
                    max(c, key=lambda k: c[k][1])) for name, c in by_name.items()}
    ranked = sorted(named.items(), key=lambda kv: kv[1][1], reverse=True)
    rows = [{"kernel": name[:120], "calls": n, "total_us": round(us, 1), "share": share(us), "category": cat,
             **({"split": {k: round(v[1], 1) for k, v in by_name[name].items()}} if len(by_name[name]) > 1 else {})}
            for name, (n, us, cat) in ranked[:top]]
    cats: dict[str, list[float]] = {cat: [0, 0.0] for cat, _ in CATEGORIES}
    cats[OTHER] = [0, 0.0]
    for c in by_name.values():
        for cat, (n, us) in c.items():
            cats[cat][0] += n
            cats[cat][1] += us
    categories = [{"category": cat, "us": round(us, 1), "share": share(us), "calls": n}
                  for cat, (n, us) in sorted(cats.items(), key=lambda kv: kv[1][1], reverse=True) if n]
    by_site = sum(1 for name, _, site in events if site is not None and categorise(name) in GENERIC)
    return {"kernel_us": total, "launches": len(events), "top": rows, "categories": categories,
            "by_call_site": by_site}


def rates(cfg, length: int, categories: list[dict]) -> dict[str, dict]:
    """Achieved TFLOP/s of the categories whose FLOPs the model's shape gives (bench/estimates.py)."""
    us = {c["category"]: c["us"] for c in categories}
    flops = {"MoE expert GEMM": C.expert_flops(cfg, length),
             "dense linear": C.projection_flops(cfg, length),  # + the LM head's one row and the router: small
             "attention": C.attention_flops(cfg, length)}
    return {cat: {"flops": f, "us": us.get(cat), "tflops": f / us[cat] / 1e6 if us.get(cat) else None}
            for cat, f in flops.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m kvrelay.bench.profile_prefill", description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--length", type=int, default=8192, help="prompt tokens of the one sequence")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--host-profile", metavar="FILE", default=None,
                   help="also run one call under cProfile (after the timed one, so wall_ms stays clean) and write "
                        "the top 40 functions by cumulative and by own time, the allocator's counters and the "
                        "synchronising ops to FILE (text)")
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvrelay.engine.sampling import SamplingParams

    cfg = C.resolve_config(args.model)
    if args.length > cfg.max_context:
        raise SystemExit(f"--length {args.length} is longer than {cfg.name}'s max_context {cfg.max_context}")
    attention_fn, attention_label = C.choose_attention(args.attention, args.device)
    # bench/prefill.py's pool: one sequence at a time, the pages of the prompt (+1 spare) in each group
    pages = -(-args.length // args.page_size) + 1
    runner, build_s, _ = C.build_runner(args, num_pages={FULL: pages, SLIDING: pages}, attention_fn=attention_fn,
                                        retries=0)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size, (args.length,), generator=gen).tolist()
    greedy = [SamplingParams(max_tokens=1, temperature=0.0)]
    sid = ("bench-prefill", args.length)
    cuda = torch.device(args.device).type == "cuda"

    def call() -> None:  # bench/prefill.py's timed call
        logits = runner.prefill(sid, prompt)
        runner.sample(logits, greedy, [0])

    def cleanup() -> None:
        if runner.has_sequence(sid):
            runner.free(sid)

    # Two warm-up calls (Triton / FlashInfer compile, Fp8BlockLinear times its backends) outside the
    # profile, then one timed call (--iters: the median of that many) without the profiler: the wall time
    # the profile is set against.
    timing, first_s = C.time_call(call, args.device, warmup=2 if args.warmup is None else args.warmup,
                                  iters=1 if args.iters is None else args.iters, cleanup=cleanup)
    host = (host_profile.host_profile(call, args.device, args.host_profile, top=40, cleanup=cleanup)
            if args.host_profile else None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sw = C.StopWatch(args.device)
    # with_stack: the Python frames each op ran under (CALL_SITES); the host time it adds is outside the
    # kernels, whose time is what the profile counts
    # (the two StopWatch marks around the call are also the GPU-idle report's window: bench/gpu_idle.py)
    with profile(activities=acts, with_stack=True) as prof:
        a = sw.mark()
        call()
        b = sw.mark()
        sw.sync()
    profiled_ms = sw.elapsed(a, b) * 1e3
    cleanup()

    s = summarise(device_events(prof, cuda), args.top)
    idle = gpu_idle.idle_report(*gpu_idle.profiler_intervals(prof))
    tf = rates(cfg, args.length, s["categories"])
    result = {"kind": "profile-prefill", "env": C.env_info(args.device, "kvrelay.bench.profile_prefill", argv),
              "model": cfg.name, "quant": args.quant, "length": args.length, "attention": attention_label,
              "counted": "device events" if cuda else "cpu self time",
              "wall_ms": timing.median * 1e3, "profiled_wall_ms": profiled_ms, "first_call_s": first_s,
              "build_s": build_s, "kernel_ms": s["kernel_us"] / 1e3, "launches": s["launches"],
              "by_call_site": s["by_call_site"], "launches_per_layer": s["launches"] / cfg.num_hidden_layers,
              "top": s["top"],
              "categories": s["categories"], "tflops": tf, "ceilings_tflops": C.CEILING_TFLOPS, "idle": idle,
              **({"host_profile": host} if host is not None else {})}
    _print(result, cfg)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"profile-prefill-{C.slug(cfg.name)}-{args.length}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        result["file"] = str(path)
        print(f"saved {path}")
    return result


def _print(r: dict, cfg) -> None:
    unit = "kernel" if r["counted"] == "device events" else "CPU op"
    print(f"{r['model']} {r['quant']} prefill of {r['length']} tokens + first-token sample (attention: "
          f"{r['attention']}): {r['wall_ms']:.2f} ms wall unprofiled, {r['profiled_wall_ms']:.2f} ms profiled; "
          f"{r['kernel_ms']:.2f} ms of {unit} time in {r['launches']} launches "
          f"({r['launches_per_layer']:.1f} per layer; {r['by_call_site']} categorised by their call site; model "
          f"built in {r['build_s']:.1f} s)")
    print(f"{unit:90s} {'calls':>6s} {'us':>11s} {'share':>6s}  category")
    for k in r["top"]:
        print(f"{k['kernel'][:90]:90s} {k['calls']:6d} {k['total_us']:11.1f} {k['share']:6.1%}  {k['category']}")
    print(f"\n{'category':36s} {'calls':>6s} {'us':>11s} {'share':>6s}")
    for c in r["categories"]:
        print(f"{c['category']:36s} {c['calls']:6d} {c['us']:11.1f} {c['share']:6.1%}")
    for cat, t in r["tflops"].items():
        if t["tflops"] is not None:
            print(f"{cat}: {t['flops'] / 1e12:.2f} TFLOP in {t['us'] / 1e3:.2f} ms = {t['tflops']:.1f} TFLOP/s "
                  f"(fp8 ceiling {C.CEILING_TFLOPS['fp8']:.0f}, bf16 {C.CEILING_TFLOPS['bf16']:.0f})")
    gpu_idle.print_idle(r["idle"])
    h = r.get("host_profile")
    if h is not None:
        print(f"host profile (cProfile, one more call): {h['host_ms']:.2f} ms host, {h['wall_ms']:.2f} ms wall "
              f"-> {h['file']}")
        if "alloc_deltas" in h:
            print("  allocator over the call: " + ", ".join(f"{k} {v:+d}" for k, v in h["alloc_deltas"].items()))
            print(f"  synchronising ops: {sum(e['count'] for e in h['syncs'])}")
            for e in h["syncs"][:10]:
                print(f"    {e['count']}x {e['message']} at {e['stack'][0] if e['stack'] else '?'}")


if __name__ == "__main__":
    main()
