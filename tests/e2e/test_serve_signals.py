"""SIGTERM and SIGINT at each step of `kvrelay serve`'s start-up (cluster/signals.py).

Before the router serves, a signal ends start-up: one line, exit 128 + the signal's number (143 / 130),
no native stack dump (Ray's absl handler used to answer SIGTERM with one and exit 134), and no process of
the server left behind: the private Ray's GCS, raylet, agents and workers go with it. Each case waits for
the log line that marks its step, so it lands in that step whatever the machine's speed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from serve_proc import child_env

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# step -> the line that shows it began (None: at once, before the process printed anything)
STEPS = {
    "spawned": None,
    "preflight-done": "kvrelay: starting",  # checks done, Ray not yet started
    "ray-up": "Started a local Ray instance",  # ray.init returned; workers being placed
    "workers-loading": "Initialized NIXL agent",  # a worker's constructor is running
}
NATIVE_DUMP = ("PC: @", "SIGTERM received", "Fatal Python error", "*** SIG", "Traceback")


def _session(sid: int) -> list[str]:
    """Live processes of session `sid` (serve starts its own: Ray's processes stay in it), as 'pid cmd'."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(f"{stat.parent.name} {(stat.parent / 'cmdline').read_text().replace(chr(0), ' ')[:120]}")
        except (OSError, IndexError):
            continue
    return out


def _serve_and_signal(sig: signal.Signals, marker: str | None) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cluster.cli", "serve", "cpu-tiny.yaml", "--grpc-port", "0",
                             "--http-port", "0"], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while marker is not None and not any(marker in ln for ln in list(lines)):
            assert proc.poll() is None, "serve exited before the step:\n" + "".join(lines[-30:])
            assert time.monotonic() < deadline, f"no {marker!r} within 180 s:\n" + "".join(lines[-30:])
            time.sleep(0.05)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        # Nothing of the server may hold its output open, nor outlive it by more than 10 s.
        reader.join(timeout=10)
        assert not reader.is_alive(), "serve's output still open 10 s after it exited:\n" + "\n".join(_session(proc.pid))
        deadline = time.monotonic() + 10
        while (left := _session(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, "processes of serve still running 10 s after it exited:\n" + "\n".join(left)
        return code, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for entry in _session(proc.pid):  # a failed case must not leave a Ray behind for the next
            try:
                os.kill(int(entry.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("step", list(STEPS))
def test_a_signal_during_start_up_stops_everything_in_one_line(step, sig):
    code, out = _serve_and_signal(sig, STEPS[step])
    assert not any(d in out for d in NATIVE_DUMP), out[-3000:]
    assert "kvrelay-ready" not in out, out[-3000:]
    if step == "spawned" and code == -sig:
        return  # the signal beat the interpreter to its handler: the default action, silently, as any process
    assert code == 128 + sig, f"exit {code}:\n{out[-3000:]}"
    assert out.rstrip().splitlines()[-1] == f"kvrelay: {sig.name} during start-up; stopped", out[-3000:]


def test_sigint_after_ready_drains_and_exits_0():
    """Ready, Ctrl-C is an operator's stop: drained, exit 0, as SIGTERM (test_serve_cli.py)."""
    code, out = _serve_and_signal(signal.SIGINT, "kvrelay-ready")
    assert code == 0, out[-3000:]
    assert "draining in-flight requests" in out and "kvrelay: stopped" in out
    assert not any(d in out for d in NATIVE_DUMP), out[-3000:]
