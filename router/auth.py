"""API keys for both front-ends, as vLLM's `--api-key` does it: when keys are configured, every OpenAI
route (`/v1/...`) needs `Authorization: Bearer KEY` and every gRPC method but Health needs the same
`authorization` metadata; health, readiness and metrics stay open for probes and scrapers.

Keys come from `kvrelay serve --api-key KEY` (repeatable) and/or the environment variable that
`router.api_keys_env` names (comma-separated), never from the YAML itself: a topology file is shared
and committed, a key is not. Comparison is constant-time per key.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

# Probes: kvrelay's own Health and the standard grpc.health.v1 service (router/health.py).
OPEN_GRPC_METHODS = frozenset({"/kvrelay.v1.Router/Health", "/grpc.health.v1.Health/Check",
                               "/grpc.health.v1.Health/Watch"})


class ApiKeyError(ValueError):
    """The configured key source is unusable (named env var unset or empty): serve refuses to start."""


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()):
        self._keys = tuple(k.encode() for k in dict.fromkeys(k.strip() for k in keys) if k)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """True for `Bearer KEY` with a configured KEY (always True when no key is configured)."""
        if not self._keys:
            return True
        if not authorization or not authorization[:7].lower() == "bearer ":
            return False
        given = authorization[7:].strip().encode()
        # Every key is compared (no early exit), so the time taken does not say which one came close.
        return sum(hmac.compare_digest(given, k) for k in self._keys) > 0


def resolve_api_keys(cli_keys: Iterable[str] | None, env_name: str | None,
                     environ: Mapping[str, str] = os.environ, *, source: str = "topology") -> ApiKeys:
    """The keys serve uses: `--api-key` values plus the comma-separated value of `router.api_keys_env`."""
    keys = list(cli_keys or ())
    if env_name:
        raw = environ.get(env_name, "")
        from_env = [k.strip() for k in raw.split(",") if k.strip()]
        if not from_env:
            raise ApiKeyError(f"{source}: router.api_keys_env names {env_name}, which is not set or empty "
                              f"(set it to one or more comma-separated keys)")
        keys += from_env
    return ApiKeys(keys)


def install_http(app: FastAPI, keys: ApiKeys) -> None:
    """401 with OpenAI's error body on /v1 routes without a valid bearer key."""
    if not keys:
        return

    @app.middleware("http")
    async def _require_key(request: Request, call_next):
        if request.url.path.startswith("/v1") and not keys.allows(request.headers.get("authorization")):
            body = {"error": {"message": "missing or invalid API key: send 'Authorization: Bearer <key>'",
                              "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
            return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)


class GrpcKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls without `authorization: Bearer KEY` metadata (Health excepted)."""

    def __init__(self, keys: ApiKeys):
        self._keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method in OPEN_GRPC_METHODS:
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self._keys.allows(metadata.get("authorization")):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key: send metadata 'authorization: Bearer <key>'")

        make = (grpc.unary_stream_rpc_method_handler if handler.response_streaming
                else grpc.unary_unary_rpc_method_handler)
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
