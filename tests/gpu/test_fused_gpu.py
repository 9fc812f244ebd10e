"""The decode step's fused glue kernels (kernels/fused.py: add_rms_norm, rotary_kv_write) on the GPU,
against the unfused GPU chain they replace and float32 references, and the whole model with them
(the default on CUDA) against the same model with KVRELAY_FUSED=0.

Bit-for-bit checks use inputs on a coarse grid (multiples of 1/8, small): every sum of squares and
residual add is then exact in fp32 whatever order the GPU reduces in, so fused and unfused must agree
to the bit; random inputs are compared with float32 references and within one bf16 step of the chain.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import (assert_logits_agree, assert_same_logits, attn64_cfg, decode_logits, dummy_weights,
                         prompts_and_feed)

from kernel_refs import bits as _bits, poison_allocator

pytestmark = pytest.mark.gpu

EPS = 1e-5


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return torch.device("cuda")


def _nearly_same_fp8(a, b):
    """e4m3 tensors equal but for a rare element one step apart (at most 1 in 1000, 2 for small ones)."""
    diff = a.float() != b.float()
    assert int(diff.sum()) <= max(2, a.numel() // 1000), int(diff.sum())
    assert ((a.float() - b.float()).abs() <= b.float().abs() * 2 ** -3 + 2 ** -9)[diff].all()


def _chain(x, delta, w, kp):
    """The unfused GPU path: kernels.moe_gemv's combine (for fp32 [T, k, H] deltas), torch's add, the RMSNorm
    kernel, the FP8 activation quantiser."""
    import triton

    from kvrelay.kernels import fp8_gemm, fused, moe_gemv

    if delta is None:
        added = x
    elif delta.dim() == 3:
        t, k, h = delta.shape
        comb = torch.empty(t, h, dtype=torch.bfloat16, device=x.device)
        # bf16 pair outputs (the grouped path's) are summed as their fp32 values
        moe_gemv.combine_kernel[(t, triton.cdiv(h, 1024))](delta.float(), comb, h, K_TOP=k, BLOCK=1024)
        added = x + comb
    else:
        added = x + delta
    normed = fused.rms_norm(added, w, EPS)
    return added, normed, fp8_gemm.quantize_act_1x128(normed, kp)


def _inputs(t, h, k, dev, gen, grid: bool):
    if grid:  # multiples of 1/8: exact sums (see module docstring)
        x = (torch.randint(-32, 33, (t, h), generator=gen) / 8).bfloat16().to(dev)
        dl = (torch.randint(-32, 33, (t, h), generator=gen) / 8).bfloat16().to(dev)
        y = (torch.randint(-8, 9, (t, k, h), generator=gen) / 8).float().to(dev)
    else:
        x = (torch.randn(t, h, generator=gen) * 3).bfloat16().to(dev)
        dl = (torch.randn(t, h, generator=gen) * 2).bfloat16().to(dev)
        y = (torch.randn(t, k, h, generator=gen) * 2).to(dev)
    w = (torch.rand(h, generator=gen) + 0.5).to(dev)
    return x, dl, y, w


@pytest.mark.parametrize("t,h", [(1, 2880), (4, 2880), (64, 2880), (3, 200), (2, 128)])
def test_add_rms_norm_equals_unfused_chain_bit_for_bit(t, h):
    from kvrelay.kernels.fp8 import quantize_act_1x128 as ref_quant
    from kvrelay.kernels.fused import add_rms_norm

    dev = _cuda()
    g = torch.Generator().manual_seed(t * 7 + h)
    kp = -(-h // 128) * 128
    x, dl, y, w = _inputs(t, h, 4, dev, g, grid=True)
    for delta in (None, dl, y, y.to(torch.bfloat16)):
        added, normed, (cq, cs) = _chain(x, delta, w, kp)
        poison_allocator(1 << 24)
        x_new, got = add_rms_norm(x, delta, w, EPS)
        assert (x_new is None) == (delta is None)
        if delta is not None:
            assert torch.equal(x_new, added)
        assert torch.equal(got, normed)
        poison_allocator(1 << 24)
        _, (q, s) = add_rms_norm(x, delta, w, EPS, quant_k=kp)
        assert q.shape == cq.shape and s.shape == cs.shape and s.stride() == cs.stride()
        assert torch.equal(_bits(q), _bits(cq)) and torch.equal(s, cs)
        # the torch quantiser (the CPU model's): the bounds of tests/gpu/test_fp8_gemm.py's check of the
        # activation quantiser (Triton's fp32 division is not IEEE's, so a rare byte differs by one step)
        rq, rs = ref_quant(normed)
        assert torch.allclose(s[:t], rs, rtol=1e-6)
        _nearly_same_fp8(q[:t, :h], rq)
        rows = torch.tensor([t - 1, 0][:t], dtype=torch.int64, device=dev)
        none, picked = add_rms_norm(x, delta, w, EPS, rows=rows, store_x=False)
        assert none is None and torch.equal(picked, normed[rows])
    x_new, nothing = add_rms_norm(x, y, None, EPS)
    assert nothing is None and torch.equal(x_new, _chain(x, y, w, kp)[0])


@pytest.mark.parametrize("t,h", [(1, 2880), (16, 2880), (300, 2880), (5, 200)])
def test_add_rms_norm_random_inputs_against_float32(t, h):
    from kvrelay.kernels.fp8 import dequantize_act_1x128
    from kvrelay.kernels.fused import add_rms_norm

    dev = _cuda()
    g = torch.Generator().manual_seed(t + h)
    kp = -(-h // 128) * 128
    x, dl, y, w = _inputs(t, h, 4, dev, g, grid=False)
    for delta in (dl, y):
        d32 = delta.float() if delta.dim() == 2 else delta.sum(1)
        x32 = x.float() + d32
        added, normed, _ = _chain(x, delta, w, kp)
        x_new, got = add_rms_norm(x, delta, w, EPS)
        assert torch.equal(x_new, added)  # elementwise: exact on the GPU
        # float32: the new residual within its bf16 roundings (the combine's, then the add's)
        assert ((x_new.float() - x32).abs() <= (d32.abs() + x32.abs()) * 2 ** -8 * 1.01 + 1e-6).all()
        # the norm in float32 of that residual: ours is it rounded once to bf16
        ref = w * x_new.float() * torch.rsqrt(x_new.float().pow(2).mean(-1, keepdim=True) + EPS)
        assert ((got.float() - ref).abs() <= ref.abs() * 2 ** -8 * 1.01 + 1e-6).all()
        # the sum of squares may reduce in another order: at most one bf16 step from the RMSNorm kernel
        step = normed.float().abs().clamp_min(1e-30) * 2 ** -7
        assert ((got.float() - normed.float()).abs() <= step).all()
        _, (q, s) = add_rms_norm(x, delta, w, EPS, quant_k=kp)
        deq = dequantize_act_1x128(q[:t, :h], s[:t])
        # e4m3 keeps 3 mantissa bits: within 1/16 relative (+ the bf16 rounding before), plus the group's
        # smallest step near zero
        tol = ref.abs() * (2 ** -4 + 2 ** -7) + s[:t].repeat_interleave(128, -1)[:, :h] * 2 ** -6 + 1e-2
        assert ((deq - ref).abs() <= tol).all()
        if delta.dim() == 3:  # the combine is load-bearing: leaving out an expert's output must fail
            x_bad, _ = add_rms_norm(x, delta[:, :3].contiguous(), w, EPS)
            assert not torch.allclose(x_bad.float(), x32, atol=0.1)


@pytest.mark.parametrize("t,nq,nkv,d,page", [(1, 64, 8, 64, 16), (7, 64, 8, 64, 16), (33, 6, 2, 32, 4)])
def test_rotary_kv_write_equals_rotary_then_write_kv(t, nq, nkv, d, page):
    from kvrelay.kernels.fused import rotary_kv_write, rotary_qk
    from kvrelay.kernels.reference import apply_rotary, rotary_cos_sin, write_kv, yarn_inv_freq

    dev = _cuda()
    g = torch.Generator().manual_seed(t + nq)
    qkv = torch.randn(t, (nq + 2 * nkv) * d, generator=g).bfloat16().to(dev)
    inv, conc = yarn_inv_freq(d, 150000.0, 32.0, 4096, beta_fast=32.0, beta_slow=1.0)
    cos, sin = rotary_cos_sin(torch.randint(0, 100000, (t,), generator=g).to(dev), inv, conc, torch.bfloat16)
    n_pages = -(-t // page) + 3
    pools = torch.randn(2, n_pages, 2, page, nkv, d, generator=g).bfloat16().to(dev)  # a group pool
    slots = torch.randperm(n_pages * page, generator=g)[:t].to(dev)
    pages, offsets = slots // page, slots % page
    want = pools.clone()
    q0, k0 = rotary_qk(qkv, cos, sin, nq, nkv, d)
    v0 = qkv[:, (nq + nkv) * d:].view(t, nkv, d)
    write_kv(want[1], k0, v0, pages, offsets)
    poison_allocator(1 << 22)
    q = rotary_kv_write(qkv, cos, sin, nq, nkv, d, pools[1], pages, offsets)
    torch.cuda.synchronize()
    assert torch.equal(q, q0) and torch.equal(pools, want)
    kref = apply_rotary(qkv[:, nq * d:(nq + nkv) * d].float().view(t, nkv, d), cos.float(), sin.float())
    assert torch.allclose(pools[1][pages, 0, offsets].float(), kref, rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("b,heads,d", [(1, 64, 64), (4, 64, 64), (64, 64, 64), (3, 8, 16), (2, 3, 64)])
def test_sink_correct_quantize_equals_correction_then_quantiser(b, heads, d):
    from kvrelay.kernels.attention import apply_sink_correction
    from kvrelay.kernels.fp8 import dequantize_act_1x128, quantize_act_1x128 as ref_quant
    from kvrelay.kernels.fp8_gemm import quantize_act_1x128
    from kvrelay.kernels.fused import sink_correct_quantize

    dev = _cuda()
    g = torch.Generator().manual_seed(b * heads + d)
    kp = -(-heads * d // 128) * 128
    out = torch.randn(b, heads, d, generator=g).bfloat16().to(dev)
    lse = (torch.randn(b, heads, generator=g) * 3).to(dev)
    sinks = (torch.randn(heads, generator=g) * 2).to(dev)
    keep = out.clone()
    poison_allocator(1 << 22)
    q, s = sink_correct_quantize(out, lse, sinks, kp)
    assert torch.equal(out, keep)
    fixed = apply_sink_correction(out.clone(), lse, sinks)
    cq, cs = quantize_act_1x128(fixed.reshape(b, -1), kp)
    assert q.shape == cq.shape and s.stride() == cs.stride()
    assert torch.equal(_bits(q), _bits(cq)) and torch.equal(s, cs)  # elementwise: exact on the GPU
    rq, rs = ref_quant(fixed.reshape(b, -1))  # the torch quantiser, within test_fp8_gemm.py's bounds
    assert torch.allclose(s[:b], rs, rtol=1e-6)
    _nearly_same_fp8(q[:b, : heads * d], rq)
    ref = (out.float() * torch.sigmoid(lse * 0.6931471805599453 - sinks)[..., None]).reshape(b, -1)
    deq = dequantize_act_1x128(q[:b, : heads * d], s[:b])
    tol = ref.abs() * (2 ** -4 + 2 ** -7) + s[:b].repeat_interleave(128, -1)[:, : heads * d] * 2 ** -6 + 1e-3
    assert ((deq - ref).abs() <= tol).all()
    raw = out.float().reshape(b, -1)
    assert not ((deq - raw).abs() <= raw.abs() * 2 ** -4 + 1e-3).all()  # the sink was applied


@pytest.mark.parametrize("b,splits,window", [(1, 64, None), (1, 2, 128), (8, 9, None), (64, 2, None), (3, 1, 128)])
def test_merge_quantize_equals_merge_then_quantiser(b, splits, window):
    """MergePending.quantize (the Triton split-KV decode's merge + sink fused with the output projection's
    1x128 FP8 quantisation) against the merge kernel's output through quantize_act_1x128: the same scales
    and FP8 values up to the fp32 order of the sums over splits (at most one FP8 step apart, rarely),
    padding rows zero with the floor scale; and the merged values are the float32 reference attention's."""
    from kvrelay.kernels import reference as R
    from kvrelay.kernels import triton_attention as ta
    from kvrelay.kernels.fp8 import dequantize_act_1x128
    from kvrelay.kernels.fp8_gemm import quantize_act_1x128
    from kernel_refs import make_paged_batch, rel_err

    dev = _cuda()
    g = torch.Generator().manual_seed(b * 100 + splits)
    heads, kv_heads, d, page = 64, 8, 64, 16
    kv_lens = torch.randint(1, 3000, (b,), generator=g).tolist()
    pb = make_paged_batch(kv_lens, [1] * b, kv_heads, d, page, dev, gen=g)
    q = torch.randn(b, heads, d, generator=g).bfloat16().to(dev)
    sinks = (torch.randn(heads, generator=g) + 2).to(dev)
    pending = ta.sink_decode(q, pb.pool, sinks, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, sm_scale=0.125,
                             window=window, num_splits=splits, merge=False)
    poison_allocator(1 << 22)
    xq, sx = pending.quantize(heads * d)
    merged = pending.apply()
    cq, cs = quantize_act_1x128(merged.reshape(b, -1), heads * d)
    assert xq.shape == cq.shape and sx.stride() == cs.stride()
    assert torch.allclose(sx, cs, rtol=2 ** -7, atol=0)
    same = (_bits(xq) == _bits(cq)).float().mean().item()
    assert same > 0.99, same
    got = dequantize_act_1x128(xq[:b], sx[:b])
    want = dequantize_act_1x128(cq[:b], cs[:b])
    assert ((got - want).abs() <= want.abs() * 2 ** -3 + sx[:b].repeat_interleave(128, -1) * 2 ** -6).all()
    assert not _bits(xq[b:]).any()
    kv = R.PagedKV(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    qo = torch.arange(b + 1, dtype=torch.int32, device=dev)
    ref = R.paged_attention(q.float(), pb.pool.float(), qo, kv, sinks, 0.125, window)
    assert rel_err(merged, ref) < 1e-2


@pytest.mark.parametrize("t,e", [(1, 32), (1, 128), (8, 32), (64, 128)])
def test_router_logits_match_cublas_and_float32(t, e):
    from kvrelay.kernels.fused import router_logits

    dev = _cuda()
    g = torch.Generator().manual_seed(t + e)
    h = 2880
    x = torch.randn(t, h, generator=g).bfloat16().to(dev)
    w = (torch.randn(e, h, generator=g) * h ** -0.5).bfloat16().to(dev)
    b = torch.randn(e, generator=g).bfloat16().to(dev)
    poison_allocator(1 << 20)
    got = router_logits(x, w, b)
    cublas = torch.nn.functional.linear(x, w, b)
    ref = x.float() @ w.float().T + b.float()
    step = ref.abs() * 2 ** -8 + 1e-4  # half a bf16 step (+ the fp32 sum's error): both round once
    assert ((got.float() - ref).abs() <= step).all()
    assert ((got.float() - cublas.float()).abs() <= 2 * step).all()
    assert (got == cublas).float().mean() > 0.9


@pytest.mark.parametrize("quant", ["bf16", "fp8-block128"])
def test_model_fused_equals_unfused(quant, monkeypatch):
    """The model on CUDA (graphs on) with the fused glue against the same weights with KVRELAY_FUSED=0:
    the same tokens fed to both, logits within bf16 rounding of each other at every step, top-1 equal
    except at near-ties; and the fused decode step launches fewer kernels."""
    from kvrelay.engine.runner import Runner

    dev = _cuda()
    cfg = attn64_cfg()
    w = dummy_weights(cfg, seed=5)
    runners = {}
    for fused in (True, False):
        monkeypatch.setenv("KVRELAY_FUSED", "1" if fused else "0")
        runners[fused] = Runner(cfg, w, device=dev, quant=quant, page_size=16, kv_tokens=8192,
                                cuda_graph_batch_sizes=(1, 2, 4))
    monkeypatch.delenv("KVRELAY_FUSED")
    assert runners[True].model.blocks[0].fused and not runners[False].model.blocks[0].fused
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 140, 37)]
    feed = torch.randint(0, cfg.vocab_size, (8, 3), generator=g).tolist()
    logits = {}
    for fused, r in runners.items():
        steps = [r.prefill_batch([(i, p) for i, p in enumerate(prompts)])]
        for toks in feed:
            steps.append(r.decode([0, 1, 2], toks))
        logits[fused] = steps
    # The router's logits GEMV sums in another order than cuBLAS: a bf16 tie between two experts'
    # logits can then resolve the other way and route one token differently in one layer, so the bound
    # is on the typical step and on agreement, not on every row.
    assert_logits_agree(logits[True], logits[False], f"{quant}: fused vs unfused logits")

    # fewer launches per decode step (eager, so each kernel shows up in the profiler)
    from torch.profiler import ProfilerActivity, profile

    counts = {}
    for fused, r in runners.items():
        r.graph_replay = False
        r.decode([0, 1, 2], [1, 2, 3])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            r.decode([0, 1, 2], [4, 5, 6])
            torch.cuda.synchronize()
        counts[fused] = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        r.graph_replay = True
    print(f"{quant}: kernels per decode step fused {counts[True]}, unfused {counts[False]}")
    # per layer: rotary + KV write 3 -> 1; bf16: norm, add, norm, combine, add 5 -> 2; fp8: with the QKV
    # quantisation 6 -> 2, and with FlashInfer decode the sink correction + O quantisation 2 -> 1; the
    # router GEMV 1 launch where cuBLAS may take 1 or 2 (split-K + its reduction)
    fi = runners[True].model.attention_backend == "flashinfer"
    saved = 5 if quant == "bf16" else (7 if fi else 6)
    assert counts[True] <= counts[False] - cfg.num_hidden_layers * saved


