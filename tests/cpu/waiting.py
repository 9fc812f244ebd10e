"""Bounded waits for what a test's server does after the client already has its answer (a metric counted in
a handler's `finally`, a request freed in the engine): poll a predicate until it holds or the time is up."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.01) -> bool:
    """True as soon as predicate() holds; its last value once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(interval)
    return predicate()
