"""An `EngineClient` that replays scripted token sequences instead of running a model.

Random-weight models never emit a well-formed harmony tool call, so the tool-call paths of the router
(and a demo of them) need an engine whose output we choose. It honours max_tokens and stop ids the way
the real engine does, and records prompts and aborts so tests can assert on them.
"""

from __future__ import annotations

import array
import asyncio
import itertools
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterable, Union

from kvrelay.engine.sampling_params import PromptLogprobs, SamplingParams, TokenOutput
from kvrelay.router.engine_client import flatten

Script = Union[Iterable[int], Callable[[list[int]], Iterable[int]]]


def made_up_prompt_logprobs(prompt: list[int], k: int) -> PromptLogprobs:
    """Prompt logprobs a test can predict: token i+1 has logprob -0.25 (i + 1) and rank i % 3 + 1; its
    alternatives are the ids after it, at -0.1, -0.2, ..."""
    n = len(prompt) - 1
    top = tuple(tuple((prompt[i + 1] + j + 1, -0.1 * (j + 1)) for j in range(k)) for i in range(n)) if k else None
    return PromptLogprobs(tuple(-0.25 * (i + 1) for i in range(n)), tuple(i % 3 + 1 for i in range(n)), top)


@dataclass
class ScriptedEngineClient:
    """`scripts` are used in order, one per request; the last one repeats. A script is a token
    iterable (may be endless) or a function of the prompt ids returning one."""

    scripts: list[Script]
    model_name: str = "scripted"
    max_context: int = 8192
    vocab_size: int = 201088
    token_delay_s: float = 0.0
    batch: int = 1  # tokens per generate_batches list
    prompts: list[list[int]] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    # What the first token carries when a request asks for prompt logprobs.
    prompt_scorer: Callable[[list[int], int], PromptLogprobs] = made_up_prompt_logprobs

    def _tokens(self, prompt_ids: list[int]) -> Iterable[int]:
        script = self.scripts[min(len(self.prompts) - 1, len(self.scripts) - 1)]
        return script(prompt_ids) if callable(script) else script

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenOutput]:
        return flatten(self.generate_batches(request_id, prompt_ids, params))

    async def generate_batches(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[TokenOutput]]:
        """`batch` tokens per list: what a real engine hands over when the router runs behind."""
        # As the router hands them over: an array('i') (a big body's ids) stays one, as a real engine
        # client keeps it up to the worker call (router/engine_client.engine_prompt).
        self.prompts.append(prompt_ids if isinstance(prompt_ids, array.array) else list(prompt_ids))
        self.params.append(params)
        stops = set(params.stop_token_ids)
        budget = min(params.max_tokens, self.max_context - len(prompt_ids))
        ready: list[TokenOutput] = []
        for n, token in enumerate(itertools.islice(self._tokens(prompt_ids), budget), start=1):
            if request_id in self.aborted:
                return
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            reason = "stop" if token in stops else ("length" if n == budget else None)
            top = (tuple((int(token) + i, -0.5 - i) for i in range(params.top_logprobs))
                   if params.top_logprobs else None)  # the sampled token first, then made-up runners-up
            plp = (self.prompt_scorer(list(prompt_ids), params.prompt_logprobs)
                   if n == 1 and params.prompt_logprobs is not None else None)
            ready.append(TokenOutput(token_id=int(token), logprob=-0.5 if params.logprobs else None,
                                     finish_reason=reason, top_logprobs=top, prompt_logprobs=plp))
            if reason is not None:
                self.finished.append(request_id)
                yield ready
                return
            if len(ready) >= self.batch:
                yield ready
                ready = []
        if ready:
            yield ready
        # A script shorter than the budget ends like an engine hitting <|endoftext|>-less EOS.
        self.finished.append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
