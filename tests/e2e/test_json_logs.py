"""`kvrelay serve --log-format json --log-requests` on a split CPU cluster: every line the router process
writes to stderr (its own, and what Ray forwards from the workers) is one JSON object, and the lines about
a request, in the router and in the prefill and decode workers, carry the id the response returned."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from serve_proc import serving_cli

pytestmark = pytest.mark.timeout(240)

CONFIG = """
model: {name: tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 1, max_prompt_tokens: 1024}
decode: {workers: 1, max_batch: 8, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
device: cpu
log_format: json
"""


def test_one_request_id_across_router_and_workers(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG)
    with serving_cli(str(cfg), "--log-requests", split_stderr=True) as served:
        proc, out, err, ready = served.proc, served.lines, served.err, served.ready
        r = httpx.post(f"{ready['http']}/v1/completions", timeout=60,
                       json={"model": ready["model"], "prompt": [5, 6, 7, 8], "max_tokens": 5})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        assert rid.startswith("cmpl-")

        def about(request_id: str) -> list[dict]:
            return [rec for rec in map(json.loads, [ln for ln in list(err) if ln.strip()])
                    if rec.get("request_id") == request_id]

        deadline = time.monotonic() + 30  # the workers' lines arrive through Ray's log monitor
        while {rec.get("worker") for rec in about(rid)} < {"prefill-0", "decode-0"}:
            assert time.monotonic() < deadline, f"worker lines about {rid} missing:\n" + "".join(err[-40:])
            time.sleep(0.2)
    records = [json.loads(ln) for ln in err if ln.strip()]  # every stderr line is one JSON object
    # stdout: the banner, and what the workers write there (NIXL's logger) as JSON lines.
    forwarded = [json.loads(ln) for ln in out if ln.startswith("{")]
    assert any(rec["logger"] == "stdout" and "NIXL" in rec["message"] for rec in forwarded), out
    assert all(ln.startswith(("{", "kvrelay", "  ")) for ln in out), out
    assert all({"ts", "level", "logger", "message"} <= set(rec) for rec in records)
    mine = about(rid)
    by_worker = {rec.get("worker", "router"): rec for rec in mine}
    assert set(by_worker) == {"router", "prefill-0", "decode-0"}, mine
    assert "metrics" in by_worker["router"]["message"] and by_worker["router"]["logger"] == "kvrelay.requests"
    assert by_worker["prefill-0"]["message"].startswith("prefilled 4 prompt tokens")
    assert by_worker["decode-0"]["message"] == "decode ended: finish_reason length"
    pids = {name: rec["pid"] for name, rec in by_worker.items()}
    assert pids["router"] == proc.pid and len(set(pids.values())) == 3, pids  # three processes
