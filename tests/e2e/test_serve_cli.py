"""`kvrelay serve` and `kvrelay status` as an operator runs them, and the demo.

The serve process gets SIGTERM while a stream is still running: that stream must finish (drain), then
everything exits 0. Every port the process tree listens on must be a loopback one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serve_proc import child_env, serving_cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

CONFIG = """
model: {name: tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 1, max_prompt_tokens: 1024}
decode: {workers: 1, max_batch: 8, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
device: cpu
"""


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return out


def _listeners(pids: set[int]) -> list[tuple[str, int]]:
    text = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in text.splitlines():
        local = line.split()[3]
        for pid in re.findall(r"pid=(\d+)", line):
            if int(pid) in pids:
                found.append((local, int(pid)))
    return found


def test_serve_status_and_sigterm_drain(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG)
    env = child_env()
    # As an operator would run it behind a client that names the model its own way, with a key. Killed at
    # once if the test fails (the test itself sends SIGTERM to check the drain).
    with serving_cli(str(cfg), "--served-model-name", "acme/tiny", "tiny-alias", "--api-key", "sk-e2e", env=env,
                     term_timeout_s=0) as served:
        proc, lines, ready = served.proc, served.lines, served.ready
        assert ready["ray"].startswith("127.0.0.1:") and ready["grpc"].startswith("127.0.0.1:")

        listening = _listeners(_descendants(proc.pid))
        assert len(listening) >= 4  # router gRPC + HTTP, GCS, raylet, workers ...
        loopback = ("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:")  # the last: IPv4 loopback on a v6 socket
        outside = [(addr, pid) for addr, pid in listening if not addr.startswith(loopback)]
        assert not outside, f"listening beyond loopback: {outside}"

        st = subprocess.run([sys.executable, "-m", "kvrelay.cluster.cli", "status", str(cfg), "--address",
                             ready["ray"], "--json"], capture_output=True, text=True, timeout=60, env=env)
        assert st.returncode == 0, st.stderr[-2000:]
        rows = json.loads(st.stdout)
        assert [(r["role"], r["rank"], r["healthy"]) for r in rows] == [("prefill", 0, True), ("decode", 0, True)]
        assert all(r["pid"] > 0 and r["node"] and r["pages_in_use"] == {"full": 0, "sliding": 0} for r in rows)

        from kvrelay.router.client import RouterClient
        from kvrelay.router.types import SamplingOptions

        import httpx

        assert ready["model"] == "acme/tiny"
        assert httpx.get(f"{ready['http']}/v1/models", timeout=30).status_code == 401
        models = httpx.get(f"{ready['http']}/v1/models", headers={"Authorization": "Bearer sk-e2e"}, timeout=30)
        assert [m["id"] for m in models.json()["data"]] == ["acme/tiny", "tiny-alias"]
        with RouterClient(ready["grpc"], timeout_s=120, api_key="sk-e2e") as client:
            stream = client.generate(list(range(1, 30)), SamplingOptions(temperature=0.0, max_tokens=150))
            got = list(next(stream).token_ids)
            proc.send_signal(signal.SIGTERM)  # mid-stream: the drain lets it finish
            finish = 0
            for resp in stream:
                got += resp.token_ids
                finish = resp.finish_reason or finish
        assert len(got) == 150 and finish == 2
        assert proc.wait(timeout=90) == 0, "".join(lines[-30:])
        out = "".join(lines)
        assert "draining in-flight requests" in out and "kvrelay: stopped" in out
        assert "as acme/tiny, tiny-alias" in out and "Auth  1 API key(s) required" in out


def test_serve_model_one_liner_serves_a_checkpoint():
    """`kvrelay serve DIR` as `vllm serve MODEL`: OpenAI's original-format checkpoint, no YAML, on this
    CPU machine; greedy tokens equal the in-process engine's, whose first one is OpenAI's reference."""
    import httpx

    from kvrelay.engine.llm import LLM
    from kvrelay.engine.sampling import SamplingParams

    tiny = Path(__file__).resolve().parents[1] / "data" / "gpt-oss-tiny-original"
    run = json.loads((tiny / "reference.json").read_text())["runs"][1]
    with serving_cli(str(tiny), "--http-port", "0", "--grpc-port", "0", "--max-model-len", "1024") as served:
        ready, lines = served.ready, served.lines
        assert ready["model"] == "gpt-oss-tiny-original"
        r = httpx.post(f"{ready['http']}/v1/completions", timeout=120, json={
            "model": ready["model"], "prompt": run["prompt"], "max_tokens": 12, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["token_ids"]
        card = httpx.get(f"{ready['http']}/v1/models", timeout=30).json()["data"][0]
        assert card["max_model_len"] == 1024
    out = "".join(lines)
    assert "cpu-tiny.yaml for " in out or "gpt-oss-tiny-original" in out
    llm = LLM(str(tiny), device="cpu")
    want = [o.token_id for o in llm.generate(run["prompt"], SamplingParams(max_tokens=12, temperature=0.0))]
    assert got == want and got[0] == run["greedy"][0]


def test_serve_refuses_what_cannot_start_at_once(tmp_path):
    """A GPU topology on a machine without one, and a preset without --dummy: one line, no hang."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvrelay.cluster.cli", "serve", "h200-1gpu-20b.yaml", "--dummy",
                          "--http-port", "0", "--grpc-port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: h200-1gpu-20b.yaml: gpus: the workers need 1 GPUs (1 colocated worker(s) x 1 rank(s)) but the Ray "
        "cluster has 0")
    assert time.monotonic() - t0 < 60
    out = subprocess.run([sys.executable, "-m", "kvrelay.cluster.cli", "serve", "gpt-oss-20b", "--device", "cpu"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "'gpt-oss-20b' is a preset, which has no weights on disk" in out.stderr
    assert "kvrelay: starting" not in out.stdout


def test_demo_runs_end_to_end():
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # The README's first command, exactly: `make demo` (VENV points at the environment running this test, so
    # make finds it installed and goes straight to the demo).
    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run(["make", "-s", "demo", f"VENV={sys.prefix}"], capture_output=True, cwd=repo,
                         text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for what in ("TTFT (client)", "prefill", "KV transfer", "tokens/s", "stopped on SIGTERM (exit 0)"):
        assert what in res.stdout
    kib = float(re.search(r"KV transfer\s+([\d.]+) KiB", res.stdout).group(1))
    assert kib > 0
    assert time.monotonic() - t0 < 180


def test_demo_shows_the_servers_own_error_when_it_dies_before_ready(tmp_path):
    """`make demo` without -v: a server that fails at start shows its own error line, not only the demo's
    'exited before ready' (the server's output is otherwise hidden)."""
    cpu_tiny = (Path(__file__).resolve().parents[2] / "configs" / "cpu-tiny.yaml").read_text()
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(re.sub(r"(?m)^(\s*name:).*$", r"\1 /nonexistent/gpt-oss-dir", cpu_tiny, count=1))
    res = subprocess.run([sys.executable, "-m", "kvrelay.cluster.demo", str(cfg)], capture_output=True, text=True,
                         timeout=120, env=child_env())
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"[serve] error: {cfg}: model.name: '/nonexistent/gpt-oss-dir' is neither" in res.stderr, res.stderr
    assert res.stderr.rstrip().splitlines()[-1] == "error: kvrelay serve exited with 1 before 'kvrelay-ready'"
    assert "Traceback" not in res.stderr


def test_a_serve_that_never_gets_ready_fails_with_its_last_lines():
    """The helper every serve test starts through (serve_proc.start_serve): a serve that exits before its
    ready line fails the test at once, with what it printed."""
    from serve_proc import start_serve

    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)serve exited early:.*error: /nonexistent/tiny.yaml: no such file"):
        start_serve("/nonexistent/tiny.yaml", ready_timeout_s=60)
    assert time.monotonic() - t0 < 60
