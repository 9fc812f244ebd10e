"""kernels/decode_rotary.py on the H200: the split-KV decode that also does the layer's rotary and KV write
(KVRELAY_DECODE_ROTARY=1) against kernels.fused.rotary_kv_write + triton_attention.sink_decode at gpt-oss's
attention shape, and the model's graph-replayed decode with it on against off."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import decode_rotary_case, rel_err
from tiny_models import assert_same_logits, attn64_cfg, decode_logits, dummy_weights, prompts_and_feed

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
    dev = _cuda()
    cfg = attn64_cfg()
    w = dummy_weights(cfg, seed=11)
    prompts, feed = prompts_and_feed(cfg, 3, (7, 150), 6)
    logits = {}
    for on in (False, True):
        monkeypatch.setenv("KVRELAY_DECODE_ROTARY", "1" if on else "0")
        logits[on] = decode_logits(cfg, w, dev, prompts, feed, kv_tokens=4096, cuda_graph_batch_sizes=(1, 2, 4))
    assert_same_logits(logits[True], logits[False], "rotary in the decode kernel")


@pytest.mark.parametrize("lens", [[8192], [1, 17, 8192], [1, 17, 300, 8192, 5, 6, 7, 64]])
@pytest.mark.parametrize("window", [None, 128])
def test_merge_inside_decode_kernel_equals_merge_quant_launch(lens, window):
    # merge_counters: each KV head's last split program merges and quantises its heads' 512 columns, with the
    # merge-quantise launch's own code: bit for bit its output (M-padding rows included), counters left zero.
    from kvrelay.kernels import fused, triton_attention as ta
    from kvrelay.kernels.decode_rotary import MergedQuant, sink_decode_rotary

    dev = _cuda()
    g = torch.Generator().manual_seed(7)
    nq, nkv, d, page = 64, 8, 64, 16
    c = decode_rotary_case(lens, nq, nkv, d, page, dev, g)
    b, pages, offs, qkv, cos, sin, sinks = c.b, c.pages, c.offs, c.qkv, c.cos, c.sin, c.sinks
    splits = ta.default_num_splits(len(lens), nkv, window=window)
    args = (b.kv_indptr, b.kv_indices, b.kv_last_page_len)
    kw = dict(sm_scale=0.125, window=window, num_splits=splits, merge=False)
    pa = b.pool.clone()
    q = fused.rotary_kv_write(qkv, cos, sin, nq, nkv, d, pa, pages, offs)
    wq, ws = ta.sink_decode(q, pa, sinks, *args, **kw).quantize(nq * d)
    cnt = torch.zeros(len(lens) * nkv, dtype=torch.int32, device=dev)
    for _ in range(3):  # the counters reset themselves: the same result each launch
        got = sink_decode_rotary(qkv, cos, sin, nq, nkv, b.pool.clone(), pages, offs, sinks, *args, **kw,
                                 merge_counters=cnt)
        assert isinstance(got, MergedQuant)
        gq, gs = got.quantize(nq * d)
        assert torch.equal(gq.view(torch.uint8), wq.view(torch.uint8))
        assert torch.equal(gs, ws)
        assert not cnt.any()


@pytest.mark.parametrize("quant", ["fp8-block128"])
def test_model_decode_with_merge_in_attention_equals_without(monkeypatch, quant):
    # the FP8 model (its output projection takes the merged heads quantised): graph-replayed and eager decode
    # steps with the merge inside the decode kernel give the same logits, bit for bit, as the separate launch
    from kvrelay.kernels import decode_rotary

    dev = _cuda()
    cfg = attn64_cfg()
    w = dummy_weights(cfg, seed=12)
    prompts, feed = prompts_and_feed(cfg, 4, (7, 150, 300), 6)
    made = []
    orig = decode_rotary.MergedQuant.__init__

    def counted(self, *a, **k):
        made.append(1)
        orig(self, *a, **k)

    monkeypatch.setattr(decode_rotary.MergedQuant, "__init__", counted)
    logits = {}
    for on in (False, True):
        monkeypatch.setenv("KVRELAY_DECODE_MERGE_FUSE", "1" if on else "0")
        for graphs in (True, False):
            made.clear()
            logits[on, graphs] = decode_logits(
                cfg, w, dev, prompts, feed, tail=[([1], [toks[0]]) for toks in feed[:2]],  # batch 1: 3 pad rows
                kv_tokens=8192, quant=quant, cuda_graphs=graphs, cuda_graph_batch_sizes=(1, 2, 4))
            assert bool(made) == on  # the fused kernel ran (graph capture or eager) exactly when switched on
    for graphs in (True, False):
        assert_same_logits(logits[True, graphs], logits[False, graphs], ("graphs", graphs))


def test_model_decode_with_the_bit_exact_opt_in_fusions_equals_without(monkeypatch):
    # KVRELAY_ROTARY_GATHER (the rotary rows looked up in the decode kernel), KVRELAY_EMBED_FUSE (the token rows
    # in the first norm), KVRELAY_DECODE_MERGE_FUSE and KVRELAY_GRAPH_HEAD_LOGITS together against none of them:
    # the same logits, bit for bit, graph-replayed and eager (KVRELAY_MOE_NORM_FUSE is not bit-exact: its own test)
    dev = _cuda()
    cfg = attn64_cfg()
    w = dummy_weights(cfg, seed=14)
    prompts, feed = prompts_and_feed(cfg, 8, (9, 200), 5)
    logits = {}
    for on in ("1", "0"):
        for name in ("KVRELAY_ROTARY_GATHER", "KVRELAY_EMBED_FUSE", "KVRELAY_DECODE_MERGE_FUSE",
                     "KVRELAY_GRAPH_HEAD_LOGITS"):
            monkeypatch.setenv(name, on)
        for graphs in (True, False):
            logits[on, graphs] = decode_logits(cfg, w, dev, prompts, feed, tail=[([0], [feed[0][1]])], kv_tokens=8192,
                                               quant="fp8-block128", cuda_graphs=graphs, cuda_graph_batch_sizes=(1, 2))
    for graphs in (True, False):
        assert_same_logits(logits["1", graphs], logits["0", graphs], ("graphs", graphs))