@pytest.mark.parametrize("t,e", [(1, 32), (1, 128), (8, 32), (64, 128)])
def test_router_route_equals_logits_then_route_and_replays(t, e):
    """kernels/router.py (logits + top-k + softmax in one launch, routed by the last-arriving program)
    gives router_logits + route_topk's weights and ids bit for bit, eagerly and replayed in a CUDA graph
    on new inputs, and leaves its arrival counters at zero."""
    from kvrelay.kernels import moe, router
    from kvrelay.kernels.fused import router_logits

    dev = _cuda()
    g = torch.Generator().manual_seed(t * e)
    h = 2880
    w = (torch.randn(e, h, generator=g) * h ** -0.5).bfloat16().to(dev)
    b = torch.randn(e, generator=g).bfloat16().to(dev)
    cnt = router.new_counters(dev)
    x = torch.randn(t, h, generator=g).bfloat16().to(dev)
    got = router.router_route(x, w, b, 4, cnt)
    ref = moe.route_topk(router_logits(x, w, b), 4)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])
    assert not cnt.any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router.router_route(x, w, b, 4, cnt)
    for _ in range(3):
        x.copy_(torch.randn(t, h, generator=g).bfloat16().to(dev))
        graph.replay()
        ref = moe.route_topk(router_logits(x, w, b), 4)
        assert torch.equal(out[1], ref[1]) and torch.equal(out[0], ref[0])
        assert not cnt.any()


