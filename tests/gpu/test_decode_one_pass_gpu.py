"""The one-pass decode (kernels/decode_rotary.py `final=True`; KVRELAY_DECODE_ONE_PASS=1 decodes sliding-window
layers in one split whose program applies the sink and writes the output projection's FP8 input) on the H200:
at gpt-oss's attention shape, bit for bit the one-split decode merged and quantised by the merge kernels; and the
FP8 model's graph-replayed decode with it on, within bf16 noise of the two-split decode + merge it replaces."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import make_paged_batch, rel_err
from tiny_models import attn64_cfg, dummy_weights

pytestmark = pytest.mark.gpu


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return torch.device("cuda")


@pytest.mark.parametrize("window", [None, 128])
def test_one_pass_equals_one_split_decode_then_merge(window):
    from kvrelay.kernels import fused, triton_attention as ta
    from kvrelay.kernels.decode_rotary import sink_decode_rotary
    from kvrelay.kernels.reference import rotary_cos_sin, yarn_inv_freq

    dev = _cuda()
    g = torch.Generator().manual_seed(7)
    nq, nkv, d, page, lens = 64, 8, 64, 16, [1, 17, 300, 8192, 129]  # 5 rows: 3 M padding rows to 8
    b = make_paged_batch(lens, [1] * len(lens), nkv, d, page, dev, gen=g)
    pages = torch.tensor([int(b.kv_indices[int(b.kv_indptr[s]) + (n - 1) // page]) for s, n in enumerate(lens)],
                         dtype=torch.long, device=dev)
    offs = torch.tensor([(n - 1) % page for n in lens], dtype=torch.long, device=dev)
    b.pool[pages, :, offs] = 1e4  # the new tokens' slots before the write
    qkv = torch.randn(len(lens), (nq + 2 * nkv) * d, generator=g).to(torch.bfloat16).to(dev)
    inv, conc = yarn_inv_freq(d, 150000.0, 32.0, 4096, beta_fast=32.0, beta_slow=1.0)
    cos, sin = (t.to(dev) for t in rotary_cos_sin(torch.tensor(lens) - 1, inv, conc, torch.bfloat16))
    sinks = (torch.randn(nq, generator=g) + 3).float().to(dev)
    args = (b.kv_indptr, b.kv_indices, b.kv_last_page_len)
    kw = dict(sm_scale=0.125, window=window, num_splits=1)
    pa, pb = b.pool.clone(), b.pool.clone()
    q = fused.rotary_kv_write(qkv, cos, sin, nq, nkv, d, pa, pages, offs)
    pending = ta.sink_decode(q, pa, sinks, *args, **kw, merge=False)
    want = pending.apply()
    wq, ws = pending.quantize(nq * d)
    got = sink_decode_rotary(qkv, cos, sin, nq, nkv, pb, pages, offs, sinks, *args, **kw, merge=False, final=True,
                             quant_k=nq * d)
    assert torch.equal(pb, pa)
    assert got.q8 is not None
    assert torch.equal(got.apply(), want), rel_err(got.apply(), want)
    gq, gs = got.quantize(nq * d)
    assert torch.equal(gq.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(gs, ws)


def test_fp8_model_decode_in_one_pass_is_close_to_the_split_decode(monkeypatch):
    from kvrelay.engine.runner import Runner
    from kvrelay.kernels import decode_rotary

    dev = _cuda()
    cfg = attn64_cfg()
    w = dummy_weights(cfg, seed=13)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 150)]  # 150 > window
    feed = torch.randint(0, cfg.vocab_size, (6, 2), generator=g).tolist()
    finals = []
    orig = decode_rotary.sink_decode_rotary

    def counted(*a, **k):
        finals.append(bool(k.get("final")))
        return orig(*a, **k)

    monkeypatch.setattr(decode_rotary, "sink_decode_rotary", counted)
    logits = {}
    for on in (False, True):
        monkeypatch.setenv("KVRELAY_DECODE_ONE_PASS", "1" if on else "0")
        finals.clear()
        r = Runner(cfg, w, device=dev, quant="fp8-block128", page_size=16, kv_tokens=4096,
                   cuda_graph_batch_sizes=(1, 2, 4))
        steps = [r.prefill_batch([(i, p) for i, p in enumerate(prompts)])]
        steps += [r.decode([0, 1], toks) for toks in feed]
        logits[on] = torch.stack([s.float() for s in steps])
        assert any(finals) == on  # captured (and eager) decode steps took the one-pass launch only when on
    # one split instead of two over the 128-key window changes only the fp32 order of the softmax's sums
    for step in range(len(feed) + 1):
        assert rel_err(logits[True][step], logits[False][step]) < 2e-2, step
