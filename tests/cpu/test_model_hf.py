"""Our gpt-oss forward against transformers' GptOssForCausalLM (eager attention), on tiny random configs.

The HF model is saved with save_pretrained (bf16 safetensors) and read back through engine.weights, so
the name mapping, the q/k/v fusion and the expert transposition are exercised too. Weights are drawn with
unit-scale activations (not HF's 0.02 init) so greedy margins are wide and a token mismatch means a bug,
not a bf16 coin flip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import transformers  # noqa: E402  (test dependency)

from kvrelay.engine.config import load_model_config  # noqa: E402
from kvrelay.engine.runner import Runner  # noqa: E402
from kvrelay.engine.weights import open_weights  # noqa: E402


pytestmark = pytest.mark.usefixtures("model_single_thread")

@dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    window: int
    layers: int
    vocab: int
    inter: int
    orig_ctx: int = 4096
    beta_fast: float = 32.0
    theta: float = 150000.0


CASES = [
    Case("gqa2-top2-w4", hidden=64, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2, window=4,
         layers=2, vocab=160, inter=48),
    Case("mqa-top3-w7", hidden=96, heads=6, kv_heads=1, head_dim=24, experts=8, top_k=3, window=7,
         layers=3, vocab=256, inter=64),
    # A short YaRN original context (beta_fast lowered so the ramp stays inside [0, head_dim/2]):
    # positions past 32 use interpolated frequencies, and the long prompts here reach beyond 32.
    Case("yarn-short-w6", hidden=64, heads=4, kv_heads=4, head_dim=32, experts=6, top_k=4, window=6,
         layers=4, vocab=200, inter=40, orig_ctx=32, beta_fast=4.0, theta=10000.0),
]


def _hf_config(c: Case):
    return transformers.GptOssConfig(
        num_hidden_layers=c.layers, num_local_experts=c.experts, num_experts_per_tok=c.top_k,
        vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.inter, head_dim=c.head_dim,
        num_attention_heads=c.heads, num_key_value_heads=c.kv_heads, sliding_window=c.window,
        max_position_embeddings=c.orig_ctx * 32,
        rope_parameters={"rope_type": "yarn", "rope_theta": c.theta, "factor": 32.0, "beta_fast": c.beta_fast,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": c.orig_ctx},
        attn_implementation="eager", pad_token_id=None, eos_token_id=None, bos_token_id=None,
    )


def _randomise(model, seed: int) -> None:
    """Unit-scale weights: each linear's std 1/sqrt(fan_in), so activations stay O(1) through the
    layers; norms near 1; biases and sinks O(0.1..1). Rounded to bf16 so both sides hold equal values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                v = 1 + 0.2 * torch.randn(shape, generator=g)
            elif name.endswith("sinks"):
                v = torch.randn(shape, generator=g)
            elif name.endswith("bias"):
                v = 0.2 * torch.randn(shape, generator=g)
            elif name == "model.embed_tokens.weight":
                v = torch.randn(shape, generator=g)
            elif name.endswith("gate_up_proj") or name.endswith("down_proj"):
                v = torch.randn(shape, generator=g) / math.sqrt(shape[1])  # HF experts are [E, in, out]
            else:
                v = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
                if name == "lm_head.weight":
                    v = v * 4  # wide logit spread -> clear greedy margins
                if name.endswith("router.weight"):
                    v = v * 4  # well-separated expert choices, so bf16 noise rarely flips one
            p.copy_(v.to(torch.bfloat16).to(p.dtype))


@dataclass
class Pair:
    """One case's checkpoint, with HF and our model loaded lazily per activation dtype."""

    case: Case
    path: object
    _models: dict

    def hf(self, dtype: torch.dtype):
        key = ("hf", dtype)
        if key not in self._models:
            m = transformers.GptOssForCausalLM.from_pretrained(self.path, dtype=dtype, attn_implementation="eager")
            self._models[key] = m.eval()
        return self._models[key]

    def ours(self, dtype: torch.dtype) -> Runner:
        key = ("ours", dtype)
        if key not in self._models:
            cfg = load_model_config(self.path)
            self._models[key] = Runner(cfg, open_weights(self.path, cfg), page_size=4, kv_tokens=4096, dtype=dtype)
        return self._models[key]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def model_pair(request, tmp_path_factory) -> Pair:
    c: Case = request.param
    path = tmp_path_factory.mktemp(c.name)
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(_hf_config(c))
    _randomise(hf, seed=CASES.index(c))
    hf.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return Pair(c, path, {})


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _hf_greedy(hf, prompt: list[int], n_new: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy by full recompute (no HF cache involved), with each step's top-2 logits."""
    ids = list(prompt)
    out, top1, margins = [], [], []
    for _ in range(n_new):
        logits = hf(torch.tensor([ids])).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        top1.append(float(top[0]))
        margins.append(float(top[0] - top[1]))
        out.append(int(torch.argmax(logits)))
        ids.append(out[-1])
    return out, top1, margins


def _our_greedy(runner: Runner, prompt: list[int], n_new: int, sid="s") -> list[int]:
    logits = runner.prefill(sid, prompt)
    out = [int(torch.argmax(logits))]
    while len(out) < n_new:
        out.append(int(torch.argmax(runner.decode([sid], [out[-1]])[0])))
    runner.free(sid)
    return out


def _first_divergence(ours: list[int], ref: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).abs().max() / ref.abs().max())


