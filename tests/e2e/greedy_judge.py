"""Greedy streams of the CPU tiny cluster (bf16) compared with another run of other batch shapes, judged
in float32 (the project's rule for exactness).

Two bf16 runs of the same weights that batch differently (a concurrent batch vs a solo run, a TP group's
sharded sums, a re-prefill of prompt + k tokens vs the k decode steps that produced them) round their
logits differently, so a greedy token may flip where two logits are close. The tiny dummy model's logits
are O(1) and bf16 moves them by up to ~0.08 at one position, ~20 bf16 steps of the top logit there: a
"near-tie" counted in bf16 steps of the top logit calls such genuine flips errors. So: two streams must be
equal up to their first difference, and from there on every token of `got` must be one float32 allows at
its position (after `prompt` + the tokens `got` streamed before it): float32's best logit may lead it by
no more than twice what bf16 moves that position's logits (each bf16 run is about that far from float32).
A wrong token (a wrong head mapping, a missing or repeated token) is far outside that and still fails.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

# Pages of 16 positions for the judge's own throwaway sequences: the longest judged stream (prompt +
# tokens) in tests/e2e is ~520 positions.
_PAGES = 96


@functools.cache
def tiny_runners():
    """The cluster's tiny model (name tiny, dummy, seed 0) in this process: (bf16, float32)."""
    import torch

    from kvrelay.engine.runner import Runner

    return tuple(Runner.load("tiny", dummy=True, seed=0, dtype=dt, page_size=16, num_pages=_PAGES)
                 for dt in (torch.bfloat16, torch.float32))


def _rows(prompt: Sequence[int], tokens: Sequence[int], start: int, params) -> list[tuple]:
    """(bf16 logits, float32 logits) in float32 after prompt + tokens[:i], for i in start..len(tokens)-1,
    penalized as `params` asks (the penalties see the tokens generated before i)."""
    from kvrelay.engine.sampling import apply_penalties

    seq = [int(t) for t in prompt] + [int(t) for t in tokens]
    r16, r32 = tiny_runners()
    n = len(prompt)
    l16, l32 = (r.score(seq)[n - 1 + start:n - 1 + len(tokens)].float() for r in (r16, r32))
    out = []
    for j, i in enumerate(range(start, len(tokens))):
        a, b = l16[j:j + 1].clone(), l32[j:j + 1].clone()
        if params is not None:
            a = apply_penalties(a, [params], [list(tokens[:i])], [list(prompt)])
            b = apply_penalties(b, [params], [list(tokens[:i])], [list(prompt)])
        out.append((a[0], b[0]))
    return out


def float32_allows(prefix: Sequence[int], got: int, want: int) -> tuple[bool, str]:
    """Is `got` after `prefix` as right as `want`, judged in float32? Yes if float32 prefers `want` by no
    more than twice what bf16 rounding moves this position's logits (no penalties)."""
    (l16, l32), = _rows(prefix, [got], 0, None)
    noise, behind = float((l16 - l32).abs().max()), float(l32[want] - l32[got])
    return behind <= 2 * noise, (f"float32 prefers {want} to {got} by {behind:.4f}; bf16 moves this "
                                 f"position's logits by up to {noise:.4f}")


def greedy_verdict(got: Sequence[int], want: Sequence[int], prompt: Sequence[int], params=None) -> str | None:
    """None if `got` is a greedy stream as right as `want` for `prompt` (see the module docstring), else
    why not. `params`: the request's SamplingParams where it asks for penalties."""
    got, want = [int(t) for t in got], [int(t) for t in want]
    if len(got) != len(want):
        return f"{len(got)} tokens, not {len(want)}"
    first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    if first is None:
        return None
    for i, (l16, l32) in zip(range(first, len(got)), _rows(prompt, got, first, params)):
        noise, best = float((l16 - l32).abs().max()), int(l32.argmax())
        behind = float(l32[best] - l32[got[i]])
        if behind > 2 * noise:
            return (f"token {i} is {got[i]} (the other run's {want[i]}): float32 prefers {best} to it by "
                    f"{behind:.4f}, more than twice what bf16 moves this position's logits ({noise:.4f})"
                    + ("" if i == first else f"; the streams first differ at token {first}"))
    print(f"first difference at token {first} ({got[first]} vs {want[first]}), every token from there one "
          f"float32 allows")
    return None


def assert_same_greedy(got: Sequence[int], want: Sequence[int], prompt: Sequence[int], what: str,
                       params=None) -> None:
    """`got` equals `want` up to bf16 rounding, judged in float32 (greedy_verdict)."""
    why = greedy_verdict(got, want, prompt, params)
    assert why is None, f"{what}: {why}: got {list(got)}, want {list(want)}"
