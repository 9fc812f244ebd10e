"""Harmony rendering of big conversations in a helper process, so that it never holds the router's GIL.

openai-harmony renders a conversation in one call that keeps the GIL the whole time (measured: a 1 MB
message 0.4 s, 11k short messages 3.1 s); on a thread it would still stall the event loop, every other
request and /health for that long. Conversations past a small size are therefore rendered by the same
function in a spawned process (one, started on first use): the router's thread only waits on a pipe.
Small ones, nearly all, render in-process as before (a round trip to the helper costs ~1 ms). The same
process decodes big HTTP request bodies (router/body.py).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import multiprocessing
import threading

from kvrelay.router import harmony
from kvrelay.router.types import ChatRequest

# Beyond either, in-process rendering would hold the GIL for more than ~10 ms.
BIG_MESSAGES = 64
BIG_CHARS = 64 * 1024
RENDER_TIMEOUT_S = 120.0

_lock = threading.Lock()
_pool: concurrent.futures.ProcessPoolExecutor | None = None


def _chars(req: ChatRequest) -> int:
    n = sum(len(m.content) + len(m.reasoning) + sum(len(c.arguments) for c in m.tool_calls) for m in req.messages)
    return n + sum(len(t.description) + len(t.parameters_json) for t in req.tools)


def is_big(req: ChatRequest) -> bool:
    return len(req.messages) > BIG_MESSAGES or len(req.tools) > BIG_MESSAGES or _chars(req) > BIG_CHARS


def _executor() -> concurrent.futures.ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            # spawn, not fork: the router process has threads (gRPC, Ray, the event loop) a fork would copy
            # mid-state. The child loads the vocabulary itself, from where engine/vocab.py resolves it (the packaged
            # copy, or the TIKTOKEN_ENCODINGS_BASE override it inherits).
            _pool = concurrent.futures.ProcessPoolExecutor(max_workers=1,
                                                           mp_context=multiprocessing.get_context("spawn"))
            atexit.register(_pool.shutdown, wait=False, cancel_futures=True)  # not left to teardown's GC
        return _pool


def _forget_broken(fut: concurrent.futures.Future) -> None:
    global _pool
    if not fut.cancelled() and isinstance(fut.exception(), concurrent.futures.process.BrokenProcessPool):
        with _lock:  # the helper died (killed, out of memory): the next big request starts a new one
            _pool = None


def submit(fn, *args) -> concurrent.futures.Future:
    """`fn(*args)` in the helper process (fn and args picklable; router/body.py decodes big bodies here)."""
    try:
        fut = _executor().submit(fn, *args)
    except concurrent.futures.process.BrokenProcessPool as e:
        fut = concurrent.futures.Future()
        fut.set_exception(e)
    fut.add_done_callback(_forget_broken)
    return fut


def render_chat(req: ChatRequest, start_date: str) -> list[int]:
    """harmony.render_chat, in the helper process when the conversation is big (call from a thread)."""
    if not is_big(req):
        return harmony.render_chat(req, start_date)
    return submit(harmony.render_chat, req, start_date).result(timeout=RENDER_TIMEOUT_S)
