"""`kvrelay serve` and a hand-started Ray head (`ray start --head --block`) as child processes of an e2e
test, started, waited for and stopped one way everywhere.

Everything binds 127.0.0.1: the configs the tests pass bind the router there, and the environment given
to the children sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, under which Ray binds every listener to
127.0.0.1. Cleanup kills the processes this module started, by pid (the Ray head by its own process
group), never `ray stop`: other clusters run on the same machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvrelay.cluster.serve import ready_info


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child: unbuffered output, Ray on loopback, no usage stats."""
    return dict(os.environ, PYTHONUNBUFFERED="1", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                RAY_USAGE_STATS_ENABLED="0", **extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_cli() -> str:
    return str(Path(sys.executable).parent / "ray")


@dataclass
class Served:
    proc: subprocess.Popen
    lines: list[str]  # stdout as read so far (stderr too, unless split_stderr)
    err: list[str]  # stderr as read so far, with split_stderr; else empty
    ready: dict  # the `kvrelay-ready {json}` line: "http", "grpc", "ray", "model", ...


def _read(stream, into: list[str]) -> None:
    threading.Thread(target=lambda: into.extend(stream), daemon=True).start()


def start_serve(*args: str, env: dict | None = None, ready_timeout_s: float = 180.0,
                split_stderr: bool = False) -> Served:
    """`python -m kvrelay.cluster.cli serve ARGS...`, returned once it printed its ready line. If it exits
    first, or is not ready within `ready_timeout_s`, it is killed and the test fails with its last lines."""
    proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cluster.cli", "serve", *args],
                            env=env if env is not None else child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE if split_stderr else subprocess.STDOUT, text=True)
    lines: list[str] = []
    err: list[str] = []
    _read(proc.stdout, lines)
    if split_stderr:
        _read(proc.stderr, err)
    deadline = time.monotonic() + ready_timeout_s
    try:
        while True:
            tail = "".join((err if split_stderr else lines)[-30:])
            assert proc.poll() is None, "serve exited early:\n" + tail
            assert time.monotonic() < deadline, f"serve not ready within {ready_timeout_s:.0f} s:\n" + tail
            ready = next((info for ln in list(lines) if (info := ready_info(ln)) is not None), None)
            if ready is not None:
                return Served(proc, lines, err, ready)
            time.sleep(0.2)
    except BaseException:
        stop(proc, term_timeout_s=0)
        raise


def stop(proc: subprocess.Popen, term_timeout_s: float = 90.0) -> None:
    """SIGTERM (serve drains, then exits), SIGKILL if it has not exited within `term_timeout_s` (at once
    with 0). Nothing if it already exited."""
    if proc.poll() is not None:
        return
    if term_timeout_s > 0:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=term_timeout_s)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait(timeout=30)


@contextlib.contextmanager
def serving_cli(*args: str, term_timeout_s: float = 90.0, **kwargs) -> Iterator[Served]:
    """start_serve(*args, **kwargs) for the `with` block, then stop(term_timeout_s)."""
    served = start_serve(*args, **kwargs)
    try:
        yield served
    finally:
        stop(served.proc, term_timeout_s)


@dataclass
class RayHead:
    proc: subprocess.Popen
    address: str  # 127.0.0.1:PORT
    env: dict[str, str]  # the environment it runs in, for the children that join it
    lines: list[str]


@contextlib.contextmanager
def ray_head(num_cpus: int = 4, start_timeout_s: float = 120.0, current: bool = False) -> Iterator[RayHead]:
    """`ray start --head --block` on 127.0.0.1 in its own session (so its raylet and GCS go with it), its
    temp dir under /tmp (Ray's unix socket paths must stay under 107 bytes: pytest's tmp_path is too
    deep). Stopped with SIGTERM to its process group (SIGKILL after 60 s); its temp dir removed.

    `current`: the head is, for the children given `env`, the machine's latest `ray start` (what
    `ray.init()` with no address joins): RAY_TMPDIR points Ray's default temp dir, and with it the
    `ray/ray_current_cluster` file `ray start` writes, into the private dir, never /tmp/ray."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
    port = free_port()
    env = child_env(RAY_TMPDIR=str(ray_tmp)) if current else child_env()
    where = [] if current else ["--temp-dir", str(ray_tmp)]
    proc = subprocess.Popen(
        [ray_cli(), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--num-cpus", str(num_cpus), "--include-dashboard", "false", "--disable-usage-stats", *where],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    _read(proc.stdout, lines)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not any("Ray runtime started" in ln for ln in lines):
            assert proc.poll() is None, "ray start failed:\n" + "".join(lines[-30:])
            assert time.monotonic() < deadline, "ray head did not start:\n" + "".join(lines[-30:])
            time.sleep(0.5)
        yield RayHead(proc, f"127.0.0.1:{port}", env, lines)
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)
