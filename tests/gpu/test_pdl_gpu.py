"""Programmatic Dependent Launch (kernels/pdl.py) changes when kernels start, never what they compute: the
model's CUDA-graph decode steps with KVRELAY_PDL=1 give the logits of KVRELAY_PDL=0 bit for bit (also with the
decode projections on the FP8 GEMV, KVRELAY_FP8_GEMV=1), and back-to-back launches of the fused router, and of
the split-K FP8 GEMV, on one set of arrival counters (the last-arriving-program barrier, kernels/router.py,
kernels/fp8_gemv.py) compute every launch exactly, replay after replay.
(The placement of each kernel's wait is checked on the CPU, from its SASS: tests/cpu/test_pdl.py.)
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import attn64_cfg, dummy_weights

pytestmark = pytest.mark.gpu


def _pdl_device():
    from kvrelay.kernels import pdl

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_capability(dev)[0] < 9:
        pytest.skip("PDL needs compute capability 9 (Hopper) or later")
    assert pdl.triton_supports_pdl(), "triton >= 3.4 (pyproject) has PDL"
    return dev


def _launched_with_pdl(kernel) -> bool:
    """Some compiled variant of this Triton kernel carries the launch_pdl option (triton's per-device
    caches: (kernels by key, ...))."""
    return any(getattr(k.metadata, "launch_pdl", False)
               for entry in kernel.device_caches.values() for k in entry[0].values())


# the split-K FP8 GEMV tile (partials + arrival counters) the gemv case runs the decode QKV / O projections on
_GEMV = "gemv-n32-k256-s4-w4-st2"


@pytest.mark.parametrize("quant,decode,gemv", [
    ("fp8-block128", "flashinfer", False), ("fp8-block128", "triton", False), ("bf16", "flashinfer", False),
    ("bf16", "triton", False), ("fp8-block128", "flashinfer", True)])
def test_model_decode_steps_equal_with_and_without_pdl(quant, decode, gemv, monkeypatch):
    from kvrelay.engine.runner import Runner
    from kvrelay.kernels import decode_rotary, fp8_gemv, fused, moe_gemv, pdl, router, select, triton_attention
    from kvrelay.kernels.fp8_gemm import Fp8BlockLinear

    dev = _pdl_device()
    if decode == "flashinfer" and select.attention_backend(dev) != "flashinfer":
        # without FlashInfer (or with KVRELAY_ATTENTION forcing another backend) decode runs Triton's kernels,
        # not the rotary + KV write launch this case checks
        pytest.skip(f"FlashInfer is not the attention backend here ({select.attention_backend(dev)})")
    # decode attention on FlashInfer (the default) or on the Triton split-KV kernels (select.py's override)
    monkeypatch.setenv("KVRELAY_DECODE_ATTENTION", decode)
    if gemv:
        # the FP8 GEMV (kernels/fp8_gemv.py) for the decode projections, as KVRELAY_FP8_GEMV=1 lets `auto`
        # pick it; pinned to one split-K tile at decode sizes (M <= 8) rather than timed, so both runs use it
        # (a timed pick may differ between them, and at this model's sizes need not pick a GEMV at all)
        monkeypatch.setenv("KVRELAY_FP8_GEMV", "1")
        pick = Fp8BlockLinear._pick
        monkeypatch.setattr(Fp8BlockLinear, "_pick", lambda self, m, xq, sx:
                            _GEMV if m <= self.GEMV_MAX_M else pick(self, m, xq, sx))
    cfg = attn64_cfg()
    w = dummy_weights(cfg, seed=7)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 150, 40)]
    feed = torch.randint(0, cfg.vocab_size, (10, 3), generator=g).tolist()
    # the kernels this path launches: decode on FlashInfer writes rotary + KV in its own launch; the Triton
    # split-KV decode does it inside its split kernel (kernels/decode_rotary.py, the default) and merges fused
    # with the output projection's FP8 quantisation (MergePending.quantize) or alone for bf16
    pdl_kernels = [fused._add_rms_norm_kernel, router._add_norm_route_kernel, moe_gemv._gemv1_kernel,
                   moe_gemv._gemv2_kernel, *((fp8_gemv._fp8_gemv_kernel,) if gemv else ())]
    if decode == "triton":
        pdl_kernels += [decode_rotary._sink_decode_rotary_split_kernel,
                        triton_attention._sink_decode_merge_quant_kernel if quant == "fp8-block128"
                        else triton_attention._sink_decode_merge_kernel]
    else:
        pdl_kernels.append(fused._rotary_kv_write_kernel)
    steps = {}
    for flag in ("0", "1"):
        # read at each launch, so it must hold while the graphs are captured (at the first decode)
        monkeypatch.setenv("KVRELAY_PDL", flag)
        assert pdl.enabled(dev) == (flag == "1")
        if flag == "1":
            # compiled variants carrying launch_pdl found below were launched by this run, not an earlier test
            for k in pdl_kernels:
                k.device_caches.clear()
        r = Runner(cfg, w, device=dev, quant=quant, page_size=16, kv_tokens=8192, cuda_graph_batch_sizes=(1, 2, 4))
        out = [r.prefill_batch([(i, p) for i, p in enumerate(prompts)])]
        for i, toks in enumerate(feed):
            # batch 3 (graph 4), then 2 and 1 (their own graphs), several replays of each
            ids = [0, 1, 2][: 3 - (i % 3)]
            out.append(r.decode(ids, toks[: len(ids)]))
        torch.cuda.synchronize()
        steps[flag] = [t.cpu() for t in out]
        if flag == "1":
            if decode == "triton":
                assert r.attn.decode_kind == {"full": "triton", "sliding": "triton"}
            for k in pdl_kernels:
                assert _launched_with_pdl(k), k.__name__
    for i, (off, on) in enumerate(zip(steps["0"], steps["1"])):
        assert torch.equal(off, on), f"step {i}: PDL changed the logits ({(off.float() - on.float()).abs().max()})"
        assert torch.equal(off.argmax(-1), on.argmax(-1))


@pytest.mark.parametrize("t,e", [(1, 32), (4, 128)])
def test_back_to_back_router_launches_on_one_counter_set(t, e, monkeypatch):
    """60 fused-router launches in a row on the same counters, captured with PDL: each launch's increments
    follow the previous launch's reset, so every one routes exactly as route_topk(router_logits)."""
    from kvrelay.kernels import moe, pdl, router
    from kvrelay.kernels.fused import router_logits

    dev = _pdl_device()
    monkeypatch.setenv("KVRELAY_PDL", "1")
    assert pdl.enabled(dev)
    g = torch.Generator().manual_seed(t + e)
    h = 2880
    w = (torch.randn(e, h, generator=g) * h ** -0.5).bfloat16().to(dev)
    b = torch.randn(e, generator=g).bfloat16().to(dev)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16().to(dev)
    cnt = router.new_counters(dev)
    xs = [torch.randn(t, h, generator=g).bfloat16().to(dev) for _ in range(3)]
    d = torch.randn(t, h, generator=g).bfloat16().to(dev)

    def chain():
        outs = []
        for i in range(30):
            outs.append(router.router_route(xs[i % 3], w, b, 4, cnt))
            # the norm-fused router reads x + delta: its h feeds nothing here, its routing is checked
            outs.append(router.add_rms_norm_route(xs[i % 3], d, nw, 1e-5, w, b, 4, cnt)[2:])
        return outs

    chain()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    monkeypatch.setenv("KVRELAY_PDL", "0")  # the eager references below: plain launches
    for rep in range(4):
        for x in xs:
            x.copy_(torch.randn(t, h, generator=g).bfloat16().to(dev))
        graph.replay()
        torch.cuda.synchronize()
        assert not cnt.any(), "a launch left its counters non-zero"
        for i in range(30):
            x = xs[i % 3]
            rw, ri = moe.route_topk(router_logits(x, w, b), 4)
            gw, gi = outs[2 * i]
            assert torch.equal(gi, ri) and torch.equal(gw, rw), (rep, i)
            fw, fi = outs[2 * i + 1]
            ew, ei = router.add_rms_norm_route(x, d, nw, 1e-5, w, b, 4, cnt)[2:]
            assert torch.equal(fi, ei) and torch.equal(fw, ew), (rep, i)


