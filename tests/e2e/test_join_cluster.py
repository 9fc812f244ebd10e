"""The documented multi-machine path, on one box: `ray start --head`, then `kvrelay serve` joining it.

`ray up configs/cluster.yaml` ends in the same state (a head started by `ray start --head`), so this is
the part of that path a CPU machine can check: serve joins an existing Ray instead of starting its own,
serves, and on SIGTERM leaves the external Ray running (it does not own it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

CONFIG = """
model: {name: tiny, dummy: true, seed: 0, max_context: 1024}
prefill: {workers: 1, max_prompt_tokens: 512}
decode: {workers: 1, max_batch: 4, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
ray: {address: null, namespace: kvrelay-join-test}
device: cpu
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cli() -> str:
    return str(Path(sys.executable).parent / "ray")


def test_serve_joins_a_ray_head_started_by_hand(tmp_path):
    import tempfile

    # Ray's unix socket paths must stay under 107 bytes: pytest's tmp_path is too deep for them.
    ray_tmp = Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG)
    port = _free_port()
    # Loopback only: with this variable Ray binds every listener to 127.0.0.1.
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    head = subprocess.Popen(
        [_ray_cli(), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--num-cpus", "4", "--include-dashboard", "false", "--disable-usage-stats",
         "--temp-dir", str(ray_tmp)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    head_lines: list[str] = []
    threading.Thread(target=lambda: head_lines.extend(head.stdout), daemon=True).start()
    serve = None
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not any("Ray runtime started" in ln for ln in head_lines):
            assert head.poll() is None, "ray start failed:\n" + "".join(head_lines[-30:])
            assert time.monotonic() < deadline, "ray head did not start:\n" + "".join(head_lines[-30:])
            time.sleep(0.5)

        serve = subprocess.Popen([sys.executable, "-m", "kvrelay.cluster.cli", "serve", str(cfg), "--address",
                                  address], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(serve.stdout), daemon=True).start()
        ready = None
        while ready is None:
            assert serve.poll() is None, "serve exited early:\n" + "".join(lines[-30:])
            assert time.monotonic() < deadline + 120, "serve did not become ready:\n" + "".join(lines[-30:])
            ready = next((json.loads(ln.split("kvrelay-ready ", 1)[1]) for ln in list(lines)
                          if ln.startswith("kvrelay-ready ")), None)
            time.sleep(0.2)
        assert ready["ray"] == address

        from kvrelay.router.client import RouterClient
        from kvrelay.router.types import SamplingOptions

        with RouterClient(ready["grpc"], timeout_s=120) as client:
            got = [t for r in client.generate([5, 6, 7], SamplingOptions(temperature=0.0, max_tokens=12))
                   for t in r.token_ids]
        assert len(got) == 12

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=90) == 0, "".join(lines[-30:])
        # serve did not start this Ray, so it must leave it running.
        assert head.poll() is None, "serve shut down a Ray cluster it only joined"
        probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{address}'); "
                                "print(int(ray.cluster_resources()['CPU'])); ray.shutdown()"],
                               env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=120)
        assert probe.returncode == 0 and probe.stdout.strip().splitlines()[-1] == "4", probe.stderr[-2000:]
    finally:
        for p in (serve, head):
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM) if p is head else p.kill()
                    p.wait(timeout=60)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(p.pid, signal.SIGKILL) if p is head else None
        import shutil

        shutil.rmtree(ray_tmp, ignore_errors=True)
