"""bench/RESULTS.md's tuner, GEMV-sweep and profile tables (bench/results_tuning.py) over synthetic result
JSONs in a tmp dir: the figures come from the files, the newest qualifying run wins per point, a dirty-tree
result is excluded and never tabled, and the sources count them all as tabled."""

from __future__ import annotations

import json
from pathlib import Path

import git_revs
import pytest

from kvrelay.bench import provenance, report, results_tuning



def _env(commit, dirty, ts, command="python -m kvrelay.bench.x", kvrelay_env=None) -> dict:
    env = {"gpu": "NVIDIA H200", "git_commit": commit, "git_dirty": dirty, "command": command, "timestamp": ts}
    if kvrelay_env is not None:
        env["kvrelay_env"] = kvrelay_env
    return env


def _tune_point(model: str, tokens: int, h_ms: float, b_ms: float, tflops: float) -> dict:
    g = {"ms": b_ms / 2, "TFLOP/s": tflops + 10, "fp8_share": (tflops + 10) / 1378, "TB/s": 0.5, "bw_share": 0.12}
    return {"model": model, "shape": "E32_H2880_I2880", "tokens": tokens, "n_pairs": tokens * 4,
            "rows_per_expert": tokens * 4 / 32, "load": {"max_over_mean": 2.0, "active_experts": 32},
            "heuristic": {"label": "bm64 heur", "ms": h_ms, "w1": {"ms": h_ms / 2}, "w2": {"ms": h_ms / 2}},
            "best": {"label": "bm64 w1:bn128-w4-s4-g16-clamp-tma w2:bn128-w4-s4-g8", "ms": b_ms,
                     "w1": g, "w2": {**g, "TFLOP/s": tflops - 10}, "TFLOP/s": tflops,
                     "fp8_share": round(tflops / 1378, 3), "TB/s": 0.567, "bw_share": 0.135},
            "speedup": round(h_ms / b_ms, 3)}


def _tune(commit, dirty, ts, points) -> dict:
    return {"kind": "tune-moe", "env": _env(commit, dirty, ts), "ceilings": {"TB/s": 4.19, "fp8": 1378.0},
            "gpu": "NVIDIA H200", "args": {"timer": "graph"}, "complete": True, "checked_configs": 7,
            "points": points, "measurements": []}


def _gemv_row(label: str, us: float, nbytes: float) -> dict:
    tbs = nbytes / (us * 1e-6) / 1e12
    return {"launch": {}, "label": label, "us": us, "rel_err": 0.0, "tbs": tbs, "floor_share": tbs / 4.19}


def _sweep(commit, dirty, ts, today_us: float) -> dict:
    w1, w2 = 4 * 2880 * 5760, 4 * 2880 * 2880  # bytes read at 4 pairs (fp8)
    gemms = {"w1": {"today": _gemv_row("n32-k512-w4-s3", today_us, w1), "best": _gemv_row("n16-k512-w4-s1", 20.0, w1),
                    "floor_us": w1 / 4.19e12 * 1e6},
             "w2": {"today": _gemv_row("n16-k512-w4-s3", 9.0, w2), "best": None, "floor_us": w2 / 4.19e12 * 1e6}}
    for g in gemms.values():
        g["measured"] = [g["today"]] + ([g["best"]] if g["best"] else [])
    return {"kind": "sweep-gemv", "env": _env(commit, dirty, ts),
            "points": [{"tokens": 1, "pairs": 4, "model": "gpt-oss-20b", "gemms": gemms}]}


