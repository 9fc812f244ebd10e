"""Structured outputs on the GPU: the bitmask is unpacked on the device and must allow exactly the tokens
the CPU path allows; masked sampling on the device picks only allowed tokens, with the model's logprobs.

    python3 -m pytest tests/gpu/test_structured_gpu.py -m gpu -q
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


def _spec():
    from kvrelay.router import structured
    from kvrelay.router.types import ChatMessage, ChatRequest, ResponseFormat

    return structured.build(ChatRequest(messages=(ChatMessage("user", "hi"),), max_reasoning_tokens=3,
                                        response_format=ResponseFormat("json_schema", json.dumps(SCHEMA), "r")))


def test_device_unpack_equals_cpu_and_sampling_stays_in_the_mask() -> None:
    from kvrelay.engine import grammar
    from kvrelay.engine.sampling import SamplingParams, sample
    from kvrelay.engine.structured import allowed_rows, compute_masks, open_constraint, sample_constrained

    spec = _spec()
    head = list(spec.bodies[0].header)
    cons = [open_constraint(spec), open_constraint(spec, [spec.analysis_header[0]]), None,
            open_constraint(spec, head), open_constraint(spec, head + [90])]  # 90 = '{'
    rows, mask = compute_masks(cons)
    cpu = allowed_rows(mask, torch.device("cpu"), grammar.N_VOCAB)
    gpu = allowed_rows(mask, torch.device("cuda"), grammar.N_VOCAB)
    assert torch.equal(cpu, gpu.cpu())
    logits = torch.randn(len(cons), grammar.N_VOCAB, device="cuda")
    params = [SamplingParams(temperature=1.0, seed=i, logprobs=True) for i in range(len(cons))]
    out = sample_constrained(sample, logits, params, [0] * len(cons), None, masks=(rows, mask))
    raw = torch.log_softmax(logits.float(), -1)
    for k, b in enumerate(rows):
        token, lp = out[b]
        assert cpu[k, token], (b, token)
        assert lp == pytest.approx(float(raw[b, token]), abs=1e-4)


def test_overlapped_constrained_steps_decode_what_synchronous_steps_do() -> None:
    """Greedy json_schema rows on the CUDA-graph overlapped path (forward queued, mask filled while it runs,
    pinned non-blocking copy, masked argmax behind it) give the tokens of synchronous steps."""
    from kvrelay.decode_worker.scheduler import Scheduler
    from kvrelay.engine.runner import Runner
    from kvrelay.engine.sampling import SamplingParams
    from kvrelay.engine.structured import masks_for, sample_constrained
    from kvrelay.router import harmony
    from kvrelay.router.types import ChatMessage, ChatRequest

    spec = _spec()
    # One graph size: every step of both runs replays the same graph (a request that stops rides along one
    # step more when overlapped; at other padded sizes other GEMM configs could move a greedy tie).
    runner = Runner.load("gpt-oss-tiny", dummy=True, seed=0, device="cuda", page_size=16, num_pages=256,
                         cuda_graph_batch_sizes=(8,))
    prompt = harmony.render_chat(ChatRequest(messages=(ChatMessage("user", "hi"),)), "2026-12-01")

    def run(overlap: bool, tag: str):
        sched = Scheduler(runner, max_batch=8, overlap=overlap)
        out = {i: [] for i in range(6)}
        for i in range(6):  # 4 constrained rows, 2 plain ones of different lengths
            params = SamplingParams(max_tokens=60 if i < 4 else 3 + i, temperature=0.0,
                                    stop_token_ids=harmony.CHAT_STOP_TOKEN_IDS, structured=spec if i < 4 else None)
            rid = f"{tag}-{i}"
            sched.reserve(rid, len(prompt), params.max_tokens)
            logits = runner.prefill(rid, prompt)
            (tok, _), = sample_constrained(runner.sample, logits, [params], [0], masks=masks_for([params], [[]]))
            out[i].append(tok)
            sched.join(rid, params, tok, 1, lambda o, i=i: out[i].append(o.token_id))
        while sched.has_work():
            sched.step()
        return out, sched

    sync, _ = run(False, "s")
    over, sched = run(True, "o")
    assert over == sync
    assert sched.times.overlapped >= max(len(v) for v in over.values()) - 3
