"""An `EngineClient` that replays scripted token sequences instead of running a model.

Random-weight models never emit a well-formed harmony tool call, so the tool-call paths of the router
(and a demo of them) need an engine whose output we choose. It honours max_tokens and stop ids the way
the real engine does, and records prompts and aborts so tests can assert on them.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterable, Union

from kvrelay.engine.sampling import SamplingParams, TokenOutput
from kvrelay.router.engine_client import flatten

Script = Union[Iterable[int], Callable[[list[int]], Iterable[int]]]


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

    def _tokens(self, prompt_ids: list[int]) -> Iterable[int]:
        script = self.scripts[min(len(self.prompts) - 1, len(self.scripts) - 1)]
        return script(prompt_ids) if callable(script) else script

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenOutput]:
        return flatten(self.generate_batches(request_id, prompt_ids, params))

    async def generate_batches(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[TokenOutput]]:
        """`batch` tokens per list: what a real engine hands over when the router runs behind."""
        self.prompts.append(list(prompt_ids))
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
            ready.append(TokenOutput(token_id=int(token), logprob=-0.5 if params.logprobs else None,
                                     finish_reason=reason, top_logprobs=top))
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
