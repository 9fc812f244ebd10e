"""The router's Prometheus metrics, named as vLLM names its own with the `kvrelay_` prefix (docs/metrics.md
has the mapping), so dashboards and alerts built for vLLM read these after a prefix rename.

Latencies are measured where vLLM's front-end measures them: from the moment the router hands a
validated request to the engine to each token batch the engine hands back (tokens that arrive together
share the gap before them). Gauges that live on the workers (waiting line, KV pages in use) are read
when /metrics is scraped (`refresh`), not polled, so an idle cluster does no work for them. Errors are
counted by front-end and status code as they leave: HTTP by middleware, gRPC by interceptor.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger(__name__)

# vLLM's buckets for time to first token and inter-token latency (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)

RUNNING = Gauge("kvrelay_num_requests_running", "Requests streaming now (router view)")
WAITING = Gauge("kvrelay_num_requests_waiting", "Requests waiting for a decode worker with room (read at scrape)")
KV_USAGE = Gauge("kvrelay_kv_cache_usage_perc", "Share of a decode worker's KV pages in use, 0-1 (read at scrape)",
                 ["worker"])
PROMPT_TOKENS = Counter("kvrelay_prompt_tokens", "Prompt tokens of requests sent to the engine")
GENERATION_TOKENS = Counter("kvrelay_generation_tokens", "Tokens the engine generated")
TTFT = Histogram("kvrelay_time_to_first_token_seconds", "Time to first token", buckets=_TTFT_BUCKETS)
ITL = Histogram("kvrelay_inter_token_latency_seconds", "Time between consecutive output tokens",
                buckets=_ITL_BUCKETS)
E2E = Histogram("kvrelay_e2e_request_latency_seconds", "Time from the engine's start of a request to its end",
                buckets=_E2E_BUCKETS)
SUCCESS = Counter("kvrelay_request_success", "Requests that ran to their end, by finish reason", ["finished_reason"])
ERRORS = Counter("kvrelay_request_errors", "Refused or failed requests by front-end and status code",
                 ["api", "code"])

_REFRESH_TIMEOUT_S = 2.0


class RequestTimer:
    """One request's latency metrics, fed by the router's stream as the engine's token batches arrive."""

    __slots__ = ("_t0", "_last", "_tokens", "_open")

    def __init__(self, prompt_tokens: int) -> None:
        self._t0 = self._last = time.perf_counter()
        self._tokens = 0
        self._open = True
        RUNNING.inc()
        PROMPT_TOKENS.inc(prompt_tokens)

    def tokens(self, n: int) -> None:
        """`n` tokens arrived together now."""
        if n <= 0:
            return
        now = time.perf_counter()
        gap = now - self._last
        if self._tokens == 0:
            TTFT.observe(gap)
            n_itl, each = n - 1, 0.0  # the rest of the first batch came with it
        else:
            n_itl, each = n, gap / n
        for _ in range(n_itl):
            ITL.observe(each)
        self._tokens += n
        self._last = now
        GENERATION_TOKENS.inc(n)

    def finish(self, reason: str | None) -> None:
        """The request ended: `reason` is its finish reason, None when it failed or was abandoned. Once."""
        if not self._open:
            return
        self._open = False
        RUNNING.dec()
        if reason is not None:
            E2E.observe(time.perf_counter() - self._t0)
            SUCCESS.labels(reason).inc()


async def refresh(engine: Any) -> None:
    """Read the gauges the workers hold (the engine client's optional `gauges()`), bounded in time: a
    scrape must answer even when a worker does not."""
    gauges = getattr(engine, "gauges", None)
    if gauges is None:
        return
    try:
        values = await asyncio.wait_for(gauges(), _REFRESH_TIMEOUT_S)
    except Exception as e:  # a slow or dead worker: keep the last values, say why in the log
        log.info("metrics refresh failed: %r", e)
        return
    WAITING.set(values.get("waiting", 0))
    for worker, usage in values.get("kv_cache_usage", {}).items():
        KV_USAGE.labels(worker).set(usage)


def install_http(app: Any) -> None:
    """Count every HTTP response with a 4xx/5xx status (pure ASGI: streamed bodies pass untouched)."""

    def wrap(inner: Any) -> Any:
        async def counted(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return await inner(scope, receive, send)

            async def sending(message: dict) -> None:
                if message["type"] == "http.response.start" and message["status"] >= 400:
                    ERRORS.labels("http", str(message["status"])).inc()
                await send(message)

            await inner(scope, receive, sending)

        return counted

    app.add_middleware(_Asgi, wrap=wrap)


class _Asgi:
    """Starlette middleware from a function of the next app (add_middleware wants a class)."""

    def __init__(self, app: Any, wrap: Any) -> None:
        self._call = wrap(app)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self._call(scope, receive, send)


class GrpcErrorInterceptor(grpc.aio.ServerInterceptor):
    """Count every gRPC call that ends with a status other than OK, by its code's name."""

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        # A behaviour is a coroutine (unary calls; streaming ones that write with context.write, as
        # grpc.health.v1's Watch and the key check's refusal do) or an async generator (our streams).
        inner = handler.unary_unary or handler.unary_stream
        if inner is not None and not inspect.isasyncgenfunction(inner):

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                failed = True
                try:
                    out = await inner(request, context)
                    failed = False
                    return out
                finally:
                    _count(context, failed)

            make = (grpc.unary_stream_rpc_method_handler if handler.unary_stream is not None
                    else grpc.unary_unary_rpc_method_handler)
            return make(unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                failed = True
                try:
                    async for item in inner_stream(request, context):
                        yield item
                    failed = False
                except (asyncio.CancelledError, GeneratorExit):  # the client went away: not an error of ours
                    failed = False
                    raise
                finally:
                    _count(context, failed)

            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler  # no client-streaming methods in kvrelay.v1


def _count(context: grpc.aio.ServicerContext, failed: bool) -> None:
    """`failed`: the handler raised. An abort sets the code first; anything else reaches the client as
    UNKNOWN, as grpc.aio reports an exception escaping a handler."""
    code = context.code()
    if code is None and failed:
        code = grpc.StatusCode.UNKNOWN
    if code is not None and code != grpc.StatusCode.OK:
        ERRORS.labels("grpc", code.name if isinstance(code, grpc.StatusCode) else str(code)).inc()
