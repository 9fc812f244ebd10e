"""Presence/frequency penalties and min_p in the sampler, against a float64 numpy reference written
from OpenAI's and vLLM's definitions, on random (never zero) logits; and through the in-process engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvrelay.engine.sampling import SamplingParams, sample, top_logprobs

V = 300


def _penalized_reference(logits: np.ndarray, history: list[int], presence: float, frequency: float) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for tok in set(history):
        c = history.count(tok)
        out[tok] -= frequency * c + presence * (c > 0)
    return out


@pytest.mark.parametrize("presence,frequency", [(0.0, 1.5), (2.0, 0.0), (-1.0, 0.7), (0.4, -2.0)])
def test_greedy_with_penalties_matches_reference(presence: float, frequency: float) -> None:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, V, generator=g) * 3 + 0.1
    # Histories that hit the top tokens, so the penalties change the argmax.
    top = torch.topk(logits, 6, dim=-1).indices.tolist()
    histories = [[top[0][0]] * 3 + [top[0][1]], [top[1][0], top[1][2]], [], [top[3][0]] * 7 + [5, 5, 9]]
    params = [SamplingParams(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency)] * 4
    got = [t for t, _ in sample(logits, params, [len(h) for h in histories], histories)]
    want = [int(np.argmax(_penalized_reference(logits[b].numpy(), histories[b], presence, frequency)))
            for b in range(4)]
    assert got == want
    if frequency > 0 and presence >= 0:  # penalties that push the top tokens down change the choice
        assert got != torch.argmax(logits, dim=-1).tolist()


def test_penalties_leave_other_rows_and_logprobs_alone() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3)) + 0.5
    top0 = int(torch.argmax(logits[0]))
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=True),
              SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=0.0)]
    out = sample(logits, params, [2, 2, 2], [[top0, top0], [top0, top0], []])
    assert out[0][0] != top0 and out[1][0] == int(torch.argmax(logits[1])) and out[2][0] == int(torch.argmax(logits[2]))
    # logprobs stay the model's own distribution (as for temperature and top-p)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out[0][1] == pytest.approx(float(ref[0, out[0][0]]), abs=1e-5)
    with pytest.raises(ValueError, match="history"):
        sample(logits, params, [2, 2, 2])


def test_min_p_never_draws_below_the_threshold() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(11)) * 2 + 0.3
    probs = torch.softmax(logits.double(), dim=-1)
    min_p = 0.2
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < V // 10
    drawn = set()
    for seed in range(300):
        p = SamplingParams(temperature=1.0, min_p=min_p, seed=seed)
        drawn.add(sample(logits[None], [p], [0])[0][0])
    assert drawn <= allowed and len(drawn) > 1
    # without min_p the same seeds reach further down the distribution
    wide = {sample(logits[None], [SamplingParams(temperature=1.0, seed=s)], [0])[0][0] for s in range(300)}
    assert wide - allowed


def test_ranges_are_checked() -> None:
    for kwargs in ({"presence_penalty": 2.5}, {"frequency_penalty": -2.1}, {"min_p": 1.1}, {"min_p": -0.1}):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    p = SamplingParams(temperature=0.7, frequency_penalty=0.5, min_p=0.05).resolved()
    assert p.seed is not None and p.frequency_penalty == 0.5 and p.min_p == 0.05 and p.penalized


def test_in_process_engine_counts_its_own_tokens() -> None:
    """A strong frequency penalty on the tiny model: greedy output equals a step-by-step run that applies
    the reference penalty to the unpenalized engine's logits."""
    from kvrelay.engine.llm import LLM

    llm = LLM("tiny", dummy=True, seed=0, page_size=16, kv_tokens=2048)
    prompt = [5, 17, 300, 42, 7]
    params = SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5)
    got = [o.token_id for o in llm.generate(prompt, params)]
    plain = [o.token_id for o in llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))]
    # The reference: logits of prompt + tokens so far, recomputed in full each step, penalized in numpy.
    want: list[int] = []
    for _ in range(12):
        logits = _last_logits(llm, prompt + want)
        want.append(int(np.argmax(_penalized_reference(logits, want, 0.5, 1.0))))
    assert got == want and got != plain


def _last_logits(llm, ids: list[int]) -> np.ndarray:
    logits = llm.runner.prefill("ref", ids)
    llm.runner.free("ref")
    return logits.reshape(-1, logits.shape[-1])[-1].float().numpy()


def test_top_logprobs_match_a_float64_reference() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5)) * 2 + 0.2
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=4), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=True, top_logprobs=1)]
    got = top_logprobs(logits, params)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for b, k in ((0, 4), (2, 1)):
        order = torch.argsort(ref[b], descending=True)[:k].tolist()
        assert [t for t, _ in got[b]] == order
        assert [lp for _, lp in got[b]] == pytest.approx(ref[b, order].tolist(), abs=1e-5)
    assert got[1] is None
    assert top_logprobs(logits[0], params[:1])[0] == got[0]  # one row, 1-D logits
    with pytest.raises(ValueError, match="needs logprobs"):
        SamplingParams(top_logprobs=2)
