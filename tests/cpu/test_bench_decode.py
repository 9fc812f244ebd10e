"""bench.decode's two timings (bench/decode_loop.py) on CPU with the tiny model: the pipelined loop chains
its steps as the decode worker does (launch N+1 on N's tokens left on the device, read N back after), it
produces the greedy tokens the synchronous loop does, both timings land in the JSON, and the reports
headline the pipelined one (old results, sync only, keep theirs)."""

from __future__ import annotations

import json
from pathlib import Path

import git_revs
import pytest

from kvrelay.bench import decode, decode_loop, provenance, report, results_md
from kvrelay.engine import runner as runner_mod

TINY = ["--model", "gpt-oss-tiny", "--dummy", "--device", "cpu", "--quant", "bf16"]


def _spy(monkeypatch) -> list:
    """Log every decode / sample / decode_launch / decode_collect of the Runner, with what it returned."""
    log = []
    R = runner_mod.Runner
    orig = {n: getattr(R, n) for n in ("decode", "decode_launch")}
    sample, collect = R.sample, R.decode_collect

    def decode_(self, sids, toks):
        log.append(("decode", list(sids), list(toks)))
        return orig["decode"](self, sids, toks)

    def launch(self, sids, toks, prev=None, **kw):
        step = orig["decode_launch"](self, sids, toks, prev, **kw)
        log.append(("launch", list(sids), list(toks), prev, step))
        return step

    def sample_(logits, params, steps, *a, **kw):
        out = sample(logits, params, steps, *a, **kw)
        log.append(("sample", [t for t, _ in out]))
        return out

    def collect_(step):
        out = collect(step)
        log.append(("collect", step, out))
        return out

    monkeypatch.setattr(R, "decode", decode_)
    monkeypatch.setattr(R, "decode_launch", launch)
    monkeypatch.setattr(R, "sample", staticmethod(sample_))
    monkeypatch.setattr(R, "decode_collect", staticmethod(collect_))
    return log


def test_pipelined_chains_steps_and_matches_sync_tokens(tmp_path, monkeypatch):
    log = _spy(monkeypatch)
    warmup, iters = 1, 3
    argv = TINY + ["--lengths", "40", "--batches", "3", "--warmup", str(warmup), "--iters", str(iters),
                   "--out", str(tmp_path)]
    data = decode.main(argv)
    saved = json.loads(Path(data["files"]["json"]).read_text())
    assert saved["modes"] == ["pipelined", "sync"] and saved["headline"] == "pipelined"
    (p,) = saved["points"]
    # Both timings, each over `iters` steps, and the headline says which one tok/s and $ are.
    assert p["headline"] == "pipelined" and p["steps_timed"] == iters and p["pipelined_steps_timed"] == iters
    assert len(p["pipelined_step_times_s"]) == iters and all(t > 0 for t in p["pipelined_step_times_s"])
    assert p["pipelined_step_mean_s"] == pytest.approx(sum(p["pipelined_step_times_s"]) / iters)
    assert p["pipelined_tokens_per_s_per_user"] == pytest.approx(1 / p["pipelined_step_median_s"])
    assert p["pipelined_tokens_per_s_aggregate"] == pytest.approx(3 / p["pipelined_step_median_s"])
    assert p["tokens_per_s_per_user"] == pytest.approx(1 / p["step_median_s"])  # the sync keys keep their meaning
    assert p["pipelined_tokens_match_sync"] is True and p["tokens_compared_steps"] == warmup + iters

    # Sync: decode + sample per step, each step fed the tokens the one before sampled (read back).
    syncs = [e for e in log if e[0] in ("decode", "sample")]
    assert [e[0] for e in syncs] == ["decode", "sample"] * (warmup + iters)
    sync_tokens = [e[1] for e in syncs if e[0] == "sample"]
    fed = [e[2] for e in syncs if e[0] == "decode"]
    assert fed[1:] == sync_tokens[:-1]
    # Pipelined: the first launch takes the host's tokens (the sync run's first), every later one None for
    # each row and the previous launch's step as prev; step N is read back right after N+1 is launched.
    pipe = [e for e in log if e[0] in ("launch", "collect")]
    launches = [e for e in pipe if e[0] == "launch"]
    assert len(launches) == warmup + iters + 2
    assert launches[0][2] == fed[0] and launches[0][3] is None
    assert launches[0][1] != syncs[0][1]  # forks of the sync run's sequences (the same KV)
    for a, b in zip(launches, launches[1:]):
        assert b[2] == [None] * 3 and b[3] is a[4] and b[1] == a[1]
    order = [("L", e[4]) if e[0] == "launch" else ("C", e[1]) for e in pipe]
    steps = [e[4] for e in launches]
    want = [("L", steps[0])]
    for k in range(1, len(steps)):
        want += [("L", steps[k]), ("C", steps[k - 1])]
    want.append(("C", steps[-1]))
    assert [(k, id(s)) for k, s in order] == [(k, id(s)) for k, s in want]
    # The same greedy tokens, step for step, seen at the Runner's own calls (not the bench's comparison).
    pipe_tokens = [e[2] for e in pipe if e[0] == "collect"]
    assert pipe_tokens[: warmup + iters] == sync_tokens
    assert len({t for step in sync_tokens for t in step}) > 3  # not a constant stream


