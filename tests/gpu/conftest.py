"""tests/gpu runs on the H200 machine only: without a GPU the whole run fails (a GPU suite that "passes"
by skipping everything would hide that nothing was tested)."""

from __future__ import annotations

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.exit("tests/gpu needs an NVIDIA GPU (torch.cuda.is_available() is False); run it on the "
                    "H200 machine (README: GPU tests)", returncode=3)
