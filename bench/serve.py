"""Serving benchmark: streaming /v1/completions against any OpenAI-compatible server (kvrelay, vLLM,
SGLang), over a concurrency sweep for each (input, output) length workload. The multi-turn workload (a shared
system prompt and growing histories, for prefix caches) is bench/serve_multiturn.py.

    python -m kvrelay.bench.serve --base-url http://127.0.0.1:8000 --gpus 2 --topology configs/h200-2gpu.yaml
    python -m kvrelay.bench.serve --concurrency 1,16 --workloads 8k/1k --requests 32 --label vllm-tp1
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvrelay.bench import common as C
from kvrelay.bench.serve_client import (  # noqa: F401 - part of this module's interface (tests)
    Prompts, RequestResult, StreamParser, chunk_tokens, itl_samples, one_request, request_body, send_requests,
)

DEFAULT_CONCURRENCY = "1,4,16,64,128,256"
DEFAULT_WORKLOADS = "1k/1k,8k/1k,32k/256"
# Far from both ends of the o200k vocabulary: no byte-level or special tokens in a prompt.
DEFAULT_TOKEN_RANGE = "1000,100000"
# kvrelay's per-request TTFT breakdown (the usage chunk's "kvrelay_timings"); reported as p50s.
BREAKDOWN = ("queue_s", "prefill_compute_s", "kv_handoff_s", "kv_handoff_gb_s", "delivery_s")


# ---- arithmetic (unit-tested by hand) --------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default), so p50 of an even count is the mean of the middle two; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def parse_length(text: str) -> int:
    """'8k' -> 8192, '256' -> 256."""
    t = text.strip().lower()
    return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)


def parse_workloads(text: str) -> list[tuple[int, int]]:
    """'1k/1k,32k/256' -> [(1024, 1024), (32768, 256)]."""
    out = []
    for part in (p for p in re.split(r"[,\s]+", text.strip()) if p):
        inp, sep, outp = part.partition("/")
        if not sep:
            raise argparse.ArgumentTypeError(f"workload {part!r} is not IN/OUT (e.g. 8k/1k)")
        out.append((parse_length(inp), parse_length(outp)))
    return out



async def run_point(client, args, prompts: Prompts, conc: int, input_len: int, output_len: int,
                    n_requests: int) -> tuple[list[RequestResult], float, float]:
    """At most `conc` requests in flight until `n_requests` are done (or --duration-s has passed: requests
    not yet started then are not sent). Returns (results, wall seconds, client CPU fraction)."""
    from tqdm import tqdm

    base = prompts.issued
    prompts.issued += n_requests
    bar = tqdm(total=n_requests, desc=f"{input_len}/{output_len} C={conc}", unit="req", leave=False)
    t0, cpu0 = time.perf_counter(), time.process_time()
    results = await send_requests(
        client, f"{args.base_url}/v1/completions", args.model, prompts, base, range(n_requests), slots=conc,
        conc=conc, input_len=input_len, output_len=output_len, t_start=t0,
        stagger_s=getattr(args, "stagger_s", 0.0) or 0.0,
        deadline=math.inf if args.duration_s is None else t0 + args.duration_s, timeout_s=args.timeout_s,
        on_done=lambda: bar.update(1))
    bar.close()
    end = max((r.t_done for r in results), default=time.perf_counter())
    wall = max(end - t0, 1e-9)
    return results, wall, (time.process_time() - cpu0) / wall


def summarize(results: list[RequestResult], conc: int, input_len: int, output_len: int, wall_s: float,
              cpu_frac: float, gpus: int, usd_per_gpu_hour: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    agg = out_tokens / wall_s
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    point: dict[str, Any] = {
        "concurrency": conc, "input_len": input_len, "output_len": output_len,
        "requests": len(results), "failed": len(results) - len(ok),
        "failure_reasons": dict(Counter(r.error for r in results if not r.ok).most_common(5)),
        "wall_s": wall_s, "output_tokens": out_tokens,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "out_tok_s_aggregate": agg,
        "out_tok_s_steady": steady_rate(results, conc),
        "out_tok_s_per_user_p50": percentile([r.per_user_tok_s for r in ok if r.per_user_tok_s is not None], 50),
        "usd_per_m_output": C.decode_usd_per_m_output(agg, gpus, usd_per_gpu_hour) if agg > 0 else None,
        # Near 1.0 the client, not the server, may be what limits the numbers above.
        "client_cpu_frac": cpu_frac,
    }
    timings = [r.timings for r in ok if r.timings]
    for key in BREAKDOWN:
        vals = []
        for t in timings:
            if key == "kv_handoff_gb_s":
                if _num(t.get("kv_handoff_s")) and t["kv_handoff_s"] > 0 and _num(t.get("kv_bytes")):
                    vals.append(t["kv_bytes"] / t["kv_handoff_s"] / 1e9)
            elif _num(t.get(key)):
                vals.append(float(t[key]))
        point[key] = percentile(vals, 50)
    return point


def steady_rate(results: list[RequestResult], conc: int, min_window_s: float = 1.0) -> float | None:
    """Output tokens/s while all `conc` slots had a request in flight: from the start of the conc-th
    request (the first wave is in) to the start of the last one (after it, slots drain). The aggregate
    over the whole point also counts the ramp up and the drain, when fewer streams run; this is the
    rate *at* the concurrency. None when the run has no such window of at least `min_window_s`."""
    starts = sorted(r.t_send for r in results)
    if len(starts) <= conc:
        return None
    t_a, t_b = starts[conc - 1], starts[-1]
    if t_b - t_a < min_window_s:
        return None
    tokens = sum(k for r in results if r.ok for t, k in r.arrivals if t_a <= t <= t_b)
    return tokens / (t_b - t_a)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---- CLI ------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvrelay.bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is dropped)")
    p.add_argument("--model", default=None, help="model name to request (default: first id of GET /v1/models)")
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help="requests in flight, comma list")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="IN/OUT token lengths, comma list, k = 1024")
    p.add_argument("--requests", type=int, default=None, help="requests per point (default max(2 x C, 8))")
    p.add_argument("--max-requests", type=int, default=512, help="cap on the default requests per point")
    p.add_argument("--stagger-s", type=float, default=0.0,
                   help="spread the first C requests' starts over this many seconds (0: all at once)")
    p.add_argument("--waves", type=float, default=None,
                   help="requests per point = max(waves x C, 4) (one wave: every stream starts together)")
    p.add_argument("--duration-s", type=float, default=None, help="stop starting requests of a point after this")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each workload")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="wall-clock limit of one request")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the server uses (for $ per 1M output tokens)")
    p.add_argument("--usd-per-gpu-hour", type=float, default=C.USD_PER_GPU_HOUR)
    p.add_argument("--topology", default=None, help="free text recorded in the JSON (e.g. the topology YAML)")
    p.add_argument("--label", default=None, help="names the result files (default: the model)")
    p.add_argument("--token-id-range", default=DEFAULT_TOKEN_RANGE,
                   help="LO,HI: prompt ids are drawn from [LO, HI) (small test models need a small HI)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-procs", type=int, default=0,
                   help="client processes per point (0: 1 up to C=32, else up to 4 by the CPU count)")
    p.add_argument("--out-dir", default=str(C.DEFAULT_OUT), help="directory for the JSON and PNG")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY; never stored in results)")
    return p


async def probe(client, args) -> dict:
    """GET /v1/models: the one-line exit when nothing answers, and the default model name."""
    import httpx

    try:
        resp = await client.get(f"{args.base_url}/v1/models", timeout=10)
    except httpx.HTTPError as e:
        raise SystemExit(f"error: cannot reach {args.base_url}: {type(e).__name__}: {e}") from None
    cards = []
    if resp.status_code == 200:
        try:
            cards = resp.json().get("data") or []
        except ValueError:
            pass
    if args.model is None:
        if not cards:
            raise SystemExit(f"error: {args.base_url}/v1/models answered HTTP {resp.status_code} with no model; "
                             "pass --model")
        args.model = cards[0]["id"]
    return next((c for c in cards if c.get("id") == args.model), {})


# 2: the result records what the server said it runs (`server`: GET /version); bench/provenance.py tables a
# schema-2 serve result only with it. Results without a schema (older) qualify by their own env as before.
SCHEMA = 2


async def server_version(client, args) -> dict | None:
    """GET /version: the server's commit, dirty flag, resolved topology and GPUs (router/version.py); None
    from a server that does not answer it (an older kvrelay, another server): recorded as such."""
    import httpx

    try:
        resp = await client.get(f"{args.base_url}/version", timeout=10)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _gpu_name() -> str:
    """This host's GPU (the client normally runs beside the server); torch would create a CUDA context."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False)
        names = out.stdout.strip().splitlines()
        return names[0].strip() if out.returncode == 0 and names else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "none (no nvidia-smi on the client host)"


