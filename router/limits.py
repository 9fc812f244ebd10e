"""Per-client rate limits, the request body limit and TLS settings of the router's two front-ends.

A rate limit counts generation requests (HTTP chat/completions and completions, gRPC Generate and Chat)
per API key, or per client address when the router has no keys, in a token bucket: `rpm` requests a
minute on average, `burst` at once. Over it: HTTP 429 with Retry-After (OpenAI's `rate_limit_exceeded`
body, which the official clients back off on), gRPC RESOURCE_EXHAUSTED. Health, models, metrics and
tokenizer routes are never limited.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

# The largest HTTP request body (a full 131k-token context as JSON token ids is ~1 MB; a batch of prompts
# more): beyond it 413 before the body is parsed. gRPC keeps its own 4 MiB message limit.
MAX_BODY_BYTES = 32 << 20
LIMITED_HTTP_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
LIMITED_GRPC_METHODS = frozenset({"/kvrelay.v1.Router/Generate", "/kvrelay.v1.Router/Chat"})


@dataclass(frozen=True)
class TlsFiles:
    """PEM certificate chain and private key; both front-ends serve TLS with them."""

    cert_file: str
    key_file: str

    def read(self) -> tuple[bytes, bytes]:
        return Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes()


class RateLimiter:
    def __init__(self, rpm: int, burst: int | None = None, clock=time.monotonic) -> None:
        if rpm <= 0:
            raise ValueError(f"rate limit: requests per minute must be > 0, got {rpm}")
        self.rate = rpm / 60.0  # tokens per second
        self.burst = max(1, burst if burst is not None else math.ceil(rpm / 6))  # default: 10 s worth
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, last refill)
        self._lock = threading.Lock()  # gRPC and HTTP share the limiter from one loop; tests call it directly

    def take(self, client: str) -> float:
        """0.0 when `client` may send a request now (one is counted), else the seconds until it may."""
        now = self._clock()
        with self._lock:
            tokens, last = self._buckets.get(client, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[client] = (tokens - 1.0, now)
                if len(self._buckets) > 100_000:  # forget buckets refilled by now: they equal a new client's
                    self._buckets = {k: (t, at) for k, (t, at) in self._buckets.items()
                                     if t + (now - at) * self.rate < self.burst}
                return 0.0
            self._buckets[client] = (tokens, now)
            return (1.0 - tokens) / self.rate


def client_key(authorization: str | None, peer: str | None) -> str:
    """Who a request counts against: its bearer key when it sends one, else its address."""
    if authorization and authorization[:7].lower() == "bearer ":
        return "key:" + authorization[7:].strip()
    return "addr:" + (peer or "?")


def install_http(app: FastAPI, limiter: RateLimiter | None) -> None:
    if limiter is None:
        return

    @app.middleware("http")
    async def _rate_limit(request: Request, call_next):
        if request.method == "POST" and request.url.path in LIMITED_HTTP_PATHS:
            peer = request.client.host if request.client else None
            wait = limiter.take(client_key(request.headers.get("authorization"), peer))
            if wait > 0:
                retry = max(1, math.ceil(wait))
                body = {"error": {"message": f"rate limit exceeded: at most {limiter.rate * 60:g} requests a minute "
                                             f"(burst {limiter.burst}); retry after {retry} s",
                                  "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}
                return JSONResponse(body, status_code=429, headers={"Retry-After": str(retry)})
        return await call_next(request)


class GrpcRateLimitInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, limiter: RateLimiter):
        self._limiter = limiter

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method not in LIMITED_GRPC_METHODS:
            return handler
        limiter = self._limiter
        inner = handler.unary_stream

        async def limited(request, context):
            metadata = dict(context.invocation_metadata() or ())
            wait = limiter.take(client_key(metadata.get("authorization"), context.peer()))
            if wait > 0:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"rate limit exceeded: at most {limiter.rate * 60:g} requests a minute "
                                    f"(burst {limiter.burst}); retry after {max(1, math.ceil(wait))} s")
            async for resp in inner(request, context):
                yield resp

        return grpc.unary_stream_rpc_method_handler(limited, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)


class BodyTooLarge(ValueError):
    """An HTTP body grew past MAX_BODY_BYTES while it was read (no Content-Length, or a wrong one)."""


def too_large_body(limit: int) -> dict:
    return {"error": {"message": f"body: larger than {limit} bytes", "type": "invalid_request_error",
                      "param": "body", "code": "request_too_large"}}


class BodyLimit:
    """Pure ASGI: a declared Content-Length over the limit is refused (413) before anything is read; a
    body that grows past it while read raises BodyTooLarge into the app (http_api answers 413)."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await JSONResponse(too_large_body(self.max_bytes), status_code=413)(scope, receive, send)
            return
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)
