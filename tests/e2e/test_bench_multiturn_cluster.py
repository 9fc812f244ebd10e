"""bench/serve_multiturn.py against the real CPU tiny cluster (configs/cpu-tiny.yaml: router, prefill worker,
NIXL handoff, decode worker) with prefill.prefix_cache on: token-id prompts answered with
return_token_ids, and turns 2+ hit the cache (usage.prompt_tokens_details.cached_tokens > 0)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]


def test_multiturn_with_the_prefix_cache_on_the_cpu_tiny_cluster(tmp_path):
    from conftest import serving

    from kvrelay.bench import serve_multiturn as mt

    topo = yaml.safe_load((REPO / "configs" / "cpu-tiny.yaml").read_text())
    topo["prefill"]["prefix_cache"] = True
    topo["router"].update(grpc_port=0, http_port=0)  # the preset's fixed ports may be taken on a shared box
    with serving(yaml.safe_dump(topo)) as (_, server):
        # 2 conversations x 3 turns: prompts of 96, 144, 192 tokens (page_size 16), 8 tokens an answer.
        argv = ["--base-url", server.http_url, "--conversations", "2", "--turns", "3", "--system-len", "64",
                "--first-user-len", "32", "--user-len", "40", "--answer-len", "8", "--warmup", "0",
                "--prefix-cache", "on", "--topology", "configs/cpu-tiny.yaml + prefill.prefix_cache",
                "--out-dir", str(tmp_path), "--timeout-s", "60", "--duration-s", "120"]
        payload = asyncio.run(mt.run(mt.build_parser().parse_args(argv), argv))
    saved = json.loads(Path(payload["files"]["json"]).read_text())
    assert saved["kind"] == "serve-multiturn" and saved["prompt_format"] == "ids"  # kvrelay returns token ids
    assert not saved["stopped_early"] and saved["prompt_len_mismatches"] == 0
    rows = {r["turn"]: r for r in saved["points"]}
    assert list(rows) == ["1", "2", "3", "2+", "all"]
    assert [(rows[t]["requests"], rows[t]["failed"], rows[t]["prompt_tokens_p50"]) for t in "123"] == [
        (2, 0, 96), (2, 0, 144), (2, 0, 192)]
    assert all(rows[t]["ttft_p50_s"] > 0 and rows[t]["out_tok_s"] > 0 for t in "123")
    # Each later turn starts with the previous turn's whole prompt: at least its whole pages are cached
    # (the split topology's prefill worker keeps prompts; what decode generated is not among them).
    for r in saved["requests"]:
        if r["turn"] >= 2:
            prev = 96 + (r["turn"] - 2) * 48
            assert r["cached_tokens"] >= prev // 16 * 16, r
    assert rows["2+"]["cached_tokens_p50"] > 0 and rows["2+"]["cached_frac"] > 0.5
