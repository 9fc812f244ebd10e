"""kernels/fused.py (Triton RMSNorm and q/k rotary) under TRITON_INTERPRET=1 on CPU tensors, against the
torch reference path the CPU model uses, on random inputs of odd sizes. The interpreter flag must be set
before triton is imported, so the checks run in a child interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import torch
    from kvrelay.engine.layers.norm import RMSNorm
    from kvrelay.engine.layers.linear import TensorDictWeights
    from kvrelay.kernels import fused
    from kvrelay.kernels.reference import apply_rotary, rotary_cos_sin, yarn_inv_freq

    g = torch.Generator().manual_seed(0)
    for t, h in [(1, 2880), (7, 100), (3, 64)]:
        x = (torch.randn(t, h, generator=g) * 3).to(torch.bfloat16)
        w = torch.rand(h, generator=g) + 0.5
        ref = RMSNorm(TensorDictWeights({"n": w.to(torch.bfloat16)}), "n", 1e-5, "cpu")
        want = ref(x).float()
        got = fused.rms_norm(x, ref.scale, 1e-5).float()
        assert got.dtype == want.dtype and got.shape == want.shape
        err = ((got - want).abs() / want.abs().clamp_min(1e-2)).max().item()
        assert err <= 2 ** -7, ("rmsnorm", t, h, err)  # at most one bf16 rounding step apart

    for t, nq, nkv, d in [(1, 64, 8, 64), (5, 6, 2, 32), (4, 3, 1, 16)]:
        qkv = torch.randn(t, (nq + 2 * nkv) * d, generator=g).to(torch.bfloat16)
        inv, conc = yarn_inv_freq(d, 150000.0, 32.0, 4096, beta_fast=32.0, beta_slow=1.0)
        pos = torch.randint(0, 5000, (t,), generator=g)
        cos, sin = rotary_cos_sin(pos, inv, conc, torch.bfloat16)
        q, k, _ = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        # float32 reference of the same rotation (the bf16 torch path rounds after each op)
        want_q = apply_rotary(q.float().view(t, nq, d), cos.float(), sin.float())
        want_k = apply_rotary(k.float().view(t, nkv, d), cos.float(), sin.float())
        got_q, got_k = fused.rotary_qk(qkv, cos, sin, nq, nkv, d)
        assert got_q.shape == (t, nq, d) and got_k.shape == (t, nkv, d) and got_q.dtype == torch.bfloat16
        for got, want in [(got_q, want_q), (got_k, want_k)]:
            assert torch.allclose(got.float(), want, rtol=2 ** -7, atol=1e-2), (t, nq, nkv, d)
        # and dropping the rotation (or swapping halves) would not pass
        assert not torch.allclose(got_q.float(), q.float().view(t, nq, d), rtol=2 ** -7, atol=1e-2) or t == 0
    print("ok")
""")


def test_fused_kernels_interpreted() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-3000:] + res.stderr[-3000:]


