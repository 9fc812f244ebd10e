"""The MoE's GEMV2 with the next block's residual add + RMSNorm (+ the QKV GEMM's 1x128 FP8 quantisation) fused
into its launch (kernels/moe_gemv.py: MoePending.finish_norm, _gemv2_norm_kernel): the same bits as GEMV2
followed by kernels.fused.add_rms_norm, under TRITON_INTERPRET=1 on CPU tensors (the interpreter sums in one
order whatever the warps; the GPU side is tests/gpu/test_moe_norm_fuse_gpu.py); the tiny model's prefill and
decode logits equal with the fusion on and off (KVRELAY_MOE_NORM_FUSE); and the kernel's PDL wait placement,
from its SASS (tests/cpu/test_pdl.py's check)."""

from __future__ import annotations

import os

import pytest
import torch
from interp_helpers import interpreted, refs

_interpreted = interpreted(__file__)


def _experts(e, h, inter, fp8_weights, g):
    from kvrelay.kernels import fp8, moe

    w1 = torch.randn(e, 2 * inter, h, generator=g) * 0.05
    w2 = torch.randn(e, h, inter, generator=g) * 0.05
    b1 = torch.randn(e, 2 * inter, generator=g).bfloat16()
    b2 = torch.randn(e, h, generator=g).bfloat16()
    if not fp8_weights:
        return moe.MoEWeights.from_bf16(w1.bfloat16(), b1, w2.bfloat16(), b2)
    q1, s1 = fp8.quantize_experts_block128(w1)
    q2, s2 = fp8.quantize_experts_block128(w2)
    return moe.MoEWeights.from_fp8(q1, s1, b1, q2, s2, b2)


_same = refs.assert_same


@_interpreted
def test_fused_gemv2_norm_equals_gemv2_then_add_rms_norm():
    """bf16 and fp8 experts, hidden 256 (quant_k 256) and 200 (K padded to 256), 1-3 tokens of 4 experts:
    finish_norm gives add_rms_norm(x, outputs(), ...)'s new residual, FP8 rows, scales (the M-padding rows
    included) and normed rows bit for bit, leaves its counters zero, and repeats itself exactly."""
    from kvrelay.kernels import fused, moe, moe_gemv

    g = torch.Generator().manual_seed(0)
    e, k, inter, eps = 8, 4, 96, 1e-5
    for fp8_weights in (False, True):
        for h, kp in ((256, 256), (200, 256)):
            ex = _experts(e, h, inter, fp8_weights, g)
            for t in (1, 2, 3):
                hx = torch.randn(t, h, generator=g).bfloat16()
                ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
                rw = torch.softmax(torch.randn(t, k, generator=g), -1).bfloat16()
                res = (torch.randn(t, h, generator=g) * 3).bfloat16()
                nw = (torch.rand(h, generator=g) + 0.5).bfloat16()
                cnt = moe_gemv.new_norm_counters("cpu")
                pend = moe.moe_experts(hx, ids, rw, ex, combine=False, norm_counters=cnt)
                assert isinstance(pend, moe_gemv.MoePending)
                y = pend.outputs()
                # the plain GEMV2 of the pending is moe_experts(combine=False)'s output
                _same(y, moe.moe_experts(hx, ids, rw, ex, combine=False), "outputs")
                case = (fp8_weights, h, t)
                for quant in (kp, None):
                    want_x, want = fused.add_rms_norm(res, y, nw, eps, quant_k=quant)
                    got_x, got = pend.finish_norm(res, nw, eps, quant_k=quant)
                    assert not cnt.any(), case  # the last arrivals reset their counters
                    _same(got_x, want_x, ("x", case))
                    assert got_x.data_ptr() != res.data_ptr()  # a new residual tensor, as add_rms_norm's
                    if quant is None:
                        _same(got, want, ("normed", case))
                        continue
                    (q, s), (wq, ws) = got, want
                    _same(q, wq, ("q", case))
                    _same(s, ws, ("scale", case))
                    # the GEMM's M padding: zero rows with the floor scale (not left to the allocator)
                    assert q.shape[0] == 4 and not q[t:].float().any(), case
                    assert torch.equal(s[t:], torch.full_like(s[t:], 1e-12 / 448)), case
                    again_x, (q2, s2) = pend.finish_norm(res, nw, eps, quant_k=quant)
                    _same(again_x, got_x, ("again x", case))
                    _same(q2, q, ("again q", case))
                    _same(s2, s, ("again scale", case))
                    # the combine is load-bearing: without one expert's rows the residual differs
                    assert not torch.equal(got_x, fused.add_rms_norm(res, y[:, :3].contiguous(), nw, eps)[0])


