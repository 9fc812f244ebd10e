"""SIGTERM and SIGINT while `kvrelay serve` starts (Ray starting, workers loading, router binding).

Until the router serves, a signal means "give up": `serve` prints one line, stops what it started (the
private Ray's processes with it) and exits 128 + the signal's number (143 / 130), as a shell reports a
process the signal killed. Once it serves, `serve` installs its own drain handlers (cluster/serve.py).

The handler raises `StartupInterrupted` in the main thread, which lands wherever it is: in Python code, or
out of Ray's blocking calls (ray.get and placement-group waits check for signals while they wait). Python
can run a handler where an exception cannot propagate (a fork hook while Ray spawns a process: it is
printed and dropped), so the signal is also recorded and `check()` raises it again at each start-up step.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StartupInterrupted(SystemExit):
    """A SIGTERM/SIGINT before serving. A SystemExit so that asyncio's callbacks and tasks let it through
    (they swallow other exceptions) and Ray's `except Exception` clauses do not catch it."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


_received: int | None = None
_starting = False


def _handler(signum: int, frame) -> None:
    global _received
    if _received is not None or not _starting:
        # A second signal while the first unwinds: one is enough. Not starting: uvicorn puts this handler
        # back when the router stops (it restores what it found); the stop under way is bounded anyway.
        return
    _received = signum
    raise StartupInterrupted(signum)


def guard() -> None:
    """From now until serving: SIGTERM and SIGINT raise StartupInterrupted (main thread only)."""
    global _received, _starting
    _received, _starting = None, True
    for sig in SIGNALS:
        signal.signal(sig, _handler)
    if not getattr(sys.unraisablehook, "_kvrelay", False):
        sys.unraisablehook = _drop_interrupted(sys.unraisablehook)


def _drop_interrupted(hook):
    """A StartupInterrupted raised where Python cannot propagate it (an import's Cython patching, a fork
    hook) would be printed as 'Exception ignored in ...' with a traceback; it is not lost (`check()`
    raises it again), so it is not printed."""

    def unraisable(info) -> None:
        if not isinstance(info.exc_value, StartupInterrupted):
            hook(info)

    unraisable._kvrelay = True  # type: ignore[attr-defined]
    return unraisable


def serving() -> None:
    """Start-up is over: the caller's own handlers take SIGTERM/SIGINT from here (a drain, not an exit)."""
    global _starting
    _starting = False


def check() -> None:
    """Raise StartupInterrupted if a signal came during start-up whose exception was dropped."""
    if _received is not None:
        raise StartupInterrupted(_received)


def quiet() -> None:
    """While stopping after an interruption: further SIGTERM/SIGINT are ignored (the stop is bounded)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextmanager
def kept_through_ray_init() -> Iterator[None]:
    """Around ray.init: keep a SIGTERM handler the caller installed (`guard`) in place. ray.init installs
    its own (sys.exit(15), raised wherever the main thread is) and its core worker installs absl's failure
    handler, which answers SIGTERM with a native stack dump and an abort (exit 134). With no handler of
    the caller's (SIG_DFL, tests starting a Cluster in-process, another thread), Ray's stay."""
    ours = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if not callable(ours):
        yield
        return
    import ray._private.utils as ray_utils
    from ray._private import ray_constants

    # Read when ray.init creates this process's core worker; the worker processes keep theirs (a native
    # crash there still dumps its stack). Python's faulthandler still reports a crash here.
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    install = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None  # ray.init looks it up when it installs its own
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = install
        signal.signal(signal.SIGTERM, ours)


def received() -> int | None:
    """The signal that interrupted start-up, if one did (whatever exception it became on its way out:
    Ray turns one raised inside its blocking calls into its own)."""
    return _received
