"""The benchmarks' arithmetic (against the seed's own published numbers) and both benchmarks end to end on
CPU with the tiny preset: they must write JSON + PNG with the fields the lead reads."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from kvrelay.bench import common as C

TINY = ["--model", "gpt-oss-tiny", "--dummy", "--device", "cpu", "--quant", "bf16"]
# The 1024-token vocabulary preset: same code path, cheaper where only bookkeeping is under test.
SMALL = ["--model", "tiny", "--dummy", "--device", "cpu", "--quant", "bf16"]


def test_prefill_cost_matches_seed_example():
    # seed-notes: 0.364 s x 1 x 3/3600 x 1e6 / 8192 = $0.037
    usd = C.prefill_usd_per_m_input(0.364, 8192, gpus=1)
    assert usd == pytest.approx(0.364 * 3 / 3600 * 1e6 / 8192)
    assert round(usd, 3) == 0.037
    assert C.fmt_cell(0.364, usd) == "0.364 s, $0.037"


@pytest.mark.parametrize("model", sorted(C.SEED_PREFILL))
def test_seed_prefill_table_is_consistent_with_the_formula(model):
    # Every published cell's cost follows from its latency and GPU count (up to the 3-decimal rounding of
    # the latency), which pins both our formula and our transcription of the table.
    for config, cells in C.SEED_PREFILL[model].items():
        gpus = int(config.split()[0][2:])
        for length, (lat, usd) in cells.items():
            assert C.prefill_usd_per_m_input(lat, length, gpus) == pytest.approx(usd, abs=1.5e-3), (config, length)


def test_decode_cost():
    # 1 GPU at $3/h producing 1000 tokens/s in aggregate: $3 / 3.6M tokens = $0.8333 per 1M.
    assert C.decode_usd_per_m_output(1000.0, gpus=1) == pytest.approx(3 / 3600 / 1000 * 1e6)
    assert C.decode_usd_per_m_output(1000.0, gpus=4) == pytest.approx(4 * 0.8333333, rel=1e-6)


@pytest.mark.parametrize("window", [None, 1, 3, 128])
@pytest.mark.parametrize("start,n", [(0, 1), (0, 7), (2, 5), (130, 3), (0, 300)])
def test_causal_pairs_brute_force(window, start, n):
    brute = sum(1 for q in range(start, start + n) for k in range(q + 1) if window is None or k > q - window)
    assert C.causal_pairs(n, start, window) == brute


def test_flop_and_byte_estimates_are_plausible():
    cfg = C.resolve_config("gpt-oss-120b")
    # ~5.1B active parameters per token (OpenAI quotes 5.1B for 120b).
    assert 4.9e9 < C.active_params(cfg) < 5.3e9
    f = C.prefill_flops(cfg, 8192)
    assert f["total"] == pytest.approx(f["linear"] + f["attention"])
    # The seed's 0.364 s at 8192 is then ~233 TFLOP/s: a sane fraction of the FP8 ceiling.
    assert 150 < f["total"] / 0.364 / 1e12 < 400
    assert C.weight_bytes(cfg, "fp8-block128") < 0.55 * C.weight_bytes(cfg, "bf16")
    assert C.decode_bytes_per_step(cfg, 64, 8192, "fp8") > C.decode_bytes_per_step(cfg, 1, 8192, "fp8")


def test_env_info_and_save(tmp_path):
    env = C.env_info("cpu", "kvrelay.bench.prefill", ["--quick"])
    assert env["gpu"] == "cpu"
    assert env["command"].endswith("-m kvrelay.bench.prefill --quick")
    for key in ("torch", "triton", "flashinfer", "git_commit", "timestamp"):
        assert key in env
    assert env["git_commit"] == "unknown" or len(env["git_commit"]) == 40
    assert env["pdl"] is False  # kernels/pdl.py: never on a CPU
    fig, ax = C.new_figure()
    ax.plot([1, 2], [3, 4])
    paths = C.save_result(tmp_path / "out", "x", {"a": float("nan")}, fig)
    assert Path(paths["png"]).stat().st_size > 0
    assert json.loads(Path(paths["json"]).read_text())["files"] == paths


def test_git_commit_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("KVRELAY_GIT_COMMIT", raising=False)
    assert C.git_commit(tmp_path) == "unknown"
    monkeypatch.setenv("KVRELAY_GIT_COMMIT", "abc123")
    assert C.git_commit(tmp_path) == "abc123"
    # A copied tree: unknown unless the launcher vouches that it was clean
    monkeypatch.delenv("KVRELAY_GIT_CLEAN", raising=False)
    assert C.git_dirty(tmp_path) is None
    monkeypatch.setenv("KVRELAY_GIT_CLEAN", "1")
    assert C.git_dirty(tmp_path) is False


def _load(payload: dict) -> dict:
    files = payload["files"]
    assert Path(files["png"]).stat().st_size > 0
    return json.loads(Path(files["json"]).read_text())


def test_prefill_end_to_end_cpu(tmp_path):
    from kvrelay.bench import prefill

    argv = TINY + ["--lengths", "64,256,9000", "--warmup", "0", "--iters", "2", "--out", str(tmp_path)]
    data = _load(prefill.main(argv))
    assert data["kind"] == "prefill" and data["env"]["gpu"] == "cpu"
    assert "--lengths 64,256,9000" in data["env"]["command"]
    assert [p["length"] for p in data["points"]] == [64, 256]
    assert any(s["length"] == 9000 and "max_context" in s["reason"] for s in data["skipped"])
    for p in data["points"]:
        assert p["n"] == 2 and p["median_s"] > 0
        assert p["usd_per_m_input"] == pytest.approx(p["median_s"] * 3 / 3600 * 1e6 / p["length"])
        assert p["tokens_per_s"] == pytest.approx(p["length"] / p["median_s"])
        assert p["tflops"] > 0 and "seed_latency_s" not in p  # no seed numbers for the tiny model
    assert data["table_markdown"].startswith("| config | 64 | 256 |")
    assert len(re.findall(r"\| \d+\.\d{3} s, \$\d+\.\d{3} ", data["table_markdown"])) == 2


def test_prefill_in_chunks_cpu(tmp_path):
    # --chunk-tokens runs a prompt over N tokens as the prefill worker does (prefill, then extend): the
    # sequence ends as long as the prompt, each point says how many forwards it took, RESULTS.md says so.
    from kvrelay.bench import prefill, results_md
    from kvrelay.engine import runner as runner_mod

    lengths = []
    real_extend = runner_mod.Runner.extend

    def extend(self, seq_id, token_ids, **kw):
        out = real_extend(self, seq_id, token_ids, **kw)
        lengths.append(self.length(seq_id))
        return out

    runner_mod.Runner.extend = extend
    try:
        argv = TINY + ["--lengths", "64,256", "--chunk-tokens", "100", "--warmup", "0", "--iters", "1",
                       "--out", str(tmp_path)]
        data = _load(prefill.main(argv))
    finally:
        runner_mod.Runner.extend = real_extend
    assert data["chunk_tokens"] == 100
    assert [(p["length"], p["chunks"]) for p in data["points"]] == [(64, 1), (256, 3)]
    assert lengths == [200, 256]  # 256 = 100 + 100 + 56: two extends, the last one reaching the prompt's end
    assert results_md._prefill_cell(data["points"][1]).endswith("(3 chunks)")
    assert "chunks" not in results_md._prefill_cell(data["points"][0])


def test_prefill_budget_skips_are_reported(tmp_path):
    from kvrelay.bench import prefill

    argv = SMALL + ["--lengths", "16,32", "--warmup", "0", "--iters", "3", "--budget-s", "0", "--out", str(tmp_path)]
    data = _load(prefill.main(argv))
    # The first point always runs (one timed call); the next is forecast past the budget and skipped.
    assert [p["length"] for p in data["points"]] == [16] and data["points"][0]["n"] == 1
    assert [s["length"] for s in data["skipped"]] == [32] and "budget" in data["skipped"][0]["reason"]


def test_prefill_seed_comparison_rows():
    payload = {"quant": "fp8-block128", "points": [
        {"length": 8192, "median_s": 0.728, "usd_per_m_input": 0.074, "seed_latency_s": 0.364,
         "seed_usd_per_m_input": 0.037, "ratio_vs_seed": 2.0}]}
    from kvrelay.bench.prefill import seed_table_markdown

    md = seed_table_markdown(payload).splitlines()
    assert md[0] == "| config | 8192 |"
    assert md[2].endswith("| 0.728 s, $0.074 |")
    assert md[3] == "| EP1 DP1 TP1 (seed) | 0.364 s, $0.037 |"
    assert md[4] == "| kvrelay / seed latency | 2.00x |"


def test_decode_end_to_end_cpu(tmp_path):
    from kvrelay.bench import decode

    argv = TINY + ["--lengths", "64,200", "--batches", "1,3", "--warmup", "0", "--iters", "2", "--out", str(tmp_path)]
    data = _load(decode.main(argv))
    assert data["kind"] == "decode" and "random" in data["kv_fill"]
    assert sorted((p["length"], p["batch"]) for p in data["points"]) == [(64, 1), (64, 3), (200, 1), (200, 3)]
    for p in data["points"]:
        assert p["steps_timed"] == 2
        assert p["tokens_per_s_per_user"] == pytest.approx(1 / p["step_median_s"])
        assert p["tokens_per_s_aggregate"] == pytest.approx(p["batch"] / p["step_median_s"])
        assert p["usd_per_m_output"] == pytest.approx(3 / 3600 / p["tokens_per_s_aggregate"] * 1e6)
        assert p["forward_median_s"] <= p["step_median_s"] + 1e-9


def test_decode_leaves_no_sequences_behind(tmp_path, monkeypatch):
    # Points share one Runner: every imported sequence must be freed, or later points run out of pages.
    from kvrelay.bench import decode
    from kvrelay.engine import runner as runner_mod

    seen = []
    orig = runner_mod.Runner.__init__

    def spy(self, *a, **kw):
        orig(self, *a, **kw)
        seen.append(self)

    monkeypatch.setattr(runner_mod.Runner, "__init__", spy)
    # A pool for 3 sequences of 100 (+2 steps): batch 5 must be reported as not fitting, not crash.
    monkeypatch.setattr(decode, "_pool_pages", lambda *a: ({"full": 3 * 7, "sliding": 5 * 4}, "test pool"))
    argv = SMALL + ["--lengths", "100", "--batches", "2,5", "--warmup", "0", "--iters", "1", "--out", str(tmp_path)]
    data = decode.main(argv)
    assert [p["batch"] for p in data["points"]] == [2]
    assert [(s["batch"], "KV pool too small" in s["reason"]) for s in data["skipped"]] == [(5, True)]
    (r,) = seen
    assert not r.kv.seqs
    assert r.free_pages() == {g: a.num_pages for g, a in r.kv.allocators.items()}


def test_report_collects_runs(tmp_path):
    from kvrelay.bench import decode, prefill, report

    prefill.main(SMALL + ["--lengths", "32", "--warmup", "0", "--iters", "1", "--out", str(tmp_path)])
    decode.main(SMALL + ["--lengths", "32", "--batches", "1,2", "--warmup", "0", "--iters", "1",
                         "--out", str(tmp_path)])
    text = report.main([str(tmp_path), "--out", str(tmp_path / "REPORT.md")])
    assert "### prefill: tiny bf16 on cpu" in text and "### decode: tiny bf16 on cpu" in text
    assert "| EP1 DP1 TP1 (kvrelay, bf16) |" in text and "| 32 | 2 |" in text
    assert (tmp_path / "REPORT.decode.png").stat().st_size > 0


def test_graph_and_attention_choice_follow_the_runner_signature(monkeypatch):
    from kvrelay.engine import runner as runner_mod

    # With today's Runner (reference attention by default) a GPU run gets a GPU kernel, a CPU run the engine's.
    label = C.choose_attention("auto", "cuda")[1]
    assert label.startswith(("triton", "flashinfer", "engine default"))
    assert C.choose_attention("auto", "cpu")[0] is None

    def with_switch(self, cfg, weights, *, device="cpu", cuda_graphs: bool = False):
        pass

    monkeypatch.setattr(runner_mod.Runner, "__init__", with_switch)
    assert C.graph_kwargs("auto", "cuda") == ({"cuda_graphs": True}, "cuda_graphs=True")
    assert C.graph_kwargs("auto", "cpu")[0] == {"cuda_graphs": False}
    # No attention_fn parameter: the engine chooses; an explicit backend is refused loudly.
    assert C.choose_attention("auto", "cuda") == (None, "engine default")
    with pytest.raises(SystemExit):
        C.choose_attention("triton", "cuda")

    def with_sizes(self, cfg, weights, *, cuda_graph_batch_sizes=()):
        pass

    monkeypatch.setattr(runner_mod.Runner, "__init__", with_sizes)
    assert C.graph_kwargs("auto", "cuda", [1, 8])[0] == {"cuda_graph_batch_sizes": (1, 8)}
    assert C.graph_kwargs("off", "cuda", [1, 8])[0] == {}


def test_decode_sweep_captures_a_graph_for_each_of_its_batches():
    # The real Runner has both the switch and the sizes: a sweep's batch past the engine's default graphs
    # (up to 128) ran on the piecewise path (20b batch 256 at 8192: 37.4 ms against 14.3 at 128).
    from kvrelay.engine.config import DEFAULT_GRAPH_BATCH_SIZES

    kw, label = C.graph_kwargs("auto", "cuda", [1, 96, 256])
    assert kw == {"cuda_graphs": True,
                  "cuda_graph_batch_sizes": tuple(sorted({*DEFAULT_GRAPH_BATCH_SIZES, 96, 256}))}
    assert "256" in label
    assert C.graph_kwargs("auto", "cpu", [1, 256])[0] == {"cuda_graphs": False}


def test_decode_pool_on_a_full_gpu_fits_the_largest_batch_that_can_fit(monkeypatch):
    # 120b on one H200 (2026-12-03): batch 64 at 8192 was skipped, one group short, because the sliding
    # group was reserved for batch 256 (which cannot fit anyway) and the weights were counted 5% over
    # unpadded. Free memory here is what that run had; the pool must now hold batch 64, not 128.
    import types

    import torch

    from kvrelay.bench import decode

    cfg = C.resolve_config("gpt-oss-120b")
    args = types.SimpleNamespace(page_size=16, warmup=3, iters=10, mode="pipelined", device="cuda",
                                 quant="fp8-block128", mem_headroom_gib=6.0)
    free = int(139.286 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (free, free))
    pages, note = decode._pool_pages(cfg, args, [8192, 32768], [1, 8, 32, 64, 128, 256])
    assert "capped" in note
    full_seq = decode.pages_spanned(8192 + decode._steps(args), 16)
    slide_seq = decode.window_pages(cfg.sliding_window, 16) + decode.pages_spanned(decode._steps(args), 16)
    assert pages["full"] >= 64 * full_seq + 1 and pages["sliding"] == 64 * slide_seq + 1
    assert pages["full"] < 128 * full_seq + 1
    page = C.kv_bytes_per_page(cfg, 16, len(cfg.full_layers))
    used = pages["full"] * page + pages["sliding"] * C.kv_bytes_per_page(cfg, 16, len(cfg.sliding_layers))
    assert used + C.weight_bytes(cfg, "fp8-block128", resident=True) + 6 * 2**30 <= free


def _keep_scratch_pages_like_a_gpu_runner(monkeypatch):
    """A GPU Runner with decode graphs keeps one scratch page per group (the padding rows' page) out of
    the pool it is given; on CPU it runs no graphs and keeps none. Make the CPU Runner keep them exactly
    as the GPU one does (engine/runner.Runner._new_pool), so the bench's pool sizing is tested against it."""
    from kvrelay.engine import runner as runner_mod
    from kvrelay.engine.kv_cache import GROUPS

    orig = runner_mod.Runner._new_pool

    def new_pool(self, num_pages):
        orig(self, num_pages)
        if not self._scratch:
            self._scratch = {g: self.kv.allocators[g].allocate(1)[0] for g in GROUPS}

    monkeypatch.setattr(runner_mod.Runner, "_new_pool", new_pool)


@pytest.mark.parametrize("mode", ["sync", "both"])
@pytest.mark.parametrize("short", [None, "full", "sliding"])
def test_decode_pool_holds_the_largest_point(tmp_path, monkeypatch, short, mode):
    # Issue 11: the pool was sized one page short (the scratch page was not counted), so the largest
    # batch was always skipped as "KV pool too small". The pool must hold it, with nothing to spare: one
    # page less in either group (short=...) must skip it, which also proves this test can fail. With both
    # modes each sequence also has a fork (the pipelined run's, same KV): its copy of the partial last page
    # is one page more per sequence in each group.
    from kvrelay.bench import decode

    _keep_scratch_pages_like_a_gpu_runner(monkeypatch)
    if short is not None:
        sized = decode._pool_pages

        def one_short(*a):
            pages, note = sized(*a)
            return dict(pages, **{short: pages[short] - 1}), note

        monkeypatch.setattr(decode, "_pool_pages", one_short)
    # S=17 (+ 3 or 4 steps in the sizing): 2 pages of 16 per sequence in both groups (the sliding window of
    # 8 still reaches page 0), + 1 for the fork with both modes; 3 sequences + the scratch page = 7 (10)
    # per group, every page used.
    argv = SMALL + ["--lengths", "17", "--batches", "1,3", "--warmup", "0", "--iters", "2", "--mode", mode,
                    "--out", str(tmp_path)]
    data = decode.main(argv)
    n = 7 if mode == "sync" else 10
    assert data["pool_pages"] == ({"full": n, "sliding": n} if short is None else
                                  dict({"full": n, "sliding": n}, **{short: n - 1}))
    if short is None:
        assert [p["batch"] for p in data["points"]] == [1, 3] and data["skipped"] == []
    else:
        assert [p["batch"] for p in data["points"]] == [1]
        assert [(s["batch"], "KV pool too small" in s["reason"]) for s in data["skipped"]] == [(3, True)]


def test_h200_steps_script_parses_and_needs_the_commit(tmp_path):
    """bench/h200_steps.sh (the device calls' runner, README 'On the GPU machine') is valid bash and stops
    before doing anything when the carried tree's commit is not given (results must name their commit)."""
    import subprocess

    script = Path(__file__).resolve().parents[2] / "bench" / "h200_steps.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "KVRELAY_GIT_COMMIT"}
    res = subprocess.run(["bash", str(script)], cwd=tmp_path, env={**env, "OUT": str(tmp_path), "STEPS": "pre20"},
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "set KVRELAY_GIT_COMMIT" in res.stderr
    assert list(tmp_path.iterdir()) == []


def _shim_python3(tmp_path, prefix: str = ""):
    """A python3 for bench/h200_steps.sh: benchmark modules are logged (`prefix` + argv, one line each, in the
    returned log) instead of run, pip installs (a checkout's .dev/ bundles) and `python3 -c` probes do nothing
    (so `import flashinfer` fails), anything else runs on this interpreter. Returns (its folder, the log)."""
    import shlex
    import sys

    shim = tmp_path / "bin"
    shim.mkdir()
    log = tmp_path / "calls.txt"
    (shim / "python3").write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = -m ] && [[ "$2" == kvrelay.bench.* ]]; then echo "{prefix}$*" >> {shlex.quote(str(log))}; exit 0; fi\n'
        'if [ "$1" = -m ] && [ "$2" = pip ]; then exit 0; fi\n'
        'if [ "$1" = -c ]; then exit 1; fi\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n')
    (shim / "python3").chmod(0o755)
    return shim, log


