"""Where a batch-1 prefill's wall time goes beyond its GPU work: the host's start-up before the first kernel, and
the GPU running slower under sustained load (the power cap lowering its clocks).

The call of bench/prefill.py (`Runner.prefill`, then `Runner.sample`) runs in two modes:
- plain: back to back, as bench/prefill.py times it (and as a busy prefill worker runs);
- ahead: behind a GPU sleep long enough for the host to queue the whole call first, so the GPU never waits for
  the host, and starts from an idle (cool, unthrottled) spell.
A mark after each layer (a CUDA event on the Runner's stream; a host timestamp on the CPU, where nothing is
queued and the two modes are one) gives each layer's end on the device's timeline, and the host's time when it
queued it. On a GPU, with `--clocks` (default on where nvidia-smi exists), SM clock, power and the throttle
reasons are sampled every 20 ms over each mode (the ahead mode's samples include its sleeps). H200 at 9f3b4d2,
8192 tokens (bench/results/prefill-wall-*): 20b plain 106.0 ms, ahead 100.5 ms; 2.1 ms of the gap is there by the
end of layer 0 (host work before the first kernels), the rest grows ~0.15 ms a layer although the host is ahead
of the GPU from layer 1 on: the same kernels at a median SM clock of 1800 MHz back to back against 1965 MHz after
the idle spell (the software power cap's reason is set in both).

    python -m kvrelay.bench.prefill_wall --model gpt-oss-20b --dummy --quant fp8-block128 --device cuda
    python -m kvrelay.bench.prefill_wall --model gpt-oss-tiny --dummy --device cpu --length 64 --iters 2   # plumbing
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import subprocess
import sys
import threading
import time

from kvrelay.bench import common as C
from kvrelay.engine.kv_geometry import FULL, SLIDING

SLEEP_CYCLES = 600_000_000  # torch.cuda._sleep: ~0.3 s at the H200's 1980 MHz, far more than a call's host time
SW_POWER_CAP = 0x4  # nvidia-smi clocks_event_reasons bit: clocks lowered to keep under the power limit


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvrelay.bench.prefill_wall", description=__doc__.split("\n\n")[0])
    C.add_common_args(p)
    p.add_argument("--length", type=int, default=8192, help="prompt tokens (one forward)")
    p.add_argument("--clocks", choices=["auto", "on", "off"], default="auto",
                   help="sample nvidia-smi's SM clock, power and throttle reasons over each mode (auto: on a GPU "
                        "when nvidia-smi is on PATH)")
    return p


@contextlib.contextmanager
def layer_marks(mark):
    """While active, `mark()` runs after each block's forward (GptOss.forward's last call of a block) and its
    result is appended with the host's perf_counter to the yielded list; the method is restored afterwards."""
    from kvrelay.engine import model as M

    orig = M.Block.attention_out_deferred
    marks: list[tuple[int, object, float]] = []

    def marked(self, x, o):
        out = orig(self, x, o)
        marks.append((self.layer, mark(), time.perf_counter()))
        return out

    M.Block.attention_out_deferred = marked
    try:
        yield marks
    finally:
        M.Block.attention_out_deferred = orig


class ClockSampler:
    """nvidia-smi's SM clock (MHz), power (W) and throttle reasons every 20 ms in a thread, between start/stop."""

    QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"

    def __init__(self):
        self.rows: list[tuple[float, float, int]] = []
        self._proc = None
        self._thread = None

    def start(self) -> None:
        self.rows = []
        self._proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                       "-lms", "20"], stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                mhz, watts, reasons = (s.strip() for s in line.split(","))
                self.rows.append((float(mhz), float(watts), int(reasons, 16)))
            except ValueError:  # a header or a field nvidia-smi reports as N/A
                continue

    def stop(self) -> dict:
        self._proc.terminate()
        self._proc.wait()
        self._thread.join(timeout=2)
        return summarize_clocks(self.rows)


