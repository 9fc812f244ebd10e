"""bench/sweep_glue.py end to end on CPU under TRITON_INTERPRET=1 (a child process: the flag must precede
triton's import): every launch variant of the decode glue kernels is checked against the default launch
before it is timed (add_rms_norm bit for bit, the router's ids and logits), and the JSON and table name each."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_sweep_checks_and_records_every_launch(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "kvrelay.bench.sweep_glue", "--device", "cpu", "--rows", "1,3",
                          "--warps", "4,16", "--route-rows", "2", "--route-warps", "4", "--route-block-e", "2,4",
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (path,) = tmp_path.glob("sweep-glue-*.json")
    assert path.with_suffix(".png").exists()
    points = json.loads(path.read_text())["points"]
    norm = [p for p in points if p["kernel"] == "add_rms_norm attention-in"]
    assert [(p["rows"], p["launch"]) for p in norm] == [(t, l) for t in (1, 3) for l in ("default", "warps 4", "warps 16")]
    route = [p for p in points if p["kernel"].startswith("add_rms_norm_route")]
    assert {p["kernel"] for p in route} == {"add_rms_norm_route E=32", "add_rms_norm_route E=128"} and len(route) == 10
    assert {p["launch"] for p in route} >= {"add_rms_norm + router_route", "add_rms_norm + GEMM + route_topk"}
    for p in points:
        assert p["us"] > 0 and p.get("exact", True) is True, p
    assert "decode glue launches" in res.stdout
