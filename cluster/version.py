"""The /version body of a server started from a topology (router/version.py): the build, read once at
start, the resolved topology, and the GPUs nvidia-smi lists on the router's host."""

from __future__ import annotations

import shutil
import subprocess

from kvrelay.cluster.topology import Topology
from kvrelay.router.version import BuildInfo, ServerInfo


def gpu_names() -> tuple[str, ...]:
    """Each visible GPU's name from nvidia-smi (no CUDA context in the router process); () without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in out.splitlines() if line.strip())


def server_info(topo: Topology) -> ServerInfo:
    return ServerInfo(build=BuildInfo.detect(), topology=topo.to_dict(), topology_source=topo.source,
                      device=topo.device, gpus=gpu_names() if topo.device == "cuda" else ())
