"""What a running server says about itself (`GET /version`, gRPC `Version`): the kvrelay version, the git
commit and dirty flag of the code it runs, the topology it was started with (resolved) and the GPUs it
sees, so that a benchmark result can name exactly what produced it (bench/serve.py records it).

Read once, when the server starts: a commit read per request would describe whatever the checkout holds
by then, not the code that was imported. The environment variables that override git (a copied tree on a
machine without the repository) are read here and nowhere else in the server: `BuildEnv`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The checkout this module was imported from (an editable install or a source tree); in an installed wheel
# it is site-packages, which is no checkout, and git is asked only if it is the top of one.
REPO_ROOT = Path(__file__).resolve().parents[1]
UNKNOWN = "unknown"


@dataclass(frozen=True)
class BuildEnv:
    """KVRELAY_GIT_COMMIT: the commit of a tree copied without its .git (or with a stale one: the GPU box);
    KVRELAY_GIT_CLEAN=1: whoever copied it checked it was clean (nothing here to compare against)."""

    git_commit: str | None = None
    git_clean: bool = False

    @classmethod
    def read(cls, env: Mapping[str, str] = os.environ) -> "BuildEnv":
        return cls(git_commit=env.get("KVRELAY_GIT_COMMIT") or None, git_clean=env.get("KVRELAY_GIT_CLEAN") == "1")


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _is_checkout(repo: Path) -> bool:
    """`repo` is the top of a git work tree (not merely inside one, as a venv's site-packages may be)."""
    top = _git(repo, "rev-parse", "--show-toplevel")
    return top is not None and Path(top.strip()).resolve() == repo.resolve()


def git_commit(repo: Path = REPO_ROOT, env: BuildEnv | None = None) -> str:
    """KVRELAY_GIT_COMMIT when set, else the checkout's HEAD, else "unknown"."""
    env = env or BuildEnv.read()
    if env.git_commit:
        return env.git_commit
    head = _git(repo, "rev-parse", "HEAD") if _is_checkout(repo) else None
    return head.strip() if head and head.strip() else UNKNOWN


def git_dirty(repo: Path = REPO_ROOT, env: BuildEnv | None = None) -> bool | None:
    """Tracked files differ from HEAD; None where that cannot be known (a copied tree not vouched for)."""
    env = env or BuildEnv.read()
    if env.git_commit:
        return False if env.git_clean else None
    if not _is_checkout(repo):
        return None
    out = _git(repo, "status", "--porcelain", "--untracked-files=no")
    return None if out is None else bool(out.strip())


def kvrelay_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kvrelay")
    except metadata.PackageNotFoundError:
        return UNKNOWN


@dataclass(frozen=True)
class BuildInfo:
    version: str
    git_commit: str
    git_dirty: bool | None

    @classmethod
    def detect(cls, repo: Path = REPO_ROOT, env: BuildEnv | None = None) -> "BuildInfo":
        env = env or BuildEnv.read()
        return cls(kvrelay_version(), git_commit(repo, env), git_dirty(repo, env))


@dataclass(frozen=True)
class ServerInfo:
    """The /version body. `topology`: the resolved topology (cluster/topology.Topology.to_dict) or None for
    a server not started from one (tests, an in-process engine); `device` and `gpus`: what the router's
    process sees (nvidia-smi on its host; the workers run there on a local cluster), not asked of workers."""

    build: BuildInfo
    topology: Mapping[str, Any] | None = None
    topology_source: str | None = None
    device: str = "cpu"
    gpus: tuple[str, ...] = field(default_factory=tuple)

    def body(self) -> dict[str, Any]:
        return {"version": self.build.version, "git_commit": self.build.git_commit, "git_dirty": self.build.git_dirty,
                "topology_source": self.topology_source, "topology": dict(self.topology) if self.topology else None,
                "device": self.device, "gpus": list(self.gpus), "gpus_seen_by": "router"}
