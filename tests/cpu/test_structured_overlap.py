"""Structured outputs on the overlapped decode path: greedy constrained rows take overlapped steps (the
forward of step N+1 queued before step N's tokens are fed to the constraints and N+1's masks filled), and
their tokens are exactly those of synchronous steps, for a batch that mixes constrained and plain rows,
rows that end at different steps and a row that joins mid-run."""

from __future__ import annotations

import json

import jsonschema
from openai_harmony import Role

from kvrelay.decode_worker.scheduler import Scheduler
from kvrelay.engine import structured as es
from kvrelay.engine.runner import Runner
from kvrelay.engine.sampling import SamplingParams
from kvrelay.router import harmony, structured
from kvrelay.router.types import ChatMessage, ChatRequest, ResponseFormat, ToolSpec


BOUNDED = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "name": {"type": "string", "maxLength": 6}, "kind": {"enum": ["a", "b", "c"]}},
    "required": ["ok", "n", "name", "kind"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}


def _messages(tokens: list[int]):
    return harmony.load_encoding().parse_messages_from_completion_tokens(tokens, Role.ASSISTANT)


def _requests():
    json_req = ChatRequest(messages=(ChatMessage("user", "hi"),), max_reasoning_tokens=2,
                           response_format=ResponseFormat("json_schema", json.dumps(BOUNDED), "r"))
    tool_req = ChatRequest(messages=(ChatMessage("user", "weather?"),), max_reasoning_tokens=0,
                           tools=(ToolSpec("get_weather", "", json.dumps(WEATHER)),), tool_choice="required")
    stops = harmony.CHAT_STOP_TOKEN_IDS
    return {  # name -> (prompt, params, step() calls before it joins)
        "json": (harmony.render_chat(json_req, "2026-12-01"),
                 SamplingParams(max_tokens=120, temperature=0.0, stop_token_ids=stops,
                                structured=structured.build(json_req)), 0),
        "tool": (harmony.render_chat(tool_req, "2026-12-01"),
                 SamplingParams(max_tokens=120, temperature=0.0, stop_token_ids=stops,
                                structured=structured.build(tool_req)), 3),
        "plain": (harmony.render_chat(json_req, "2026-12-01"), SamplingParams(max_tokens=5, temperature=0.0), 0),
    }


def _run(runner: Runner, overlap: bool, tag: str) -> tuple[dict[str, list[int]], Scheduler]:
    sched = Scheduler(runner, max_batch=4, overlap=overlap)
    reqs = _requests()
    out: dict[str, list[int]] = {name: [] for name in reqs}

    def join(name: str) -> None:
        prompt, params, _ = reqs[name]
        rid = f"{tag}-{name}"
        sched.reserve(rid, len(prompt), params.max_tokens)
        logits = runner.prefill(rid, prompt)
        (tok, _), = es.sample_constrained(runner.sample, logits, [params], [0], masks=es.masks_for([params], [[]]))
        out[name].append(tok)
        sched.join(rid, params, tok, 1, lambda o, name=name: out[name].append(o.token_id))

    calls = 0
    for name, (_, _, at) in reqs.items():
        if at == 0:
            join(name)
    while sched.has_work() or calls <= 3:
        sched.step()
        calls += 1
        for name, (_, _, at) in reqs.items():
            if at == calls:
                join(name)
    return out, sched


def test_constrained_greedy_rows_overlap_and_decode_what_synchronous_steps_do() -> None:
    runner = Runner.load("gpt-oss-tiny", dummy=True, seed=0, page_size=16, num_pages=128)
    sync, sync_sched = _run(runner, False, "sync")
    over, over_sched = _run(runner, True, "over")
    assert sync_sched.times.overlapped == 0
    assert over == sync
    # The constrained rows really took the overlapped path: every launch but the first (nothing was in
    # flight) had the step before still to read back.
    assert over_sched.times.overlapped >= len(over["json"]) - 3, (over_sched.times, len(over["json"]))
    msgs = _messages(over["json"])
    assert over["json"][-1] == harmony.RETURN and msgs[-1].channel == "final"
    jsonschema.validate(json.loads(msgs[-1].content[0].text), BOUNDED)
    call = _messages(over["tool"])[-1]
    assert over["tool"][-1] == harmony.CALL and call.recipient == "functions.get_weather"
    jsonschema.validate(json.loads(call.content[0].text), WEATHER)
    assert len(over["plain"]) == 5


def test_a_mask_job_feeds_the_unfed_tokens_before_it_fills_the_masks() -> None:
    """ConstraintBatch.submit(constraints, feeds): the same masks as feeding on the caller's thread."""
    spec = _requests()["json"][1].structured
    head = list(spec.bodies[0].header)
    body = harmony.encode_text('{"ok":true,"n":7')
    ahead = es.open_constraint(spec, head + body)
    behind = es.open_constraint(spec, head + body[:2])
    batch = es.ConstraintBatch()
    try:
        rows, mask = batch.submit([behind, None], [body[2:], []]).result()
    finally:
        batch.close()
    want_rows, want = es.compute_masks([ahead, None])
    assert rows == want_rows == [0] and mask.equal(want) and behind.state == ahead.state


def test_bench_reports_the_hot_path_with_the_constrained_steps_overlapped() -> None:
    from kvrelay.bench.structured import bench_steps

    res = bench_steps("gpt-oss-tiny", "cpu", "bf16", 2, 5)
    hot = res["hot_path"]
    assert hot["plain"]["p50_ms"] > 0 and hot["json_schema"]["p50_ms"] > 0
    # each block's first step() launches with nothing in flight; every other one overlaps
    assert hot["json_schema"]["overlapped_share"] >= 0.75 and hot["plain"]["overlapped_share"] >= 0.75
    assert hot["added_per_token_ms"] == hot["added_per_step_ms"] / 2


def test_results_md_tables_the_newest_structured_run_with_its_hot_path() -> None:
    from kvrelay.bench import provenance, results_md

    def run(ts: str, hot: bool) -> provenance.Result:
        step = {"plain_sync": {"p50_ms": 6.0}, "json_schema": {"p50_ms": 8.0}, "added_per_step_ms": 2.0,
                "added_per_token_ms": 2.0 / 64}
        if hot:
            step["hot_path"] = {"plain": {"p50_ms": 5.0}, "json_schema": {"p50_ms": 5.25, "overlapped_share": 0.95},
                                "added_per_step_ms": 0.25, "added_per_token_ms": 0.25 / 64}
        data = {"env": {"gpu": "NVIDIA H200", "command": "python -m kvrelay.bench.structured --model gpt-oss-20b "
                        "--quant fp8-block128"}, "state_machine": {"b64": {"per_token_ms": 0.013}},
                "decode_steps": {"b64": step}}
        return provenance.Result(f"structured-cuda-{ts}.json", "structured", data, "abcdef1", ts, "clean")

    col = provenance.Collection([run("2026-12-01 14:13", False), run("2026-12-01 16:00", True)])
    table = [line for line in results_md.structured_section(col) if line.startswith("| gpt-oss-20b")]
    assert table == ["| gpt-oss-20b (fp8-block128), NVIDIA H200 | 64 | 0.0130 | 6.00 | 8.00 | +2.00 | +0.031 | 5.00 "
                     "| 5.25 | +0.25 | +0.004 | 95% | `abcdef1` 2026-12-01 16:00 |"]
