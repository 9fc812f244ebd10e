"""kernels/decode_rotary.py (the split-KV decode that also does the rotary and the KV-cache write) under
TRITON_INTERPRET=1 on CPU tensors: bit for bit what kernels.fused.rotary_kv_write followed by
triton_attention.sink_decode give (outputs, partials and the pool), and the model's decode with it switched
on (KVRELAY_DECODE_ROTARY=1) equal to the model's without it. Its sm_90 PDL placement is in test_pdl.py."""

from __future__ import annotations

import os

import torch
from interp_helpers import interpreted, refs

_interpreted = interpreted(__file__)
PROMPT = [3, 141, 59, 26, 535, 8, 97, 93, 23, 84, 62, 64]


def _tiny_decode_logits(**env: str) -> torch.Tensor:
    """The 2-layer tiny model on the GPU kernels under the interpreter (fused glue, Triton attention) with `env`
    set for the run: a 12-token prefill and three decode steps, every step's logits stacked (fp32)."""
    from kvrelay.engine.config import PRESETS
    from kvrelay.engine.runner import Runner
    from kvrelay.engine.weights import open_weights

    cfg = PRESETS["tiny"].replace(num_hidden_layers=2)
    env = {"KVRELAY_KERNELS": "triton", "KVRELAY_ATTENTION": "triton", **env}
    os.environ.update(env)
    try:
        r = Runner(cfg, open_weights(None, cfg, dummy=True, seed=3), page_size=4, kv_tokens=64)
        assert r.model.blocks[0].fused
        out = [r.prefill("a", PROMPT).float()] + [r.decode(["a"], [t]).float() for t in (7, 900, 12)]
    finally:
        for k in env:
            os.environ.pop(k, None)
    return torch.stack([o.reshape(-1) for o in out])


