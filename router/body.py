"""Big HTTP request bodies are decoded and validated in the helper process, never on the router's event loop.

FastAPI parses a JSON body with json.loads and validates it with pydantic on the event loop; both are one
C call each that holds the GIL for the whole body (measured on the 2-core CI machine: a 32 MiB body of
token ids, 4.5M ids, 0.3 s of json.loads plus 0.06 s of validation; a thread would not help). /health and
every other request stood still meanwhile (0.44 s). `OffLoopJsonRoute` therefore spills a JSON body
over SMALL_BODY_BYTES, as it arrives, to a file in memory (/dev/shm) for the render pool's helper
process (router/render_pool.py), which runs the same json.loads and the same pydantic validation and
sends back either the validated model, or the error as FastAPI would have raised it (invalid JSON named
with its offset, a field's 400). The model comes back
compact: long token-id arrays (the models' `token_id_fields`, e.g. /v1/completions' `prompt`) as
array('i'), which unpickles as one copy instead of 4.5M int objects. FastAPI's own validation of the
already validated instance is then a type check. Whatever else a body holds is bounded by MAX_JSON_VALUES,
so that unpickling it stays short too; over it the body is refused with 413 like an over-long one.
Small bodies, nearly all, are parsed in-process as before (a round trip to the helper costs ~1 ms).
"""

from __future__ import annotations

import array
import asyncio
import email.message
import json
import os
import re
import tempfile
from typing import Any, Callable

import pydantic
from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from kvrelay.router import render_pool
from kvrelay.router.validation import ValidationError, check_json_text

# json.loads + validation of a body this small take ~2 ms in-process: less than the round trip's copies.
SMALL_BODY_BYTES = 256 * 1024
# JSON values outside compacted token ids a body may hold: unpickling this many takes ~20 ms of GIL here.
# The request limits (2048 messages, 128 tools, 256 prompts) stay far below it.
MAX_JSON_VALUES = 1 << 18
# Spilled body chunks are written in batches of this size from a worker thread: one thread hop a MiB.
SPILL_WRITE_BYTES = 1 << 20
MIN_COMPACT_IDS = 256  # shorter id lists unpickle quickly as they are
DECODE_TIMEOUT_S = 120.0
# The body goes to the helper as a file in memory (tmpfs): os.write copies it without the GIL, where
# pickling it into the pipe would hold the GIL for the copy (~20 ms for 32 MiB here).
_SPILL_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
_INT32 = 1 << 31


# A lone surrogate can only enter a body as a JSON escape (raw surrogate bytes are not UTF-8, refused
# when the body is decoded): bodies without one, nearly all, are not walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_body_text(body: bytes, data: Any = None) -> None:
    """Every string of a JSON body, whatever field holds it (text for the tokenizer or one a reply echoes:
    model, metadata, request_id), must be Unicode text: a ValidationError naming the first that is not
    (validation.check_unicode). `data`: the body already decoded; a body that is not JSON is left to the
    decoder to report."""
    if _SURROGATE_ESCAPE.search(body) is None:
        return
    if data is None:
        try:
            data = json.loads(body)
        except ValueError:
            return
    check_json_text(data, "")


def _is_json(request: Request) -> bool:
    """FastAPI's rule for when a body is JSON (a JSON content type; FastAPI is strict about its absence)."""
    value = request.headers.get("content-type")
    if not value:
        return False
    message = email.message.Message()
    message["content-type"] = value
    sub = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (sub == "json" or sub.endswith("+json"))


def _compact(ids: Any) -> Any:
    """A long list of token ids as array('i') (ids outside int32 cannot be in any vocabulary; they stay a
    list, for validation downstream to name)."""
    if (isinstance(ids, list) and len(ids) >= MIN_COMPACT_IDS
            and all(type(t) is int and 0 <= t < _INT32 for t in ids)):
        return array.array("i", ids)
    return ids


def _count_values(obj: Any, limit: int) -> int:
    """JSON values in `obj` (compacted id arrays count 1), counting stops past `limit`."""
    n, stack = 0, [obj]
    while stack and n <= limit:
        o = stack.pop()
        n += 1
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
    return n


def _errors(exc: pydantic.ValidationError) -> list[dict[str, Any]]:
    """pydantic's errors as FastAPI reports them (loc under "body"), picklable and without the input,
    which may be the whole body."""
    return [{"type": e["type"], "loc": ("body", *e["loc"]), "msg": e["msg"],
             **({"ctx": {k: str(v) for k, v in e["ctx"].items()}} if "ctx" in e else {})}
            for e in exc.errors(include_url=False, include_input=False)]