async def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    try:
        import httpx
    except ImportError:
        raise SystemExit("error: kvrelay.bench.serve needs httpx (pip install httpx)") from None
    from kvrelay.bench.serve_procs import auto_procs, run_point_procs

    args.base_url = re.sub(r"/v1/?$", "", args.base_url.rstrip("/"))
    concurrency = C.parse_ints(args.concurrency)
    workloads = parse_workloads(args.workloads)
    lo, hi = C.parse_ints(args.token_id_range)
    limits = httpx.Limits(max_connections=max(concurrency) + 8, max_keepalive_connections=max(concurrency) + 8)
    # The per-request limit is enforced around the whole stream; httpx's own timeouts only guard the socket.
    timeout = httpx.Timeout(args.timeout_s, connect=30.0)
    console = C.console()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        card = await probe(client, args)
        server = await server_version(client, args)
        if server is None:
            console.print(f"[yellow]{args.base_url}/version did not answer: the result will not be tabled[/]")
        env = C.env_info("cpu", "kvrelay.bench.serve", argv)
        if args.api_key:  # a key given on the command line stays out of the stored results
            env["command"] = env["command"].replace(args.api_key, "***")
        env.update(gpu=_gpu_name(), device="client host (the server may run elsewhere)")
        payload: dict[str, Any] = {
            "kind": "serve", "schema": SCHEMA, "server": server, "env": env, "model": args.model, "base_url": args.base_url, "topology": args.topology,
            "label": args.label, "gpus": args.gpus, "usd_per_gpu_hour": args.usd_per_gpu_hour,
            "server_model_card": card,
            "settings": {"concurrency": concurrency, "workloads": [list(w) for w in workloads],
                         "requests": args.requests, "max_requests": args.max_requests, "duration_s": args.duration_s,
                         "warmup": args.warmup, "timeout_s": args.timeout_s, "stagger_s": args.stagger_s,
                         "waves": args.waves, "token_id_range": [lo, hi], "client_procs": args.client_procs,
                         "seed": args.seed, "endpoint": "/v1/completions (streamed, token-id prompts, ignore_eos)"},
            "breakdown_note": "queue_s .. delivery_s are p50s of the server's kvrelay_timings (null if not sent)",
            "points": [], "skipped": [],
        }
        console.print(f"[bold]serve[/] {args.model} at {args.base_url}, {args.gpus} GPU(s), topology {args.topology}")
        prompts = Prompts(args.seed, lo, hi)
        max_len = card.get("max_model_len")
        for input_len, output_len in workloads:
            if isinstance(max_len, int) and input_len + output_len > max_len:
                payload["skipped"].append({"input_len": input_len, "output_len": output_len,
                                           "reason": f"input + output > max_model_len {max_len}"})
                continue
            url = f"{args.base_url}/v1/completions"
            for _ in range(args.warmup):
                w = await one_request(client, url, request_body(args.model, prompts.next(input_len), output_len),
                                      output_len, args.timeout_s)
                if not w.ok:
                    console.print(f"[yellow]warmup {input_len}/{output_len} failed: {w.error}[/]")
            for conc in concurrency:
                if args.requests:
                    n = args.requests
                elif args.waves:
                    n = max(int(round(args.waves * conc)), 4)
                else:
                    n = min(max(2 * conc, 8), args.max_requests)
                procs = args.client_procs or auto_procs(conc)
                if procs > 1:
                    results, wall, cpu = await asyncio.to_thread(run_point_procs, args, prompts, conc, input_len,
                                                                 output_len, n, procs)
                else:
                    results, wall, cpu = await run_point(client, args, prompts, conc, input_len, output_len, n)
                pt = summarize(results, conc, input_len, output_len, wall, cpu, args.gpus, args.usd_per_gpu_hour)
                pt["client_procs"] = procs
                payload["points"].append(pt)
                if pt["failed"]:
                    console.print(f"[yellow]{input_len}/{output_len} C={conc}: {pt['failed']} of {pt['requests']} "
                                  f"failed: {pt['failure_reasons']}[/]")
    _print(console, payload)
    fig = _plot(payload)
    name = C.slug(args.label or args.model)
    payload["files"] = C.save_result(args.out_dir, f"serve-{name}-{C.stamp()}", payload, fig)
    console.print(f"saved {payload['files']}")
    return payload