GLUE = textwrap.dedent("""
    import torch, triton
    from kvrelay.kernels import fused, fp8, fp8_gemm, moe_gemv
    from kvrelay.kernels.reference import apply_rotary, rotary_cos_sin, write_kv, yarn_inv_freq

    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    def same(a, b, what):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
        assert a.stride() == b.stride(), (what, a.stride(), b.stride())
        assert torch.equal(bits(a), bits(b)), (what, (a.float() - b.float()).abs().max())

    def interp_add(a, b):
        # torch's bf16 `a + b` (fp32 sum, one rounding) with the interpreter's fp32->bf16 cast, which
        # truncates where the GPU (and torch) round to nearest even; the GPU test compares with torch's add
        s = a.float() + b.float()
        return (s.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

    g = torch.Generator().manual_seed(0)
    eps = 1e-5
    for t, h, k in [(1, 2880, 4), (5, 200, 4), (3, 128, 2), (6, 64, 1)]:
        kp = -(-h // 128) * 128
        x = (torch.randn(t, h, generator=g) * 3).to(torch.bfloat16)
        w = torch.rand(h, generator=g) + 0.5
        dl = (torch.randn(t, h, generator=g) * 2).to(torch.bfloat16)
        y = torch.randn(t, k, h, generator=g) * 2  # the MoE's weighted expert outputs (fp32)
        # the unfused GPU chain: combine kernel, torch add, RMSNorm kernel, activation quantiser
        comb = torch.empty(t, h, dtype=torch.bfloat16)
        moe_gemv.combine_kernel[(t, triton.cdiv(h, 1024))](y, comb, h, K_TOP=k, BLOCK=1024)
        # the grouped path's bf16 pair outputs (kernels/moe.py, a bf16 model): summed in fp32 as the fp32 ones
        yb = y.to(torch.bfloat16)
        comb_b = torch.empty(t, h, dtype=torch.bfloat16)
        moe_gemv.combine_kernel[(t, triton.cdiv(h, 1024))](yb.float(), comb_b, h, K_TOP=k, BLOCK=1024)
        for delta, added in [(None, x), (dl, interp_add(x, dl)), (y, interp_add(x, comb)), (yb, interp_add(x, comb_b))]:
            chain_n = fused.rms_norm(added, w, eps)
            chain_q, chain_s = fp8_gemm.quantize_act_1x128(chain_n, kp)
            x_new, normed = fused.add_rms_norm(x, delta, w, eps)
            if delta is None:
                assert x_new is None
            else:
                same(x_new, added, ("x", t, h))
            same(normed, chain_n, ("normed", t, h))
            x_new2, (q, s) = fused.add_rms_norm(x, delta, w, eps, quant_k=kp)
            same(q, chain_q, ("q", t, h))
            same(s, chain_s, ("scale", t, h))
            # the torch quantiser of kernels.fp8 (the CPU model's) gives the same scales; its fp8 bytes are
            # compared on the GPU (tests/gpu/test_fused_gpu.py): the interpreter's fp32->e4m3 cast does not
            # round to nearest even as the hardware's (and torch's) does
            rq, rs = fp8.quantize_act_1x128(chain_n)
            assert torch.equal(s[:t], rs), (t, h)
            assert (s[t:] == 1e-12 / 448.0).all() and not bits(q[t:]).any() and not bits(q[:, h:]).any()
            # float32 reference of the whole chain
            x32 = x.float() + (0 if delta is None else (delta.float() if delta.dim() == 2 else delta.float().sum(1)))
            ref = w * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            assert ((normed.float() - ref).abs() <= ref.abs() * 2 ** -7 + 0.02).all(), (t, h)
            assert torch.allclose(s[:t], ref.view(t, -1, 128).abs().amax(-1) / 448.0, rtol=2 ** -7) if h % 128 == 0 else True
            if delta is not None:  # dropping the residual add would not pass
                assert not ((fused.rms_norm(x, w, eps).float() - ref).abs() <= ref.abs() * 2 ** -7 + 0.02).all()
            # the head's form: a few rows, no residual written
            rows = torch.tensor([t - 1, 0][: t], dtype=torch.int64)
            none, picked = fused.add_rms_norm(x, delta, w, eps, rows=rows, store_x=False)
            assert none is None
            same(picked, chain_n[rows], ("rows", t, h))
            # and the FP8 head's (quant fp8-block128-lmhead): those rows quantised for its GEMM
            hq, hs = fp8_gemm.quantize_act_1x128(chain_n[rows], kp)
            _, (pq, ps) = fused.add_rms_norm(x, delta, w, eps, rows=rows, store_x=False, quant_k=kp)
            same(pq, hq, ("rows q", t, h))
            same(ps, hs, ("rows scale", t, h))
        # add only (no norm): the residual after the last layer
        x_new, nothing = fused.add_rms_norm(x, y, None, eps)
        assert nothing is None
        same(x_new, interp_add(x, comb), ("add only", t, h))

    # rotary + KV write against rotary_qk + write_kv on a random, non-zero pool
    for t, nq, nkv, d, page in [(1, 64, 8, 64, 16), (5, 6, 2, 32, 4), (4, 3, 1, 16, 2)]:
        qkv = torch.randn(t, (nq + 2 * nkv) * d, generator=g).to(torch.bfloat16)
        inv, conc = yarn_inv_freq(d, 150000.0, 32.0, 4096, beta_fast=32.0, beta_slow=1.0)
        pos = torch.randint(0, 5000, (t,), generator=g)
        cos, sin = rotary_cos_sin(pos, inv, conc, torch.bfloat16)
        # a group pool [layers, pages, 2, page, kv heads, d]; the layer's view is not at offset 0
        group = torch.randn(2, 6, 2, page, nkv, d, generator=g).to(torch.bfloat16)
        slots = torch.randperm(6 * page, generator=g)[:t]
        pages, offsets = slots // page, slots % page
        want_pool = group.clone()
        q0, k0 = fused.rotary_qk(qkv, cos, sin, nq, nkv, d)
        v0 = qkv[:, (nq + nkv) * d:].view(t, nkv, d)
        write_kv(want_pool[1], k0, v0, pages, offsets)
        got = fused.rotary_kv_write(qkv, cos, sin, nq, nkv, d, group[1], pages, offsets)
        same(got, q0, ("q", t, nq))
        assert torch.equal(group, want_pool), (t, nq, "pool")
        # float32 reference of the rotation of what landed in the cache
        kref = apply_rotary(qkv[:, nq * d:(nq + nkv) * d].float().view(t, nkv, d), cos.float(), sin.float())
        assert torch.allclose(group[1][pages, 0, offsets].float(), kref, rtol=2 ** -7, atol=1e-2)
        assert torch.equal(group[1][pages, 1, offsets], v0)
        assert not torch.allclose(group[1][pages, 0, offsets].float(), qkv[:, nq * d:(nq + nkv) * d].float().view(t, nkv, d),
                                  rtol=2 ** -7, atol=1e-2)

    # FlashInfer decode's sink correction + the output projection's quantisation against the two kernels
    from kvrelay.kernels.attention import apply_sink_correction
    for b, heads, d in [(1, 64, 64), (3, 8, 16), (5, 4, 32), (2, 3, 64)]:
        kp = -(-heads * d // 128) * 128
        out = torch.randn(b, heads, d, generator=g).to(torch.bfloat16)
        lse = torch.randn(b, heads, generator=g) * 3
        sinks = torch.randn(heads, generator=g) * 2
        keep = out.clone()
        q, s = fused.sink_correct_quantize(out, lse, sinks, kp)
        assert torch.equal(out, keep)  # the attention output is read, not corrected in place
        fixed = apply_sink_correction(out.clone(), lse, sinks)
        cq, cs = fp8_gemm.quantize_act_1x128(fixed.reshape(b, heads * d), kp)
        same(q, cq, ("sink q", b, heads))
        same(s, cs, ("sink scale", b, heads))
        ref = out.float() * torch.sigmoid(lse * 0.6931471805599453 - sinks)[..., None]
        rs = ref.reshape(b, -1)
        rs = torch.nn.functional.pad(rs, (0, kp - rs.shape[1])).view(b, -1, 128).abs().amax(-1).clamp_min(1e-12) / 448
        assert torch.allclose(s[:b], rs, rtol=2 ** -6), (b, heads)
        # the sink is load-bearing: the uncorrected output's scales differ
        _, s_raw = fp8_gemm.quantize_act_1x128(out.reshape(b, heads * d), kp)
        assert not torch.allclose(s_raw[:b], s[:b], rtol=2 ** -6)

    # the router's logits GEMV against float32 (one bf16 step: the interpreter truncates its rounding)
    for t, e, h in [(1, 32, 2880), (5, 128, 2880), (3, 8, 100)]:
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        w = (torch.randn(e, h, generator=g) * h ** -0.5).to(torch.bfloat16)
        bias = torch.randn(e, generator=g).to(torch.bfloat16)
        for bb in (bias, None):
            got = fused.router_logits(x, w, bb)
            ref = x.float() @ w.float().T + (0 if bb is None else bb.float())
            assert got.shape == (t, e) and got.dtype == torch.bfloat16
            assert ((got.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).all(), (t, e, h)
        assert not ((fused.router_logits(x, w, None).float() - (x.float() @ w.float().T + bias.float())).abs()
                    <= 1e-2).all()  # the bias is load-bearing
    print("ok")
""")