@pytest.mark.parametrize("k,n", [(2880, 5120), (4096, 2880)])
def test_back_to_back_fp8_gemv_launches_on_one_counter_set(k, n, monkeypatch):
    """40 launches in a row of split-K FP8 GEMV tiles of one layer (one set of arrival counters), captured with
    PDL at decode row counts 1..8: each launch's counting starts after the previous launch's last arrival
    reset the counters, so every output is bit for bit the eager PDL-off launch's, replay after replay."""
    from kvrelay.kernels import fp8_gemv, pdl
    from kvrelay.kernels.fp8 import quantize_weight_block128
    from kvrelay.kernels.fp8_gemm import Fp8BlockLinear, quantize_act_1x128

    dev = _pdl_device()
    monkeypatch.setenv("KVRELAY_PDL", "1")
    assert pdl.enabled(dev)
    g = torch.Generator().manual_seed(k + n)
    wq, ws = quantize_weight_block128((torch.randn(n, k, generator=g) * 0.02).to(dev))
    bias = torch.randn(n, generator=g).bfloat16().to(dev)
    tiles = [t for t in Fp8BlockLinear.GEMV_TILES if Fp8BlockLinear.GEMV_TILES[t].split_k > 1]
    lin = {t: Fp8BlockLinear(wq, ws, bias, backend=t) for t in tiles}
    for t in tiles[1:]:
        lin[t]._counters = lin[tiles[0]]._counters  # one counter set for every launch below
    kp = lin[tiles[0]].kp
    xs = [quantize_act_1x128(torch.randn(8, k, generator=g).bfloat16().to(dev), kp) for _ in range(3)]
    plan = [(tiles[i % len(tiles)], xs[i % 3], (1, 2, 3, 4, 8)[i % 5]) for i in range(40)]

    def chain():
        return [lin[t].run_quantized(xq, sx, m) for t, (xq, sx), m in plan]

    chain()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    assert any(getattr(c.metadata, "launch_pdl", False) for e in fp8_gemv._fp8_gemv_kernel.device_caches.values()
               for c in e[0].values())
    monkeypatch.setenv("KVRELAY_PDL", "0")  # the eager references below: plain launches
    for rep in range(3):
        for xq, sx in xs:
            q2, s2 = quantize_act_1x128(torch.randn(8, k, generator=g).bfloat16().to(dev), kp)
            xq.copy_(q2)
            sx.copy_(s2)
        graph.replay()
        torch.cuda.synchronize()
        assert not lin[tiles[0]]._counters.any(), "a launch left its counters non-zero"
        for i, (t, (xq, sx), m) in enumerate(plan):
            assert torch.equal(outs[i], lin[t].run_quantized(xq, sx, m)), (rep, i, t, m)


