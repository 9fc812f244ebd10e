"""Start-up mistakes an operator makes get one clear line at once, not a hang or a late traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

CONFIG = """
model: {name: tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {max_prompt_tokens: 1024}
router: {host: 127.0.0.1, grpc_port: 0, http_port: PORT}
device: cpu
"""


def _cli(*args: str, timeout: float = 60, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvrelay.cluster.cli", *args], capture_output=True, text=True,
                         timeout=timeout, env=env)
    return out, time.monotonic() - t0


def _status_of_a_mute_listener(env: dict) -> tuple[str, subprocess.CompletedProcess, float]:
    """`kvrelay status --timeout 3` against a socket that accepts connections and never answers."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        address = f"127.0.0.1:{mute.getsockname()[1]}"
        return (address, *_cli("status", "--address", address, "--timeout", "3", env=env))


def test_status_of_an_address_where_nothing_listens_fails_fast():
    out, took = _cli("status", "--address", "127.0.0.1:1", "--timeout", "2")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "error: no running kvrelay cluster at 127.0.0.1:1: nothing accepts connections there (within 2 s)")
    assert took < 30


def test_status_of_an_address_that_is_no_ray_cluster_honours_its_timeout(tmp_path):
    """Something accepts connections there but never answers as a GCS: Ray's join would wait 10+ minutes.
    With a Ray auth token at hand (as after any local `kvrelay serve`), Ray gets as far as connecting; a
    machine that never ran a cluster has none, and Ray (2.60) then refuses before it connects (next test)."""
    env = dict(os.environ, HOME=str(tmp_path), RAY_AUTH_TOKEN="0123456789abcdef0123456789abcdef")
    address, out, took = _status_of_a_mute_listener(env)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: no running kvrelay cluster at {address}: something accepts connections there but no Ray "
        "cluster answered within 3 s")
    assert took < 20


def test_status_without_a_ray_auth_token_says_so_at_once(tmp_path):
    """No token anywhere (a fresh HOME, no RAY_AUTH_TOKEN*): one line naming the missing token, not a hang."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
    env["HOME"] = str(tmp_path)
    address, out, took = _status_of_a_mute_listener(env)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: no running kvrelay cluster at {address}: ") and "token" in last.lower(), last
    assert took < 20


def test_serve_refuses_a_router_port_in_use_before_starting_anything(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = tmp_path / "busy.yaml"
        cfg.write_text(CONFIG.replace("PORT", str(port)))
        out, took = _cli("serve", str(cfg))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"error: {cfg}: router.http_port: 127.0.0.1:{port} is already in use (")
    assert "kvrelay: starting" not in out.stdout and took < 30


def test_version_and_defaults_in_help():
    out, _ = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip().startswith("kvrelay ")
    out, _ = _cli("serve", "--help")
    text = " ".join(out.stdout.split())
    assert "seconds in-flight requests get to finish on shutdown (default: 30.0)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_serve_refuses_an_unset_api_keys_env_before_starting_anything(tmp_path):
    cfg = tmp_path / "keys.yaml"
    cfg.write_text(CONFIG.replace("PORT", "0").replace("http_port: 0}", "http_port: 0, api_keys_env: KVRELAY_NO_SUCH_VAR}"))
    out, took = _cli("serve", str(cfg))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: {cfg}: router.api_keys_env names KVRELAY_NO_SUCH_VAR, which is not set or empty "
        "(set it to one or more comma-separated keys)")
    assert "kvrelay: starting" not in out.stdout and took < 30


def test_serve_refuses_half_a_tls_pair_before_starting_anything(tmp_path):
    cfg = tmp_path / "tls.yaml"
    cfg.write_text(CONFIG.replace("PORT", "0"))
    cert = tmp_path / "cert.pem"
    cert.write_text("not used")
    out, took = _cli("serve", str(cfg), "--ssl-certfile", str(cert))
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
        "error: --ssl-certfile and --ssl-keyfile go together")
    out, took = _cli("serve", str(cfg), "--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "no.pem"))
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
        f"error: --ssl-keyfile: '{tmp_path / 'no.pem'}' is not a file")
    assert "kvrelay: starting" not in out.stdout and took < 30
