"""kernels/decode_rotary.py on the H200: the split-KV decode that also does the layer's rotary and KV write
(KVRELAY_DECODE_ROTARY=1) against kernels.fused.rotary_kv_write + triton_attention.sink_decode at gpt-oss's
attention shape, and the model's graph-replayed decode with it on against off."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import decode_rotary_case, rel_err
from tiny_models import attn64_cfg, dummy_weights

pytestmark = pytest.mark.gpu


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return torch.device("cuda")


@pytest.mark.parametrize("window", [None, 128])
def test_decode_rotary_equals_rotary_write_then_split_decode(window):
    from kvrelay.kernels import fused, triton_attention as ta
    from kvrelay.kernels.decode_rotary import sink_decode_rotary

    dev = _cuda()
    g = torch.Generator().manual_seed(5)
    nq, nkv, d, page, lens = 64, 8, 64, 16, [1, 17, 300, 8192]
    c = decode_rotary_case(lens, nq, nkv, d, page, dev, g)  # the new tokens' slots hold 1e4 before the write
    b, pages, offs, qkv, cos, sin, sinks = c.b, c.pages, c.offs, c.qkv, c.cos, c.sin, c.sinks
    splits = ta.default_num_splits(len(lens), nkv, window=window)
    args = (b.kv_indptr, b.kv_indices, b.kv_last_page_len)
    kw = dict(sm_scale=0.125, window=window, num_splits=splits)
    pa, pb = b.pool.clone(), b.pool.clone()
    q = fused.rotary_kv_write(qkv, cos, sin, nq, nkv, d, pa, pages, offs)
    want = ta.sink_decode(q, pa, sinks, *args, **kw)
    got = sink_decode_rotary(qkv, cos, sin, nq, nkv, pb, pages, offs, sinks, *args, **kw)
    # the same fp32 rotary expressions and roundings as rotary_kv_write, the same split loop: bit for bit
    assert torch.equal(pb, pa)
    assert torch.equal(got, want), rel_err(got, want)
    assert rel_err(ta.sink_decode(q, b.pool.clone(), sinks, *args, **kw), want) > 0.1  # stale slots matter


def test_model_decode_with_rotary_in_attention_equals_without(monkeypatch):
    from kvrelay.engine.runner import Runner

    dev = _cuda()
    cfg = attn64_cfg()
    w = dummy_weights(cfg, seed=11)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 150)]
    feed = torch.randint(0, cfg.vocab_size, (6, 2), generator=g).tolist()
    logits = {}
    for on in (False, True):
        monkeypatch.setenv("KVRELAY_DECODE_ROTARY", "1" if on else "0")
        r = Runner(cfg, w, device=dev, page_size=16, kv_tokens=4096, cuda_graph_batch_sizes=(1, 2, 4))
        steps = [r.prefill_batch([(i, p) for i, p in enumerate(prompts)])]
        steps += [r.decode([0, 1], toks) for toks in feed]
        logits[on] = torch.stack([s.float() for s in steps])
    assert torch.equal(logits[True], logits[False])
