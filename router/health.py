"""Liveness and readiness, the same answer on HTTP (/health/live, /health/ready) and gRPC (the standard
grpc.health.v1 service that Kubernetes' gRPC probes and grpc_health_probe call, and kvrelay's own Health).

Live: the router process answers. Ready: the router can serve a request now, i.e. every worker behind it
is up (none found dead) and it is not shutting down; a load balancer stops sending traffic otherwise.
On gRPC the overall service ("") is liveness and `kvrelay.v1.Router` is readiness.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from grpc_health.v1 import health, health_pb2

READY_SERVICE = "kvrelay.v1.Router"
_WATCH_EVERY_S = 1.0


@dataclass(frozen=True)
class Readiness:
    ready: bool
    dead_workers: tuple[str, ...] = ()
    draining: bool = False

    def body(self, model: str) -> dict[str, Any]:
        if self.ready:
            return {"status": "ready", "model": model}
        out: dict[str, Any] = {"status": "not ready"}
        if self.dead_workers:
            out["dead_workers"] = list(self.dead_workers)
        if self.draining:
            out["draining"] = True
        return out


def readiness(engine: Any) -> Readiness:
    """From the engine client's optional hooks: `dead_workers()` (role, index) pairs and `draining`."""
    dead = tuple(f"{role} {i}" for role, i in getattr(engine, "dead_workers", lambda: [])())
    draining = bool(getattr(engine, "draining", False))
    return Readiness(not dead and not draining, dead, draining)


class HealthServicer(health.aio.HealthServicer):
    """grpc.health.v1 with readiness computed when asked; Watch streams see it change within a second."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self._engine = engine
        self._watch: asyncio.Task | None = None

    def _ready_status(self) -> int:
        return health_pb2.HealthCheckResponse.SERVING if readiness(self._engine).ready else \
            health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:
        if request.service == READY_SERVICE and not self._gracefully_shutting_down:
            await self.set(READY_SERVICE, self._ready_status())
        return await super().Check(request, context)

    async def start(self) -> None:
        await self.set(READY_SERVICE, self._ready_status())
        self._watch = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        while not self._gracefully_shutting_down:
            await asyncio.sleep(_WATCH_EVERY_S)
            await self.set(READY_SERVICE, self._ready_status())

    async def stop(self) -> None:
        """Everything NOT_SERVING (set before the server stops, so probes see it go)."""
        await self.enter_graceful_shutdown()
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