def _fmt(x: float | None, scale: float = 1.0, spec: str = ".3f") -> str:
    return "-" if x is None else format(x * scale, spec)


def _print(console, payload: dict) -> None:
    from rich.table import Table

    for w in sorted({(p["input_len"], p["output_len"]) for p in payload["points"]}):
        t = Table(title=f"{payload['model']} serving {w[0]}/{w[1]} tokens at {payload['base_url']}, "
                        f"{payload['gpus']} GPU(s) (${payload['usd_per_gpu_hour']:.2f}/GPU-h)")
        for col in ("conc", "reqs", "failed", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms",
                    "tok/s total", "tok/s steady", "tok/s/user p50", "$/1M out", "queue s", "prefill s", "KV handoff s",
                    "KV GB/s", "delivery s", "client CPU"):
            t.add_column(col, justify="right")
        for p in (p for p in payload["points"] if (p["input_len"], p["output_len"]) == w):
            t.add_row(str(p["concurrency"]), str(p["requests"]), str(p["failed"]), _fmt(p["ttft_p50_s"]),
                      _fmt(p["ttft_p99_s"]), _fmt(p["itl_p50_s"], 1e3, ".2f"), _fmt(p["itl_p99_s"], 1e3, ".2f"),
                      _fmt(p["out_tok_s_aggregate"], spec=",.0f"), _fmt(p.get("out_tok_s_steady"), spec=",.0f"),
                      _fmt(p["out_tok_s_per_user_p50"], spec=".1f"),
                      "-" if p["usd_per_m_output"] is None else f"${p['usd_per_m_output']:.3f}",
                      _fmt(p["queue_s"]), _fmt(p["prefill_compute_s"]), _fmt(p["kv_handoff_s"]),
                      _fmt(p["kv_handoff_gb_s"], spec=".1f"), _fmt(p["delivery_s"]), f"{p['client_cpu_frac']:.0%}")
        console.print(t)
    for s in payload["skipped"]:
        console.print(f"[yellow]skipped {s['input_len']}/{s['output_len']}: {s['reason']}[/]")


