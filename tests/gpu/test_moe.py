"""Triton MoE (routing, decode GEMV path, grouped path, torch grouped path) against float32 references."""

from __future__ import annotations

import pytest
import torch

from kernel_refs import moe_ref, poison_allocator, rel_err

pytestmark = pytest.mark.gpu


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return torch.device("cuda")


def _experts(e, hid, inter, gen, dev):
    w1 = (torch.randn(e, 2 * inter, hid, generator=gen) * hid ** -0.5).to(dev)
    b1 = (torch.randn(e, 2 * inter, generator=gen) * 0.5).bfloat16().to(dev)
    w2 = (torch.randn(e, hid, inter, generator=gen) * inter ** -0.5).to(dev)
    b2 = (torch.randn(e, hid, generator=gen) * 0.5).bfloat16().to(dev)
    return w1, b1, w2, b2


def test_route_topk_matches_reference():
    from kvrelay.kernels.moe import route_topk
    dev = _cuda()
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(513, 128, generator=g).bfloat16().to(dev)
    poison_allocator(1 << 22)
    w, ids = route_topk(logits, 4)
    vals, rids = torch.topk(logits, 4, dim=-1)
    assert torch.equal(logits.gather(-1, ids), vals)  # same values (ids equal up to exact ties)
    ref_w = torch.softmax(vals, dim=-1, dtype=torch.bfloat16)
    assert (w.float() - ref_w.float()).abs().max() <= 1 / 128  # bf16 rounding of the same softmax


@pytest.mark.parametrize("quant", ["bf16", "fp8"])
@pytest.mark.parametrize("tokens,path", [(1, "gemv"), (5, "gemv"), (1, "grouped"), (77, "grouped"),
                                         (300, "grouped"), (77, "torch")])
def test_moe_experts(quant, tokens, path):
    from kvrelay.kernels.fp8 import dequantize_weight_block128, quantize_weight_block128
    from kvrelay.kernels.moe import MoEWeights, moe_experts, route_topk
    dev = _cuda()
    if path == "torch" and quant == "fp8":
        pytest.skip("torch._grouped_mm path is bf16-only")
    g = torch.Generator().manual_seed(tokens * 3 + len(path))
    e, hid, inter, k = 16, 2880, 2880 if tokens == 1 else 384, 4
    w1, b1, w2, b2 = _experts(e, hid, inter, g, dev)
    if quant == "fp8":
        q1, s1 = quantize_weight_block128(w1)
        q2, s2 = quantize_weight_block128(w2)
        ex = MoEWeights.from_fp8(q1, s1, b1, q2, s2, b2)
        w1r, w2r = dequantize_weight_block128(q1, s1, torch.float32), dequantize_weight_block128(q2, s2, torch.float32)
    else:
        ex = MoEWeights.from_bf16(w1.bfloat16(), b1, w2.bfloat16(), b2)
        w1r, w2r = w1.bfloat16().float(), w2.bfloat16().float()
    x = torch.randn(tokens, hid, generator=g).bfloat16().to(dev)
    rw, ids = route_topk(torch.randn(tokens, e, generator=g).bfloat16().to(dev), k)
    poison_allocator(1 << 26)
    out = moe_experts(x, ids, rw, ex, path=path)
    torch.cuda.synchronize()
    # the fp8 grouped path feeds the tensor cores fp8 activations (1x128); the gemv path keeps them bf16;
    # the gemv and grouped paths round each weighted pair output to bf16 before the sum
    ref = moe_ref(x, ids, rw, w1r, b1, w2r, b2, quant_act=(quant == "fp8" and path == "grouped"),
                  round_pairs=path != "torch")
    assert rel_err(out, ref) < 1.5e-2
    # the +1 on the up half and the interleave are load-bearing: a chunk(2) layout must fail
    bad = moe_ref(x, ids, rw, w1r[:, torch.cat([torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)])],
                  b1, w2r, b2)
    assert rel_err(out, bad) > 0.1