def _greedy_lengths(c: Case) -> list[int]:
    w = c.window
    return [1, 5, w - 1, w, w + 1, 2 * w + 3]


def test_fp32_logits_match_hf_exactly(model_pair):
    """In fp32 both implementations compute the same math; any real difference (mask off by one, rope
    layout, expert row order, sink scaling) shows up orders of magnitude above this bound."""
    c = model_pair.case
    prompt = _prompt(3 * c.window + 5, c.vocab, seed=1)
    with torch.inference_mode():
        ref = model_pair.hf(torch.float32)(torch.tensor([prompt])).logits[0].float()
    rel = _rel(model_pair.ours(torch.float32).score(prompt), ref)
    print(f"[{c.name}] fp32 max relative logit error vs HF: {rel:.2e}")
    assert rel < 1e-5


def test_bf16_logits_as_close_to_fp32_as_hf_bf16(model_pair):
    """bf16 rounding makes both implementations drift from the fp32 result; ours (fp32 softmax) must
    drift no more than HF eager's own bf16 path does."""
    c = model_pair.case
    prompt = _prompt(3 * c.window + 5, c.vocab, seed=1)
    with torch.inference_mode():
        truth = model_pair.hf(torch.float32)(torch.tensor([prompt])).logits[0].float()
        hf16 = model_pair.hf(torch.bfloat16)(torch.tensor([prompt])).logits[0].float()
    ours = model_pair.ours(torch.bfloat16).score(prompt)
    ours_err, hf_err = _rel(ours, truth), _rel(hf16, truth)
    print(f"[{c.name}] bf16 max relative logit error vs fp32: ours {ours_err:.2e}, HF {hf_err:.2e}; "
          f"ours vs HF bf16 {_rel(ours, hf16):.2e}")
    assert ours_err < 5e-2
    assert ours_err <= 1.25 * hf_err + 1e-3


def test_fp32_greedy_identical_to_hf(model_pair):
    c = model_pair.case
    for i, n in enumerate(_greedy_lengths(c)):
        prompt = _prompt(n, c.vocab, seed=100 + i)
        ref, _, margins = _hf_greedy(model_pair.hf(torch.float32), prompt, 32)
        ours = _our_greedy(model_pair.ours(torch.float32), prompt, 32)
        d = _first_divergence(ours, ref)
        assert d is None or margins[d] < 1e-4, (c.name, n, d, ours, ref)


def test_bf16_greedy_matches_hf_up_to_logit_ties(model_pair):
    """bf16 logits are quantised (1 ulp = 0.0625 at |logit| 8..16), so HF itself often has exact ties.
    A divergence is accepted only where HF's top-2 margin is within 2 ulps of its top logit."""
    c = model_pair.case
    runner = model_pair.ours(torch.bfloat16)
    for i, n in enumerate(_greedy_lengths(c)):
        prompt = _prompt(n, c.vocab, seed=100 + i)
        ref, top1, margins = _hf_greedy(model_pair.hf(torch.bfloat16), prompt, 32)
        ours = _our_greedy(runner, prompt, 32)
        d = _first_divergence(ours, ref)
        if d is not None:
            ulp = 2.0 ** (math.floor(math.log2(abs(top1[d]) or 1.0)) - 7)
            assert margins[d] <= 2 * ulp, (c.name, n, d, margins[d], ulp)
    assert runner.free_pages() == {"full": 1024, "sliding": 1024}


def test_ragged_batch_equals_alone(model_pair):
    c = model_pair.case
    runner = model_pair.ours(torch.bfloat16)
    prompts = [_prompt(n, c.vocab, seed=200 + n) for n in (1, c.window + 1, 3, 2 * c.window + 2)]
    alone = [_our_greedy(runner, p, 8, sid=f"a{i}") for i, p in enumerate(prompts)]
    ids = [f"b{i}" for i in range(len(prompts))]
    logits = runner.prefill_batch(list(zip(ids, prompts)))
    toks = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(7):
        step = runner.decode(ids, [t[-1] for t in toks]).argmax(-1)
        for t, s in zip(toks, step):
            t.append(int(s))
    for i in ids:
        runner.free(i)
    assert toks == alone


def test_prefill_then_decode_equals_recompute(model_pair):
    c = model_pair.case
    runner = model_pair.ours(torch.float32)
    prompt = _prompt(c.window + 2, c.vocab, seed=7)
    extra = _prompt(2 * c.window + 3, c.vocab, seed=8)
    runner.prefill("p", prompt)
    stepwise = torch.stack([runner.decode(["p"], [t])[0] for t in extra])
    runner.free("p")
    full = runner.score(prompt + extra)[len(prompt):]
    assert _rel(stepwise, full) < 1e-5
