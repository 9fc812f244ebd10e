"""`kvrelay serve`'s ready line (cluster/serve.py): written in one write, and read back by `ready_info` even when
another process's output ran into it (the router's stdout and its workers' forwarded logs can share a pipe: seen
in CI on 2026-12-05, a NIXL log line of a prefill worker appended to the ready line, which json.loads refused)."""

from __future__ import annotations

import io
import json

from kvrelay.cluster import serve

INFO = {"model": "acme/tiny", "grpc": "127.0.0.1:33181", "http": "http://127.0.0.1:39031", "ray": "127.0.0.1:43611",
        "namespace": "kvrelay", "startup_s": 21.4}


def test_ready_info_reads_the_object_and_ignores_what_follows():
    line = serve.READY + json.dumps(INFO)
    assert serve.ready_info(line) == INFO
    # the CI line: a worker's log after the object, without a newline between
    tail = "\x1b[36m(PrefillWorker pid=24096)\x1b[0m 2026-12-05 07:20:00 NIXL INFO    _api.py:405 Backend UCX was instantiated"
    assert serve.ready_info(line + tail) == INFO
    assert serve.ready_info("\x1b[36m(DecodeWorker pid=1)\x1b[0m " + line) == INFO  # or before it
    assert serve.ready_info("kvrelay: serving acme/tiny") is None
    assert serve.ready_info("") is None


def test_the_banner_and_ready_line_go_out_in_one_write(monkeypatch):
    writes = []

    class Out(io.StringIO):
        def write(self, s):
            writes.append(s)
            return super().write(s)

    monkeypatch.setattr(serve.sys, "stdout", Out())
    serve._say("kvrelay: serving m\n" + serve.READY + json.dumps(INFO))
    assert len(writes) == 1 and writes[0].endswith("}\n")
    assert serve.ready_info(writes[0].splitlines()[-1]) == INFO
