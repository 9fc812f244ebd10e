"""The README's demo on a fresh machine: a checkout with nothing beside it (no build-machine folder) and no
TIKTOKEN_ENCODINGS_BASE, installed with pip, then `python -m kvrelay.cluster.demo configs/cpu-tiny.yaml`
(what `make demo` runs: `kvrelay serve`, one streamed harmony chat over gRPC, SIGTERM) from the checkout.

The checkout is this working tree's files (tracked, and new ones git does not ignore) copied into a
temporary folder, so uncommitted changes are tested too. It is installed the way a user's pip installs it
(a built wheel, not this worktree's editable install) into a scratch venv whose third-party packages
come from the test's own interpreter (a .pth line, as tests/cpu/test_wheel.py does: the editable
install's own .pth is not processed there), so nothing is downloaded and every kvrelay module, the
vocabulary included, comes from the copy. Before the vocabulary shipped as package data, this served
and said it was ready, then refused the chat (harmony could not load its vocabulary)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path

import pytest

from serve_proc import child_env

pytestmark = [pytest.mark.timeout(480), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _copy_checkout(dst: Path) -> None:
    """This working tree's files as a fresh clone of it would hold them (with uncommitted changes)."""
    names = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the working tree is not in the copy either
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def _install(checkout: Path, env_dir: Path) -> Path:
    """A scratch venv with `pip install <checkout>` in it (no dependencies: those come from this
    interpreter's site-packages, appended after its own). Returns its python."""
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.check_output(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q",
                    "--target", str(site), str(checkout)], check=True, timeout=300)
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


def test_the_readme_demo_runs_from_a_fresh_checkout(tmp_path):
    t0 = time.monotonic()
    checkout = tmp_path / "x" / "kvrelay"
    _copy_checkout(checkout)
    assert not (checkout.parent / "shared").exists() and (checkout / "configs" / "cpu-tiny.yaml").is_file()
    py = _install(checkout, tmp_path / "venv")
    env = child_env(PYTHONSAFEPATH="1", TIKTOKEN_RS_CACHE_DIR=str(tmp_path / "no-cache"))  # nothing downloaded
    env.pop("TIKTOKEN_ENCODINGS_BASE", None)
    env.pop("PYTHONPATH", None)

    where = subprocess.run([str(py), "-c", "from kvrelay.engine import vocab; print(vocab.vocab_file())"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=checkout)
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(tmp_path / "venv"), where.stdout  # the installed copy

    res = subprocess.run([str(py), "-m", "kvrelay.cluster.demo", "configs/cpu-tiny.yaml"], capture_output=True,
                         text=True, timeout=300, env=env, cwd=checkout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "$ kvrelay serve configs/cpu-tiny.yaml" in res.stdout
    for what in ("cluster up in", "assistant> ", "finish reason length", "TTFT (client)", "KV transfer",
                 "stopped on SIGTERM (exit 0)"):
        assert what in res.stdout, res.stdout[-3000:]
    print(f"\nfresh checkout: copied, installed and demoed in {time.monotonic() - t0:.1f} s")
