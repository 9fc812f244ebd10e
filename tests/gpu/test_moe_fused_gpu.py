"""The decode MoE's two GEMVs in one launch (kernels/moe_fused.py, KVRELAY_MOE_FUSED_GEMV) on the GPU, where its
programs poll each other: at gpt-oss's expert shapes it matches the float32 reference and the two GEMVs, repeats
its bits and leaves its counters zero; replayed from a CUDA graph with PDL launch after launch (a hang fails the
test after a deadline instead of holding the run); with fewer resident programs than units (forced) its programs
loop and give the same bits; and the tiny model gives the same tokens with it on and off. (The bits of the two GEMVs
under the interpreter, the compile's poll and wait: tests/cpu/test_moe_fused.py.)"""

from __future__ import annotations

import time

import pytest
import torch
from test_moe_norm_fuse_gpu import H, INTER, K, _cuda, _fp8_experts, _pdl_device, _tokens
from tiny_models import assert_logits_agree, attn64_cfg, dummy_weights

from kernel_refs import assert_same as _same, moe_ref, poison_allocator, rel_err

pytestmark = pytest.mark.gpu
HANG_S = 20.0


def _finish(what: str) -> None:
    """Wait for the GPU's work so far, failing after HANG_S instead of hanging (a poll that never ends)."""
    done = torch.cuda.Event()
    done.record()
    t0 = time.monotonic()
    while not done.query():
        if time.monotonic() - t0 > HANG_S:
            pytest.fail(f"{what}: the GPU did not finish within {HANG_S} s (a fused launch polling forever?)")
        time.sleep(0.001)


def _dequant(ex):
    from kvrelay.kernels.fp8 import dequantize_experts_block128

    w1 = dequantize_experts_block128(ex.w1, ex.s1, torch.float32)[:, :, :H]
    w2 = dequantize_experts_block128(ex.w2, ex.s2, torch.float32)[:, :, :INTER]
    return w1, w2


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_fused_matches_the_reference_and_the_two_gemvs(t):
    from kvrelay.kernels import moe_fused
    from kvrelay.kernels.moe import moe_experts

    dev = _cuda()
    g = torch.Generator(device=dev).manual_seed(20 + t)
    ex = _fp8_experts(dev, g)
    hx, ids, rw, _ = _tokens(t, dev, g)
    cnt = moe_fused.new_fused_counters(dev)
    calls = []
    orig = moe_fused.moe_gemv_fused

    def counted(*args, **kwargs):
        calls.append(orig(*args, **kwargs))
        return calls[-1]

    moe_fused.moe_gemv_fused = counted
    try:
        poison_allocator(1 << 26)  # rows the kernel failed to write would read NaN
        got = moe_experts(hx, ids, rw, ex, combine=False, fused_counters=cnt)
        _finish("fused launch")
    finally:
        moe_fused.moe_gemv_fused = orig
    assert calls == [True], "the fused launch ran"
    assert not cnt.any(), "the last programs past their polls reset the counters"
    two = moe_experts(hx, ids, rw, ex, combine=False)
    assert rel_err(got, two) < 2e-3  # the same math in other tiles: another fp32 order
    w1, w2 = _dequant(ex)
    ref = moe_ref(hx, ids, rw, w1, ex.b1, w2, ex.b2, round_pairs=True)
    assert rel_err(got.float().sum(1), ref) < 1e-2
    again = moe_experts(hx, ids, rw, ex, combine=False, fused_counters=cnt)
    _finish("second fused launch")
    _same(again, got, "again")


@pytest.mark.parametrize("t", [1, 4])
def test_replayed_with_pdl_on_one_counter_set(t, monkeypatch):
    """Eight 'layers' of the fused MoE on one counter set (each layer's input the previous one's summed output,
    normed), captured with PDL and replayed on new inputs: each replay finishes, equals the eager chain without
    PDL bit for bit, and leaves the counters zero."""
    from kvrelay.kernels import moe_fused, pdl
    from kvrelay.kernels.fused import rms_norm
    from kvrelay.kernels.moe import moe_experts

    dev = _pdl_device()
    g = torch.Generator(device=dev).manual_seed(30 + t)
    ex = _fp8_experts(dev, g)
    hx, ids, rw, _ = _tokens(t, dev, g)
    nw = (torch.rand(H, generator=g, device=dev) + 0.5).bfloat16()
    cnt = moe_fused.new_fused_counters(dev)

    def chain():
        h, outs = hx, []
        for _ in range(8):
            y = moe_experts(h, ids, rw, ex, combine=False, fused_counters=cnt)
            h = rms_norm(y.float().sum(1).bfloat16(), nw, 1e-5)
            outs.append(y)
        return outs

    monkeypatch.setenv("KVRELAY_PDL", "1")
    assert pdl.enabled(dev)
    chain()  # compile outside the capture
    _finish("eager chain")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    monkeypatch.setenv("KVRELAY_PDL", "0")  # the eager reference: plain launches
    for i in range(5):
        hx.copy_(torch.randn(t, H, generator=g, device=dev).bfloat16())
        graph.replay()
        _finish(f"replay {i}")
        assert not cnt.any()
        for j, (a, b) in enumerate(zip(outs, chain())):
            _same(a, b, f"replay {i} layer {j}")


