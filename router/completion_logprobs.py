"""The legacy completions API's logprobs shapes for echoed prompts (OpenAI's `logprobs` object, vLLM's
`prompt_logprobs` list), built from the engine's `PromptLogprobs` (engine/sampling.py).

Kept apart from the HTTP plumbing: these are pure functions of a prompt's ids and its logprobs, and they
are what lm-eval and other scoring clients parse, so their layout is checked field by field in tests.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvrelay.router import harmony


def legacy_top(alts) -> dict[str, float]:
    """One token's alternatives as {text: logprob}, in the given order (the token itself first, then the
    most likely: OpenAI's up to logprobs + 1 entries); of two tokens with the same text, the first."""
    d: dict[str, float] = {}
    for t, lp in alts or ():
        d.setdefault(harmony.decode_tokens([t]), lp)
    return d


def echoed_prompt(prompt_ids: Sequence[int], plp) -> tuple[str, list, list[int], list]:
    """An echoed prompt as vLLM lays it out: (text, token logprobs, text offsets, alternatives per token).
    The first token has no logprob and no alternatives (None); each other token lists itself, then its
    most likely alternatives. Offsets count the characters of the tokens' texts before each one. `plp`
    None (the engine computed none): logprobs None, no alternatives."""
    ids = list(prompt_ids)
    lps: list = [None] + list(plp.token_logprobs) if plp is not None else [None] * len(ids)
    offsets, at = [], 0
    for t in ids:
        offsets.append(at)
        at += len(harmony.decode_tokens([t]))
    tops: list = [None]
    for i, t in enumerate(ids[1:]):
        if plp is None:
            tops.append(())
            continue
        alts = plp.top[i] if plp.top is not None else ()
        tops.append(((t, plp.token_logprobs[i]),) + tuple(alts))
    return harmony.decode_tokens(ids), lps, offsets, tops


def vllm_prompt_logprobs(prompt_ids: Sequence[int], plp) -> list[Any] | None:
    """vLLM's `prompt_logprobs`: None for the first token, then per token {"<id>": {logprob, rank,
    decoded_token}} for the token itself and its most likely alternatives (ranks 1, 2, ...)."""
    if plp is None:
        return None
    out: list[Any] = [None]
    for i, t in enumerate(list(prompt_ids)[1:]):
        entry = {str(t): {"logprob": plp.token_logprobs[i], "rank": plp.ranks[i],
                          "decoded_token": harmony.decode_tokens([t])}}
        for rank, (alt, lp) in enumerate(plp.top[i] if plp.top is not None else (), start=1):
            entry.setdefault(str(alt), {"logprob": lp, "rank": rank, "decoded_token": harmony.decode_tokens([alt])})
        out.append(entry)
    return out
