"""A plain wheel install works: build the wheel, install it into a scratch venv, import every module.

The scratch venv takes its third-party packages from the test's own interpreter (a .pth file), so the
check is about our packaging (package-dir mapping, package data), not about downloading dependencies.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBPACKAGES = ["protos", "v1", "configs", "cluster", "router", "prefill_worker", "decode_worker", "engine",
               "engine.layers", "kernels", "bench"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(REPO)], check=True, timeout=300)
    (whl,) = out.glob("kvrelay-*.whl")
    return whl


def test_wheel_layout(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    # Only our namespace and the dist-info: no generic top-level module names leak into site-packages.
    assert tops == {"kvrelay", next(t for t in tops if t.endswith(".dist-info"))}
    for sub in SUBPACKAGES:
        assert f"kvrelay/{sub.replace('.', '/')}/__init__.py" in names, sub
    assert "kvrelay/configs/cpu-tiny.yaml" in names
    # The o200k vocabulary harmony loads offline, and its licence: a fresh install needs nothing beside it.
    assert {"kvrelay/engine/o200k-vocab/o200k_base.tiktoken", "kvrelay/engine/o200k-vocab/LICENSE"} <= set(names)
    assert not any(n.startswith("kvrelay/tests") for n in names)


def test_wheel_installs_and_imports(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.check_output(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    # Install the wheel's files with the outer pip, into the scratch venv's site-packages.
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                    str(wheel)], check=True, timeout=300)
    # Third-party dependencies come from the outer environment, appended after the scratch site.
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import importlib, pkgutil, kvrelay.engine as e\n"
        f"site = {str(site)!r}\n"
        "assert e.__file__.startswith(site), e.__file__\n"
        f"for sub in {SUBPACKAGES!r}:\n"
        "    pkg = importlib.import_module('kvrelay.' + sub)\n"
        "    assert pkg.__file__.startswith(site), pkg.__file__\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        if not m.ispkg:\n"
        "            importlib.import_module(f'kvrelay.{sub}.{m.name}')\n"
        "from kvrelay.cluster.topology import load_topology\n"
        "from kvrelay.engine import vocab\n"
        "assert str(vocab.vocab_file()).startswith(site), vocab.vocab_file()\n"
        "from kvrelay.router import harmony\n"
        "assert harmony.encode_text('hello world') == [24912, 2375]\n"
        "print(load_topology(None).model.name)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_ENCODINGS_BASE"}  # the installed copy, only
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "gpt-oss-tiny"
