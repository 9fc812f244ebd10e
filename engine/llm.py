"""LLM: single-process generation with continuous batching over a Runner.

The engine loop is explicit: `add_request` queues, `step` runs one forward round (prefill of newly
admitted prompts as one ragged batch, then one decode step for every request already running) and
returns the tokens it produced, `abort` drops a request. `generate` and `generate_many` are loops over
that. The class is not thread-safe: one thread drives it (the router's in-process client does so from a
dedicated thread and routes the `step` outputs by request id).

Admission reserves, on paper, the pages a request can reach (prompt + max_tokens), so a running request
never runs out of KV mid-generation and no preemption is needed.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Iterator, Sequence

import torch

from kvrelay.engine.config import ModelConfig
from kvrelay.engine.kv_geometry import pages_spanned
from kvrelay.engine.parallel import SINGLE, ParallelContext
from kvrelay.engine.runner import Runner
from kvrelay.engine.sampling import (SamplingParams, TokenOutput, finish_reason_at, prompt_logprobs,
                                     top_logprobs)
from kvrelay.engine.structured import compute_masks, open_constraint, sample_constrained


@dataclass
class _Request:
    req_id: Hashable
    prompt: list[int]
    params: SamplingParams
    pages: int  # full-group pages reserved on paper at admission
    output: list[int] = field(default_factory=list)
    constraint: object | None = None  # engine.structured.Constraint (structured outputs)


class LLM:
    def __init__(
        self,
        model: str | Path | ModelConfig,
        *,
        device: str | torch.device = "cpu",
        quant: str = "bf16",
        dummy: bool = False,
        seed: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        page_size: int = 16,
        kv_tokens: int = 65536,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = 8192,
        weights=None,
        shard: ParallelContext = SINGLE,
    ):
        """`model`: a preset name, a model directory, or a ModelConfig (then `weights` or dummy=True).
        `weights`: any object with WeightSource's `get` (tests pass in-memory tensors).
        `shard`: this process's rank in a TP/EP group; every rank runs the same requests in lockstep."""
        if isinstance(model, ModelConfig):
            cfg = model
            if weights is None:
                from kvrelay.engine.runner import open_model_weights

                if not dummy:
                    raise ValueError("LLM(ModelConfig) needs weights=... or dummy=True")
                weights = open_model_weights(cfg.name, cfg, dummy=True, seed=seed)
            self.runner = Runner(cfg, weights, device=device, dtype=dtype, quant=quant, page_size=page_size,
                                 kv_tokens=kv_tokens, shard=shard)
        elif weights is not None:
            from kvrelay.engine.config import load_model_config

            self.runner = Runner(load_model_config(model), weights, device=device, dtype=dtype, quant=quant,
                                 page_size=page_size, kv_tokens=kv_tokens, shard=shard)
        else:
            self.runner = Runner.load(model, dummy=dummy, seed=seed, device=device, dtype=dtype, quant=quant,
                                      page_size=page_size, kv_tokens=kv_tokens, shard=shard)
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self._total_pages = min(self.runner.free_pages().values())
        self._reserved_pages = 0
        self._waiting: deque[_Request] = deque()
        self._running: dict[Hashable, _Request] = {}
        self._ids = itertools.count()

    @property
    def config(self) -> ModelConfig:
        return self.runner.cfg

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    # ---- engine loop ---------------------------------------------------------------------------
    def _pages_for(self, n_tokens: int) -> int:
        return pages_spanned(n_tokens, self.runner.page_size)

    def add_request(self, req_id: Hashable, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids outside [0, {self.config.vocab_size}): {bad[:5]}")
        if len(prompt) >= self.max_context:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_context is {self.max_context}")
        if req_id in self._running or any(r.req_id == req_id for r in self._waiting):
            raise ValueError(f"request {req_id!r} already exists")
        # The last generated token is never fed back, so the KV holds at most prompt + max_tokens - 1.
        reach = min(len(prompt) + params.max_tokens - 1, self.max_context)
        pages = self._pages_for(reach)
        if pages > self._total_pages:
            raise ValueError(f"request needs {pages} KV pages (prompt {len(prompt)} + max_tokens "
                             f"{params.max_tokens}); the pool has {self._total_pages}")
        self._waiting.append(_Request(req_id, prompt, params.resolved(), pages))

    def abort(self, req_id: Hashable) -> bool:
        for r in list(self._waiting):
            if r.req_id == req_id:
                self._waiting.remove(r)
                return True
        req = self._running.get(req_id)
        if req is None:
            return False
        self._finish(req)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def _finish(self, req: _Request) -> None:
        self._running.pop(req.req_id, None)
        self.runner.free(req.req_id)
        self._reserved_pages -= req.pages

    def _admit(self) -> list[_Request]:
        admitted, tokens = [], 0
        while self._waiting and len(self._running) + len(admitted) < self.max_num_seqs:
            req = self._waiting[0]
            fits_pages = self._reserved_pages + req.pages <= self._total_pages
            fits_batch = not admitted or tokens + len(req.prompt) <= self.max_prefill_tokens
            if not (fits_pages and fits_batch):
                break
            self._waiting.popleft()
            self._reserved_pages += req.pages
            admitted.append(req)
            tokens += len(req.prompt)
        return admitted

    def _emit(self, reqs: list[_Request], logits: torch.Tensor,
              plps: Sequence | None = None) -> list[tuple[Hashable, TokenOutput]]:
        for r in reqs:
            if r.params.structured is not None and r.constraint is None:
                r.constraint = open_constraint(r.params.structured)
        masks = compute_masks([r.constraint for r in reqs])
        picks = sample_constrained(self.runner.sample, logits, [r.params for r in reqs], [len(r.output) for r in reqs],
                                   [r.output for r in reqs], [r.prompt for r in reqs], masks=masks)
        tops = top_logprobs(logits, [r.params for r in reqs])
        outs = []
        for i, (req, (token, logprob), top) in enumerate(zip(reqs, picks, tops)):
            req.output.append(token)
            if req.constraint is not None:
                req.constraint.feed(token)
            reason = finish_reason_at(token, len(req.output), req.params, len(req.prompt) + len(req.output),
                                      self.max_context)
            outs.append((req.req_id, TokenOutput(token, logprob, reason, top, plps[i] if plps else None)))
            if reason is not None:
                self._finish(req)
        return outs

    def step(self) -> list[tuple[Hashable, TokenOutput]]:
        """One round: prefill newly admitted prompts, then one decode step for the others."""
        decoding = list(self._running.values())
        outs: list[tuple[Hashable, TokenOutput]] = []
        admitted = self._admit()
        if admitted:
            for r in admitted:
                self._running[r.req_id] = r
            every = [i for i, r in enumerate(admitted) if r.params.prompt_logprobs is not None]
            try:
                if every:  # every position's logits of those prompts (their own logprobs)
                    rows = self.runner.forward_mixed([(r.req_id, r.prompt) for r in admitted], all_positions=every)
                else:
                    logits = self.runner.prefill_batch([(r.req_id, r.prompt) for r in admitted])
            except BaseException:
                for r in admitted:
                    self._finish(r)
                raise
            plps = None
            if every:
                plps, last, at = [], [], 0
                for i, r in enumerate(admitted):
                    n = len(r.prompt) if i in every else 1
                    plps.append(prompt_logprobs(rows[at: at + n], r.prompt, 0, r.params.prompt_logprobs)
                                if i in every else None)
                    at += n
                    last.append(at - 1)
                logits = rows[last]
            outs += self._emit(admitted, logits, plps)
        if decoding:
            logits = self.runner.decode([r.req_id for r in decoding], [r.output[-1] for r in decoding])
            outs += self._emit(decoding, logits)
        return outs

    # ---- convenience loops ---------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams()) -> Iterator[TokenOutput]:
        """Stream one request's tokens; the last one carries finish_reason. Closing the iterator early
        aborts the request."""
        req_id = ("generate", next(self._ids))
        self.add_request(req_id, prompt_ids, params)
        try:
            while True:
                for rid, out in self.step():
                    if rid == req_id:
                        yield out
                        if out.finish_reason is not None:
                            return
        finally:
            self.abort(req_id)

    def generate_many(self, prompts: Sequence[Sequence[int]],
                      params: SamplingParams | Sequence[SamplingParams] = SamplingParams()) -> list[list[int]]:
        """Generate for every prompt with continuous batching; returns each prompt's generated ids."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError("generate_many: one SamplingParams per prompt (or a single one)")
        ids = [("many", next(self._ids)) for _ in prompts]
        results: dict[Hashable, list[int]] = {i: [] for i in ids}
        for i, p, sp in zip(ids, prompts, plist):
            self.add_request(i, p, sp)
        try:
            pending = set(ids)
            while pending:
                for rid, out in self.step():
                    if rid in results:
                        results[rid].append(out.token_id)
                        if out.finish_reason is not None:
                            pending.discard(rid)
        finally:
            for i in ids:
                self.abort(i)
        return [results[i] for i in ids]
