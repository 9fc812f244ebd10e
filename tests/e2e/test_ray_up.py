"""`ray up` as users run it: configs/cluster.yaml against a real sshd on 127.0.0.1.

The test starts its own sshd (a free loopback port, throwaway host and user keys, its own config; no
system file is touched) whose sessions get a throwaway home: its profile puts this checkout's Python
environment on PATH, as a node's own profile would. Then, with the shipped cluster file changed only in
its SSH port (through a ProxyCommand), key, Ray port and topology: `ray up` starts the Ray head and
`kvrelay serve` from the file's commands; a gRPC Generate and an OpenAI chat call succeed; `ray exec`
runs `kvrelay status`; `ray down` stops everything and leaves no process or listening port behind.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
RELAY = """import os, socket, sys, threading
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def up():
    while True:
        b = os.read(0, 65536)
        if not b:
            s.shutdown(socket.SHUT_WR)
            return
        s.sendall(b)
threading.Thread(target=up, daemon=True).start()
while True:
    b = s.recv(65536)
    if not b:
        break
    while b:
        b = b[os.write(1, b):]
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_ports() -> set[int]:
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


def processes_matching(needle: str) -> list[str]:
    found = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmd.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in text and str(os.getpid()) != cmd.parent.name:
            found.append(f"{cmd.parent.name}: {text[:200]}")
    return found


@pytest.fixture
def sshd(tmp_path):
    """sshd on a free 127.0.0.1 port; yields (port, user key, home of its sessions)."""
    binary = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(binary) or not shutil.which("rsync"):
        pytest.fail("needs Debian's openssh-server and rsync (.ci/run installs them)")
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "user_key.pub").read_text())
    home = tmp_path / "home"
    home.mkdir()
    venv_bin = Path(sys.executable).parent
    # Ray's token auth, as a secured deployment runs it: the token on every node, the mode in the profile.
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    # No TIKTOKEN_ENCODINGS_BASE: the nodes read the vocabulary shipped with the package, as a user's do.
    profile = f'export PATH="{venv_bin}:$PATH" RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=token\n'
    for rc in (".bashrc", ".bash_profile", ".profile"):
        (home / rc).write_text(profile)
    # Every session runs with the throwaway home, so `~` in the cluster file lands in tmp_path.
    force = tmp_path / "session.sh"
    force.write_text(f'#!/bin/sh\nexport HOME="{home}"\ncd "$HOME"\nexec /bin/bash -c "$SSH_ORIGINAL_COMMAND"\n')
    force.chmod(0o755)
    port = free_port()
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp_path / 'host_key'}\n"
        f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}\nPidFile {tmp_path / 'sshd.pid'}\n"
        f"AllowUsers {user}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        f"KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nForceCommand {force}\n")
    os.makedirs("/run/sshd", exist_ok=True)  # privilege separation directory sshd insists on
    proc = subprocess.Popen([binary, "-D", "-e", "-f", str(tmp_path / "sshd_config")],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "sshd.log", "w"))
    deadline = time.monotonic() + 20
    while port not in listening_ports():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "sshd.log").read_text()
        time.sleep(0.1)
    try:
        yield port, tmp_path / "user_key", home, user
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def test_ray_up_serves_and_ray_down_cleans_up(tmp_path, sshd):
    port, key, home, user = sshd
    ray_port, grpc_port, http_port = free_port(), free_port(), free_port()
    topo = tmp_path / "topology.yaml"
    topo.write_text(
        "model: {name: gpt-oss-tiny, dummy: true, seed: 0, max_context: 2048}\n"
        "prefill: {workers: 1, max_prompt_tokens: 1024}\ndecode: {workers: 1, max_batch: 8, page_size: 16}\n"
        f"router: {{host: 127.0.0.1, grpc_port: {grpc_port}, http_port: {http_port}}}\n"
        "ray: {address: auto}\ndevice: cpu\n")
    (tmp_path / "relay.py").write_text(RELAY)
    cfg = yaml.safe_load((REPO / "configs" / "cluster.yaml").read_text())
    cfg["auth"].update(ssh_user=user, ssh_private_key=str(key),
                       ssh_proxy_command=f"{sys.executable} {tmp_path / 'relay.py'} 127.0.0.1 {port}")
    cfg["file_mounts"] = {"~/kvrelay-topology.yaml": str(topo)}
    cfg["head_start_ray_commands"] = [c.replace("6379", str(ray_port)) for c in cfg["head_start_ray_commands"]]
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(cfg))
    name = f"kvrelay-test-{uuid.uuid4().hex[:8]}"
    ray = [str(Path(sys.executable).parent / "ray")]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")

    def ray_cli(verb: str, *flags: str, command: str | None = None, timeout: float = 240):
        argv = ray + [verb, *flags, "-n", name, str(cluster)] + ([command] if command else [])
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)

    up = ray_cli("up", "-y", "--no-config-cache")
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        log = home / "kvrelay-serve.log"
        deadline = time.monotonic() + 180
        while not (log.exists() and "kvrelay-ready" in log.read_text()):
            text = log.read_text() if log.exists() else "no serve log"
            assert "Traceback" not in text and "error:" not in text, text[-3000:]
            assert time.monotonic() < deadline, text[-3000:]
            time.sleep(0.5)

        from kvrelay.router.client import RouterClient
        from kvrelay.router.types import SamplingOptions

        with RouterClient(f"127.0.0.1:{grpc_port}", timeout_s=120) as c:
            tokens = [t for r in c.generate([1, 2, 3, 4], SamplingOptions(temperature=0.0, max_tokens=5))
                      for t in r.token_ids]
        assert len(tokens) == 5
        import openai

        chat = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused").chat.completions.create(
            model="gpt-oss-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0)
        assert chat.usage.completion_tokens >= 1 and chat.choices[0].finish_reason in ("stop", "length")

        st = ray_cli("exec", command=f"kvrelay status ~/kvrelay-topology.yaml --address 127.0.0.1:{ray_port} --json",
                     timeout=120)
        assert st.returncode == 0, st.stdout[-3000:] + st.stderr[-3000:]
        rows = json.loads(re.search(r"^\[.*^\]", st.stdout, re.S | re.M).group(0))
        assert [(r["role"], r["healthy"]) for r in rows] == [("prefill", True), ("decode", True)]
        # Everything the cluster listens on is loopback (Ray pinned by the file's commands).
        ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
        ours = [line for line in ss.splitlines() if any(f":{p} " in line for p in (ray_port, grpc_port, http_port))]
        assert ours and all("127.0.0.1" in line.split()[3] for line in ours), ours
    finally:
        down = ray_cli("down", "-y")
    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    # kvrelay serve exits once its Ray cluster is gone; the SSH control master goes after ControlPersist.
    deadline = time.monotonic() + 60
    while True:
        left = (processes_matching(f"127.0.0.1:{ray_port}") + processes_matching(f"gcs_server_port={ray_port}")
                + processes_matching(str(home)) + processes_matching(str(key)))
        ports = {ray_port, grpc_port, http_port} & listening_ports()
        if not left and not ports:
            break
        assert time.monotonic() < deadline, f"left behind: processes {left}, listening ports {ports}"
        time.sleep(1)
