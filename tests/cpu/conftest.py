"""Shared test fixtures for tests/cpu."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_single_thread():
    """Run a module's tiny-model forwards on one intra-op thread. Toy matrices gain nothing from a second
    thread, and on a loaded 2-core machine oversubscribed OpenMP spinning made them ~10x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
