"""The float32 judge of bf16 greedy streams (greedy_judge.py), on the tiny model in this process (no
cluster): it allows the genuine bf16 flip of the reported prompt either way, and refuses a wrong token,
a missing token and a stream sampled without the penalties the request asked for."""

from __future__ import annotations

import pytest

from greedy_judge import assert_same_greedy, float32_allows, greedy_verdict, tiny_runners

# test_cluster.prompt_of(29, 303) + [735] * 3: bf16 takes 115 at token 2, float32 735 (by 0.049), and
# bf16 moves that position's logits by 0.080.
REPORTED = [(31 * i + 17 * 303 + 3) % 1000 + 1 for i in range(29)] + [735] * 3


def greedy(runner, prompt: list[int], k: int, params=None) -> list[int]:
    """Full-recompute greedy tokens of `runner` (penalized as `params` asks)."""
    from kvrelay.engine.sampling import apply_penalties

    out: list[int] = []
    for _ in range(k):
        logits = runner.score(prompt + out)[-1:].float().clone()
        if params is not None:
            logits = apply_penalties(logits, [params], [out], [prompt])
        out.append(int(logits[0].argmax()))
    return out


@pytest.fixture(scope="module")
def streams():
    r16, r32 = tiny_runners()
    return greedy(r16, REPORTED, 8), greedy(r32, REPORTED, 8)


def test_the_reported_bf16_flip_is_allowed_either_way(streams):
    bf16, fp32 = streams
    assert bf16[:2] == fp32[:2] and (bf16[2], fp32[2]) == (115, 735)  # the flip the judge must allow
    assert greedy_verdict(bf16, fp32, REPORTED) is None
    assert greedy_verdict(fp32, bf16, REPORTED) is None
    assert_same_greedy(bf16, bf16, REPORTED, "equal streams")
    assert float32_allows(REPORTED + bf16[:2], 115, 735)[0]


def test_a_wrong_token_is_refused(streams):
    bf16, _ = streams
    _, r32 = tiny_runners()
    worst = int(r32.score(REPORTED + bf16[:4])[-1].argmin())
    bad = bf16[:4] + [worst] + bf16[5:]
    why = greedy_verdict(bad, bf16, REPORTED)
    assert why is not None and why.startswith(f"token 4 is {worst}"), why
    assert not float32_allows(REPORTED + bf16[:4], worst, bf16[4])[0]
    with pytest.raises(AssertionError, match="wrong token: token 4"):
        assert_same_greedy(bad, bf16, REPORTED, "wrong token")


def test_a_missing_token_is_refused(streams):
    bf16, _ = streams
    missing = bf16[:3] + bf16[4:] + bf16[-1:]  # token 3 dropped, as a resume that skipped one would
    why = greedy_verdict(missing, bf16, REPORTED)
    assert why is not None and why.startswith("token 3 is"), why
    assert greedy_verdict(bf16[:-1], bf16, REPORTED) == "7 tokens, not 8"


def test_penalties_are_part_of_the_judgement():
    """A penalized stream diverges from the plain one at once: allowed when judged with its penalties,
    refused without them (so a worker that dropped the penalty fails the comparison)."""
    from kvrelay.engine.sampling import SamplingParams

    r16, _ = tiny_runners()
    prompt = [(37 * i + 11) % 1000 + 1 for i in range(40)]
    params = SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.5)
    penalized, plain = greedy(r16, prompt, 6, params), greedy(r16, prompt, 6)
    assert penalized != plain
    assert greedy_verdict(penalized, plain, prompt, params) is None
    assert greedy_verdict(penalized, plain, prompt) is not None
