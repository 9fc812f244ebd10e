"""Shared by the test files that run Triton kernels under TRITON_INTERPRET=1 on CPU tensors.

The interpreter flag must be set before triton is imported: a test decorated with `interpreted(__file__)`
runs as it is when the session was started with TRITON_INTERPRET=1, and otherwise re-runs itself in a child
pytest with the flag set (CI runs `pytest tests/cpu` plainly). `refs` is tests/gpu/kernel_refs.py (the
float32 references and rel_err), loaded by path since tests/ is not a package.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "kernel_refs", Path(__file__).resolve().parents[1] / "gpu" / "kernel_refs.py")
refs = importlib.util.module_from_spec(_spec)
sys.modules["kernel_refs"] = refs  # dataclasses look their module up there
_spec.loader.exec_module(refs)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
import triton  # noqa: E402,F401  (test dependency; imported after the flag is read, as the kernels are)


def _rerun_interpreted(test_file: str, test_name: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          f"{test_file}::{test_name}"], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


def interpreted(test_file: str):
    """The decorator for the tests of `test_file` (pass `__file__`)."""
    path = str(Path(test_file).resolve())

    def deco(fn):
        def wrapper():
            if not INTERPRETED:
                _rerun_interpreted(path, fn.__name__)
                return
            fn()
        wrapper.__name__ = fn.__name__
        return wrapper
    return deco
