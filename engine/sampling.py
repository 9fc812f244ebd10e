"""The token sampler (the sampling parameters themselves are torch-free, in engine/sampling_params.py).

Seeded sampling draws step n of a request from a generator seeded with (seed, n) rather than one
generator advanced step by step: the draw then depends only on the request and the step, so a prefill
worker (step 0) and a decode worker (steps 1..) in different processes reproduce a single-process run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# the parameters and token records are torch-free (the router imports them): engine/sampling_params.py
from kvrelay.engine.sampling_params import (  # noqa: F401
    FINISH_REASONS, MAX_TOP_LOGPROBS, PROMPT_LOGPROB_CHUNK, PromptLogprobs, SamplingParams, TokenOutput,
    context_full, finish_reason, finish_reason_at, token_set)


def prompt_logprobs(rows: torch.Tensor, ids: Sequence[int], start: int, k: int) -> PromptLogprobs:
    """The logprobs of the prompt tokens that rows [m, vocab] predict: row i is position start + i, which
    predicts ids[start + i + 1]; a row past the prompt's last token (the one the first output token is
    sampled from) predicts nothing here. Computed on the rows' device; only the results come back."""
    targets = list(ids[start + 1: start + rows.shape[0] + 1])
    if not targets:
        return PromptLogprobs((), (), () if k else None)
    lp = torch.log_softmax(rows[: len(targets)].float(), dim=-1)
    tgt = torch.as_tensor(targets, dtype=torch.long, device=lp.device)
    tok = lp.gather(1, tgt[:, None])[:, 0]
    ranks = (lp > tok[:, None]).sum(dim=-1) + 1
    top = None
    if k:
        values, top_ids = torch.topk(lp, k, dim=-1)
        top = tuple(tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist()))
    return PromptLogprobs(tuple(tok.tolist()), tuple(ranks.tolist()), top)


def _step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    # A fixed odd multiplier spreads (seed, step) pairs over the 64-bit seed space without collisions
    # for any realistic step count.
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + step) % (1 << 63))
    return g


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities [V] after temperature, top-k and top-p (nucleus: the smallest set of most likely
    tokens whose mass reaches top_p; the token that crosses the threshold is kept)."""
    scaled = logits / p.temperature
    if p.top_k and p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    history: Sequence[Sequence[int]] | None,
                    prompts: Sequence[Sequence[int] | torch.Tensor] | None = None) -> torch.Tensor:
    """The penalties on the rows that ask for them, in place, on the logits' device, in vLLM's order:
    the repetition penalty over the prompt's tokens (`prompts[b]`) and the generated ones (`history[b]`),
    then OpenAI's frequency and presence penalties over each row's counts of its generated tokens."""
    rows = [b for b, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    if history is None:
        raise ValueError("sample(): penalized params need each request's generated tokens (history)")
    if prompts is None and any(params[b].needs_prompt_tokens for b in rows):
        raise ValueError("sample(): repetition_penalty needs each request's prompt tokens (prompts)")
    for b in rows:
        p = params[b]
        if p.needs_prompt_tokens:
            seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            seen[torch.as_tensor(prompts[b], dtype=torch.long).to(logits.device)] = True
            if history[b]:
                seen[torch.as_tensor(list(history[b]), dtype=torch.long, device=logits.device)] = True
            row = logits[b]
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            logits[b] = torch.where(seen, penalized, row)
        if not history[b] or (p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
            continue
        ids = torch.as_tensor(list(history[b]), dtype=torch.long, device=logits.device)
        counts = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits[b] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
           history: Sequence[Sequence[int]] | None = None,
           prompts: Sequence[Sequence[int] | torch.Tensor] | None = None) -> list[tuple[int, float | None]]:
    """Choose one token per row of logits [B, V] (fp32). `steps[b]` is how many tokens request b has
    already generated; `history[b]` those tokens (needed only for penalized rows); `prompts[b]` its prompt
    tokens, any order, repeats allowed (only for repetition_penalty). Returns (token,
    logprob or None); the logprob is of the model's distribution (log-softmax of the raw logits), not of
    the penalized, temperature/top-p-filtered one."""
    logits = logits.float()
    want_lp = any(p.logprobs for p in params)
    # The logprob is of the model's distribution, before min_tokens masks the stop tokens.
    logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None
    masked = [b for b, p in enumerate(params) if p.masks_stops(steps[b])]
    if masked or any(p.penalized for p in params):
        logits = logits.clone()
        for b in masked:
            logits[b, list(params[b].stop_token_ids)] = float("-inf")
        apply_penalties(logits, params, history, prompts)
    greedy_ids = torch.argmax(logits, dim=-1)  # ties go to the lowest id, matching HF greedy
    out: list[tuple[int, float | None]] = []
    for b, p in enumerate(params):
        if p.greedy:
            token = int(greedy_ids[b])
        else:
            if p.seed is None:
                raise ValueError("sample() needs resolved params (a concrete seed); call params.resolved()")
            probs = _filtered_probs(logits[b], p)
            gen = _step_generator(p.seed, steps[b], logits.device)
            token = int(torch.multinomial(probs, 1, generator=gen))
        lp = float(logprobs[b, token]) if p.logprobs else None
        out.append((token, lp))
    return out


def top_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[tuple[tuple[int, float], ...] | None]:
    """Per row, the `top_logprobs` most likely tokens of the model's distribution (log-softmax of the raw
    logits, as the sampled token's logprob) with their logprobs; None for rows that did not ask."""
    if logits.dim() == 1:
        logits = logits[None]
    rows = [b for b, p in enumerate(params) if p.top_logprobs]
    out: list[tuple[tuple[int, float], ...] | None] = [None] * len(params)
    if not rows:
        return out
    k = max(params[b].top_logprobs for b in rows)
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    values, ids = torch.topk(lp, k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    for i, b in enumerate(rows):
        n = params[b].top_logprobs
        out[b] = tuple(zip(ids[i][:n], values[i][:n]))
    return out