@_interpreted
def test_deferral_only_where_it_applies():
    """A MoePending only for combine=False with counters, up to NORM_FUSE_MAX_TOKENS tokens; otherwise the
    uncombined outputs as before. The engine passes the counters only with KVRELAY_MOE_NORM_FUSE=1 (norm_fuse:
    off by default until measured in the model on the H200)."""
    from kvrelay.kernels import moe, moe_gemv

    g = torch.Generator().manual_seed(1)
    e, k, h = 8, 4, 128
    ex = _experts(e, h, 64, False, g)
    cnt = moe_gemv.new_norm_counters("cpu")
    n = moe_gemv.NORM_FUSE_MAX_TOKENS
    hx = torch.randn(n + 1, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n + 1)])
    rw = torch.softmax(torch.randn(n + 1, k, generator=g), -1).bfloat16()
    plain = moe.moe_experts(hx, ids, rw, ex, combine=False)
    assert isinstance(moe.moe_experts(hx[:n], ids[:n], rw[:n], ex, combine=False, norm_counters=cnt),
                      moe_gemv.MoePending)
    _same(moe.moe_experts(hx, ids, rw, ex, combine=False, norm_counters=cnt), plain, "above the limit")
    _same(moe.moe_experts(hx[:1], ids[:1], rw[:1], ex, combine=False), plain[:1], "no counters")
    saved = os.environ.pop("KVRELAY_MOE_NORM_FUSE", None)
    try:
        assert not moe_gemv.norm_fuse()
        for flag, on in (("0", False), ("1", True)):
            os.environ["KVRELAY_MOE_NORM_FUSE"] = flag
            assert moe_gemv.norm_fuse() is on
    finally:
        os.environ.pop("KVRELAY_MOE_NORM_FUSE", None)
        if saved is not None:
            os.environ["KVRELAY_MOE_NORM_FUSE"] = saved
    with pytest.raises(ValueError, match="combine"):
        moe.moe_experts(hx[:1], ids[:1], rw[:1], ex, combine=True, norm_counters=cnt)


@_interpreted
def test_tiny_model_logits_equal_with_the_fusion_on_and_off():
    """The model's fused GPU glue under the interpreter (KVRELAY_KERNELS=triton; bf16, so the normed rows are not
    quantised): a 3-token prefill (deferred), a 6-token one (above the limit), decode steps of 2 and 1
    sequences give the same logits with KVRELAY_MOE_NORM_FUSE=1 and 0, and the fused launch ran in every
    block but the last (whose MoE outputs the head adds) of each forward of up to 4 tokens."""
    from kvrelay.engine.config import PRESETS
    from kvrelay.engine.runner import Runner
    from kvrelay.engine.weights import open_weights
    from kvrelay.kernels import moe_gemv

    cfg = PRESETS["tiny"]
    calls = {"fused": 0, "plain": 0}
    orig_fused, orig_plain = moe_gemv.gemv2_norm, moe_gemv.gemv2

    def counted(kind, fn):
        def run(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return run

    def forward_all(flag):
        os.environ["KVRELAY_MOE_NORM_FUSE"] = flag
        r = Runner(cfg, open_weights(None, cfg, dummy=True, seed=3), page_size=4, kv_tokens=128)
        assert r.model.blocks[0].fused
        out = [r.prefill("a", [3, 141, 59]), r.prefill("b", [7, 8, 9, 10, 11, 12])]
        for toks in ([897, 5], [12, 40], [100, 3]):
            out.append(r.decode(["a", "b"], toks))
            out.append(r.decode(["a"], toks[:1]))
        return out

    env = {k: os.environ.get(k) for k in ("KVRELAY_MOE_NORM_FUSE", "KVRELAY_KERNELS", "KVRELAY_ATTENTION")}
    os.environ.update(KVRELAY_KERNELS="triton", KVRELAY_ATTENTION="reference")  # attention: not what this checks
    moe_gemv.gemv2_norm, moe_gemv.gemv2 = counted("fused", orig_fused), counted("plain", orig_plain)
    try:
        on = forward_all("1")
        on_calls = dict(calls)
        calls.update(fused=0, plain=0)
        off = forward_all("0")
    finally:
        moe_gemv.gemv2_norm, moe_gemv.gemv2 = orig_fused, orig_plain
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    layers = cfg.num_hidden_layers
    # forwards of <= 4 tokens: the 3-token prefill and 6 decode steps; the 6-token prefill launches GEMV2 alone
    assert on_calls == {"fused": 7 * (layers - 1), "plain": 7 + layers}, on_calls
    assert calls == {"fused": 0, "plain": 8 * layers}, calls
    for i, (a, b) in enumerate(zip(on, off)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("early", [True, False])
def test_norm_fused_gemv2_waits_before_touching_memory(early):
    """_gemv2_norm_kernel at gpt-oss's shapes, compiled for sm_90 with PDL: the wait precedes every store,
    atomic and branch; with EARLY only the router's ids and weights and the expert's weights, scales and bias are
    loaded before it (kernels/pdl.py's rules, checked as tests/cpu/test_pdl.py checks every decode kernel)."""
    import test_pdl as checks

    ptr = checks.P
    types = {"act": ptr["bf16"], "ids": ptr["i64"], "route_w": ptr["bf16"], "w": ptr["fp8"], "s": ptr["f32"],
             "b": ptr["bf16"], "y": ptr["bf16"], "x": ptr["bf16"], "nw": ptr["bf16"], "xo": ptr["bf16"],
             "out": ptr["bf16"], "q": ptr["fp8"], "sq": ptr["f32"], "cnt": ptr["i32"], "eps": checks.F32,
             **checks._ints("Kdim", "Ndim", "T", "MP", "s_at", "s_we", "s_wn", "s_se", "s_sn", "s_be", "s_yt", "s_x",
                            "s_xo", "s_o", "s_q", "s_sm", "s_sk")}
    consts = {"K_TOP": 4, "FP8": True, "BLOCK_N": 32, "BLOCK_K": 256, "QUANT": True, "N_GROUPS": 23, "BLOCK": 4096,
              "LATE": True, "EARLY": early}
    from kvrelay.kernels import moe_gemv

    checks.test_kernel_waits_before_touching_memory(
        moe_gemv._gemv2_norm_kernel, types, consts, ("ids", "route_w", "w", "s", "b") if early else (), (),
        {"num_warps": 8, "num_stages": 2})
