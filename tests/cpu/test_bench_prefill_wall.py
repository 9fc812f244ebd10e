"""bench/prefill_wall.py on the CPU (one mode there: nothing is queued ahead of the host): a mark after every layer,
in order, inside the call; the engine's Block method restored afterwards; the JSON and PNG written; and the clock
samples' summary (the H200's power-cap bit counted)."""

from __future__ import annotations

import json

from kvrelay.bench import common as C
from kvrelay.bench import prefill_wall as PW
from kvrelay.engine import model as M


def test_plain_mode_marks_every_layer_and_restores_the_block(tmp_path):
    orig = M.Block.attention_out_deferred
    payload = PW.main(["--model", "gpt-oss-tiny", "--dummy", "--device", "cpu", "--length", "48", "--iters", "2",
                       "--out", str(tmp_path)])
    assert M.Block.attention_out_deferred is orig
    assert list(payload["modes"]) == ["plain"]
    plain = payload["modes"]["plain"]
    layers = plain["layers"]
    n_layers = C.resolve_config("gpt-oss-tiny").num_hidden_layers
    assert [x["layer"] for x in layers] == list(range(n_layers)) and n_layers >= 2
    ends = [x["device_ms"] for x in layers]
    assert ends == sorted(ends) and 0 < ends[-1] <= plain["device_ms"] <= plain["wall_ms"]
    assert plain["clocks"] is None
    (path,) = tmp_path.glob("prefill-wall-gpt-oss-tiny-48-*.json")
    assert path.with_suffix(".png").exists()
    saved = json.loads(path.read_text())
    assert saved["kind"] == "prefill-wall" and saved["length"] == 48 and saved["env"]["git_commit"]


def test_marks_restore_the_block_after_an_error():
    orig = M.Block.attention_out_deferred
    try:
        with PW.layer_marks(lambda: 0):
            assert M.Block.attention_out_deferred is not orig
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert M.Block.attention_out_deferred is orig


def test_clock_summary_counts_the_power_cap():
    rows = [(1980.0, 300.0, 0x0), (1830.0, 690.0, 0x4), (1815.0, 700.0, 0x4 | 0x1), (1965.0, 500.0, 0x1)]
    s = PW.summarize_clocks(rows)
    assert s == {"samples": 4, "sm_mhz_median": 1897.5, "sm_mhz_min": 1815.0, "power_w_median": 595.0,
                 "power_w_max": 700.0, "sw_power_cap_share": 0.5}
    assert PW.summarize_clocks([]) == {"samples": 0}