def test_h200_steps_script_runs_each_benchmark_on_a_real_preset(tmp_path):
    """Each benchmark step of bench/h200_steps.sh names a model preset that exists (a step once asked for
    "gpt-oss-20", which every decode run of a device call rejected) and writes into its TAG-suffixed folder.
    python3 is shimmed: the benchmark modules are recorded instead of run, pip and `python3 -c` probes do
    nothing; the rest (the package links from pyproject.toml, the result tarball) is real."""
    import shlex
    import subprocess

    from kvrelay.engine.config import PRESETS

    root = Path(__file__).resolve().parents[2]
    shim, log = _shim_python3(tmp_path)
    steps = "dec20 dec120 decsweep20 decsweep120 pp20 pp120 pre20 pre120 prof20 prof120 wall20 wall120"
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "OUT": str(tmp_path), "STEPS": steps,
           "KVRELAY_GIT_COMMIT": "0" * 40, "WORK_DIR": str(tmp_path / "w"), "TAG": "-x"}
    res = subprocess.run(["bash", str(root / "bench" / "h200_steps.sh")], cwd=root, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    calls = [shlex.split(line) for line in log.read_text().splitlines()]
    assert len(calls) == len(steps.split())
    for step, argv in zip(steps.split(), calls):
        model = argv[argv.index("--model") + 1]
        assert model in PRESETS and model.startswith("gpt-oss-"), (step, model)
        assert model.endswith("120b" if "120" in step else "20b"), (step, model)
        assert argv[argv.index("--out") + 1] == str(tmp_path / "w" / "r" / f"{step}-x")
    assert (tmp_path / "w" / "kvp" / "kvrelay" / "engine").resolve() == root / "engine"
    assert (tmp_path / "r.tgz").is_file()


def _run_steps(tmp_path, prefix: str, clear: tuple[str, ...], **settings) -> list[list[str]]:
    """bench/h200_steps.sh with `settings` (STEPS, M1_SET, ...) and the shimmed python3 (_shim_python3, each
    benchmark call logged behind `prefix`), `clear`ed of the caller's environment: the logged argv lists."""
    import shlex
    import subprocess

    root = Path(__file__).resolve().parents[2]
    shim, log = _shim_python3(tmp_path, prefix=prefix)
    env = {k: v for k, v in os.environ.items() if k not in (*clear, "TAG")}
    env.update(PATH=f"{shim}:{os.environ['PATH']}", OUT=str(tmp_path), KVRELAY_GIT_COMMIT="0" * 40,
               WORK_DIR=str(tmp_path / "w"), **settings)
    res = subprocess.run(["bash", str(root / "bench" / "h200_steps.sh")], cwd=root, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    calls = [shlex.split(line) for line in log.read_text().splitlines()]
    assert all(argv[argv.index("--batches") + 1] == "1" and "kvrelay.bench.decode" in argv for argv in calls)
    return calls


def _model_and_folder(argv: list[str]) -> tuple[str, str]:
    return argv[argv.index("--model") + 1], Path(argv[argv.index("--out") + 1]).name


def test_h200_steps_m1ab_runs_both_models_per_backend_set(tmp_path):
    """The m1ab step of bench/h200_steps.sh runs the batch-1 decode of 20b and 120b once per KVRELAY_FP8_M1 value
    of M1_SET, with that value in the benchmark's environment (the decode JSON records it) and each run in its
    own folder, and writes which set each index was. python3 is shimmed (_shim_python3)."""
    sets = ["2880x4096=cublas", "2880x4096=gemv-n32-k256-s8-w4-st2,5120x2880=gemv-n8-k512-s4-w1-st2"]
    calls = _run_steps(tmp_path, "M1=$KVRELAY_FP8_M1 ", ("KVRELAY_FP8_M1",), STEPS="m1ab", M1_SET=" ".join(sets))
    want = [(f"M1={pin}", f"gpt-oss-{m}b", f"dec{m}-m1ab{i}") for i, pin in enumerate(sets, 1) for m in (20, 120)]
    assert [(argv[0], *_model_and_folder(argv)) for argv in calls] == want
    assert (tmp_path / "w" / "r" / "m1ab.txt").read_text().splitlines() == [f"m1ab{i} {p}" for i, p in enumerate(sets, 1)]


def test_h200_steps_envab_runs_both_models_per_env_set(tmp_path):
    """The envab step of bench/h200_steps.sh runs the batch-1 decode of 20b and 120b once per item of ENV_SET with
    that item's "+"-joined settings in the benchmark's environment ("-": none), nothing of one item leaking into
    the next, each run in its own folder, and writes which item each index was. python3 is shimmed."""
    items = ["-", "KVRELAY_DECODE_MERGE_FUSE=1", "KVRELAY_DECODE_MERGE_FUSE=1+KVRELAY_MOE_NORM_FUSE=1", "-"]
    seen = [("unset", "unset"), ("1", "unset"), ("1", "1"), ("unset", "unset")]
    calls = _run_steps(tmp_path, "M=${KVRELAY_DECODE_MERGE_FUSE:-unset} N=${KVRELAY_MOE_NORM_FUSE:-unset} ",
                       ("KVRELAY_DECODE_MERGE_FUSE", "KVRELAY_MOE_NORM_FUSE"), STEPS="envab", ENV_SET=" ".join(items))
    want = [(f"M={mf}", f"N={nf}", f"gpt-oss-{m}b", f"dec{m}-envab{i}")
            for i, (mf, nf) in enumerate(seen, 1) for m in (20, 120)]
    assert [(argv[0], argv[1], *_model_and_folder(argv)) for argv in calls] == want
    assert (tmp_path / "w" / "r" / "envab.txt").read_text().splitlines() == [f"envab{i} {p}"
                                                                              for i, p in enumerate(items, 1)]


def test_h200_steps_tune_runs_the_tuner_into_the_results(tmp_path):
    """The tune step of bench/h200_steps.sh runs bench.tune_moe under what is left of the call, its JSON and the
    config file it would track both in r/tune (fetched with the rest), narrowed by TUNE_TOKENS / TUNE_MODELS
    when set and with the tuner's defaults when not. python3 is shimmed (_shim_python3)."""
    import shlex
    import subprocess

    root = Path(__file__).resolve().parents[2]
    for i, extra in enumerate(({}, {"TUNE_TOKENS": "4096,8192", "TUNE_MODELS": "gpt-oss-120b"})):
        run = tmp_path / f"run{i}"
        run.mkdir()
        shim, log = _shim_python3(run)
        env = {k: v for k, v in os.environ.items() if k not in ("TAG", "TUNE_TOKENS", "TUNE_MODELS")}
        env.update(PATH=f"{shim}:{os.environ['PATH']}", OUT=str(run), KVRELAY_GIT_COMMIT="0" * 40,
                   WORK_DIR=str(run / "w"), STEPS="tune", LIMIT="300", **extra)
        res = subprocess.run(["bash", str(root / "bench" / "h200_steps.sh")], cwd=root, env=env,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        (argv,) = [shlex.split(line) for line in log.read_text().splitlines()]
        assert argv[:2] == ["-m", "kvrelay.bench.tune_moe"]
        assert argv[argv.index("--out") + 1] == str(run / "w" / "r" / "tune")
        assert argv[argv.index("--config-out") + 1] == str(run / "w" / "r" / "tune") + "/"
        assert 200 < float(argv[argv.index("--budget-s") + 1]) < 300
        for flag, var in (("--tokens", "TUNE_TOKENS"), ("--models", "TUNE_MODELS")):
            assert (argv[argv.index(flag) + 1] if flag in argv else None) == extra.get(var)