@pytest.mark.parametrize("t,e", [(1, 32), (1, 128), (8, 32), (64, 128)])
def test_add_norm_route_matches_add_rms_norm_and_router(t, e):
    """kernels/router.add_rms_norm_route (residual add + MoE norm + router + routing in one launch):
    x + delta equal to add_rms_norm's, the normed row within its RMSNorm sum order (one bf16 step), the
    logits within half a bf16 step of float32 on that row, the routing exactly route_topk of the
    kernel's logits, also replayed in a CUDA graph; counters left at zero."""
    from kvrelay.kernels import moe, router
    from kvrelay.kernels.fused import add_rms_norm

    dev = _cuda()
    g = torch.Generator().manual_seed(3 * t + e)
    h = 2880
    x = torch.randn(t, h, generator=g).bfloat16().to(dev)
    d = torch.randn(t, h, generator=g).bfloat16().to(dev)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16().to(dev)
    w = (torch.randn(e, h, generator=g) * h ** -0.5).bfloat16().to(dev)
    b = torch.randn(e, generator=g).bfloat16().to(dev)
    cnt = router.new_counters(dev)
    lg = torch.empty(t, e, dtype=torch.bfloat16, device=dev)

    def check(out):
        xn, hn, gw, gi = out
        rx, rh = add_rms_norm(x, d, nw, 1e-5)
        assert torch.equal(xn, rx)
        assert ((hn.float() - rh.float()).abs() <= rh.float().abs() * 2 ** -7 + 1e-6).all()
        ref = hn.float() @ w.float().T + b.float()
        assert ((lg.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-4).all()
        rw, ri = moe.route_topk(lg, 4)
        assert torch.equal(gi, ri) and torch.equal(gw, rw)
        assert not cnt.any()

    check(router.add_rms_norm_route(x, d, nw, 1e-5, w, b, 4, cnt, logits=lg))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router.add_rms_norm_route(x, d, nw, 1e-5, w, b, 4, cnt, logits=lg)
    for _ in range(3):
        x.copy_(torch.randn(t, h, generator=g).bfloat16().to(dev))
        graph.replay()
        check(out)


@pytest.mark.parametrize("quant", ["bf16", "fp8-block128"])
def test_model_with_the_lookup_in_the_first_norm_equals_without(monkeypatch, quant):
    # KVRELAY_EMBED_FUSE=1: the first block's norm launch looks the token rows up itself (the same bits as
    # F.embedding then the norm), graph-replayed and eager decode steps and a prefill alike
    dev = _cuda()
    cfg = attn64_cfg()
    w = dummy_weights(cfg, seed=13)
    prompts, feed = prompts_and_feed(cfg, 6, (5, 90), 4)
    logits = {}
    for on in ("1", "0"):
        monkeypatch.setenv("KVRELAY_EMBED_FUSE", on)
        for graphs in (True, False):
            logits[on, graphs] = decode_logits(cfg, w, dev, prompts, feed, tail=[([1], [feed[0][0]])], kv_tokens=4096,
                                               quant=quant, cuda_graphs=graphs, cuda_graph_batch_sizes=(1, 2))
    for graphs in (True, False):
        assert_same_logits(logits["1", graphs], logits["0", graphs], ("graphs", graphs))
