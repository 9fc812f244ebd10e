"""How the HTTP front end answers errors: OpenAI's error body with the status code a client acts on (400 naming
the field, 413 for a body over the limit, 429 / 503 with Retry-After, which the official clients retry, 500
only for a bug, logged with its traceback)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrelay.router import limits
from kvrelay.router.engine_client import EngineOverloaded, EngineUnavailable
from kvrelay.router.validation import ValidationError

log = logging.getLogger("kvrelay.router.http_api")  # the logger these handlers always wrote to


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ValidationError)
    async def _invalid(_: Request, exc: ValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), param=exc.field), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _malformed(_: Request, exc: RequestValidationError) -> JSONResponse:
        # Report the first problem the way our own validation would: "field.path: what is wrong".
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request body"}
        if err.get("type") == "json_invalid":  # FastAPI's loc is (body, offset): name the problem instead
            ctx = err.get("ctx") or {}
            where = f" at character {err['loc'][-1]}" if len(err.get("loc", ())) > 1 else ""
            return JSONResponse(error_body(f"body: not valid JSON{where}: {ctx.get('error', err.get('msg'))}",
                                           param="body"), status_code=400)
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        return JSONResponse(error_body(f"{field}: {err.get('msg')}", param=field), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and isinstance(exc.__cause__, limits.BodyTooLarge):
            return JSONResponse(limits.too_large_body(limits.MAX_BODY_BYTES), status_code=413)
        if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
            # FastAPI's "There was an error parsing the body": bytes that are not UTF-8 text cannot be JSON.
            return JSONResponse(error_body(f"body: not valid JSON: not UTF-8 text ({exc.__cause__})", param="body"),
                                status_code=400)
        return JSONResponse(error_body(str(exc.detail), type_="not_found_error" if exc.status_code == 404 else "invalid_request_error"),
                            status_code=exc.status_code)

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(_: Request, exc: EngineOverloaded) -> JSONResponse:
        # The official clients retry a 429 after Retry-After (with backoff), as they do for OpenAI's.
        return JSONResponse(error_body(str(exc), type_="rate_limit_error", code="server_overloaded"),
                            status_code=429, headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(_: Request, exc: EngineUnavailable) -> JSONResponse:
        # No worker took the request within the engine's resume bound (its workers died and are being
        # replaced): 503 + Retry-After, which the official clients retry like a 429. Not a server bug, so
        # no traceback (this handler also keeps Starlette from re-raising it into uvicorn's log).
        log.warning("request refused: %s", exc)
        return JSONResponse(error_body(str(exc), type_="server_error", code="service_unavailable"),
                            status_code=503, headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(error_body(f"internal error: {exc}", type_="server_error"), status_code=500)