def summarize_clocks(rows: list[tuple[float, float, int]]) -> dict:
    """Samples (MHz, W, reasons) -> median/min SM clock, median/max power, share of samples under the SW power cap."""
    if not rows:
        return {"samples": 0}
    mhz, watts, reasons = zip(*rows)
    return {"samples": len(rows), "sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz),
            "power_w_median": statistics.median(watts), "power_w_max": max(watts),
            "sw_power_cap_share": sum(1 for r in reasons if r & SW_POWER_CAP) / len(rows)}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    import torch

    from kvrelay.engine.sampling import SamplingParams

    console = C.console()
    cfg = C.resolve_config(args.model)
    cuda = torch.device(args.device).type == "cuda"
    iters = args.iters or 5
    n = args.length
    pages = -(-n // args.page_size) + 1
    runner, load_s, _ = C.build_runner(args, num_pages={FULL: pages, SLIDING: pages}, retries=0)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    greedy = [SamplingParams(max_tokens=1, temperature=0.0)]
    sw = C.StopWatch(args.device)
    clocks = args.clocks == "on" or (args.clocks == "auto" and cuda and shutil.which("nvidia-smi") is not None)
    sid = ("bench-prefill-wall", n)

    def since(a, b) -> float:  # ms from mark a to mark b
        return sw.elapsed(a, b) * 1e3

    def one(ahead: bool) -> dict:
        sw.sync()
        if ahead:
            torch.cuda._sleep(SLEEP_CYCLES)
        with layer_marks(sw.mark) as marks:
            start = sw.mark()
            t0 = time.perf_counter()
            logits = runner.prefill(sid, ids)
            issued = time.perf_counter() - t0
            end = sw.mark()
            runner.sample(logits, greedy, [0])
            wall = time.perf_counter() - t0
        sw.sync()
        runner.free(sid)
        return {"wall_ms": wall * 1e3, "issue_ms": issued * 1e3, "device_ms": since(start, end),
                "layers": [{"layer": lay, "device_ms": since(start, m), "host_ms": (t - t0) * 1e3}
                           for lay, m, t in marks]}

    for _ in range(2):  # warm-up: kernels compiled, allocator and staging buffers at their steady sizes
        one(False)
    modes = ("plain", "ahead") if cuda else ("plain",)
    payload: dict = {"kind": "prefill-wall", "env": C.env_info(args.device, "kvrelay.bench.prefill_wall", argv),
                     "model": cfg.name, "quant": args.quant, "dummy": args.dummy, "length": n, "iters": iters,
                     "load_s": load_s, "sleep_cycles": SLEEP_CYCLES if cuda else None, "modes": {}}
    for mode in modes:
        sampler = ClockSampler() if clocks else None
        if sampler:
            sampler.start()
        runs = [one(mode == "ahead") for _ in range(iters)]
        res = {k: statistics.median(r[k] for r in runs) for k in ("wall_ms", "issue_ms", "device_ms")}
        res["layers"] = [{"layer": rows[0]["layer"],
                          "device_ms": statistics.median(r["device_ms"] for r in rows),
                          "host_ms": statistics.median(r["host_ms"] for r in rows)}
                         for rows in zip(*(r["layers"] for r in runs))]
        res["clocks"] = sampler.stop() if sampler else None
        payload["modes"][mode] = res
    _print(console, payload)
    payload["files"] = C.save_result(args.out, f"prefill-wall-{C.slug(cfg.name)}-{n}-{C.stamp()}", payload,
                                     _plot(payload))
    console.print(f"saved {payload['files']}")
    return payload


def _print(console, payload: dict) -> None:
    from rich.table import Table

    modes = payload["modes"]
    t = Table(title=f"{payload['model']} prefill of {payload['length']} tokens: wall vs device time, ms "
                    f"(median of {payload['iters']})")
    for col in ("mode", "wall", "device", "host queued all by", "SM MHz (median, min)", "power W (median)",
                "SW power cap share"):
        t.add_column(col, justify="right")
    for mode, r in modes.items():
        c = r["clocks"] or {}
        t.add_row(mode, f"{r['wall_ms']:.2f}", f"{r['device_ms']:.2f}", f"{r['issue_ms']:.2f}",
                  f"{c['sm_mhz_median']:.0f}, {c['sm_mhz_min']:.0f}" if c.get("samples") else "-",
                  f"{c['power_w_median']:.0f}" if c.get("samples") else "-",
                  f"{c['sw_power_cap_share']:.0%}" if c.get("samples") else "-")
    console.print(t)
    if "ahead" in modes:
        lt = Table(title="each layer's end on the device timeline (ms from the call's start)")
        for col in ("layer", "plain", "ahead", "plain - ahead", "host queued it (plain)"):
            lt.add_column(col, justify="right")
        for p, a in zip(modes["plain"]["layers"], modes["ahead"]["layers"]):
            lt.add_row(str(p["layer"]), f"{p['device_ms']:.2f}", f"{a['device_ms']:.2f}",
                       f"{p['device_ms'] - a['device_ms']:.2f}", f"{p['host_ms']:.2f}")
        console.print(lt)


def _plot(payload: dict):
    fig, ax = C.new_figure(figsize=(7, 4))
    for mode, r in payload["modes"].items():
        ax.plot([x["layer"] for x in r["layers"]], [x["device_ms"] for x in r["layers"]], marker=".",
                label=f"{mode}: layer end on the device")
    plain = payload["modes"]["plain"]["layers"]
    ax.plot([x["layer"] for x in plain], [x["host_ms"] for x in plain], ls="--", label="plain: host queued it")
    ax.set_xlabel("layer")
    ax.set_ylabel("ms from the call's start")
    ax.set_title(f"{payload['model']} prefill {payload['length']} tokens, {payload['env']['gpu']}")
    ax.legend()
    return fig


if __name__ == "__main__":
    sys.exit(C.run_cli(main, ok=lambda p: bool(p.get("modes"))))
