"""bench.serve's load split over several client processes (`--client-procs`).

One Python process parses every SSE chunk of every stream: measured on the H200 at 512 streams of 20b, the
client sat at 100% of a core while the server was still sending, so the client set the numbers. Each
process here drives its share of the streams with its own HTTP client; the requests, prompts and
staggered start are those of the one-process run, and the results are merged (times are
CLOCK_MONOTONIC, which all processes of the machine share)."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor

from kvrelay.bench.serve_client import Prompts, RequestResult, send_requests

_done = None  # the shared count of finished requests, in each child


def auto_procs(conc: int) -> int:
    """Processes for a point of `conc` streams: one up to 32, then up to 4, leaving cores to the server."""
    return 1 if conc <= 32 else max(1, min(4, (os.cpu_count() or 2) // 4))


def _init(done) -> None:
    global _done
    _done = done


def _child(spec: dict, k: int, procs: int, base: int, conc: int, input_len: int, output_len: int, n: int,
           t_start: float) -> tuple[list[RequestResult], float]:
    return asyncio.run(_drive(spec, k, procs, base, conc, input_len, output_len, n, t_start))


async def _drive(spec: dict, k: int, procs: int, base: int, conc: int, input_len: int, output_len: int, n: int,
                 t_start: float) -> tuple[list[RequestResult], float]:
    import httpx

    slots = sum(1 for i in range(min(conc, n)) if i % procs == k)
    limits = httpx.Limits(max_connections=slots + 8, max_keepalive_connections=slots + 8)
    timeout = httpx.Timeout(spec["timeout_s"], connect=30.0)
    headers = {"Authorization": f"Bearer {spec['api_key']}"} if spec["api_key"] else None
    def count() -> None:
        with _done.get_lock():
            _done.value += 1

    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        await asyncio.sleep(max(0.0, t_start - time.perf_counter()))
        cpu0 = time.process_time()
        results = await send_requests(
            client, f"{spec['base_url']}/v1/completions", spec["model"], Prompts(spec["seed"], spec["lo"], spec["hi"]),
            base, range(k, n, procs), slots=slots, conc=conc, input_len=input_len, output_len=output_len,
            t_start=t_start, stagger_s=spec["stagger_s"] or 0.0,
            deadline=float("inf") if spec["duration_s"] is None else t_start + spec["duration_s"],
            timeout_s=spec["timeout_s"], on_done=count)
        return results, time.process_time() - cpu0


def run_point_procs(args: argparse.Namespace, prompts: Prompts, conc: int, input_len: int, output_len: int,
                    n_requests: int, procs: int) -> tuple[list[RequestResult], float, float]:
    """run_point's contract over `procs` processes: (results, wall seconds, the busiest process's CPU
    fraction)."""
    from tqdm import tqdm

    base = prompts.issued
    prompts.issued += n_requests
    spec = {"base_url": args.base_url, "model": args.model, "timeout_s": args.timeout_s, "api_key": args.api_key,
            "stagger_s": getattr(args, "stagger_s", 0.0), "duration_s": args.duration_s, "seed": prompts.seed,
            "lo": prompts.lo, "hi": prompts.hi}
    ctx = mp.get_context("spawn")  # the parent runs an event loop and threads: never fork it
    done = ctx.Value("i", 0)
    bar = tqdm(total=n_requests, desc=f"{input_len}/{output_len} C={conc} ({procs} client procs)", unit="req",
               leave=False)
    with ProcessPoolExecutor(procs, mp_context=ctx, initializer=_init, initargs=(done,)) as pool:
        t_start = time.perf_counter() + 2.0 + 0.5 * procs  # the children start (imports) before it
        futures = [pool.submit(_child, spec, k, procs, base, conc, input_len, output_len, n_requests, t_start)
                   for k in range(procs)]
        while not all(f.done() for f in futures):
            bar.n = done.value
            bar.refresh()
            time.sleep(0.5)
        outs = [f.result() for f in futures]
    bar.close()
    results = [r for rs, _ in outs for r in rs]
    end = max((r.t_done for r in results), default=time.perf_counter())
    wall = max(end - t_start, 1e-9)
    return results, wall, max(cpu for _, cpu in outs) / wall
