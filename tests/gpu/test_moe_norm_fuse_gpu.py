"""The MoE's GEMV2 with the next block's residual add + RMSNorm + 1x128 FP8 quantisation fused into its launch
(kernels/moe_gemv.py: MoePending.finish_norm) on the GPU, at gpt-oss's expert shapes: bit for bit GEMV2 followed
by kernels.fused.add_rms_norm launched with the same warps (the RMSNorm's fp32 sum of squares is reduced in an
order that depends on the warps; add_rms_norm's own launch takes 16), within one bf16 step of add_rms_norm's
default launch (the new residual exactly); replayed from a CUDA graph with PDL on one counter set, launch after
launch; and the model with KVRELAY_MOE_NORM_FUSE=1 against 0 (off by default until measured in the model).
(The same bits as the unfused chain under the Triton interpreter, and the wait placement from the SASS:
tests/cpu/test_moe_norm_fuse.py.)
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import assert_logits_agree, attn64_cfg, dummy_weights

from kernel_refs import assert_same as _same, poison_allocator

pytestmark = pytest.mark.gpu

EPS = 1e-5
E, H, INTER, K = 32, 2880, 2880, 4  # gpt-oss-20b's experts
KP = 2944  # the QKV GEMM's K (2880 padded to 128)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return torch.device("cuda")


def _fp8_experts(dev, gen):
    from kvrelay.kernels.fp8 import quantize_weight_block128
    from kvrelay.kernels.moe import MoEWeights

    w1 = torch.randn(E, 2 * INTER, H, generator=gen, device=dev) * H ** -0.5
    w2 = torch.randn(E, H, INTER, generator=gen, device=dev) * INTER ** -0.5
    b1 = (torch.randn(E, 2 * INTER, generator=gen, device=dev) * 0.5).bfloat16()
    b2 = (torch.randn(E, H, generator=gen, device=dev) * 0.5).bfloat16()
    q1, s1 = quantize_weight_block128(w1)
    q2, s2 = quantize_weight_block128(w2)
    return MoEWeights.from_fp8(q1, s1, b1, q2, s2, b2)


def _tokens(t, dev, gen):
    from kvrelay.kernels.moe import route_topk

    hx = torch.randn(t, H, generator=gen, device=dev).bfloat16()
    rw, ids = route_topk(torch.randn(t, E, generator=gen, device=dev).bfloat16(), K)
    res = (torch.randn(t, H, generator=gen, device=dev) * 3).bfloat16()
    return hx, ids, rw, res


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_fused_gemv2_norm_bit_exact_at_gpt_oss_shapes(t):
    from kvrelay.kernels.fp8 import dequantize_act_1x128
    from kvrelay.kernels.fused import add_rms_norm
    from kvrelay.kernels.moe import moe_experts
    from kvrelay.kernels.moe_gemv import MoePending, gemv_config, new_norm_counters

    dev = _cuda()
    g = torch.Generator(device=dev).manual_seed(t)
    ex = _fp8_experts(dev, g)
    hx, ids, rw, res = _tokens(t, dev, g)
    nw = (torch.rand(H, generator=g, device=dev) + 0.5).bfloat16()
    cnt = new_norm_counters(dev)
    pend = moe_experts(hx, ids, rw, ex, combine=False, norm_counters=cnt)
    assert isinstance(pend, MoePending) and pend.launch == gemv_config(H, INTER).w2
    y = pend.outputs()
    warps = pend.launch.num_warps
    for quant in (KP, None):
        want_x, want = add_rms_norm(res, y, nw, EPS, quant_k=quant, num_warps=warps)
        dflt_x, dflt = add_rms_norm(res, y, nw, EPS, quant_k=quant)
        poison_allocator(1 << 26)  # outputs the kernel failed to write would read NaN
        got_x, got = pend.finish_norm(res, nw, EPS, quant_k=quant)
        torch.cuda.synchronize()
        assert not cnt.any(), "the last arrivals reset their counters"
        _same(got_x, want_x, "x")
        _same(got_x, dflt_x, "x vs the 16-warp launch")  # elementwise: no reduction order involved
        again_x, again = pend.finish_norm(res, nw, EPS, quant_k=quant)
        _same(again_x, got_x, "again x")
        if quant is None:
            _same(got, want, "normed")
            _same(again, got, "again normed")
            step = dflt.float().abs().clamp_min(1e-30) * 2 ** -7
            assert ((got.float() - dflt.float()).abs() <= step).all()
            continue
        (q, s), (wq, ws), (dq, ds) = got, want, dflt
        _same(q, wq, "q")
        _same(s, ws, "scale")
        _same(again[0], q, "again q")
        _same(again[1], s, "again scale")
        assert not q[t:].float().any() and torch.equal(s[t:], torch.full_like(s[t:], 1e-12 / 448))
        # against the 16-warp launch: the normed rows one bf16 step apart at most, so the scales (a group's
        # amax / 448) within that step, and the dequantised rows within an e4m3 step (1/8) plus it, plus the
        # group's smallest step near zero
        assert torch.allclose(s[:t], ds[:t], rtol=2 ** -7, atol=0)
        a, b = dequantize_act_1x128(q[:t, :H], s[:t]), dequantize_act_1x128(dq[:t, :H], ds[:t])
        tol = b.abs() * (2 ** -3 + 2 ** -7) + s[:t].repeat_interleave(128, -1)[:, :H] * 2 ** -6
        assert ((a - b).abs() <= tol).all()


def _pdl_device():
    from kvrelay.kernels import pdl

    dev = _cuda()
    if torch.cuda.get_device_capability(dev)[0] < 9:
        pytest.skip("PDL needs compute capability 9 (Hopper) or later")
    assert pdl.triton_supports_pdl()
    return dev


@pytest.mark.parametrize("t", [1, 4])
def test_fused_launches_replayed_with_pdl_on_one_counter_set(t, monkeypatch):
    """Six 'layers' (GEMV1, the fused GEMV2 + add + norm + quantisation, an RMSNorm feeding the next layer)
    on one counter set, captured with PDL and replayed on new inputs: every replay equals the eager chain
    without PDL bit for bit, and the counters are left zero."""
    from kvrelay.kernels import pdl
    from kvrelay.kernels.fused import rms_norm
    from kvrelay.kernels.moe import moe_experts
    from kvrelay.kernels.moe_gemv import new_norm_counters

    dev = _pdl_device()
    g = torch.Generator(device=dev).manual_seed(10 + t)
    ex = _fp8_experts(dev, g)
    hx, ids, rw, res = _tokens(t, dev, g)
    nw = (torch.rand(H, generator=g, device=dev) + 0.5).bfloat16()
    cnt = new_norm_counters(dev)

    def chain():
        h, x, outs = hx, res, []
        for _ in range(6):
            x, (q, s) = moe_experts(h, ids, rw, ex, combine=False, norm_counters=cnt).finish_norm(x, nw, EPS, KP)
            h = rms_norm(x, nw, EPS)
            outs += [x, q, s]
        return outs

    monkeypatch.setenv("KVRELAY_PDL", "1")
    assert pdl.enabled(dev)
    chain()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    monkeypatch.setenv("KVRELAY_PDL", "0")  # the eager reference: plain launches
    for _ in range(3):
        hx.copy_(torch.randn(t, H, generator=g, device=dev).bfloat16())
        res.copy_((torch.randn(t, H, generator=g, device=dev) * 3).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert not cnt.any()
        for i, (a, b) in enumerate(zip(outs, chain())):
            _same(a, b, f"output {i}")


@pytest.mark.parametrize("quant", ["bf16", "fp8-block128"])
def test_model_with_the_fusion_on_and_off(quant, monkeypatch):
    """The tiny model on CUDA (graphs of 1, 2 and 4 rows, PDL where supported) with KVRELAY_MOE_NORM_FUSE=1 and
    0: logits within bf16 rounding of each other (the fused norm's sum of squares is reduced by GEMV2's warps),
    top-1 equal but at near-ties; the fused kernel ran, with PDL where it is on; and a decode step launches
    one kernel fewer per block but the last."""
    from torch.profiler import ProfilerActivity, profile

    from kvrelay.engine.runner import Runner
    from kvrelay.kernels import moe_gemv, pdl

    dev = _cuda()
    cfg = attn64_cfg()
    w = dummy_weights(cfg, seed=5)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 140, 37)]
    feed = torch.randint(0, cfg.vocab_size, (9, 3), generator=g).tolist()
    logits, counts = {}, {}
    for flag in ("1", "0"):
        # read at each launch: it must hold while the graphs are captured (the first decode) and replayed
        monkeypatch.setenv("KVRELAY_MOE_NORM_FUSE", flag)
        moe_gemv._gemv2_norm_kernel.device_caches.clear()
        r = Runner(cfg, w, device=dev, quant=quant, page_size=16, kv_tokens=8192, cuda_graph_batch_sizes=(1, 2, 4))
        steps = [r.prefill_batch([(i, p) for i, p in enumerate(prompts)])]
        for i, toks in enumerate(feed):
            ids = [0, 1, 2][: 3 - (i % 3)]  # batch 3 (graph 4), then 2 and 1
            steps.append(r.decode(ids, toks[: len(ids)]))
        torch.cuda.synchronize()
        logits[flag] = [s.cpu() for s in steps]
        caches = moe_gemv._gemv2_norm_kernel.device_caches.values()
        variants = [k for entry in caches for k in entry[0].values()]
        assert bool(variants) == (flag == "1")
        if flag == "1" and pdl.enabled(dev):
            assert any(getattr(k.metadata, "launch_pdl", False) for k in variants)
        r.graph_replay = False  # eager, so each kernel shows up in the profiler
        r.decode([0, 1, 2], [1, 2, 3])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            r.decode([0, 1, 2], [4, 5, 6])
            torch.cuda.synchronize()
        counts[flag] = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    # the residual stream is the same bits either way; the attention input can differ by a bf16 step in a
    # rare element, after which a near-tie between two experts' logits may route a token differently (the
    # bounds of tests/gpu/test_fused_gpu.py's fused vs unfused model)
    assert_logits_agree(logits["1"], logits["0"],
                        f"{quant}: fusion on vs off (kernels per decode step {counts})")
    assert counts["1"] <= counts["0"] - (cfg.num_hidden_layers - 1), counts
