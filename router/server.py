"""RouterServer: gRPC (grpc.aio) and OpenAI-compatible HTTP (uvicorn) in one asyncio process.

Both front-ends share one `RouterCore`, hence one engine client and one in-flight table. Port 0 picks
a free port; the bound ports are exposed after `start()`. `BackgroundRouter` runs a server on its own
event-loop thread for callers that are synchronous (tests with the `openai` client, demos).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading
from typing import Callable, Sequence

import grpc
import uvicorn
from grpc_health.v1 import health_pb2_grpc

from kvrelay.router.auth import ApiKeys, GrpcKeyInterceptor
from kvrelay.router.engine_client import EngineClient
from kvrelay.router import grpc_service
from kvrelay.router.grpc_service import RouterServicer
from kvrelay.router.http_api import create_app
from kvrelay.router.health import HealthServicer
from kvrelay.router.limits import GrpcRateLimitInterceptor, RateLimiter, TlsFiles
from kvrelay.router.metrics import GrpcErrorInterceptor
from kvrelay.router.parser import new_call_id
from kvrelay.router.service import RouterCore, utc_today
from kvrelay.router.version import BuildInfo, ServerInfo

log = logging.getLogger(__name__)


class RouterServer:
    def __init__(
        self,
        engine_client: EngineClient,
        model_name: str | Sequence[str] | None = None,
        host: str = "127.0.0.1",
        grpc_port: int = 0,
        http_port: int = 0,
        *,
        today: Callable[[], str] = utc_today,
        call_id_factory: Callable[[], str] = new_call_id,
        grace_s: float = 1.0,
        api_keys: ApiKeys = ApiKeys(),
        tls: TlsFiles | None = None,
        rate_limit: RateLimiter | None = None,
        server_info: ServerInfo | None = None,
    ) -> None:
        # Several names (vLLM's --served-model-name a b): the first is the id responses carry, and requests
        # may use any of them.
        names = (model_name,) if model_name is None or isinstance(model_name, str) else tuple(model_name)
        self.core = RouterCore(engine_client, model_name=names[0], today=today, call_id_factory=call_id_factory)
        self.core.model_names = tuple(dict.fromkeys((self.core.model_name, *(n for n in names if n))))
        # What /version answers, read now (at start) rather than per request: see router/version.py.
        self.core.server_info = server_info or ServerInfo(build=BuildInfo.detect())
        self.api_keys = api_keys
        self.tls = tls
        self.rate_limit = rate_limit
        self.host = host
        self._grpc_port_requested = grpc_port
        self._http_port_requested = http_port
        self._grace_s = grace_s
        self._grpc: grpc.aio.Server | None = None
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task[None] | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.health: HealthServicer | None = None

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.http_port}"

    async def start(self) -> None:
        # Tokenizing threads and the event loop share the GIL: with Python's default 5 ms switch interval
        # every hand-off to the loop can wait 5 ms, and a /health answer needs several (measured: 60-75 ms
        # beside a 2.7 MB prompt); at 1 ms it stays a few ms. The router process favours the loop's latency.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.001))
        # The key check runs first: a call without a valid key is refused before it counts against a limit.
        # Errors are counted first, so the key check's and the rate limit's refusals count too.
        interceptors = [GrpcErrorInterceptor()] + ([GrpcKeyInterceptor(self.api_keys)] if self.api_keys else []) + (
            [GrpcRateLimitInterceptor(self.rate_limit)] if self.rate_limit else [])
        self._grpc = grpc.aio.server(interceptors=interceptors)
        grpc_service.add_to_server(RouterServicer(self.core), self._grpc)  # undecodable requests: INVALID_ARGUMENT
        self.health = HealthServicer(self.core.engine)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        await self.health.start()
        address = f"{self.host}:{self._grpc_port_requested}"
        if self.tls:
            cert, key = self.tls.read()
            self.grpc_port = self._grpc.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            self.grpc_port = self._grpc.add_insecure_port(address)
        if self.grpc_port == 0:
            raise OSError(f"gRPC could not bind {self.host}:{self._grpc_port_requested}")
        await self._grpc.start()

        # We bind the HTTP socket ourselves so port 0 resolves before uvicorn starts serving.
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP. Without it a
        # response written in two parts (headers, body; every SSE chunk) waits for the client's delayed
        # ACK: measured 44 ms per request on a kept-alive connection, 0.2 ms with it.
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._http_port_requested))
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(self.core, self.api_keys, self.rate_limit), log_level="warning", lifespan="off",
            timeout_graceful_shutdown=max(1, int(self._grace_s)),
            ssl_certfile=self.tls.cert_file if self.tls else None, ssl_keyfile=self.tls.key_file if self.tls else None,
        )
        self._http = uvicorn.Server(config)
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        while not self._http.started:
            if self._http_task.done():  # startup failed; surface its exception
                await self._http_task
                raise RuntimeError("HTTP server exited during startup")
            await asyncio.sleep(0.01)
        log.info("router serving %s: gRPC %s, HTTP %s", self.core.model_name, self.grpc_target, self.http_url)

    async def stop(self) -> None:
        if self.health is not None:
            await self.health.stop()
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            await self._http_task
            self._http = self._http_task = None
        if self._grpc is not None:
            await self._grpc.stop(self._grace_s)
            self._grpc = None

    async def wait(self) -> None:
        """Serve until the HTTP server exits (Ctrl-C) or the gRPC server terminates."""
        assert self._http_task is not None and self._grpc is not None
        grpc_done = asyncio.ensure_future(self._grpc.wait_for_termination())
        try:
            await asyncio.wait({self._http_task, grpc_done}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Also when wait() itself is cancelled: a dangling wait_for_termination() would otherwise make
            # a later stop() raise CancelledError.
            grpc_done.cancel()
            await asyncio.gather(grpc_done, return_exceptions=True)


class BackgroundRouter:
    """A RouterServer on a private event loop thread: `with BackgroundRouter(...) as server:`."""

    def __init__(self, engine_client: EngineClient, **kwargs: object) -> None:
        self._engine = engine_client
        self._kwargs = kwargs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvrelay-router", daemon=True)
        self.server: RouterServer | None = None

    def __enter__(self) -> RouterServer:
        self._thread.start()

        async def make() -> RouterServer:
            server = RouterServer(self._engine, **self._kwargs)  # type: ignore[arg-type]
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(make(), self._loop).result(timeout=30)
        return self.server

    def __exit__(self, *exc: object) -> None:
        try:
            if self.server is not None:
                asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
