"""bench/sweep_gemv.py end to end on CPU under TRITON_INTERPRET=1 (a child process: the flag must precede
triton's import): every launch is checked against today's before it is timed, a launch that gives
other numbers is refused, and the JSON names today's and the best launch per GEMM."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _run(tmp_path, *extra):
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "kvrelay.bench.sweep_gemv", "--device", "cpu", "--models",
                          "gpt-oss-tiny", "--tokens", "1,2", "--samples", "3", "--out", str(tmp_path), *extra],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (path,) = tmp_path.glob("sweep-gemv-*.json")
    return json.loads(path.read_text()), res.stdout


def test_sweep_checks_and_records_every_launch(tmp_path):
    payload, out = _run(tmp_path)
    assert [p["tokens"] for p in payload["points"]] == [1, 2] and payload["complete"]
    assert "decode GEMVs" in out
    for p in payload["points"]:
        for gemm in ("w1", "w2"):
            g = p["gemms"][gemm]
            assert len(g["measured"]) == 4  # today's + 3 samples
            assert g["today"]["label"] == g["measured"][0]["label"]
            for r in g["measured"]:
                assert r["us"] is not None and r["rel_err"] < 2e-3, r
            assert g["best"]["us"] == min(r["us"] for r in g["measured"])
            if g["best"]["label"] != g["today"]["label"]:
                rc = g["recheck"]  # today's and the best timed again, alternately, after the sweep
                assert len(rc["today_us"]) == len(rc["best_us"]) == 3
                assert rc["speedup"] == rc["today_median_us"] / rc["best_median_us"]
            else:
                assert "recheck" not in g


def test_gemms_restricts_the_sweep_to_one_gemm(tmp_path):
    # --gemms w1: the whole budget on GEMM1; the run still counts as complete (every launch of what it swept)
    payload, out = _run(tmp_path, "--gemms", "w1")
    assert payload["complete"] and all(list(p["gemms"]) == ["w1"] for p in payload["points"])
    assert all(len(p["gemms"]["w1"]["measured"]) == 4 for p in payload["points"])


def test_fused_sweep_times_one_launch_against_todays_two(tmp_path):
    # --gemms fused: today's two GEMVs first, then fused launches (kernels/moe_fused.py), each checked on y
    payload, out = _run(tmp_path, "--gemms", "fused")
    assert payload["complete"] and payload["fused_space"]["rows2"]
    for p in payload["points"]:
        g = p["gemms"]["fused"]
        assert g["today"]["label"].startswith("two GEMVs ") and g["today"]["launch"] is None
        assert len(g["measured"]) == 4 and all(r["label"].startswith("fused-r") for r in g["measured"][1:])
        for r in g["measured"]:
            assert r["us"] is not None and r["rel_err"] < 2e-3, r
        assert g["floor_us"] > 0 and g["best"]["us"] == min(r["us"] for r in g["measured"])


def test_an_unknown_gemm_is_refused_by_name(tmp_path):
    res = subprocess.run([sys.executable, "-m", "kvrelay.bench.sweep_gemv", "--device", "cpu", "--models",
                          "gpt-oss-tiny", "--gemms", "w1,w3", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--gemms 'w1,w3'" in res.stderr, res.stderr[-2000:]
    assert not list(tmp_path.glob("sweep-gemv-*.json"))


def test_a_launch_with_other_numbers_is_refused(tmp_path, monkeypatch):
    # A deliberately wrong kernel variant (the SwiGLU limit changed) must fail the check, not be timed.
    env_code = ("import sys; from kvrelay.bench import sweep_gemv as S; import kvrelay.kernels.moe_gemv as G\n"
                "orig = G.gemv1\n"
                "def bad(x, ids, k, ex, a, l, act, launch):\n"
                "    orig(x, ids, k, ex, a, l, act, launch)\n"
                "    if launch != G.gemv_config(ex.hidden, ex.w1.shape[1] // 2).w1: act.mul_(1.01)\n"
                "G.gemv1 = bad\n"
                "sys.exit(S.C.run_cli(lambda: S.main(sys.argv[1:])))\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", env_code, "--device", "cpu", "--models", "gpt-oss-tiny",
                          "--tokens", "1", "--samples", "2", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (path,) = tmp_path.glob("sweep-gemv-*.json")
    g = json.loads(path.read_text())["points"][0]["gemms"]["w1"]
    assert all("check failed" in r["error"] and r["us"] is None for r in g["measured"][1:]), g["measured"]
    assert g["best"]["label"] == g["today"]["label"]


def test_dense_sweep_checks_and_times_gemv_launches(tmp_path):
    # --dense: the FP8 GEMV launches (Fp8BlockLinear.GEMV_TILES first) per (shape, M), each checked against
    # float64 before it is timed, cuBLAS recorded beside them (on CPU it cannot run: an error row)
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "kvrelay.bench.sweep_gemv", "--dense", "--device", "cpu",
                          "--dense-shapes", "QKV:300:160", "--rows", "1,3", "--max-launches", "3", "--out",
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (path,) = tmp_path.glob("sweep-gemv-dense-*.json")
    payload = json.loads(path.read_text())
    from kvrelay.bench.sweep_gemv_dense import launches
    from kvrelay.kernels.fp8_gemm import Fp8BlockLinear
    assert payload["kind"] == "sweep-gemv-dense" and payload["complete"]
    assert [(p["shape"], p["k"], p["n"], p["rows"]) for p in payload["points"]] == [("QKV", 300, 160, 1),
                                                                                 ("QKV", 300, 160, 3)]
    # at M=1 the first launches are today's candidates; from M=2 on those that spill are left out
    assert [f"gemv-{l.label()}" for l in launches(1, 3)] == list(Fp8BlockLinear.GEMV_TILES)[:3]
    assert all(l.block_n * l.block_k <= 128 * 32 * l.num_warps for l in launches(3))
    for p in payload["points"]:
        assert p["kp"] == 384 and p["cublas"]["label"] == "cublas"
        gemv = p["measured"][1:]
        assert [r["label"] for r in gemv] == [l.label() for l in launches(p["rows"], 3)]
        for r in gemv:
            assert r["us"] is not None and r["rel_err"] < 1e-2, r
        assert p["best"]["us"] == min(r["us"] for r in gemv)


def test_expert_sets_rotate_disjoint_experts_between_calls():
    # consecutive timed calls share no expert (else GEMM2's 4 experts, 33 MB, are read from the 50 MB L2), a cycle
    # covers every expert once at batch 1, and each token's experts stay distinct; larger batches fall back to
    # random sets
    import torch

    from kvrelay.bench.sweep_gemv import expert_sets

    gen = torch.Generator().manual_seed(0)
    for experts, tokens, want in ((32, 1, 8), (128, 1, 32), (128, 4, 8)):
        sets = expert_sets(experts, tokens, 4, gen, "cpu")
        assert len(sets) == want and all(s.dtype == torch.int32 and s.numel() == 4 * tokens for s in sets)
        ids = torch.cat(sets)
        assert ids.unique().numel() == ids.numel() == want * 4 * tokens
        assert sorted(ids.tolist()) == list(range(experts))  # one cycle reads every expert once
    many = expert_sets(32, 8, 4, gen, "cpu")  # 32 pairs over 32 experts: random sets, distinct per token
    assert len(many) > 1 and all(len(set(s.view(8, 4)[t].tolist())) == 4 for s in many for t in range(8))