def test_moe_paths_agree_fp8_decode_batch():
    """gemv and grouped paths on the same fp8 experts (decode batch 8, gpt-oss shapes)."""
    from kvrelay.kernels.fp8 import dequantize_weight_block128, quantize_weight_block128
    from kvrelay.kernels.moe import MoEWeights, moe_experts, route_topk
    dev = _cuda()
    g = torch.Generator().manual_seed(7)
    w1, b1, w2, b2 = _experts(8, 2880, 2880, g, dev)
    q1, s1 = quantize_weight_block128(w1)
    q2, s2 = quantize_weight_block128(w2)
    ex = MoEWeights.from_fp8(q1, s1, b1, q2, s2, b2)
    x = torch.randn(8, 2880, generator=g).bfloat16().to(dev)
    rw, ids = route_topk(torch.randn(8, 8, generator=g).bfloat16().to(dev), 4)
    a = moe_experts(x, ids, rw, ex, path="gemv")
    b = moe_experts(x, ids, rw, ex, path="grouped")
    w1r = dequantize_weight_block128(q1, s1, torch.float32)
    w2r = dequantize_weight_block128(q2, s2, torch.float32)
    assert rel_err(a, moe_ref(x, ids, rw, w1r, b1, w2r, b2)) < 1.5e-2
    assert rel_err(b, moe_ref(x, ids, rw, w1r, b1, w2r, b2, quant_act=True, round_pairs=True)) < 1.5e-2
    assert rel_err(a, b) < 6e-2  # the two differ by the activation quantisation only


@pytest.mark.parametrize("num_experts,tokens", [(32, 256), (128, 512), (32, 2048)])
def test_expert_sort_kernel_equals_torch_sort(num_experts, tokens):
    """The decode path's one-program counting sort equals the torch ops on the GPU, bit for bit."""
    from kvrelay.kernels.moe import sort_by_expert

    g = torch.Generator(device="cuda").manual_seed(tokens)
    weights = torch.rand(num_experts, device="cuda", generator=g) ** 3
    ids = torch.multinomial(weights, tokens * 4, replacement=True, generator=g).view(tokens, 4)
    for block_m in (16, 64):
        got = sort_by_expert(ids, num_experts, block_m, path="kernel")
        want = sort_by_expert(ids, num_experts, block_m, path="torch")
        for a, b in zip(got, want):
            assert torch.equal(a.long(), b.long())


@pytest.mark.parametrize("num_experts,tokens,block_m", [(32, 8192, 64), (128, 8192, 64), (32, 32768, 128),
                                                        (128, 2049, 16)])
def test_chunked_expert_sort_equals_torch_sort(num_experts, tokens, block_m):
    """The prefill path's chunked sort (what sort_by_expert picks past SORT_KERNEL_MAX_PAIRS on CUDA) equals
    the torch ops on the GPU, bit for bit, under PDL as the model launches it, at an 8k-token prefill's
    32,768 pairs and a 32k-token chunk's 131,072."""
    from kvrelay.kernels import moe

    g = torch.Generator(device="cuda").manual_seed(tokens + num_experts)
    weights = torch.rand(num_experts, device="cuda", generator=g) ** 3
    ids = torch.multinomial(weights, tokens * 4, replacement=True, generator=g).view(tokens, 4)
    assert ids.numel() > moe.SORT_KERNEL_MAX_PAIRS
    got = moe.sort_by_expert(ids, num_experts, block_m)  # auto: the chunked kernels
    want = moe.sort_by_expert(ids, num_experts, block_m, path="torch")
    for a, b in zip(got, want):
        assert a.dtype == torch.int32
        assert torch.equal(a.long(), b.long())


def test_grouped_moe_on_the_chunked_sort_matches_reference(monkeypatch):
    """A prefill-sized grouped MoE (2,500 tokens: 10,000 pairs, past the one-program sort) on the chunked
    sort: against the float32 reference, and bit-equal to the same call on the torch sort."""
    from kvrelay.kernels import moe
    dev = _cuda()
    ex, x, ids, rw, ref = _fp8_setup(32, 512, 256, 2500, 17, dev)
    assert ids.numel() > moe.SORT_KERNEL_MAX_PAIRS
    out = moe.moe_experts(x, ids, rw, ex, path="grouped")
    assert rel_err(out, ref) < 1.5e-2
    sort = moe.sort_by_expert
    monkeypatch.setattr(moe, "sort_by_expert", lambda *a, **k: sort(*a, **{**k, "path": "torch"}))
    assert torch.equal(moe.moe_experts(x, ids, rw, ex, path="grouped"), out)


