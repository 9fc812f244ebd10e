"""The n choices of one prompt (OpenAI's `n`, vLLM's parallel sampling), as both roles see them.

A request with n choices is prefilled once: the prefill (a prefill worker, or a colocated worker's prompt
chunks) samples each choice's first token from the one logits row of the prompt's last position, and the
decode side forks the prompt's KV into one sequence per choice (`KVCache.fork`: whole pages shared,
the partial last page copied). From then on each choice is an ordinary decode row with its own sampling
stream, stop and finish reason. Choice 0 is the request the prefill was called for; `forks` are the
SamplingParams of choices 1..n-1 (each with its own seed, as the router draws them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvrelay.engine.sampling import SamplingParams, TokenOutput, finish_reason_at, top_logprobs
from kvrelay.engine.structured import masks_for, sample_constrained


def sample_forks(sample: Callable, row: torch.Tensor, forks: Sequence[SamplingParams], prompt_ids: Sequence[int],
                 generated: int, max_context: int, first: TokenOutput) -> tuple[TokenOutput, ...]:
    """The first token of each of `forks` from `row` (the logits of the prompt's last position, [V] or
    [1, V]), as choice 0's was sampled from it; `first` is choice 0's, whose prompt logprobs (asked for
    once, the prompt's own) every choice carries too."""
    if not forks:
        return ()
    n = len(forks)
    rows = row.reshape(1, -1).repeat(n, 1)  # a copy: penalties and masks change rows in place
    done = [list(prompt_ids[len(prompt_ids) - generated:])] * n
    params = list(forks)
    sampled = sample_constrained(sample, rows, params, [generated] * n, done, [list(prompt_ids)] * n,
                                 masks=masks_for(params, done))
    tops = top_logprobs(rows, params)
    return tuple(TokenOutput(token, logprob, finish_reason_at(token, generated + 1, p, len(prompt_ids) + 1, max_context),
                             top, first.prompt_logprobs)
                 for p, (token, logprob), top in zip(params, sampled, tops))


def any_continues(first: TokenOutput, forks: Sequence[TokenOutput]) -> bool:
    """Some choice goes on decoding after its first token: the prompt's KV must stay."""
    return first.finish_reason is None or any(f.finish_reason is None for f in forks)

