"""The sampling parameters and the plain records of a request's tokens (SamplingParams, TokenOutput,
PromptLogprobs), what a structured output asks for (StructuredOutput, Body: engine/structured.py enforces it)
and the rule that ends a request: torch-free, so the router (which builds and reads them)
imports no torch. engine/sampling.py, the sampler, re-exports them; the engine imports them from there.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

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
    # Structured outputs (StructuredOutput, below): the harmony reply's constrained message;
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


def token_set(ids: Sequence[int]) -> tuple[int, ...]:
    """The distinct token ids of a prompt, sorted: what a decode worker needs of it for the repetition
    penalty (a few KB where the prompt may be 100k tokens)."""
    return tuple(sorted(set(int(t) for t in ids)))


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


@dataclass(frozen=True)
class Body:
    """One constrained message the reply may end with: its header tokens (after `<|start|>assistant`,
    through `<|message|>`), the JSON Schema of its body (canonical text), and its terminator."""

    header: tuple[int, ...]
    schema: str
    end: int


@dataclass(frozen=True)
class StructuredOutput:
    bodies: tuple[Body, ...]
    allow_analysis: bool = True
    analysis_header: tuple[int, ...] = ()  # <|channel|>analysis<|message|>
    restart: tuple[int, ...] = ()  # <|start|>assistant: what follows an analysis message's <|end|>
    max_reasoning_tokens: int | None = None  # analysis body tokens in all; then <|end|> is forced

    def __post_init__(self) -> None:
        if not self.bodies:
            raise ValueError("StructuredOutput needs at least one constrained body")
        if self.allow_analysis and not (self.analysis_header and self.restart):
            raise ValueError("allow_analysis needs analysis_header and restart tokens")
        if self.max_reasoning_tokens is not None and self.max_reasoning_tokens < 0:
            raise ValueError(f"max_reasoning_tokens must be >= 0, got {self.max_reasoning_tokens}")