@pytest.mark.parametrize("path,tokens", [("grouped", 300), ("gemv", 8)])
def test_grouped_uncombined_pairs_are_bf16_and_sum_to_the_combined_output(path, tokens):
    """combine=False of a bf16 model keeps each weighted pair output bf16 on either path (half the bytes the
    next residual add reads; both paths round alike, so a decode row does not change with the batch that
    picks the path), the pairs the combined path sums: their fp32 sum is the combined output within its
    final bf16 rounding, and both stay within the float32 reference's bound."""
    from kvrelay.kernels import moe

    dev = _cuda()
    # (the gemv path feeds its GEMMs bf16 activations, the grouped one fp8)
    ex, x, ids, rw, ref = _fp8_setup(32, 512, 256, tokens, 23, dev, quant_act=path == "grouped")
    pairs = moe.moe_experts(x, ids, rw, ex, path=path, combine=False)
    assert pairs.dtype == torch.bfloat16 and pairs.shape == (tokens, ids.shape[1], 512)
    out = moe.moe_experts(x, ids, rw, ex, path=path)
    summed = pairs.float().sum(1)
    step = out.float().abs() * 2 ** -8 + 1e-6
    assert ((summed - out.float()).abs() <= step).all()
    assert rel_err(summed.to(torch.bfloat16), ref) < 1.5e-2 and rel_err(out, ref) < 1.5e-2
    # every pair slot holds a real output (not a zeroed or stale buffer)
    assert (pairs.float().abs().sum(-1) > 0).all()
    # fp32 activations keep fp32 pairs
    assert moe.moe_experts(x.float(), ids, rw, ex, path=path, combine=False).dtype == torch.float32


def _fp8_setup(e, hid, inter, tokens, seed, dev, quant_act=True):
    from kvrelay.kernels.fp8 import dequantize_weight_block128, quantize_weight_block128
    from kvrelay.kernels.moe import MoEWeights, route_topk
    g = torch.Generator().manual_seed(seed)
    w1, b1, w2, b2 = _experts(e, hid, inter, g, dev)
    q1, s1 = quantize_weight_block128(w1)
    q2, s2 = quantize_weight_block128(w2)
    ex = MoEWeights.from_fp8(q1, s1, b1, q2, s2, b2)
    x = torch.randn(tokens, hid, generator=g).bfloat16().to(dev)
    # skewed routing: several M blocks for some experts, none for others
    logits = torch.randn(tokens, e, generator=g) + 1.5 * torch.randn(e, generator=g)
    rw, ids = route_topk(logits.bfloat16().to(dev), 4)
    ref = moe_ref(x, ids, rw, dequantize_weight_block128(q1, s1, torch.float32), b1,
                  dequantize_weight_block128(q2, s2, torch.float32), b2, quant_act=quant_act, round_pairs=True)
    return ex, x, ids, rw, ref


