"""bench/RESULTS.md: the generator (bench/provenance.py + bench/results_md.py) over synthetic results in a
tmp dir (a dirty run and a foreign commit excluded, an older run superseded, the prefill ratio against the
seed, a serve table against the TensorRT-LLM anchor), and the committed file against bench/results today."""

from __future__ import annotations

import json
from pathlib import Path

import git_revs
import pytest

from kvrelay.bench import provenance, report, results_md

REPO = Path(__file__).resolve().parents[2]


def _head(rev: str = "HEAD") -> str:
    return git_revs.rev(rev)


def _env(commit, dirty, ts: str, command: str = "python -m kvrelay.bench.x") -> dict:
    return {"gpu": "NVIDIA H200", "git_commit": commit, "git_dirty": dirty, "command": command, "timestamp": ts}


def _prefill(commit, dirty, ts, points: dict[int, float]) -> dict:
    return {"kind": "prefill", "env": _env(commit, dirty, ts), "model": "gpt-oss-20b", "quant": "fp8-block128",
            "config": "EP1 DP1 TP1", "gpus": 1,
            "points": [{"length": n, "median_s": t, "usd_per_m_input": t * 3 / 3600 * 1e6 / n}
                       for n, t in points.items()]}


def _serve_point(conc: int, agg: float) -> dict:
    return {"concurrency": conc, "input_len": 1024, "output_len": 1024, "requests": conc, "failed": 0,
            "ttft_p50_s": 0.25, "ttft_p99_s": 0.5, "itl_p50_s": 0.0125, "out_tok_s_aggregate": agg,
            "out_tok_s_steady": None, "out_tok_s_per_user_p50": 80.0, "usd_per_m_output": 3 / 3600 / agg * 1e6,
            "queue_s": 0.125, "prefill_compute_s": 0.0625, "kv_handoff_s": 0.0, "delivery_s": 0.004}


def _serve(commit, ts, points) -> dict:
    return {"kind": "serve", "env": _env(commit, None, ts), "model": "gpt-oss-20b", "label": "20b-1k1k",
            "topology": "configs/h200-1gpu-20b.yaml", "gpus": 1, "points": points}


@pytest.fixture
def results(tmp_path) -> Path:
    head, prev = _head(), _head("HEAD~1") if git_revs.has_rev("HEAD~1") else _head()
    d = tmp_path / "results"
    d.mkdir()
    files = {
        # older: both lengths; newer: 8192 only, so 8192 comes from the newer run, 32768 from the older one
        "prefill-old.json": _prefill(prev, False, "2026-11-29T10:00:00+00:00", {8192: 0.3, 32768: 1.25}),
        "prefill-new.json": _prefill(head, False, "2026-11-30T09:30:00+00:00", {8192: 0.2}),
        "prefill-dirty.json": _prefill(head, True, "2026-12-01T00:00:00+00:00", {8192: 0.111, 65536: 3.333}),
        "prefill-foreign.json": _prefill("f" * 40, False, "2026-12-01T00:00:00+00:00", {128000: 9.876}),
        "decode-a.json": {"kind": "decode", "env": _env(head, None, "2026-11-30T09:40:00+00:00"),
                          "model": "gpt-oss-20b", "quant": "fp8-block128", "config": "EP1 DP1 TP1",
                          "points": [{"length": 8192, "batch": b, "step_median_s": t, "tokens_per_s_per_user": 1 / t,
                                      "tokens_per_s_aggregate": b / t, "usd_per_m_output": 3 / 3600 / (b / t) * 1e6}
                                     for b, t in ((1, 0.004), (8, 0.008))]},
        "serve-old.json": _serve(prev, "2026-11-30T08:00:00+00:00", [_serve_point(64, 4321.0)]),
        "serve-new.json": _serve(head, "2026-11-30T12:00:00+00:00", [_serve_point(64, 5000.0),
                                                                      _serve_point(256, 10000.0)]),
        "kernels-20261130-101500.json": {"commit": head, "command": "bench/kernels.py", "ceilings": {"TB/s": 4.19, "bf16": 762.0,
                                                                                        "fp8": 1378.0},
                           "rows": [{"group": "fp8", "name": "gemm", "ms": 0.25, "note": "", "TFLOP/s": 689.0,
                                     "share": 0.5, "target": ">=800 TFLOP/s"}]},
        "kernels-2.json": {"commit": head + " (+ uncommitted kernel files)", "rows": [
            {"group": "attn", "name": "decode", "ms": 0.3, "note": "", "TB/s": 3.9, "share": 0.931}]},
        "serve-x-status.json": [{"role": "decode", "healthy": True}],
    }
    for name, payload in files.items():
        (d / name).write_text(json.dumps(payload))
    return d


def _section(text: str, title: str) -> str:
    return text.split(title, 1)[1].split("\n## ", 1)[0]