def _plot(payload: dict):
    if not payload["points"]:
        return None
    try:
        fig, (ax_tok, ax_ttft) = C.new_figure(ncols=2, figsize=(11, 4.5))
    except ImportError:  # matplotlib is a test extra; the JSON alone is the result
        print("matplotlib not installed: no PNG")
        return None
    for w in sorted({(p["input_len"], p["output_len"]) for p in payload["points"]}):
        pts = sorted((p for p in payload["points"] if (p["input_len"], p["output_len"]) == w),
                     key=lambda p: p["concurrency"])
        xs = [p["concurrency"] for p in pts]
        ax_tok.plot(xs, [p["out_tok_s_aggregate"] for p in pts], "o-", label=f"{w[0]}/{w[1]}")
        ax_ttft.plot(xs, [math.nan if p["ttft_p50_s"] is None else p["ttft_p50_s"] for p in pts], "o-",
                     label=f"{w[0]}/{w[1]}")
    ticks = sorted({p["concurrency"] for p in payload["points"]})
    for ax, ylabel in ((ax_tok, "output tokens/s (aggregate)"), (ax_ttft, "TTFT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(title="input/output tokens", fontsize=8)
    fig.suptitle(f"{payload['model']} serving, {payload['gpus']} GPU(s), {payload['label'] or payload['base_url']}",
                 fontsize=10)
    return fig


def main(argv: list[str] | None = None) -> dict:
    return asyncio.run(run(build_parser().parse_args(argv), argv))


def _any_success(payload: dict) -> bool:
    return any(p["requests"] > p["failed"] for p in payload["points"])


if __name__ == "__main__":
    sys.exit(C.run_cli(main, ok=_any_success))