@_interpreted
def test_decode_rotary_equals_rotary_write_then_split_decode_interpreted():
    from kvrelay.kernels import fused, triton_attention as ta
    from kvrelay.kernels.decode_rotary import sink_decode_rotary

    g = torch.Generator().manual_seed(21)
    for nq, nkv, d, page, lens in [(8, 2, 64, 16, [1, 9, 40, 129]), (6, 2, 32, 4, [3, 4, 5, 17])]:
        # the new tokens' slots hold garbage before the write: a kernel that read them would be far off
        c = refs.decode_rotary_case(lens, nq, nkv, d, page, "cpu", g)
        b, pages, offs, qkv, cos, sin, sinks = c.b, c.pages, c.offs, c.qkv, c.cos, c.sin, c.sinks
        for window, splits in ((None, 1), (None, 3), (8, 2)):
            pa, pb = b.pool.clone(), b.pool.clone()
            args = (b.kv_indptr, b.kv_indices, b.kv_last_page_len)
            kw = dict(sm_scale=0.125, window=window, num_splits=splits, block_n=16)
            q = fused.rotary_kv_write(qkv, cos, sin, nq, nkv, d, pa, pages, offs)
            want = ta.sink_decode(q, pa, sinks, *args, **kw)
            got = sink_decode_rotary(qkv, cos, sin, nq, nkv, pb, pages, offs, sinks, *args, **kw)
            assert torch.equal(got, want), (nq, window, splits, (got.float() - want.float()).abs().max())
            assert torch.equal(pb, pa), (nq, window, splits)  # the same K/V rows written, nothing else
            # deferred merge: the same partials, so the same merged + quantised projection input
            kp = -(-nq * d // 128) * 128
            wq, ws = ta.sink_decode(q, pa, sinks, *args, **kw, merge=False).quantize(kp)
            gq, gs = sink_decode_rotary(qkv, cos, sin, nq, nkv, pb.clone(), pages, offs, sinks, *args, **kw,
                                        merge=False).quantize(kp)
            assert torch.equal(gq.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(gs, ws)
            # against float32: the attention over the pool with the rotated rows in place
            ref = refs.sink_attention_ref(q, refs.PagedBatch(pa, b.qo_indptr, b.kv_indptr, b.kv_indices,
                                                             b.kv_last_page_len, b.kv_lens, b.q_lens),
                                          sinks, 0.125, window)
            assert refs.rel_err(got, ref) < 1e-2
            # attending the pool as it was (the garbage slot) is far off: the fresh row is what is used
            stale = ta.sink_decode(q, b.pool.clone(), sinks, *args, **kw)
            assert refs.rel_err(stale, ref) > 0.1


@_interpreted
def test_model_decode_with_rotary_in_the_attention_kernel_equals_without_interpreted():
    # The GPU-kernel model (fused glue, Triton attention) under the interpreter: decode steps with
    # KVRELAY_DECODE_ROTARY=1 (its layers' rotary + KV write inside the split-KV kernel) give the same logits,
    # bit for bit, as without, across the sliding window (8); the fused kernel did run, in every layer.
    from kvrelay.kernels import decode_rotary

    calls = []
    orig = decode_rotary.sink_decode_rotary

    def counted(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    decode_rotary.sink_decode_rotary = counted
    try:
        off = _tiny_decode_logits(KVRELAY_DECODE_ROTARY="0")
        assert not calls
        on = _tiny_decode_logits(KVRELAY_DECODE_ROTARY="1")
    finally:
        decode_rotary.sink_decode_rotary = orig
    assert len(calls) == 3 * 2  # every decode step's every (2) layer, never the prefill
    assert torch.equal(on, off)


@_interpreted
def test_merge_inside_the_decode_kernel_equals_the_merge_quant_launch_interpreted():
    # merge_counters: the last split program of each (sequence, KV head) merges and quantises that head
    # group's columns: bit for bit MergePending.quantize's launch (rows, M-padding rows and scales), the
    # counters left zero, the partials intact (apply still works); without counters, or for a group narrower
    # than 128 columns, the MergePending as before. The engine asks for it only with KVRELAY_DECODE_MERGE_FUSE=1.
    from kvrelay.kernels import fused, triton_attention as ta
    from kvrelay.kernels.decode_rotary import MergedQuant, merge_fuse_enabled, sink_decode_rotary

    g = torch.Generator().manual_seed(5)
    # (8, 2, 32): 4 heads of 32 = one 128-block per KV head; (16, 2, 64): four; batches 1, 3, 4 -> 3, 1, 0 pad rows
    for nq, nkv, d, page, lens in [(8, 2, 32, 4, [9]), (16, 2, 64, 16, [1, 40, 129]), (8, 2, 32, 4, [3, 4, 5, 17])]:
        c = refs.decode_rotary_case(lens, nq, nkv, d, page, "cpu", g)
        b, pages, offs, qkv, cos, sin, sinks = c.b, c.pages, c.offs, c.qkv, c.cos, c.sin, c.sinks
        args = (b.kv_indptr, b.kv_indices, b.kv_last_page_len)
        for window, splits in ((None, 1), (None, 3), (8, 2)):
            kw = dict(sm_scale=0.125, window=window, num_splits=splits, block_n=16)
            pa, pb = b.pool.clone(), b.pool.clone()
            q = fused.rotary_kv_write(qkv, cos, sin, nq, nkv, d, pa, pages, offs)
            wq, ws = ta.sink_decode(q, pa, sinks, *args, **kw, merge=False).quantize(nq * d)
            cnt = torch.zeros(len(lens) * nkv + 3, dtype=torch.int32)
            got = sink_decode_rotary(qkv, cos, sin, nq, nkv, pb, pages, offs, sinks, *args, **kw, merge=False,
                                     merge_counters=cnt)
            assert isinstance(got, MergedQuant)
            assert got.q.shape == wq.shape and got.s.stride() == ws.stride()
            gq, gs = got.quantize(nq * d)
            assert torch.equal(gq.view(torch.uint8), wq.view(torch.uint8)), (nq, lens, window, splits)
            assert torch.equal(gs, ws), (nq, lens, window, splits)
            assert not cnt.any()
            assert torch.equal(pb, pa)
            assert torch.equal(got.apply(), ta.sink_decode(q, pa, sinks, *args, **kw))
            # another width re-merges from the partials
            wq2, ws2 = ta.sink_decode(q, pa, sinks, *args, **kw, merge=False).quantize(nq * d + 128)
            gq2, gs2 = got.quantize(nq * d + 128)
            assert torch.equal(gq2.view(torch.uint8), wq2.view(torch.uint8)) and torch.equal(gs2, ws2)
    c = refs.decode_rotary_case([5, 9], 8, 2, 32, 4, "cpu", g)
    args = (c.b.kv_indptr, c.b.kv_indices, c.b.kv_last_page_len)
    kw = dict(sm_scale=0.125, window=None, num_splits=2, block_n=16, merge=False)
    cnt = torch.zeros(4, dtype=torch.int32)
    off = sink_decode_rotary(c.qkv, c.cos, c.sin, 8, 2, c.b.pool.clone(), c.pages, c.offs, c.sinks, *args, **kw)
    assert type(off) is ta.MergePending
    saved = os.environ.pop("KVRELAY_DECODE_MERGE_FUSE", None)
    try:
        assert not merge_fuse_enabled()  # opt-in until measured in the model on the H200
        os.environ["KVRELAY_DECODE_MERGE_FUSE"] = "1"
        assert merge_fuse_enabled()
    finally:
        os.environ.pop("KVRELAY_DECODE_MERGE_FUSE", None)
        if saved is not None:
            os.environ["KVRELAY_DECODE_MERGE_FUSE"] = saved
    c = refs.decode_rotary_case([5, 9], 4, 2, 32, 4, "cpu", g)  # 2 heads of 32 a KV head: 64 columns
    args = (c.b.kv_indptr, c.b.kv_indices, c.b.kv_last_page_len)
    narrow = sink_decode_rotary(c.qkv, c.cos, c.sin, 4, 2, c.b.pool.clone(), c.pages, c.offs, c.sinks, *args, **kw,
                                merge_counters=cnt)
    assert type(narrow) is ta.MergePending


@_interpreted
def test_rotary_rows_looked_up_in_the_kernel_equal_the_gathered_rows_interpreted():
    # positions=: cos/sin are the whole tables and each sequence's row is looked up inside the kernel
    # (KVRELAY_ROTARY_GATHER=1): the same outputs, partials and pool as with the rows gathered beforehand.
    from kvrelay.kernels import triton_attention as ta
    from kvrelay.kernels.decode_rotary import sink_decode_rotary
    from kvrelay.kernels.reference import rotary_cos_sin, yarn_inv_freq

    g = torch.Generator().manual_seed(13)
    nq, nkv, d, page, lens = 8, 2, 32, 4, [5, 17, 9]
    c = refs.decode_rotary_case(lens, nq, nkv, d, page, "cpu", g)
    inv, conc = yarn_inv_freq(d, 150000.0, 32.0, 4096, beta_fast=32.0, beta_slow=1.0)
    cos_t, sin_t = rotary_cos_sin(torch.arange(64), inv, conc, torch.bfloat16)
    pos = torch.tensor(lens) - 1
    args = (c.b.kv_indptr, c.b.kv_indices, c.b.kv_last_page_len)
    for merge in (True, False):
        kw = dict(sm_scale=0.125, window=None, num_splits=2, block_n=16, merge=merge)
        pa, pb = c.b.pool.clone(), c.b.pool.clone()
        want = sink_decode_rotary(c.qkv, cos_t[pos], sin_t[pos], nq, nkv, pa, c.pages, c.offs, c.sinks, *args, **kw)
        got = sink_decode_rotary(c.qkv, cos_t, sin_t, nq, nkv, pb, c.pages, c.offs, c.sinks, *args, **kw,
                                 positions=pos)
        assert torch.equal(pb, pa)
        if merge:
            assert torch.equal(got, want)
        else:
            assert isinstance(got, ta.MergePending)
            assert torch.equal(got.apply(), want.apply())
    try:
        sink_decode_rotary(c.qkv, cos_t, sin_t, nq, nkv, c.b.pool.clone(), c.pages, c.offs, c.sinks, *args,
                           sm_scale=0.125, window=None, positions=pos[:2])
        raise AssertionError("positions for the wrong number of rows were accepted")
    except ValueError as e:
        assert "positions" in str(e)


@_interpreted
def test_model_decode_with_the_rotary_rows_looked_up_in_attention_equals_without_interpreted():
    # The tiny model with fused glue and Triton attention under the interpreter: decode steps with
    # KVRELAY_ROTARY_GATHER=1 (and KVRELAY_EMBED_FUSE=1 with it) give the same logits, bit for bit, as without,
    # and with it every decode layer's kernel got the whole tables and the positions.
    from kvrelay.kernels import decode_rotary

    seen = []
    orig = decode_rotary.sink_decode_rotary

    def counted(*a, **k):
        seen.append(k.get("positions") is not None)
        return orig(*a, **k)

    def run(on: bool):
        flag = "1" if on else "0"
        return _tiny_decode_logits(KVRELAY_ROTARY_GATHER=flag, KVRELAY_EMBED_FUSE=flag)

    decode_rotary.sink_decode_rotary = counted
    try:
        off = run(False)
        assert seen and not any(seen)
        seen.clear()
        on = run(True)
    finally:
        decode_rotary.sink_decode_rotary = orig
    assert len(seen) == 3 * 2 and all(seen)  # every decode step's every (2) layer
    assert torch.equal(on, off)
