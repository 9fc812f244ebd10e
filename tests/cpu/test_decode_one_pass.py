"""The one-pass decode (kernels/decode_rotary.py `final=True`, KVRELAY_DECODE_ONE_PASS=1) under
TRITON_INTERPRET=1 on CPU tensors: a one-split launch that finishes its rows (sink, output, and the output
projection's FP8 input) gives bit for bit what the one-split decode's partial merged by the merge kernels gives
(rotary_kv_write + sink_decode(num_splits=1) + MergePending.apply / .quantize), M padding rows included, and the
model's decode with the switch on equal to the model's without it, the one-pass launch run in every sliding layer."""

from __future__ import annotations

import os

import pytest
import torch
from interp_helpers import interpreted

_interpreted = interpreted(__file__)


@_interpreted
def test_one_pass_equals_one_split_decode_then_merge_interpreted():
    from interp_helpers import refs

    from kvrelay.kernels import fused, triton_attention as ta
    from kvrelay.kernels.decode_rotary import final_quant_ok, sink_decode_rotary

    g = torch.Generator().manual_seed(29)
    # (8 q, 2 kv, D 64): two heads a 128-wide block, two blocks a KV head; (16, 2, 32): four heads a block;
    # (6, 2, 64): three heads a KV head, so its blocks straddle two KV heads: quantised on demand instead
    for nq, nkv, d, page, lens in [(8, 2, 64, 16, [1, 9, 40]), (16, 2, 32, 4, [3, 17, 5, 30, 2]),
                                   (6, 2, 64, 8, [4, 12])]:
        c = refs.decode_rotary_case(lens, nq, nkv, d, page, "cpu", g)  # new tokens' slots: 1e4 before the write
        b, pages, offs, qkv, cos, sin, sinks = c.b, c.pages, c.offs, c.qkv, c.cos, c.sin, c.sinks
        kp = nq * d
        assert final_quant_ok(nq, nkv, d, torch.bfloat16, kp) == (nq != 6)
        for window in (None, 8):
            args = (b.kv_indptr, b.kv_indices, b.kv_last_page_len)
            kw = dict(sm_scale=0.125, window=window, num_splits=1, block_n=16)
            pa, pb, pc = b.pool.clone(), b.pool.clone(), b.pool.clone()
            q = fused.rotary_kv_write(qkv, cos, sin, nq, nkv, d, pa, pages, offs)
            pending = ta.sink_decode(q, pa, sinks, *args, **kw, merge=False)
            want = pending.apply()
            wq, ws = pending.quantize(kp)
            got = sink_decode_rotary(qkv, cos, sin, nq, nkv, pb, pages, offs, sinks, *args, **kw, merge=False,
                                     final=True, quant_k=kp)
            assert torch.equal(pb, pa)  # the same K/V rows written, nothing else
            assert torch.equal(got.apply(), want), (nq, window, (got.apply().float() - want.float()).abs().max())
            assert (got.q8 is not None) == (nq != 6)
            gq, gs = got.quantize(kp)
            assert gq.shape == wq.shape and gs.stride() == ws.stride()
            assert torch.equal(gq.view(torch.uint8), wq.view(torch.uint8)), (nq, window)
            assert torch.equal(gs, ws), (nq, window)  # the padding rows' floor scales too (B -> a multiple of 4)
            # merge=True: the finished output itself
            out = sink_decode_rotary(qkv, cos, sin, nq, nkv, pc, pages, offs, sinks, *args, **kw, final=True)
            assert torch.equal(out, want)
            ref = refs.sink_attention_ref(q, refs.PagedBatch(pa, b.qo_indptr, b.kv_indptr, b.kv_indices,
                                                             b.kv_last_page_len, b.kv_lens, b.q_lens),
                                          sinks, 0.125, window)
            assert refs.rel_err(out, ref) < 1e-2
        with pytest.raises(ValueError, match="one split"):
            sink_decode_rotary(qkv, cos, sin, nq, nkv, b.pool.clone(), pages, offs, sinks, *args, sm_scale=0.125,
                               window=None, num_splits=2, block_n=16, final=True)


@_interpreted
def test_model_decode_in_one_pass_equals_without_interpreted():
    # The GPU-kernel model under the interpreter: with KVRELAY_DECODE_ONE_PASS=1 its sliding layers decode in one
    # split that finishes the rows (the tiny model's 8-key window is one split either way, so the logits must
    # be the same bits), and that launch ran for every sliding layer of every decode step, never elsewhere.
    from kvrelay.engine.config import PRESETS
    from kvrelay.engine.runner import Runner
    from kvrelay.engine.weights import open_weights
    from kvrelay.kernels import decode_rotary

    cfg = PRESETS["tiny"].replace(num_hidden_layers=2)
    sliding = sum(cfg.layer_is_sliding(i) for i in range(cfg.num_hidden_layers))
    assert 0 < sliding < cfg.num_hidden_layers
    prompt = [3, 141, 59, 26, 535, 8, 97, 93, 23, 84, 62, 64]
    finals = []
    orig = decode_rotary.sink_decode_rotary

    def counted(*a, **k):
        finals.append(bool(k.get("final")))
        return orig(*a, **k)

    def run(on: bool):
        env = {"KVRELAY_KERNELS": "triton", "KVRELAY_ATTENTION": "triton", "KVRELAY_DECODE_ONE_PASS": "1" if on else "0"}
        os.environ.update(env)
        try:
            r = Runner(cfg, open_weights(None, cfg, dummy=True, seed=3), page_size=4, kv_tokens=64)
            out = [r.prefill("a", prompt).float()] + [r.decode(["a"], [t]).float() for t in (7, 900, 12)]
        finally:
            for k in env:
                os.environ.pop(k, None)
        return torch.stack([o.reshape(-1) for o in out])

    decode_rotary.sink_decode_rotary = counted
    try:
        off = run(False)
        assert finals and not any(finals)
        finals.clear()
        on = run(True)
    finally:
        decode_rotary.sink_decode_rotary = orig
    assert len(finals) == 3 * cfg.num_hidden_layers and sum(finals) == 3 * sliding
    assert torch.equal(on, off)
