"""A fake HTTP server a tests/cpu module writes as an ASGI app (the benchmarks' fake OpenAI servers in
test_bench_serve and test_bench_multiturn: a FastAPI app that lists one model, to which the test adds the
routes it fakes), served by uvicorn in a thread on 127.0.0.1 for one test."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


def fake_openai_app(model: str, max_model_len: int = 4096):
    """A FastAPI app whose GET /v1/models lists `model`, and a list `app.state.seen` for the request bodies
    the routes the test adds keep."""
    from fastapi import FastAPI

    app = FastAPI()
    app.state.seen = []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "max_model_len": max_model_len}]}

    return app


@contextlib.contextmanager
def serving_app(app, start_timeout_s: float = 20.0) -> Iterator[str]:
    """`app` served on a free port of 127.0.0.1 until the block ends: its base URL, http://127.0.0.1:PORT."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