def _profile(commit, dirty, ts, *, graphs, wall, kernel, launches, kvrelay_env=None, batch=1) -> dict:
    cmd = f"python -m kvrelay.bench.profile_decode --batch {batch} --context 8192" + (" --graphs" if graphs else "")
    d = {"env": _env(commit, dirty, ts, cmd, kvrelay_env), "wall_ms": wall, "kernel_ms": kernel,
         "launches": launches, "batch": batch, "context": 8192, "model": "gpt-oss-20b", "quant": "fp8-block128",
         "top": [{"kernel": f"k{i}_kernel", "calls": 24, "total_us": 100.0 * (7 - i), "share": 0.1} for i in range(6)]}
    d["top"][0]["kernel"] = "void flashinfer::BatchPrefillWithPagedKVCacheKernel<true, flashinfer::KernelTraits<(flashi"
    if graphs:  # newer profiles record it; the eager one here is told by its command alone
        d.update(graphs=True, launches_per_layer=launches / 24, pipelined_ms=2.5)
    return d


@pytest.fixture
def results(tmp_path) -> tuple[Path, str]:
    head = git_revs.rev("HEAD")
    d = tmp_path / "results"
    d.mkdir()
    files = {
        # the older run has 1024 and 4096, the newer 4096 only: 4096 from the newer, 1024 from the older
        "tune-moe-NVIDIA_H200-20261130-100000.json": _tune(head, False, "2026-11-30T10:00:00+00:00", [
            _tune_point("gpt-oss-20b", 1024, 0.5, 0.49, 416.0), _tune_point("gpt-oss-20b", 4096, 2.5, 2.0, 433.3)]),
        "tune-moe-NVIDIA_H200-20261201-100000.json": _tune(head, False, "2026-12-01T10:00:00+00:00", [
            _tune_point("gpt-oss-20b", 4096, 2.25, 1.5, 568.5), _tune_point("gpt-oss-20b", 8192, 4.25, 2.75, 612.0)]),
        "tune-moe-NVIDIA_H200-20261201-120000.json": _tune(head, True, "2026-12-01T12:00:00+00:00", [
            _tune_point("gpt-oss-20b", 4096, 2.25, 1.111, 777.7)]),
        "sweep-gemv-NVIDIA_H200-20261201-110000.json": _sweep(head, False, "2026-12-01T11:00:00+00:00", 24.0),
        "sweep-gemv-NVIDIA_H200-20261201-120000.json": _sweep(head, True, "2026-12-01T12:00:00+00:00", 99.0),
        "profile-decode-a.json": _profile(head, False, "2026-12-01T11:00:00+00:00", graphs=True, wall=3.25,
                                          kernel=2.5, launches=480, kvrelay_env={
                                              "KVRELAY_FUSED": "0", "KVRELAY_FI_SPLIT_PAGES": "",
                                              "KVRELAY_GIT_COMMIT": head}),
        "profile-decode-b.json": _profile(head, None, "2026-11-30T11:00:00+00:00", graphs=False, wall=31.5,
                                          kernel=3.75, launches=1169, batch=2),
        "profile-decode-dirty.json": _profile(head, True, "2026-12-01T12:00:00+00:00", graphs=True, wall=8.88,
                                              kernel=7.77, launches=999),
    }
    for name, payload in files.items():
        (d / name).write_text(json.dumps(payload))
    return d, head


def _section(text: str, title: str) -> str:
    return text.split(title, 1)[1].split("\n## ", 1)[0]


def _rows(section: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in section.splitlines()
            if ln.startswith("| ") and not ln.startswith("| ---")][1:]


