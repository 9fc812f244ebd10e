"""Checks shared by the split and colocated cluster tests: completions echo with prompt logprobs (what
lm-eval's loglikelihood tasks send) against a float64 log-softmax of Runner.score on the same tiny model,
and repetition_penalty against single-process LLM.generate."""

from __future__ import annotations

import httpx
import pytest
import torch

from kvrelay.engine.sampling import SamplingParams
from kvrelay.router import harmony


def _reference_logprobs(reference, prompt: list[int]) -> torch.Tensor:
    return torch.log_softmax(reference.runner.score(prompt).double(), dim=-1)


def check_echo_scoring(server, model: str, reference, prompts: list[list[int]]) -> None:
    """echo, logprobs 2, max_tokens 0, the prompts as one batch: each prompt token's logprob (all but the
    first) and its alternatives equal the reference; then echo with 4 generated tokens: the prompt's
    logprobs, then the generated ones equal to LLM.generate's."""
    body = {"model": model, "prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 0}
    r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 0,
                            "total_tokens": sum(map(len, prompts)), "prompt_tokens_details": {"cached_tokens": 0}}
    for choice in out["choices"]:
        prompt = prompts[choice["index"]]
        lp = _reference_logprobs(reference, prompt)
        got = choice["logprobs"]
        assert choice["text"] == harmony.decode_tokens(prompt) and choice["finish_reason"] == "length"
        assert got["tokens"] == [harmony.decode_tokens([t]) for t in prompt]
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        want = [float(lp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
        assert got["token_logprobs"][1:] == pytest.approx(want, abs=2e-3)
        for i, top in enumerate(got["top_logprobs"][1:]):
            alts = torch.topk(lp[i], 2).indices.tolist()
            names = list(dict.fromkeys([harmony.decode_tokens([prompt[i + 1]])] + [harmony.decode_tokens([t]) for t in alts]))
            assert list(top) == names
    prompt = prompts[0]
    body = {"model": model, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    gen = list(reference.generate(prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=True)))
    assert choice["token_ids"] == [o.token_id for o in gen]
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == len(prompt) + 4
    lp = _reference_logprobs(reference, prompt)
    assert lps[1:len(prompt)] == pytest.approx([float(lp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)], abs=2e-3)
    assert lps[len(prompt):] == pytest.approx([o.logprob for o in gen], abs=1e-4)
    assert choice["text"] == harmony.decode_tokens(prompt) + harmony.decode_tokens([o.token_id for o in gen])


def check_repetition_penalty(server, model: str, reference, prompt: list[int]) -> None:
    """Greedy with repetition_penalty 2: every step depends on the prompt's tokens (which the decode
    worker gets as a set) and the output so far; equal to LLM.generate, unlike the plain run."""
    params = SamplingParams(max_tokens=30, temperature=0, repetition_penalty=2.0)
    want = [o.token_id for o in reference.generate(prompt, params)]
    plain = [o.token_id for o in reference.generate(prompt, SamplingParams(max_tokens=30, temperature=0))]
    body = {"model": model, "prompt": prompt, "max_tokens": 30, "temperature": 0, "repetition_penalty": 2.0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want and want != plain