@pytest.mark.parametrize("room", [7, 131, 0])
@pytest.mark.parametrize("which", ["default", "tuned"])
def test_fewer_resident_programs_loop_over_the_units(room, which, monkeypatch):
    """Where the occupancy bound allows fewer programs than units (larger batches; here forced), the launch's
    programs loop over several units each, all GEMM1 parts first, and give the same bits as the same launch
    unbounded; where no program fits (0), moe_gemv_fused launches nothing and moe_experts runs the two GEMVs.
    For DEFAULT_LAUNCH and the launch tuned for gpt-oss's experts (moe_fused.TUNED)."""
    from kvrelay.kernels import moe_fused
    from kvrelay.kernels.moe import moe_experts

    dev = _cuda()
    launch = moe_fused.DEFAULT_LAUNCH if which == "default" else moe_fused.fused_launch(H, INTER)
    assert which == "default" or launch is moe_fused.TUNED[(H, INTER)]
    g = torch.Generator(device=dev).manual_seed(40)
    ex = _fp8_experts(dev, g)
    hx, ids, rw, _ = _tokens(2, dev, g)
    cnt = moe_fused.new_fused_counters(dev)

    def fused(act, y):
        return moe_fused.moe_gemv_fused(hx, ids.reshape(-1), K, rw.reshape(-1), ex, 1.702, 7.0, act, y, cnt, launch)

    want = torch.zeros(2 * K, H, dtype=torch.bfloat16, device=dev)
    assert fused(torch.zeros(2 * K, INTER, dtype=torch.bfloat16, device=dev), want)  # as many programs as fit
    _finish("fused launch")
    rooms = []
    orig = moe_fused.resident_programs

    def tight(*args):
        rooms.append(orig(*args))
        return room

    monkeypatch.setattr(moe_fused, "resident_programs", tight)
    monkeypatch.setattr(moe_fused, "_ROOM", {})
    act = torch.zeros(2 * K, INTER, dtype=torch.bfloat16, device=dev)
    y = torch.zeros(2 * K, H, dtype=torch.bfloat16, device=dev)
    ran = fused(act, y)
    _finish(f"fused launch of {room} programs")
    assert ran is (room > 0) and not cnt.any()
    print(f"resident programs of {launch.label()} on this GPU: {rooms}; batch 1 has {K * (H // launch.rows2)} units")
    if which == "default":
        assert rooms and rooms[0] >= K * (H // launch.rows2)  # batch 1: a program a unit
    if room:
        _same(y, want, "looping programs")
    else:
        assert not act.any() and not y.any()
        _same(moe_experts(hx, ids, rw, ex, combine=False, fused_counters=cnt),
              moe_experts(hx, ids, rw, ex, combine=False), "the two GEMVs")


@pytest.mark.parametrize("quant", ["bf16", "fp8-block128"])
def test_model_with_the_fusion_on_and_off(quant, monkeypatch):
    """The tiny model on CUDA (graphs of 1, 2 and 4 rows, PDL where supported) with KVRELAY_MOE_FUSED_GEMV=1 and
    0: logits within the fp32-order differences of the two tilings, top-1 equal but at near-ties, and the fused
    kernel ran (its experts tiled by a launch for the tiny shape)."""
    from kvrelay.engine.runner import Runner
    from kvrelay.kernels import moe_fused

    dev = _cuda()
    cfg = attn64_cfg()
    w = dummy_weights(cfg, seed=5)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 140, 37)]
    feed = torch.randint(0, cfg.vocab_size, (9, 3), generator=g).tolist()
    launch = moe_fused.FusedLaunch(rows2=32, block_n1=32, block_k=256, num_warps=4, num_stages=2)
    assert launch.rows1(cfg.hidden_size, cfg.intermediate_size) == (64, 32)
    monkeypatch.setitem(moe_fused.TUNED, (cfg.hidden_size, cfg.intermediate_size), launch)
    logits = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVRELAY_MOE_FUSED_GEMV", flag)
        moe_fused._moe_fused_kernel.device_caches.clear()
        r = Runner(cfg, w, device=dev, quant=quant, page_size=16, kv_tokens=8192, cuda_graph_batch_sizes=(1, 2, 4))
        steps = [r.prefill_batch([(i, p) for i, p in enumerate(prompts)])]
        for i, toks in enumerate(feed):
            ids = [0, 1, 2][: 3 - (i % 3)]
            steps.append(r.decode(ids, toks[: len(ids)]))
        _finish(f"model, fusion {flag}")
        logits[flag] = [s.cpu() for s in steps]
        variants = [k for entry in moe_fused._moe_fused_kernel.device_caches.values() for k in entry[0].values()]
        assert bool(variants) == (flag == "1")
    assert_logits_agree(logits["1"], logits["0"], f"{quant}: fused GEMVs on vs off")
