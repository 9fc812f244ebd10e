"""Structured outputs: the harmony + grammar state machine with the real o200k_harmony vocabulary.

Any token sequence the masks allow (random allowed tokens, drawn by hypothesis) must parse with
openai-harmony into the expected message, and its body must be JSON valid against the schema."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from openai_harmony import Role

from kvrelay.engine import grammar
from kvrelay.engine.sampling import SamplingParams, sample
from kvrelay.engine.structured import (ConstraintError, apply_bitmask, compute_masks, open_constraint,
                                       sample_constrained)
from kvrelay.router import harmony, structured
from kvrelay.router.types import ChatMessage, ChatRequest, ResponseFormat, ToolSpec
from kvrelay.router.validation import ValidationError


BOUNDED = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "name": {"type": "string", "maxLength": 6}, "kind": {"enum": ["a", "b", "c"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["ok", "n", "name", "kind", "tags"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
MSG = (ChatMessage("user", "hi"),)


def _chat(**kw) -> ChatRequest:
    return ChatRequest(messages=MSG, **kw)


def _allowed(mask_row: torch.Tensor) -> list[int]:
    return np.flatnonzero(np.unpackbits(mask_row.numpy().view(np.uint8), bitorder="little")).tolist()


def _drive(spec, rng: random.Random, limit: int = 400) -> list[int]:
    """Random allowed tokens until the constrained message ends (or `limit`)."""
    c = open_constraint(spec)
    out: list[int] = []
    while not c.done and len(out) < limit:
        (row,), mask = compute_masks([c])
        allowed = _allowed(mask[0])
        assert allowed, f"nothing allowed after {out}"
        # Lean towards structural tokens now and then, so analysis messages also end by themselves.
        t = harmony.END if harmony.END in allowed and rng.random() < 0.2 else rng.choice(allowed)
        out.append(t)
        c.advance(t)
    return out


def _messages(tokens: list[int]):
    return harmony.load_encoding().parse_messages_from_completion_tokens(tokens, Role.ASSISTANT)


def test_header_tokens_are_what_harmony_parses() -> None:
    enc = harmony.load_encoding()
    call = list(structured.tool_header("get_weather")) + enc.encode('{"city":"x"}', allowed_special=set()) + [harmony.CALL]
    (m,) = _messages(call)
    assert (m.channel, m.recipient, m.content_type) == ("commentary", "functions.get_weather", "<|constrain|>json")
    (m,) = _messages(list(structured.final_header()) + enc.encode("{}", allowed_special=set()) + [harmony.RETURN])
    assert m.channel == "final" and m.recipient is None


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), budget=st.sampled_from([None, 0, 3, 20]))
def test_any_allowed_sequence_is_a_final_json_message_matching_the_schema(seed, budget) -> None:
    spec = structured.build(_chat(response_format=ResponseFormat("json_schema", json.dumps(BOUNDED), "r"),
                                  max_reasoning_tokens=budget))
    tokens = _drive(spec, random.Random(seed))
    assert tokens[-1] == harmony.RETURN, harmony.decode_tokens(tokens)
    msgs = _messages(tokens)
    assert all(m.channel == "analysis" for m in msgs[:-1])
    if budget == 0:
        assert len(msgs) == 1  # no analysis at all
    assert msgs[-1].channel == "final"
    jsonschema.validate(json.loads(msgs[-1].content[0].text), BOUNDED)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), named=st.booleans())
def test_any_allowed_sequence_under_tool_choice_is_a_call_with_valid_arguments(seed, named) -> None:
    tools = (ToolSpec("get_weather", "", json.dumps(WEATHER)), ToolSpec("get_time", "", json.dumps(
        {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
         "additionalProperties": False})))
    req = _chat(tools=tools, tool_choice="auto" if named else "required",
                tool_choice_function="get_time" if named else "", max_reasoning_tokens=8)
    tokens = _drive(structured.build(req), random.Random(seed))
    assert tokens[-1] == harmony.CALL
    call = _messages(tokens)[-1]
    assert call.channel == "commentary" and call.content_type == "<|constrain|>json"
    name = call.recipient.removeprefix("functions.")
    if named:
        assert name == "get_time"
    schema = json.loads({t.name: t for t in tools}[name].parameters_json)
    jsonschema.validate(json.loads(call.content[0].text), schema)


def test_json_object_without_schema_is_any_object() -> None:
    spec = structured.build(_chat(response_format=ResponseFormat("json_object"), max_reasoning_tokens=0))
    rng = random.Random(7)
    ended = 0
    for _ in range(10):
        tokens = _drive(spec, rng, limit=120)
        body = harmony.decode_tokens(tokens[3:])  # after <|channel|>final<|message|>: an object so far
        assert body.startswith("{")
        if tokens[-1] == harmony.RETURN:
            ended += 1
            assert isinstance(json.loads(harmony.decode_tokens(tokens[3:-1])), dict)
    assert ended >= 1


def test_replay_continues_the_same_state() -> None:
    spec = structured.build(_chat(response_format=ResponseFormat("json_schema", json.dumps(BOUNDED), "r"),
                                  max_reasoning_tokens=4))
    tokens = _drive(spec, random.Random(3))
    for cut in (0, 2, 5, len(tokens) - 2):
        c = open_constraint(spec, tokens[:cut])
        (_,), mask = compute_masks([c])
        assert tokens[cut] in _allowed(mask[0])
    with pytest.raises(ConstraintError):
        open_constraint(spec, [harmony.START])  # not a header the spec allows
    live = open_constraint(spec, list(structured.final_header()))
    live.feed(harmony.START)  # a live request fed a token the mask never allowed: the message ends there
    (_,), mask = compute_masks([live])
    assert live.done and _allowed(mask[0]) == [harmony.RETURN]


def test_masked_sampling_keeps_the_models_logprobs_and_fits_a_narrow_vocab() -> None:
    spec = structured.build(_chat(response_format=ResponseFormat("json_object"), max_reasoning_tokens=0))
    c = open_constraint(spec)
    masks = compute_masks([None, c])
    logits = torch.randn(2, grammar.N_VOCAB)
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=0.0, logprobs=True)]
    (t0, lp0), (t1, lp1) = sample_constrained(sample, logits, params, [0, 0], None, masks=masks)
    assert t0 == int(logits[0].argmax()) and t1 == harmony.CHANNEL  # the only token a header allows
    assert lp1 == pytest.approx(float(torch.log_softmax(logits[1], -1)[harmony.CHANNEL]), abs=1e-5)
    narrow = torch.randn(1, 1024)  # the tiny model: ids past its vocabulary are cut off the mask
    rows, mask = compute_masks([open_constraint(spec, list(structured.final_header()))])
    out = apply_bitmask(narrow.clone(), rows, mask)
    assert torch.isfinite(out).any() and out.shape == (1, 1024)
    allowed = set(_allowed(mask[0]))
    assert all((i in allowed) == bool(torch.isfinite(out[0, i])) for i in range(1024))
    # The GPU's unpacking (shifts on the device) agrees with numpy's, here on the CPU.
    from kvrelay.engine.structured import allowed_rows, unpack_on

    rows, mask = compute_masks([c, open_constraint(spec, list(structured.final_header()) + [90]), None])
    numpy_bits = allowed_rows(mask, torch.device("cpu"), grammar.N_VOCAB)
    assert torch.equal(numpy_bits, unpack_on(mask, torch.device("cpu"))[:, :grammar.N_VOCAB])


def test_bad_schemas_and_choices_name_the_field() -> None:
    def err(**kw) -> str:
        req = _chat(**kw)
        with pytest.raises(ValidationError) as e:
            structured.check_chat_structured(req)
        return e.value.field

    assert err(response_format=ResponseFormat("json_schema", '{"type": "object", "properties": 3}', "r")) == \
        "response_format.json_schema.schema"
    assert err(response_format=ResponseFormat("json_schema", "[1]", "r")) == "response_format.json_schema.schema"
    assert err(tool_choice="required") == "tool_choice"
    assert err(tools=(ToolSpec("a"),), tool_choice_function="b") == "tool_choice.function.name"
    assert err(tools=(ToolSpec("a", "", '{"type": "object", "properties": {"x": {"type": "strin"}}}'),),
               tool_choice="required") == "tools[0].function.parameters"


def test_decode_steps_mask_constrained_rows_and_keep_the_rest_on_the_fast_path() -> None:
    """Scheduler with overlapped steps: a structured request's steps are synchronous, their masks
    submitted before the forward; alone, the plain greedy request overlaps again and equals a solo run."""
    from kvrelay.decode_worker.scheduler import Scheduler
    from kvrelay.engine import structured as es
    from kvrelay.engine.runner import Runner

    runner = Runner.load("gpt-oss-tiny", dummy=True, seed=0, page_size=16, num_pages=64)
    sched = Scheduler(runner, max_batch=4, overlap=True)
    events: list[str] = []
    decode, submit = runner.decode, es.ConstraintBatch.submit
    runner.decode = lambda *a, **k: (events.append("forward"), decode(*a, **k))[1]
    es.ConstraintBatch.submit = lambda self, *a: (events.append("mask"), submit(self, *a))[1]
    try:
        spec = structured.build(_chat(response_format=ResponseFormat("json_schema", json.dumps(BOUNDED), "r"),
                                      max_reasoning_tokens=2))
        stops = harmony.CHAT_STOP_TOKEN_IDS
        prompt = harmony.render_chat(_chat(), "2026-12-01")
        out: dict[str, list] = {"json": [], "plain": []}
        params = {"json": SamplingParams(max_tokens=80, temperature=1.0, seed=1, stop_token_ids=stops, structured=spec),
                  "plain": SamplingParams(max_tokens=6, temperature=0.0)}
        for rid in ("json", "plain"):
            sched.reserve(rid, len(prompt), params[rid].max_tokens)
            logits = runner.prefill(rid, prompt)
            (tok, _), = sample_constrained(runner.sample, logits, [params[rid]], [0],
                                           masks=es.masks_for([params[rid]], [[]]))
            out[rid].append(tok)
            sched.join(rid, params[rid], tok, 1, lambda o, rid=rid: out[rid].append(o.token_id))
        while sched.has_work():
            sched.step()
    finally:
        runner.decode, es.ConstraintBatch.submit = decode, submit
    msgs = _messages(out["json"])
    assert out["json"][-1] == harmony.RETURN and msgs[-1].channel == "final"
    jsonschema.validate(json.loads(msgs[-1].content[0].text), BOUNDED)
    assert events[:2] == ["mask", "forward"] and events.count("mask") == events.count("forward")
    # No step overlapped (a constrained row was in each); the plain request is what it is alone.
    assert sched.times.overlapped == 0
    logits, solo = runner.prefill("solo", prompt), []
    for step in range(6):
        (tok, _), = runner.sample(logits, [params["plain"]], [step])
        solo.append(tok)
        logits = runner.decode(["solo"], [tok])[0]
    assert out["plain"] == solo


def test_bench_structured_runs_and_stores_its_json(tmp_path, monkeypatch) -> None:
    import sys

    from kvrelay.bench import structured as bench

    monkeypatch.setattr(sys, "argv", ["structured", "--engines", "llguidance", "--steps", "5", "--batches", "1,3",
                                      "--model", "", "--out", str(tmp_path)])
    res = bench.main()
    (path,) = tmp_path.glob("structured-cpu-*.json")
    stored = json.loads(path.read_text())
    assert stored["engines"]["llguidance"]["person-b3"]["fill"]["p50_ms"] > 0
    assert stored["apply"]["b3"]["p50_ms"] > 0 and "decode_steps" not in stored  # (--model '' skips them)
    assert res["state_machine"]["b1"]["per_token_ms"] > 0 and stored["env"]["git_commit"]


@pytest.mark.parametrize("with_tools", [False, True])
def test_the_schema_reaches_the_model_as_harmonys_response_formats_section(with_tools) -> None:
    """The developer message gains `# Response Formats` (harmony's docs); everything before it, the
    system message's tool-channel line included, renders as without a response_format."""
    tools = (ToolSpec("f", "d", json.dumps(WEATHER)),) if with_tools else ()
    msgs = (ChatMessage("system", "Be brief."), ChatMessage("user", "hi"))
    rf = ResponseFormat("json_schema", json.dumps(BOUNDED), "verdict", "The verdict.")
    plain = harmony.decode_tokens(harmony.render_chat(ChatRequest(messages=msgs, tools=tools), "2026-12-01"))
    shaped = harmony.decode_tokens(harmony.render_chat(ChatRequest(messages=msgs, tools=tools, response_format=rf),
                                                       "2026-12-01"))
    section = "# Response Formats\n\n## verdict\n\n// The verdict.\n" + json.dumps(BOUNDED, separators=(",", ":"))
    assert section in shaped and shaped.replace("\n\n" + section, "") == plain
    assert shaped.split("<|start|>developer")[0] == plain.split("<|start|>developer")[0]
