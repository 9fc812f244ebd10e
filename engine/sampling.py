"""Sampling parameters and the token sampler.

Seeded sampling draws step n of a request from a generator seeded with (seed, n) rather than one
generator advanced step by step: the draw then depends only on the request and the step, so a prefill
worker (step 0) and a decode worker (steps 1..) in different processes reproduce a single-process run.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

FINISH_REASONS = (None, "stop", "length")
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None = random
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    min_tokens: int = 0  # the stop tokens cannot be sampled before this many tokens (vLLM's min_tokens)
    # OpenAI's penalties over the tokens generated so far: logit -= frequency x count + presence x (count > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (vLLM's)
    top_logprobs: int = 0  # with logprobs: also the most likely tokens and their logprobs, up to 20
    # vLLM's/HF's multiplicative penalty over every token of prompt + output: a seen token's logit is
    # divided by it when positive, multiplied when negative (1 = off).
    repetition_penalty: float = 1.0
    # vLLM's prompt_logprobs: each prompt token's logprob given the tokens before it (all but the first),
    # with this many most likely alternatives; None = off. Computed by the prefill forward, once.
    prompt_logprobs: int | None = None
    # Structured outputs (engine.structured.StructuredOutput): the harmony reply's constrained message;
    # its state is rebuilt from the tokens generated so far wherever the request is sampled.
    structured: object | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """The choice depends on the tokens generated so far (the sampler needs them)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_prompt_tokens(self) -> bool:
        """The choice depends on which tokens the prompt holds (repetition_penalty)."""
        return self.repetition_penalty != 1.0

    def resolved(self) -> "SamplingParams":
        """A copy with a concrete seed, so every later step of the request draws from a fixed stream."""
        if self.seed is not None or self.greedy:
            return self
        return dataclasses.replace(self, seed=random.getrandbits(63))

    def masks_stops(self, step: int) -> bool:
        """The token after `step` generated ones must not be a stop token (min_tokens not reached)."""
        return step < self.min_tokens and bool(self.stop_token_ids)


@dataclass(frozen=True)
class TokenOutput:
    token_id: int
    logprob: float | None
    finish_reason: str | None
    # (token, logprob) of the most likely tokens, most likely first, when the request asked for them
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    # On a request's first token only, when it asked for them (SamplingParams.prompt_logprobs)
    prompt_logprobs: "PromptLogprobs | None" = None


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of prompt tokens 1..n-1, each given the tokens before it (token 0 has none): the model's
    log-softmax in fp32, the token's rank in it (1 = most likely, vLLM's), and per position the `k` most
    likely tokens (None when k = 0). Only these travel: never the [n, vocab] logits."""

    token_logprobs: tuple[float, ...] = ()
    ranks: tuple[int, ...] = ()
    top: tuple[tuple[tuple[int, float], ...], ...] | None = None

    @staticmethod
    def join(parts: Sequence["PromptLogprobs"]) -> "PromptLogprobs":
        """One prompt's chunks, in order, as one."""
        tops = [p.top for p in parts]
        return PromptLogprobs(tuple(x for p in parts for x in p.token_logprobs),
                              tuple(x for p in parts for x in p.ranks),
                              None if not parts or any(t is None for t in tops) else tuple(x for t in tops for x in t))


# Rows of all-position logits a forward may return for prompt logprobs: [rows, vocab] fp32 and its
# log-softmax are what the forward's activations must leave room for (gpt-oss: 2 x 412 MB at 512).
PROMPT_LOGPROB_CHUNK = 512


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


def token_set(ids: Sequence[int]) -> tuple[int, ...]:
    """The distinct token ids of a prompt, sorted: what a decode worker needs of it for the repetition
    penalty (a few KB where the prompt may be 100k tokens)."""
    return tuple(sorted(set(int(t) for t in ids)))


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


def finish_reason(token: int, n_generated: int, params: SamplingParams) -> str | None:
    """Why a request ends after emitting `token` as its n_generated-th token (1-based), if it does."""
    if token in params.stop_token_ids:
        return "stop"
    if n_generated >= params.max_tokens:
        return "length"
    return None


def context_full(total_tokens: int, max_context: int) -> bool:
    """A sequence of `total_tokens` (prompt + output) has no position left for another token."""
    return total_tokens >= max_context


def finish_reason_at(token: int, n_generated: int, params: SamplingParams, total_tokens: int,
                     max_context: int) -> str | None:
    """`finish_reason`, plus the context rule: a request whose prompt and output, `token` included
    (`total_tokens`), fill `max_context` ends here with "length". The one rule of the prefill worker,
    the colocated worker, the decode scheduler and the in-process LLM."""
    reason = finish_reason(token, n_generated, params)
    if reason is None and context_full(total_tokens, max_context):
        return "length"
    return reason