def test_glue_kernels_interpreted() -> None:
    """add_rms_norm, rotary_kv_write and sink_correct_quantize (kernels/fused.py) equal, bit for bit
    under the interpreter, the unfused GPU chain they replace (combine kernel, torch add, RMSNorm kernel,
    activation quantiser; rotary kernel + write_kv; sink correction kernel + activation quantiser), and
    stay within rounding of float32 references; router_logits within one bf16 step of float32."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", GLUE], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-3000:] + res.stderr[-3000:]


MODEL = textwrap.dedent("""
    import os, torch
    from kvrelay.engine.config import PRESETS
    from kvrelay.engine.runner import Runner
    from kvrelay.engine.weights import open_weights

    cfg = PRESETS["tiny"].replace(num_hidden_layers=2)
    os.environ["KVRELAY_ATTENTION"] = "reference"  # attention is not what this checks; it is slow interpreted
    def run(kernels, fused):
        os.environ["KVRELAY_FUSED"] = fused
        if kernels:
            os.environ["KVRELAY_KERNELS"] = kernels
        r = Runner(cfg, open_weights(None, cfg, dummy=True, seed=3), page_size=4, kv_tokens=64)
        os.environ.pop("KVRELAY_KERNELS", None)
        assert r.model.blocks[0].fused == (kernels == "triton" and fused == "1"), kernels
        out = [r.prefill("a", [3, 141, 59, 26, 535]).float()]  # 20 (token, expert) pairs: the decode MoE path
        out.append(r.decode(["a"], [897]).float())
        return torch.stack([o.reshape(-1) for o in out])
    ref = run(None, "1")
    unfused = run("triton", "0")
    fused = run("triton", "1")
    rel = lambda a, b: float((a - b).norm() / b.norm())
    # the interpreter's casts truncate where the GPU rounds to nearest, so fused and unfused differ by
    # rounding here (on a GPU they are bit-equal up to the RMSNorm sum order: tests/gpu/test_fused_gpu.py)
    assert rel(fused, unfused) < 2e-2, rel(fused, unfused)
    assert rel(fused, ref) < 2 * rel(unfused, ref) + 1e-2, (rel(fused, ref), rel(unfused, ref))
    print("ok", rel(fused, unfused), rel(unfused, ref), rel(fused, ref))
