"""`kvrelay serve` with model.quant mxfp4-bf16 on OpenAI's original-format MXFP4 checkpoint: the served path (the
prefill worker, the NIXL KV handoff, the decode worker, the router) with the experts held as the file's MXFP4
bytes. Greedy tokens equal the in-process engine's of the same quant, whose first one is OpenAI's reference."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import yaml
from serve_proc import serving_cli

from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "gpt-oss-tiny-original"


def test_served_mxfp4_checkpoint_equals_the_engine(tmp_path):
    raw = yaml.safe_load((ROOT / "configs" / "cpu-tiny.yaml").read_text())
    raw["model"].update(name=str(TINY), dummy=False, quant="mxfp4-bf16", max_context=1024)
    raw["prefill"]["max_prompt_tokens"] = 1024
    raw["router"].update(grpc_port=0, http_port=0)
    assert raw.get("colocate") is not True  # the split path: KV over NIXL between the two workers
    topo = tmp_path / "mxfp4.yaml"
    topo.write_text(yaml.safe_dump(raw))
    run = json.loads((TINY / "reference.json").read_text())["runs"][0]
    with serving_cli(str(topo)) as served:
        r = httpx.post(f"{served.ready['http']}/v1/completions", timeout=120, json={
            "model": served.ready["model"], "prompt": run["prompt"], "max_tokens": 10, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["token_ids"]
        version = httpx.get(f"{served.ready['http']}/version", timeout=30).json()
    assert version["topology"]["model"]["quant"] == "mxfp4-bf16", version
    llm = LLM(str(TINY), device="cpu", quant="mxfp4-bf16")
    want = [o.token_id for o in llm.generate(run["prompt"], SamplingParams(max_tokens=10, temperature=0.0))]
    assert got == want and got[0] == run["greedy"][0]