@pytest.mark.parametrize("t,e", [(1, 32), (4, 128)])
def test_moe_gemv_chains_follow_new_routing_every_replay(t, e, monkeypatch):
    """20 routed MoE blocks in a row (router -> GEMV1 -> GEMV2 -> combine), captured with PDL, where GEMV2 reads
    the router's ids and routing weights ahead of its wait (kernels/moe_gemv.py EARLY): with new inputs, hence
    new experts, at every replay, each block's output is bit for bit the eager PDL-off one, and the same as
    with GEMV2 waiting first (KVRELAY_MOE_EARLY=0)."""
    from kvrelay.kernels import moe, pdl
    from kvrelay.kernels.fp8 import quantize_weight_block128

    dev = _pdl_device()
    g = torch.Generator().manual_seed(31 * t + e)
    h = i = 2880
    q1, s1 = quantize_weight_block128((torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dev))
    q2, s2 = quantize_weight_block128((torch.randn(e, h, i, generator=g) * i ** -0.5).to(dev))
    ex = moe.MoEWeights.from_fp8(q1, s1, (torch.randn(e, 2 * i, generator=g) * 0.5).bfloat16().to(dev),
                                 q2, s2, (torch.randn(e, h, generator=g) * 0.5).bfloat16().to(dev))
    gate_w = (torch.randn(e, h, generator=g) * h ** -0.5).bfloat16().to(dev)
    gate_b = torch.randn(e, generator=g).bfloat16().to(dev)
    xs = [torch.randn(t, h, generator=g).bfloat16().to(dev) for _ in range(4)]

    def chain():
        return [moe.moe_forward(xs[j % 4], gate_w, gate_b, ex, 4, path="gemv") for j in range(20)]

    graphs = {}
    for early in ("1", "0"):
        monkeypatch.setenv("KVRELAY_PDL", "1")
        monkeypatch.setenv("KVRELAY_MOE_EARLY", early)
        assert pdl.enabled(dev)
        chain()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain()
        graphs[early] = (graph, outs)
    monkeypatch.setenv("KVRELAY_PDL", "0")  # the eager references below: plain launches
    monkeypatch.setenv("KVRELAY_MOE_EARLY", "0")
    for rep in range(4):
        for x in xs:
            x.copy_(torch.randn(t, h, generator=g).bfloat16().to(dev))
        ref = [moe.moe_forward(xs[j % 4], gate_w, gate_b, ex, 4, path="gemv") for j in range(20)]
        for early, (graph, outs) in graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            for j in range(20):
                assert torch.equal(outs[j], ref[j]), (early, rep, j, (outs[j].float() - ref[j].float()).abs().max())
