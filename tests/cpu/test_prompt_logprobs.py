"""Prompt logprobs (echo / vLLM's prompt_logprobs) in the engine: each prompt token's logprob given the
tokens before it, its rank and the most likely alternatives, computed by the serving forward (chunked
prefill's all-position logits, log-softmax in fp32, only the needed numbers kept) and compared with a
float64 log-softmax of Runner.score's logits over the whole prompt."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.sampling import PromptLogprobs, SamplingParams, prompt_logprobs

PROMPT = [5, 17, 300, 42, 7, 17, 99, 1, 250, 64, 3, 17, 8]


def reference(runner, prompt: list[int], k: int) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    """float64 log-softmax of every position's logits: (token logprobs, ranks, top-k ids, top-k logprobs)
    for prompt tokens 1..n-1."""
    lp = torch.log_softmax(runner.score(prompt).double(), dim=-1)[:-1]
    tgt = torch.tensor(prompt[1:])
    tok = lp.gather(1, tgt[:, None])[:, 0]
    ranks = ((lp > tok[:, None]).sum(-1) + 1).tolist()
    values, ids = torch.topk(lp, k, dim=-1)
    return tok.tolist(), ranks, ids.tolist(), values.tolist()


def check(got: PromptLogprobs, runner, prompt: list[int], k: int, tol: float = 2e-3) -> None:
    lps, ranks, ids, values = reference(runner, prompt, k)
    assert len(got.token_logprobs) == len(prompt) - 1
    assert list(got.token_logprobs) == pytest.approx(lps, abs=tol)
    assert list(got.ranks) == ranks
    if k:
        assert [[t for t, _ in row] for row in got.top] == ids
        assert [v for row in got.top for _, v in row] == pytest.approx([v for row in values for v in row], abs=tol)
    else:
        assert got.top is None


def test_chunks_join_to_the_whole_prompt() -> None:
    from kvrelay.engine.runner import Runner

    runner = Runner.load("tiny", dummy=True, seed=0, page_size=4, kv_tokens=512)
    whole = runner.prefill("a", PROMPT, all_logits=True)
    runner.free("a")
    parts, last = [], None
    for s in range(0, len(PROMPT), 5):  # as the prefill worker runs it: chunk after chunk
        piece = PROMPT[s:s + 5]
        out = runner.prefill("b", piece, all_logits=True) if s == 0 else runner.extend("b", piece, all_logits=True)
        parts.append(prompt_logprobs(out, PROMPT, s, 3))
        last = out[-1]
    runner.free("b")
    joined = PromptLogprobs.join(parts)
    check(joined, runner, PROMPT, 3)
    assert torch.allclose(last, whole[-1], atol=1e-3)  # the sampling row is the last position's
    # mixed forward: a decode-like item and an all-positions item side by side
    runner.prefill("c", [1, 2, 3])
    rows = runner.forward_mixed([("c", [4]), ("d", PROMPT)], all_positions={1})
    assert rows.shape[0] == 1 + len(PROMPT)
    check(prompt_logprobs(rows[1:], PROMPT, 0, 2), runner, PROMPT, 2)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_in_process_engine_returns_them_with_the_first_token(k: int) -> None:
    from kvrelay.engine.llm import LLM

    llm = LLM("tiny", dummy=True, seed=0, page_size=16, kv_tokens=2048)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=k)
    outs = list(llm.generate(PROMPT, params))
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    check(outs[0].prompt_logprobs, llm.runner, PROMPT, k)
    plain = [o.token_id for o in llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0.0))]
    assert [o.token_id for o in outs] == plain  # asking for them changes nothing else
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
