"""`python -m kvrelay.cluster.demo [CONFIG]`: the whole path once, end to end, then a clean shutdown.

Starts `kvrelay serve CONFIG` as a child process (free ports, loopback), sends one harmony chat request
over gRPC, prints the reply as it streams, then the request's numbers: TTFT as the client saw it, and
the server-side prefill time, KV bytes and transfer time, and decode rate (from the server's per-request
metrics line). Ends the server with SIGTERM, as an operator would, and reports how it exited.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from kvrelay.cluster.serve import READY, ready_info
METRICS = " metrics "
TAIL_LINES = 20  # of the server's output, shown when it fails before it is ready


class ServeFailed(RuntimeError):
    """kvrelay serve exited, or never got ready: the demo says so with the server's own last lines."""


def _pump(stream, lines: queue.Queue, tail: collections.deque, echo: bool) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
        tail.append(line.rstrip())
        if echo:
            print(f"  [serve] {line.rstrip()}", file=sys.stderr)


def _wait_for(lines: queue.Queue, proc: subprocess.Popen, marker: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                raise ServeFailed(f"kvrelay serve exited with {proc.returncode} before '{marker.strip()}'")
            continue
        if marker in line:
            return line
    raise ServeFailed(f"no '{marker.strip()}' from kvrelay serve within {timeout_s:g} s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = argv[0] if argv else "cpu-tiny.yaml"
    verbose = "-v" in argv
    t_start = time.perf_counter()
    cmd = [sys.executable, "-m", "kvrelay.cluster.cli", "serve", config, "--grpc-port", "0", "--http-port", "0",
           "--log-requests", "--drain-timeout", "10"]
    print(f"$ kvrelay serve {config} --grpc-port 0 --http-port 0 --log-requests")
    env = dict(os.environ, RAY_DEDUP_LOGS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    pump = threading.Thread(target=_pump, args=(proc.stdout, lines, tail, verbose), daemon=True)
    pump.start()
    status = 1
    try:
        try:
            ready = ready_info(_wait_for(lines, proc, READY, 150))
        except ServeFailed as e:
            # Without -v the server's output is not shown as it runs: its own error is in its last lines.
            pump.join(timeout=5 if proc.poll() is not None else 0)
            if not verbose:
                print("\n".join(f"  [serve] {ln}" for ln in tail), file=sys.stderr)
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"cluster up in {time.perf_counter() - t_start:.1f} s: gRPC {ready['grpc']}, HTTP {ready['http']}")
        status = _chat(ready, lines, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            print(f"kvrelay serve stopped on SIGTERM (exit {code}); total {time.perf_counter() - t_start:.1f} s")
            status = status or code
    return status


def _chat(ready: dict, lines: queue.Queue, proc: subprocess.Popen) -> int:
    from kvrelay.router.client import RouterClient
    from kvrelay.router.types import ChatMessage, SamplingOptions

    rid = f"demo-{os.getpid()}"
    messages = [ChatMessage("user", "In one sentence: why split prefill and decode onto different GPUs?")]
    print(f"\nuser> {messages[0].content}\nassistant> ", end="", flush=True)
    t0 = time.perf_counter()
    ttft = None
    n_tokens = 0
    finish = None
    section = None
    with RouterClient(ready["grpc"], timeout_s=120) as client:
        stream = client.chat(messages, reasoning_effort="low", request_id=rid,
                             sampling=SamplingOptions(temperature=0.0, max_tokens=64))
        for resp in stream:
            if resp.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            n_tokens += len(resp.token_ids)
            for kind, text in (("analysis", resp.reasoning), ("final", resp.content)):
                if text:
                    if kind != section:
                        print(f"\n  [{kind}] ", end="")
                        section = kind
                    print(text, end="", flush=True)
            if resp.finish_reason:
                finish = resp.finish_reason
    elapsed = time.perf_counter() - t0
    from kvrelay.v1 import router_pb2 as pb

    reason = pb.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower() if finish else "none"
    print(f"\n\n{n_tokens} tokens in {elapsed:.2f} s, finish reason {reason}")
    line = _wait_for(lines, proc, f"request {rid}{METRICS}", 10)
    m = json.JSONDecoder().raw_decode(line, line.index(METRICS) + len(METRICS))[0]  # another process's text may follow
    print(f"  TTFT (client)      {ttft * 1000:8.1f} ms" if ttft is not None else "  TTFT (client)        n/a")
    print(f"  TTFT (server)      {m['ttft_s'] * 1000:8.1f} ms   (queue {m['queue_s'] * 1000:.1f} ms)")
    print(f"  prefill            {m['prefill_s'] * 1000:8.1f} ms   ({m['prompt_tokens']} prompt tokens)")
    print(f"  KV transfer        {m['kv_bytes'] / 1024:8.1f} KiB in {m['kv_transfer_s'] * 1000:.1f} ms (NIXL READ)")
    print(f"  decode             {m['decode_tokens_per_s']:8.1f} tokens/s ({m['tpot_s'] * 1000:.1f} ms per token, "
          f"{m['output_tokens']} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
