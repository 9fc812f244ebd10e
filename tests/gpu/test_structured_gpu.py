"""Structured outputs on the GPU: the bitmask is unpacked on the device and must allow exactly the tokens
the CPU path allows; masked sampling on the device picks only allowed tokens, with the model's logprobs.

    python3 -m pytest tests/gpu/test_structured_gpu.py -m gpu -q
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


def _spec():
    from kvrelay.router import harmony, structured
    from kvrelay.router.types import ChatMessage, ChatRequest, ResponseFormat

    vocab = Path(__file__).resolve().parents[2].parent / "shared" / "tokenizer"
    harmony.use_vocab_dir(os.environ.get("TIKTOKEN_ENCODINGS_BASE", vocab))
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
