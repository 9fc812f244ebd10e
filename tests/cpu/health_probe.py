"""The /health probe of the tests that send the router work it must keep off its event loop (big bodies,
big prompts, big conversations): one request in a thread while /health is asked every 5 ms on fresh
connections; the request's response and every /health round trip come back for the test to judge."""

from __future__ import annotations

import gc
import http.client
import threading
import time

import httpx


def post_watching_health(server, path: str, **post) -> tuple[httpx.Response, list[float]]:
    """POST to `server`'s `path` (httpx.post keyword arguments `post`: json=, content=, headers=, ...;
    timeout 120 s unless given) while /health is asked every 5 ms: the response and every /health round
    trip (s)."""
    post.setdefault("timeout", 120)
    done = threading.Event()
    result: dict = {}

    def send() -> None:
        try:
            result["r"] = httpx.post(f"{server.http_url}{path}", **post)
        finally:
            done.set()  # also when the POST failed: the probe stops and join() lets its error show

    # What `kvrelay serve` does after start-up: a full collection walking everything this pytest process
    # has accumulated would otherwise pause whichever thread triggers it (~0.4 s in a long run).
    gc.collect()
    gc.freeze()
    t = threading.Thread(target=send)
    t.start()
    gaps = []
    host, port = server.http_url.split("//")[1].rsplit(":", 1)
    try:
        while not done.is_set():
            # A new connection each time: what is measured is the event loop's answer, never a reused
            # connection's TCP timing (the server's two writes meeting the client's delayed ACK).
            t0 = time.perf_counter()
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            conn.close()
            gaps.append(time.perf_counter() - t0)
            time.sleep(0.005)
    finally:
        t.join()
        gc.unfreeze()
    assert "r" in result, "the POST raised (its traceback is above)"
    return result["r"], gaps