def test_results_md_from_synthetic_results(results, tmp_path):
    md_path = tmp_path / "out" / "RESULTS.md"
    text = report.main([str(results), "--results-md", str(md_path)])
    assert md_path.read_text() == text
    assert text.splitlines()[0] == "# kvrelay benchmark results"
    assert "`python -m kvrelay.bench.report --results-md`" in text.splitlines()[2]
    head, short = _head(), _head()[:7]

    pre = _section(text, "### gpt-oss-20b\n")
    lines = [ln for ln in pre.splitlines() if ln.startswith("|")]
    assert lines[0] == "| config | 8192 | 32768 | 65536 | 128000 |"
    # 8192 from the newer run (0.200 s, $0.020), 32768 from the older one; the dirty 65536 and the foreign
    # commit's 128000 are not run as far as this table knows.
    assert lines[2] == "| EP1 DP1 TP1 kvrelay (fp8-block128) | 0.200 s, $0.020 | 1.250 s, $0.032 | not run | not run |"
    assert lines[3] == "| EP1 DP1 TP1 seed | 0.239 s, $0.024 | 1.610 s, $0.041 | 4.895 s, $0.062 | 16.037 s, $0.104 |"
    assert lines[4] == f"| kvrelay / seed | {0.2 / 0.239:.2f}x | {1.25 / 1.61:.2f}x | - | - |"
    prev_short = provenance.collect([results / "prefill-old.json"]).results[0].short
    assert lines[5] == (f"| measured at | `{short}` 2026-11-30 09:30 | `{prev_short}` 2026-11-29 10:00 | - | - |")
    assert "0.111 s" not in text and "3.333 s" not in text and "9.876 s" not in text
    # the 120b table is there with the seed's row and nothing of ours
    assert "| EP1 DP1 TP1 kvrelay (fp8-block128) | not run | not run | not run | not run |" in _section(
        text, "### gpt-oss-120b\n")

    dec = _section(text, "## Decode")
    assert "![decode curves](RESULTS-decode.png)" in dec
    assert (md_path.parent / "RESULTS-decode.png").stat().st_size > 10_000
    row = next(ln for ln in dec.splitlines() if ln.startswith("| 8192 | 8 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:6] == ["8.00", "125.0", "1,000", "$0.833"] and cells[-1] == f"`{short}` 2026-11-30 09:40"
    floor_tok_s, share = float(cells[6].replace(",", "")), float(cells[7].rstrip("%")) / 100
    assert 0 < share < 1 and floor_tok_s > 125.0  # the floor is faster than any measurement

    srv = _section(text, "## Serving")
    assert "### gpt-oss-20b, configs/h200-1gpu-20b.yaml (1 GPU): 1k/1k" in srv
    assert "(serve-new.json)" in srv and "serve-old.json" not in srv and "4,321" not in srv
    rows = [ln for ln in srv.splitlines() if ln.startswith("| 1k/1k |")]
    assert rows == [
        "| 1k/1k | 64 | 64 (0) | 0.250 | 0.500 | 12.50 | 5,000 | - | 80.0 | $0.167 | 0.125 | 0.062 | 0.000 | 0.004 | 36% | 50% |",
        "| 1k/1k | 256 | 256 (0) | 0.250 | 0.500 | 12.50 | 10,000 | - | 80.0 | $0.083 | 0.125 | 0.062 | 0.000 | 0.004 | 72% | 100% |",
    ]
    assert ("1k/1k best: 10,000 tok/s per GPU at C=256: 72% of TensorRT-LLM's 13,858; target >= 10,000: met (100%)."
            in srv)

    ker = _section(text, "## Kernels")
    # kernels.py writes no timestamp: the date is the file name's stamp; the ceiling is the one share implies
    assert f"| gemm | 250.0 | 689 TFLOP/s | fp8 1378 TFLOP/s | 50% | >=800 TFLOP/s |  | `{short}` 2026-11-30 10:15 |" in ker
    assert "| decode |" not in ker

    exc = _section(text, "## Excluded")
    assert "| prefill-dirty.json | prefill | dirty tree (env.git_dirty is true) |" in exc
    assert f"| prefill-foreign.json | prefill | commit {'f' * 40} is not a commit of this repository |" in exc
    assert f"| kernels-2.json | kernels | commit field '{head} (+ uncommitted kernel files)' is not a commit id |" in exc
    assert "| serve-x-status.json | status | commit not recorded |" in exc
    src = _section(text, "## Sources")
    assert "| serve-old.json | serve |" in src and "| superseded |" in src.split("serve-old.json")[1].split("\n")[0]
    assert "prefill-dirty.json" not in src


def test_committed_results_md_is_what_the_generator_writes():
    # Exact, not structural: a result added to bench/results without regenerating fails here, naming the fix.
    _head()
    md = REPO / "bench" / "RESULTS.md"
    col = provenance.collect([REPO / "bench" / "results"])
    want = results_md.expected(col, md)
    assert md.read_text() == want, f"bench/RESULTS.md is stale: run `{results_md.COMMAND}` and commit it"
    png = results_md.png_path(col, md)
    assert png is None or png.is_file(), f"{png} is missing: run `{results_md.COMMAND}`"