def test_a_broken_chain_is_caught(tmp_path, monkeypatch):
    # Steps fed the placeholder instead of the previous step's token on the device: the bench must say the
    # tokens differ (this is what makes the match above a check).
    monkeypatch.setattr(runner_mod, "_fill_ids", lambda ids, fill: None)
    data = decode.main(TINY + ["--lengths", "40", "--batches", "3", "--warmup", "0", "--iters", "3",
                               "--out", str(tmp_path)])
    assert data["points"][0]["pipelined_tokens_match_sync"] is False


@pytest.mark.parametrize("mode", ["sync", "pipelined"])
def test_one_mode(tmp_path, monkeypatch, mode):
    log = _spy(monkeypatch)
    data = decode.main(TINY + ["--lengths", "40", "--batches", "1,2", "--warmup", "0", "--iters", "2",
                               "--mode", mode, "--out", str(tmp_path)])
    assert data["modes"] == [mode] and [p["headline"] for p in data["points"]] == [mode, mode]
    used = {e[0] for e in log}
    if mode == "sync":
        assert used == {"decode", "sample"}
        assert all("pipelined_step_median_s" not in p for p in data["points"])
    else:
        assert used == {"launch", "collect"}
        assert all("step_median_s" not in p and p["pipelined_steps_timed"] == 2 for p in data["points"])
    assert all("pipelined_tokens_match_sync" not in p for p in data["points"])
    text = report.main([str(tmp_path)])
    assert f"| 40 | 2 | {decode_loop.headline(data['points'][1])['step_s'] * 1e3:.2f} | {mode} |" in text


def _head() -> str:
    return git_revs.rev("HEAD")


def _decode_json(ts: str, points: list[dict]) -> dict:
    return {"kind": "decode", "env": {"gpu": "NVIDIA H200", "git_commit": _head(), "git_dirty": False,
                                      "command": "python -m kvrelay.bench.decode", "timestamp": ts},
            "model": "gpt-oss-20b", "quant": "fp8-block128", "config": "EP1 DP1 TP1", "points": points}


def _sync(b: int, t: float) -> dict:
    return {"length": 8192, "batch": b, "step_median_s": t, "tokens_per_s_per_user": 1 / t,
            "tokens_per_s_aggregate": b / t, "usd_per_m_output": 3 / 3600 / (b / t) * 1e6}


def test_results_md_headlines_the_pipelined_step(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    both = dict(_sync(1, 0.00339), pipelined_step_median_s=0.0025, pipelined_tokens_per_s_per_user=400.0,
                pipelined_tokens_per_s_aggregate=400.0, pipelined_usd_per_m_output=3 / 3600 / 400 * 1e6)
    (d / "decode-new.json").write_text(json.dumps(_decode_json("2026-12-01T17:00:00+00:00", [both])))
    # An old run (sync only) at another batch keeps its sync figure, saying so.
    (d / "decode-old.json").write_text(json.dumps(_decode_json("2026-11-30T17:00:00+00:00", [_sync(8, 0.008)])))
    md = tmp_path / "RESULTS.md"
    text = report.main([str(d), "--results-md", str(md)])
    dec = text.split("## Decode", 1)[1].split("\n## ", 1)[0]
    head = next(ln for ln in dec.splitlines() if ln.startswith("| context |"))
    rows = {ln.split("|")[2].strip(): [c.strip() for c in ln.strip("|").split("|")]
            for ln in dec.splitlines() if ln.startswith("| 8192 |")}
    cols = [c.strip() for c in head.strip("|").split("|")]
    one, eight = dict(zip(cols, rows["1"])), dict(zip(cols, rows["8"]))
    assert (one["step ms"], one["tok/s/user"], one["timed as"], one["sync step ms"]) == ("2.50", "400.0", "pipelined",
                                                                                         "3.39")
    assert one["$/1M output"] == f"${3 / 3600 / 400 * 1e6:.3f}"
    assert (eight["step ms"], eight["timed as"], eight["sync step ms"]) == ("8.00", "sync", "8.00")
    assert md.with_name("RESULTS-decode.png").stat().st_size > 10_000
    col = provenance.collect([d])
    assert results_md.expected(col, md) == text


def test_profile_decode_chain(tmp_path, monkeypatch):
    from kvrelay.bench import profile_decode

    log = _spy(monkeypatch)
    out = profile_decode.main(["--model", "tiny", "--dummy", "--device", "cpu", "--quant", "bf16", "--batch", "2",
                               "--context", "40", "--chain", "2", "--top", "3", "--out", str(tmp_path)])
    assert out["chain"] == 2 and out["pipelined_ms"] > 0
    launches = [e for e in log if e[0] == "launch"]
    assert len(launches) == 3 + 2 + 2 and all(e[2] == [None, None] for e in launches[1:])
