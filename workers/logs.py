"""Log lines of every kvrelay process, the router and each worker, in one format: text (the default) or
JSON, one object per line (`kvrelay serve --log-format json`, topology key `log_format`), for a log
pipeline to parse and join.

A line about a request carries its `request_id`: the id the router assigned and answered with (the
response's `id`; gRPC's `request_id`); a retried attempt's worker lines add `attempt`. Per-request lines
(logger `kvrelay.requests`: the router's metrics line, each worker's prefill and finish) are written with
`--log-requests` only.

The router configures itself with `configure`; every Ray worker process runs `setup_worker` when it
starts (Ray's `worker_process_setup_hook`), reading the choice from the environment the router gives it.
In JSON mode the router's stderr is wrapped so that anything else written there (lines the workers
print that are not ours, Ray's own messages, tracebacks) arrives as a JSON line too, and a worker's
stdout (where NIXL logs) is; the router's stdout keeps its human banner and `kvrelay-ready` line.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import sys
import threading
from typing import Any, TextIO

FORMAT_ENV = "KVRELAY_LOG_FORMAT"
REQUESTS_ENV = "KVRELAY_LOG_REQUESTS"
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s: %(message)s"
REQUEST_LOG = "kvrelay.requests"
_FIELDS = ("request_id", "attempt", "worker")  # extras a record may carry (see request_extra)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC), level, logger, message, pid, and request_id / attempt /
    worker when the record carries them; exc with the traceback of a logged exception."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": _now(), "level": record.levelname, "logger": record.name,
                               "message": record.getMessage(), "pid": record.process}
        for key in _FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def request_extra(request_id: str, worker: str | None = None) -> dict[str, str]:
    """`extra=` for a log call about a request: the router's id, and the attempt when it is a retry
    (attempt ids are `ID#retryN`, cluster/engine_client.py)."""
    base = request_id.split("#", 1)[0]
    out = {"request_id": base}
    if base != request_id:
        out["attempt"] = request_id
    if worker is not None:
        out["worker"] = worker
    return out


class JsonLines:
    """A text stream that writes every line as JSON: lines that already are a JSON object pass as they
    are, others become {"ts", "level": "INFO", "logger": NAME, "message"} (colour codes removed)."""

    def __init__(self, raw: TextIO, name: str = "stderr") -> None:
        self._raw = raw
        self._name = name
        self._buf = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._buf += text
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                self._raw.write(as_json_line(line, self._name))
        return len(text)

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return getattr(self._raw, "encoding", "utf-8")


def as_json_line(line: str, name: str = "stderr") -> str:
    line = _ANSI.sub("", line).rstrip("\r")
    if not line.strip():
        return ""
    if line.startswith("{"):
        try:
            if isinstance(json.loads(line), dict):
                return line + "\n"
        except ValueError:
            pass
    return json.dumps({"ts": _now(), "level": "INFO", "logger": name, "message": line},
                      ensure_ascii=False) + "\n"


def configure(fmt: str = "text", *, log_requests: bool = False, wrap_stderr: bool = False) -> None:
    """The root logger writes to stderr in `fmt`; per-request lines only with `log_requests`.
    `wrap_stderr` (the router, JSON): everything else written to stderr becomes JSON lines too."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if fmt == "json" and wrap_stderr and not isinstance(sys.stderr, JsonLines):
        sys.stderr = JsonLines(sys.stderr)  # type: ignore[assignment]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger(REQUEST_LOG).setLevel(logging.INFO if log_requests else logging.WARNING)


def worker_env() -> dict[str, str]:
    """The router's choice, for the workers' environment (left there by `configure_router`)."""
    return {k: os.environ[k] for k in (FORMAT_ENV, REQUESTS_ENV) if k in os.environ}


def configure_router(fmt: str, *, log_requests: bool) -> None:
    """The router process: configure it, and leave the choice in the environment the workers get."""
    os.environ[FORMAT_ENV] = fmt
    os.environ[REQUESTS_ENV] = "1" if log_requests else "0"
    if fmt == "json":
        # Ray reads these at import: worker lines reach us as written (no "(Actor pid=...)" prefix, no
        # "[repeated Nx]" merging of similar lines), so they stay one JSON object each.
        os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    configure(fmt, log_requests=log_requests, wrap_stderr=True)


def setup_worker() -> None:
    """Ray's worker_process_setup_hook: each worker process logs as the router asked. In JSON mode its
    stdout becomes JSON lines too (libraries that log there, NIXL's logger, print())."""
    fmt = os.environ.get(FORMAT_ENV, "text")
    if fmt == "json" and not isinstance(sys.stdout, JsonLines):
        sys.stdout = JsonLines(sys.stdout, "stdout")  # type: ignore[assignment]
    configure(fmt, log_requests=os.environ.get(REQUESTS_ENV) == "1")