def test_tuning_tables_from_synthetic_results(results, tmp_path):
    d, head = results
    text = report.main([str(d), "--results-md", str(tmp_path / "RESULTS.md")])
    short = head[:7]

    tune = _section(text, "## MoE expert GEMMs")
    assert "### gpt-oss-20b on NVIDIA H200" in tune
    assert "| tokens | pairs | rows/expert | heuristic us | best us | speed-up | best TFLOP/s w1 / w2 / both | " \
           "of fp8 1378 TFLOP/s |" in tune
    rows = _rows(tune)
    assert [r[0] for r in rows] == ["1024", "4096", "8192"]
    assert rows[0][:9] == ["1024", "4,096", "128", "500.0", "490.0", "1.02x", "426 / 406 / 416", "30%", "0.57"]
    assert rows[0][10:] == ["-", f"`{short}` 2026-11-30 10:00"]
    # 4096 from the newer clean run, not the older one nor the dirty one (777.7 TFLOP/s)
    assert rows[1][3:9] == ["2,250.0", "1,500.0", "1.50x", "578 / 558 / 568", "41%", "0.57"]
    assert rows[1][9] == "`bm64 w1:bn128-w4-s4-g16-clamp-tma w2:bn128-w4-s4-g8`"
    assert rows[1][10:] == ["not met (95%, 32 TFLOP/s short)", f"`{short}` 2026-12-01 10:00"]
    assert rows[2][10] == "met (102%)"
    assert "777" not in tune and "433" not in tune and "1,111" not in tune
    assert "At >= 4,096 tokens: best 612 TFLOP/s at 8,192 tokens; target >= 600 TFLOP/s met at 1 of 2 token counts." \
        in tune

    sweep = _rows(_section(text, "## Decode MoE GEMVs"))
    w1_tbs = 4 * 2880 * 5760 / 20e-6 / 1e12
    assert sweep[0] == ["gpt-oss-20b", "1", "4", "w1", "`n32-k512-w4-s3`", "24.0", f"{w1_tbs * 20 / 24 / 4.19:.0%}",
                        "`n16-k512-w4-s1`", "20.0", f"{w1_tbs:.2f}", f"{w1_tbs / 4.19:.0%}",
                        f"{4 * 2880 * 5760 / 4.19e12 * 1e6:.1f}", "1.20x", f"`{short}` 2026-12-01 11:00"]
    assert sweep[1][3:10] == ["w2", "`n16-k512-w4-s3`", "9.0", sweep[1][6], "no launch passed", "-", "-"]
    assert "| best of 4.19 TB/s |" in _section(text, "## Decode MoE GEMVs")
    assert "99.0" not in _section(text, "## Decode MoE GEMVs")

    prof = _rows(_section(text, "## Decode step profiles"))
    assert len(prof) == 2  # the dirty one is not tabled
    a, b = prof  # batch 1 before batch 2
    assert a[:10] == ["gpt-oss-20b (fp8-block128)", "NVIDIA H200", "1", "8192", "graph", "`KVRELAY_FUSED=0`", "3.25",
                      "2.50", "2.50", "480 (20.0/layer)"]
    assert a[11].split("; ") == ["`flashinfer::BatchPrefillWithPagedKVCacheKernel` 700.0 (24)",
                                 "`k1_kernel` 600.0 (24)", "`k2_kernel` 500.0 (24)", "`k3_kernel` 400.0 (24)",
                                 "`k4_kernel` 300.0 (24)"]  # the top 5 of 6
    assert a[12] == f"`{short}` 2026-12-01 11:00 (profile-decode-a.json)"
    assert b[:10] == ["gpt-oss-20b (fp8-block128)", "NVIDIA H200", "2", "8192", "eager", "not recorded", "31.50", "-",
                      "3.75", "1169"]
    git_revs.rev(results_tuning.PROFILE_COUNT_FIX)  # the commit the counting changed at
    assert a[10] == b[10] == "device events"
    assert "8.88" not in text and "7.77" not in text

    exc = _section(text, "## Excluded")
    for name in ("tune-moe-NVIDIA_H200-20261201-120000.json", "sweep-gemv-NVIDIA_H200-20261201-120000.json",
                 "profile-decode-dirty.json"):
        assert f"| {name} |" in exc and "dirty tree" in exc.split(name)[1].split("\n")[0]
    src = _section(text, "## Sources")
    counts = {r[0]: r[5] for r in _rows(src)}
    assert counts == {"tune-moe-NVIDIA_H200-20261130-100000.json": "1 tabled",
                      "tune-moe-NVIDIA_H200-20261201-100000.json": "2 tabled",
                      "sweep-gemv-NVIDIA_H200-20261201-110000.json": "2 tabled",
                      "profile-decode-a.json": "1 tabled", "profile-decode-b.json": "1 tabled"}
    assert "no table for" not in text