""")


def test_model_fused_path_interpreted() -> None:
    """The model's fused GPU path (Block.residual_attention_in / attention_out_deferred / head) runs under
    the interpreter on CPU and stays as close to the CPU reference as the unfused GPU path."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", MODEL], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


GEMM_TILES = textwrap.dedent("""
    import torch
    from kvrelay.kernels import fp8, fp8_gemm

    g = torch.Generator().manual_seed(0)
    for m, k, n in [(1, 300, 200), (4, 256, 96), (19, 130, 64)]:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        w = torch.randn(n, k, generator=g) * 0.05
        b = torch.randn(n, generator=g).to(torch.bfloat16)
        wq, ws = fp8.quantize_weight_block128(w)
        wd = fp8.dequantize_weight_block128(wq, ws, torch.float32)
        for name in fp8_gemm.Fp8BlockLinear.TRITON_TILES:
            lin = fp8_gemm.Fp8BlockLinear(wq, ws, b, backend=name)
            xq, sx = fp8_gemm.quantize_act_1x128(x, lin.kp)
            y = lin.run_quantized(xq, sx, m)
            # float32 product of the same quantised operands (+ bias)
            ref = (xq[:m, :k].float() * sx[:m].repeat_interleave(128, 1)[:, :k]) @ wd.T + b.float()
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            err = float((y.float() - ref).norm() / ref.norm())
            assert err < 1e-2, (name, m, k, n, err)
            assert float((y.float() - ref + b.float()).norm() / ref.norm()) > 5e-2  # the bias is in
    print("ok")
""")


def test_fp8_gemm_decode_tiles_interpreted() -> None:
    """The FP8 block GEMM's 16-row decode tiles (Fp8BlockLinear.TRITON_TILES) against float32 on the same
    quantised operands, under the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", GEMM_TILES], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