def decode(path: str, annotation: Any) -> tuple:
    """In the helper process, the body spilled to `path`: ("ok", model) | ("json", msg, pos) |
    ("unreadable", UnicodeDecodeError's fields) | ("text", field, message) (`check_body_text`) |
    ("invalid", errors) | ("too_many", count)."""
    with open(path, "rb") as f:
        body = f.read()
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return ("json", e.msg, e.pos)
    except UnicodeDecodeError as e:  # not UTF-8 (http_errors names it): the byte, not the 32 MiB around it
        return ("unreadable", e.encoding, e.object[e.start:e.end], e.start, e.end, e.reason)
    try:
        check_body_text(body, data)
    except ValidationError as e:
        return ("text", e.field, e.message)
    del body
    try:
        value = pydantic.TypeAdapter(annotation).validate_python(data)
    except pydantic.ValidationError as e:
        return ("invalid", _errors(e))
    for name in getattr(value, "token_id_fields", ()):
        ids = getattr(value, name)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            ids = [_compact(p) for p in ids]
        else:
            ids = _compact(ids)
        value.__dict__[name] = ids  # no re-validation: the lists were just validated
        data.pop(name, None)
    count = _count_values(data, MAX_JSON_VALUES)
    if count > MAX_JSON_VALUES:
        return ("too_many", count)
    return ("ok", value)


def _write_chunks(fd: int, chunks: list[bytes]) -> None:
    """os.write on tmpfs, in a worker thread: a copy that releases the GIL (a file object's write would not
    for small chunks), and whatever the kernel makes the write wait for (page allocation under memory
    pressure) never holds the event loop."""
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view):]


def _too_many_body() -> dict:
    return {"error": {"message": f"body: more than {MAX_JSON_VALUES} JSON values besides token ids",
                      "type": "invalid_request_error", "param": "body", "code": "request_too_large"}}


class OffLoopJsonRoute(APIRoute):
    """An APIRoute whose big JSON body is decoded in the helper process; FastAPI then finds it parsed."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()
        field = self.body_field
        if field is None:
            return handler
        annotation = field.field_info.annotation

        async def route(request: Request) -> Response:
            if not _is_json(request):
                return await handler(request)
            chunks: list[bytes] = []
            size, pending, spill = 0, 0, None
            try:
                try:
                    async for chunk in request.stream():
                        size += len(chunk)
                        chunks.append(chunk)
                        pending += len(chunk)
                        if spill is None and size > SMALL_BODY_BYTES:
                            spill = await asyncio.to_thread(tempfile.NamedTemporaryFile, dir=_SPILL_DIR,
                                                            prefix="kvrelay-body-")
                        if spill is not None and pending >= SPILL_WRITE_BYTES:
                            await asyncio.to_thread(_write_chunks, spill.fileno(), chunks)
                            chunks, pending = [], 0
                    if spill is not None and chunks:
                        await asyncio.to_thread(_write_chunks, spill.fileno(), chunks)
                except Exception as e:  # as FastAPI answers it (http_errors: 413 for limits.BodyTooLarge)
                    raise HTTPException(status_code=400, detail="There was an error parsing the body") from e
                if spill is None:
                    request._body = b"".join(chunks)  # Starlette's cache: FastAPI parses it as before
                    check_body_text(request._body)
                    return await handler(request)
                fut = render_pool.submit(decode, spill.name, annotation)
                out = await asyncio.wait_for(asyncio.wrap_future(fut), DECODE_TIMEOUT_S)
            finally:
                if spill is not None:
                    await asyncio.to_thread(spill.close)  # removes the file (freeing 32 MiB of tmpfs pages)
            if out[0] == "json":
                raise RequestValidationError([{"type": "json_invalid", "loc": ("body", out[2]), "msg":
                                               "JSON decode error", "input": {}, "ctx": {"error": out[1]}}])
            if out[0] == "unreadable":
                encoding, bad, start, end, reason = out[1:]
                cause = UnicodeDecodeError(encoding, bytes(start) + bad, start, end, reason)
                raise HTTPException(status_code=400, detail="There was an error parsing the body") from cause
            if out[0] == "invalid":
                raise RequestValidationError(out[1])
            if out[0] == "text":
                raise ValidationError(out[1], out[2])
            if out[0] == "too_many":
                return JSONResponse(_too_many_body(), status_code=413)
            # Starlette's caches: FastAPI sees a body (it never needs its bytes once parsed) and finds it
            # parsed; its validation of the instance is a type check.
            request._body = b"{}"
            request._json = out[1]
            return await handler(request)

        return route