def test_profiles_from_before_the_counting_fix_are_marked(tmp_path):
    before = git_revs.rev(f"{results_tuning.PROFILE_COUNT_FIX}~1")
    (tmp_path / "profile-decode-old.json").write_text(json.dumps(
        _profile(before, False, "2026-11-29T12:00:00+00:00", graphs=False, wall=32.0, kernel=3.5, launches=1169)))
    rows = _rows("\n".join(results_tuning.profile_section(provenance.collect([tmp_path]))))
    assert [r[10] for r in rows] == ["ops + kernels (2x)"]


def _dense_point(shape, k, n, rows, cublas_us, best_us, label="n32-k256-s4-w4-st2") -> dict:
    nbytes = n * (-(-k // 128) * 128) + rows * n * 2

    def row(name, us):
        tbs = nbytes / (us * 1e-6) / 1e12
        return {"backend": name, "label": name if name == "cublas" else label, "us": us, "rel_err": 1e-3,
                "tbs": tbs, "floor_share": tbs / 4.19}
    cub, best = row("cublas", cublas_us), (row("gemv", best_us) if best_us else None)
    return {"shape": shape, "k": k, "n": n, "rows": rows, "bytes": nbytes, "floor_us": nbytes / 4.19e6,
            "cublas": cub, "best": best, "speedup_vs_cublas": cublas_us / best_us if best_us else None,
            "measured": [cub] + ([best] if best else []), "complete": True}


def test_dense_gemv_sweep_table(tmp_path):
    # bench/sweep_gemv --dense: cuBLAS beside the best GEMV per (shape, M), newest clean run per point, the
    # dirty run never tabled, QKV (the larger N) first
    head = git_revs.rev("HEAD")
    files = {
        "sweep-gemv-dense-NVIDIA_H200-20261201-100000.json": [_dense_point("QKV", 2880, 5120, 1, 7.3, 14.0),
                                                              _dense_point("O", 4096, 2880, 1, 7.0, 5.0)],
        "sweep-gemv-dense-NVIDIA_H200-20261201-110000.json": [_dense_point("QKV", 2880, 5120, 1, 7.2, 4.5),
                                                              _dense_point("QKV", 2880, 5120, 8, 7.5, None)],
        "sweep-gemv-dense-NVIDIA_H200-20261201-120000.json": [_dense_point("O", 4096, 2880, 1, 7.0, 0.77)],
    }
    for (name, pts), (ts, dirty) in zip(files.items(), (("2026-12-01T10:00:00+00:00", False),
                                                        ("2026-12-01T11:00:00+00:00", False),
                                                        ("2026-12-01T12:00:00+00:00", True))):
        (tmp_path / name).write_text(json.dumps({"kind": "sweep-gemv-dense", "env": _env(head, dirty, ts),
                                                 "ceiling_tbs": 4.19, "points": pts, "complete": True}))
    col = provenance.collect([tmp_path])
    text = "\n".join(results_tuning.sweep_dense_section(col))
    rows = _rows(text)
    assert [r[:2] for r in rows] == [["QKV 2880->5120", "1"], ["QKV 2880->5120", "8"], ["O 4096->2880", "1"]]
    assert rows[0][2] == "7.20" and rows[0][5:7] == ["`n32-k256-s4-w4-st2`", "4.50"] and rows[0][10] == "1.60x"
    assert rows[0][-1] == f"`{head[:7]}` 2026-12-01 11:00"
    assert rows[1][5] == "no launch passed" and rows[1][10] == "-"
    assert rows[2][6] == "5.00" and rows[2][10] == "1.40x"  # the dirty run's 0.77 us is not tabled
    assert "0.77" not in text and "| cuBLAS of 4.19 TB/s |" in text
    assert results_tuning.used(col) == {"sweep-gemv-dense-NVIDIA_H200-20261201-100000.json": 1,
                                        "sweep-gemv-dense-NVIDIA_H200-20261201-110000.json": 2}
