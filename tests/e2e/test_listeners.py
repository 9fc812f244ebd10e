"""Every socket a running CPU cluster opened for others to reach (TCP listeners and bound UDP sockets of
the router, Ray's GCS, raylet, object manager, agents and workers, NIXL/UCX in the workers) is bound to
127.0.0.1, the interface the CPU preset configures: nothing is reachable from another machine.

The sockets are read from the kernel (/proc/net/{tcp,tcp6,udp,udp6}) and matched to this process and its
descendants through their open file descriptors, so other clusters running on the machine do not count."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import httpx
import pytest

from test_cluster import prompt_of

pytestmark = pytest.mark.timeout(240)

# Split roles (prefill and decode), so the KV goes over NIXL/UCX and its listeners exist.
TOPOLOGY = """
model: {name: tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 1, max_prompt_tokens: 1024}
decode: {workers: 1, max_batch: 8, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
device: cpu
"""
_TCP_LISTEN = "0A"


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # the process exited meanwhile
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return out


def _socket_inodes(pids: set[int]) -> dict[int, int]:
    """socket inode -> the pid holding it."""
    out = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                out[int(target[8:-1])] = pid
    return out


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    # The kernel prints each 32-bit word in host (little-endian) order.
    addr = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    # A dual-stack socket bound to 127.0.0.1 shows as ::ffff:127.0.0.1 in tcp6.
    return str(getattr(addr, "ipv4_mapped", None) or addr)


def bound_sockets(root: int) -> list[tuple[str, str, int, int]]:
    """(protocol, address, port, pid) of every TCP listener and bound UDP socket of `root`'s process tree."""
    inodes = _socket_inodes(_descendants(root))
    found = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/net/{proto}").read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], int(cols[9])
            if inode not in inodes or (proto.startswith("tcp") and state != _TCP_LISTEN):
                continue
            addr, port = local.split(":")
            found.append((proto, _address(addr), int(port, 16), inodes[inode]))
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def test_bound_sockets_reads_the_kernel_table():
    """The reader itself: a socket this test binds is found with its address, a closed one is not."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ("tcp", "127.0.0.1", port, os.getpid()) in bound_sockets(os.getpid())
    assert all(p != port for _, _, p, _ in bound_sockets(os.getpid()))
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ("tcp6", "::", port, os.getpid()) in bound_sockets(os.getpid())


def test_a_running_cpu_cluster_listens_on_loopback_only():
    from conftest import serving

    with serving(TOPOLOGY) as (run, server):
        # One request through prefill, the NIXL handoff and decode: every lazily opened listener exists.
        r = httpx.post(f"{server.http_url}/v1/completions", timeout=60,
                       json={"model": run.client.model_name, "prompt": prompt_of(20, 3), "max_tokens": 4})
        assert r.status_code == 200, r.text
        sockets = bound_sockets(os.getpid())
        commands = {pid: _command(pid) for _, _, _, pid in sockets}
        worker_pids = {s["pid"] for s in run.cluster.statuses() if "pid" in s}
    ports = {p for _, _, p, _ in sockets}
    assert server.http_port in ports and server.grpc_port in ports
    assert worker_pids and worker_pids <= {pid for _, _, _, pid in sockets}, "workers' listeners were not seen"
    exposed = [(proto, addr, port, commands[pid]) for proto, addr, port, pid in sockets
               if not ipaddress.ip_address(addr).is_loopback]
    print(f"\n{len(sockets)} sockets of {len(commands)} processes" if not exposed else "")
    assert not exposed, "listening beyond 127.0.0.1:\n" + "\n".join(map(str, exposed))