@pytest.mark.parametrize("block_m,w1,w2", [
    (16, dict(group_m=8), dict(group_m=8)),
    (32, dict(masked=False), dict(masked=False, group_m=4)),
    (64, dict(tma=True, masked=False, group_m=8), dict(tma=True)),
    (64, dict(block_n=256, num_warps=8, num_stages=3, tma=True), dict(block_n=256, num_warps=8, num_stages=3)),
    # the inputs in the sort's slots as TMA tiles (GEMM1 only; both)
    (16, dict(tma=True, masked=False, sorted_a=True), dict(group_m=8)),
    (64, dict(tma=True, masked=False, sorted_a=True, group_m=16), dict(tma=True, sorted_a=True, group_m=8)),
    # (not ws: kernels/moe_ws.py hung on the H200 at 806a8d7 in the 128-row case of this test)
])
def test_grouped_fp8_knobs_match_reference(block_m, w1, w2):
    """The tuner's knobs (program order, clamped unmasked loads, TMA weight tiles) at gpt-oss's N and K
    (2880 = 22.5 tiles of 128: a partial N tile in GEMM2)."""
    from kvrelay.kernels import moe
    from kvrelay.kernels.moe_configs import GemmConfig, GroupedConfig
    dev = _cuda()
    if (w1.get("tma") or w2.get("tma")) and not moe.tma_available():
        pytest.skip("triton without host TMA descriptors")
    ex, x, ids, rw, ref = _fp8_setup(16, 2880, 2880, 96, 11, dev)
    base = dict(block_n=128, num_warps=4, num_stages=4)
    cfg = GroupedConfig(block_m, GemmConfig(**{**base, **w1}), GemmConfig(**{**base, **w2}))
    poison_allocator(1 << 26)
    out = moe._moe_grouped(x, ids, rw, ex, 1.702, 7.0, config=cfg)
    torch.cuda.synchronize()
    assert rel_err(out, ref) < 1.5e-2, cfg.label()
    # a second call launches with the kept TMA descriptors (MoEWeights.descs): the same bits
    kept = dict(ex.descs)
    assert len(kept) == int(cfg.w1.tma) + int(cfg.w2.tma)
    again = moe._moe_grouped(x, ids, rw, ex, 1.702, 7.0, config=cfg)
    torch.cuda.synchronize()
    assert torch.equal(again, out) and all(ex.descs[k] is d for k, d in kept.items()), cfg.label()


def test_tracked_table_configs_match_reference():
    """Every config in this GPU's tracked table (kernels/configs/, written by bench/tune_moe.py) gives the
    reference's numbers: a kernel change that breaks a tuned config fails here, not in serving."""
    from kvrelay.kernels import moe, moe_configs
    dev = _cuda()
    path = moe_configs.CONFIG_DIR / moe_configs.file_name(torch.cuda.get_device_name(dev))
    if not path.is_file():
        pytest.skip(f"no tuned table for this GPU ({path.name})")
    configs = {c for rows in moe_configs.load_file(str(path)).values() for _, c in rows}
    ex, x, ids, rw, ref = _fp8_setup(16, 2880, 2880, 64, 12, dev)
    for cfg in sorted(configs, key=lambda c: c.label()):
        if (cfg.w1.tma or cfg.w2.tma) and not moe.tma_available():
            continue
        poison_allocator(1 << 26)
        out = moe._moe_grouped(x, ids, rw, ex, 1.702, 7.0, config=cfg)
        torch.cuda.synchronize()
        assert rel_err(out, ref) < 1.5e-2, cfg.label()


def test_quantize_sorted_rows_are_the_gathered_rows_bits():
    """kernels/moe_sort.quantize_sorted (the sorted_a configs' GEMM1 input): each live slot holds its token's row
    of quantize_act_1x128's output bit for bit, padding slots zeros with the floor scale, at gpt-oss's K (2880
    padded to 2944) on both sort paths (the one-program sort below 4,096 pairs, the chunked one above)."""
    from kvrelay.kernels.fp8_gemm import quantize_act_1x128
    from kvrelay.kernels.moe import quantize_sorted, route_topk, sort_by_expert
    dev = _cuda()
    g = torch.Generator().manual_seed(21)
    for tokens, e, bm in ((40, 32, 16), (1500, 128, 64)):
        x = torch.randn(tokens, 2880, generator=g).bfloat16().to(dev)
        _, ids = route_topk((torch.randn(tokens, e, generator=g) * 2).bfloat16().to(dev), 4)
        sid, be, _ = sort_by_expert(ids, e, bm)
        n = ids.numel()
        q, s = quantize_sorted(x, sid, be, e, n, 4, 2944)
        xq, xs = quantize_act_1x128(x, 2944, m_major=False)
        used = (be < e).repeat_interleave(bm)
        live = (sid < n) & used
        src = sid[live].long() // 4
        assert torch.equal(q[live].view(torch.uint8), xq[src].view(torch.uint8)) and torch.equal(s[live], xs[src])
        pad = (sid >= n) & used
        assert pad.any() and not q[pad].view(torch.uint8).any()
        floor = quantize_act_1x128(torch.zeros(1, 2880, dtype=torch.bfloat16, device=dev), 2944, m_major=False)[1]
        assert torch.equal(s[pad], floor[0, 0].expand_as(s[pad]))
