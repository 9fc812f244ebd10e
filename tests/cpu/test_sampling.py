"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs, stop conditions."""

from __future__ import annotations

import math

import pytest
import torch

from kvrelay.engine.sampling import SamplingParams, finish_reason, sample

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5, 2.9]])


def _draws(params: SamplingParams, n: int = 400) -> list[int]:
    return [sample(LOGITS, [params], [step])[0][0] for step in range(n)]


def test_greedy_and_logprob():
    (tok, lp), = sample(LOGITS, [SamplingParams(temperature=0, logprobs=True)], [0])
    assert tok == 1
    assert lp == pytest.approx(float(torch.log_softmax(LOGITS[0], -1)[1]))
    assert sample(LOGITS, [SamplingParams(temperature=0)], [0]) == [(1, None)]


def test_top_k_and_top_p_restrict_the_support():
    assert set(_draws(SamplingParams(temperature=5.0, top_k=2, seed=1))) == {1, 4}
    # softmax([1,3,2,.5,2.9]): ids 1 and 4 hold ~0.66 together; top_p=0.6 keeps {1, 4}, 0.3 keeps {1}.
    assert set(_draws(SamplingParams(top_p=0.6, seed=2))) == {1, 4}
    assert set(_draws(SamplingParams(top_p=0.3, seed=3))) == {1}
    assert set(_draws(SamplingParams(temperature=1.0, seed=4))) == {0, 1, 2, 3, 4}


def test_temperature_sharpens():
    cold = _draws(SamplingParams(temperature=0.2, seed=5))
    hot = _draws(SamplingParams(temperature=2.0, seed=5))
    assert cold.count(1) > hot.count(1)


def test_frequencies_follow_the_distribution():
    draws = _draws(SamplingParams(seed=6), n=3000)
    p = torch.softmax(LOGITS[0], -1)
    for t in range(5):
        assert draws.count(t) / 3000 == pytest.approx(float(p[t]), abs=0.035)


def test_seed_reproducible_per_step_and_independent_of_batch():
    p = SamplingParams(seed=42)
    alone = [sample(LOGITS, [p], [s])[0][0] for s in range(50)]
    batch = torch.cat([LOGITS.flip(-1), LOGITS])
    together = [sample(batch, [SamplingParams(seed=7), p], [s, s])[1][0] for s in range(50)]
    assert alone == together
    assert alone != [sample(LOGITS, [SamplingParams(seed=43)], [s])[0][0] for s in range(50)]


def test_unseeded_params_get_a_seed_and_validation():
    r = SamplingParams().resolved()
    assert r.seed is not None and SamplingParams(temperature=0).resolved().seed is None
    with pytest.raises(ValueError, match="resolved"):
        sample(LOGITS, [SamplingParams()], [0])
    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-1),
                dict(temperature=math.inf)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_finish_reason():
    p = SamplingParams(max_tokens=3, stop_token_ids=(9,))
    assert finish_reason(5, 1, p) is None
    assert finish_reason(9, 1, p) == "stop"
    assert finish_reason(5, 3, p) == "length"
    assert finish_reason(9, 3, p) == "stop"


def test_min_tokens_masks_the_stop_tokens_until_reached():
    greedy = SamplingParams(temperature=0, stop_token_ids=(1, 4), min_tokens=2, logprobs=True)
    (tok, lp), = sample(LOGITS, [greedy], [0])
    assert tok == 2  # 1 and 4 (the two best) are stop tokens and masked at step 0
    assert lp == pytest.approx(float(torch.log_softmax(LOGITS[0], -1)[2]))  # the model's distribution
    assert sample(LOGITS, [greedy], [1])[0][0] == 2
    assert sample(LOGITS, [greedy], [2])[0][0] == 1  # reached: stop tokens allowed again
    sampled = SamplingParams(max_tokens=400, temperature=1.0, seed=3, stop_token_ids=(1, 4), min_tokens=400)
    assert not {1, 4} & set(_draws(sampled, 300))
    assert greedy.masks_stops(1) and not greedy.masks_stops(2) and not SamplingParams(min_tokens=5).masks_stops(0)
    with pytest.raises(ValueError, match="min_tokens must be in"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(temperature=0.5, min_tokens=3).resolved().min_tokens == 3
