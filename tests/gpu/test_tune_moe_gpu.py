"""bench/tune_moe.py on the GPU, small: compiles in worker processes, the float32 check of every config,
CUDA-graph timing, the TMA knob, and a table that the engine's grouped_config then serves from."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_tuner_small_sweep_on_gpu(tmp_path, monkeypatch, capsys):
    from kvrelay.bench import tune_moe
    from kvrelay.kernels import moe, moe_configs

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cands = "16x128-w4-s4;64x128-w8-s3-g8-clamp" + (";64x128-w4-s4-g8-clamp-tma" if moe.tma_available() else "")
    payload = tune_moe.main(["--models", "gpt-oss-20b", "--tokens", "64,4096", "--candidates", cands, "--jobs", "2",
                             "--budget-s", "240", "--out", str(tmp_path), "--config-out", str(tmp_path) + "/"])
    out = capsys.readouterr().out
    assert "graph timing failed" not in out and "compile pool dropped" not in out, out[-3000:]
    # every config compiled in the workers, and the kernels they compiled are the ones this process loads
    # (the same hash: no specialisation differs between the workers' problem and the tuner's)
    assert re.search(r"compile pool: [1-9]\d* configs \(0 failed\) in 2 processes", out), out[-3000:]
    assert [p["tokens"] for p in payload["points"]] == [4096, 64] and payload["complete"]
    bad = [r for r in payload["measurements"] if r["ms"] is None]
    assert not bad, bad
    for p in payload["points"]:
        assert p["best"]["ms"] <= p["heuristic"]["ms"] * 1.001  # the heuristic is in the pool it picks from
    table = tmp_path / moe_configs.file_name(torch.cuda.get_device_name())
    # the run's two buckets are written; the tracked table's other buckets (kernels/configs, merged into
    # a new file) stay as they were
    buckets = json.loads(table.read_text())["shapes"]["E32_H2880_I2880"]["buckets"]
    assert {"256", "16384"} <= buckets.keys()
    tracked = moe_configs.CONFIG_DIR / table.name
    if tracked.exists():
        old = json.loads(tracked.read_text())["shapes"]["E32_H2880_I2880"]["buckets"]
        assert {k: v for k, v in buckets.items() if k not in ("256", "16384")} == \
            {k: v for k, v in old.items() if k not in ("256", "16384")}
    else:
        assert buckets.keys() == {"256", "16384"}
    monkeypatch.setenv(moe_configs.ENV_DIR, str(tmp_path))
    moe_configs.clear_cache()
    served = moe.grouped_config(16384, 32, 2880, 2880, device="cuda")
    assert served.source.endswith("E32_H2880_I2880/16384")
    assert served.to_json() == payload["points"][0]["best"]["config"]
    moe_configs.clear_cache()
