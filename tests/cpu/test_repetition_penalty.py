"""repetition_penalty (vLLM's/HF's multiplicative one over prompt + generated tokens) in the sampler:
against a float64 numpy reference written from the definition, against transformers'
RepetitionPenaltyLogitsProcessor, and through the in-process engine on the tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvrelay.engine.sampling import SamplingParams, apply_penalties, sample, token_set

V = 300


def _reference(logits: np.ndarray, seen: set[int], penalty: float, history: list[int] = (),
               presence: float = 0.0, frequency: float = 0.0) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for t in seen:  # a seen token's logit: divided when positive, multiplied otherwise
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    for t in set(history):  # then OpenAI's penalties over the generated tokens (vLLM's order)
        c = list(history).count(t)
        out[t] -= frequency * c + presence
    return out


def _logits(seed: int, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3  # both signs


@pytest.mark.parametrize("penalty", [1.3, 2.0, 0.7])
def test_penalized_logits_match_reference_and_transformers(penalty: float) -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = _logits(1)
    top = torch.topk(logits.abs(), 8, dim=-1).indices.tolist()  # hit big positive and negative logits
    prompts = [[top[0][0], top[0][1], top[0][0], 17], [top[1][2], 3], [4], [top[3][0], top[3][5]]]
    histories = [[top[0][3]], [], [top[2][0], top[2][0]], [top[3][0]]]
    params = [SamplingParams(temperature=0.0, repetition_penalty=penalty)] * 4
    got = apply_penalties(logits.clone(), params, histories, [token_set(p) for p in prompts])
    for b in range(4):
        want = _reference(logits[b].numpy(), set(prompts[b]) | set(histories[b]), penalty)
        np.testing.assert_allclose(got[b].double().numpy(), want, rtol=1e-6, atol=1e-6)
        # transformers' processor over the same context (prompt then generated tokens): bit for bit.
        ids = torch.tensor([prompts[b] + histories[b]])
        hf = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[b: b + 1].clone())
        assert torch.equal(got[b], hf[0])
    unseen = [t for t in range(V) if t not in set(prompts[0]) | set(histories[0])]
    assert torch.equal(got[0, unseen], logits[0, unseen])


def test_greedy_choice_with_all_penalties_matches_reference() -> None:
    logits = _logits(2)
    best = torch.argmax(logits, dim=-1).tolist()
    prompts = [[best[0]], [best[1], 9], [], [5]]
    histories = [[], [best[1]], [best[2]] * 2, [best[3], 7]]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)] * 4
    got = [t for t, _ in sample(logits, params, [len(h) for h in histories], histories, prompts)]
    want = [int(np.argmax(_reference(logits[b].numpy(), set(prompts[b]) | set(histories[b]), 1.5, histories[b],
                                     0.2, 0.3))) for b in range(4)]
    assert got == want
    assert got[0] != best[0] or logits[0, best[0]] <= 0  # the prompt's own token was pushed down
    with pytest.raises(ValueError, match="prompt tokens"):
        sample(logits, params, [0] * 4, histories)


def test_range_and_neutral_value() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad)
    assert not SamplingParams(repetition_penalty=1.0).penalized
    p = SamplingParams(repetition_penalty=1.2)
    assert p.penalized and p.needs_prompt_tokens
    assert token_set([5, 3, 5, 9, 3]) == (3, 5, 9)


def test_in_process_engine_penalizes_prompt_and_output() -> None:
    """Greedy with a strong repetition penalty on the tiny model equals a step-by-step run that penalizes
    the full recomputed logits of prompt + tokens so far with the reference."""
    from kvrelay.engine.llm import LLM

    llm = LLM("tiny", dummy=True, seed=0, page_size=16, kv_tokens=2048)
    prompt = [5, 17, 300, 42, 7, 17]
    params = SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=3.0)
    got = [o.token_id for o in llm.generate(prompt, params)]
    plain = [o.token_id for o in llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0))]
    want: list[int] = []
    for _ in range(10):
        logits = llm.runner.score(prompt + want)[-1].float().numpy()
        want.append(int(np.argmax(_reference(logits, set(prompt) | set(want), 3.0))))
    assert got == want and got != plain
