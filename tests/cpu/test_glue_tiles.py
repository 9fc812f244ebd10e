"""The prefill (tiled) launches of the glue kernels equal their decode launches bit for bit, under
TRITON_INTERPRET=1 on CPU: kernels.fp8_gemm.quantize_act_1x128 (BLOCK_M-row tiles vs one row per program)
and kernels.fused.rotary_kv_write ((tokens x heads) tiles vs one (token, head) per program), on random,
non-zero inputs whose T, K and head counts are not multiples of the tile sizes, in both scale layouts;
and both against the torch references (kernels.fp8 quantiser, rotary_qk + reference.write_kv, float32
rotation). The default launch switches to the tiles at the size threshold (checked by making the
one-row kernel unavailable). The GPU side of the same equality is tests/gpu/test_fused_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

QUANT = textwrap.dedent("""
    import torch
    from kvrelay.kernels import fp8, fp8_gemm

    def same(a, b, what):
        assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride(), (what, a.shape, b.shape,
                                                                                      a.stride(), b.stride())
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), what

    g = torch.Generator().manual_seed(0)
    for m, k, kp in [(37, 300, None), (130, 257, 512), (5, 128, None), (67, 200, 256)]:
        # a different magnitude per row and per 128-group, never zero
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).add(0.1) * 10
        x = (x + torch.sign(x) * 1e-3).bfloat16()
        assert (x != 0).all()
        for m_major in (True, False):
            base_q, base_s = fp8_gemm.quantize_act_1x128(x, kp, m_major, tile=(1, 1))
            rq, rs = fp8.quantize_act_1x128(x)
            # the torch reference's scales exactly; its fp8 values only roughly: the interpreter's fp32->e4m3
            # cast is not the hardware's rounding, off by up to half the value (tests/gpu compares the bytes)
            assert torch.equal(base_s[:m, :rs.shape[1]], rs), (m, k)
            a, b = base_q[:m, :k].float(), rq.float()
            assert ((a - b).abs() <= b.abs() / 2 + 2 ** -9).all() and (a * b >= 0).all()
            kb = base_s.shape[1]
            assert (base_s[m:] == 1e-12 / 448.0).all() and not base_q[m:].view(torch.uint8).any()
            assert not base_q[:, k:].view(torch.uint8).any() and (base_s[:, -(-k // 128):] == 1e-12 / 448.0).all()
            for tile in [(16, 4), (8, 1), (64, 4), (32, 2)]:
                q, s = fp8_gemm.quantize_act_1x128(x, kp, m_major, tile=tile)
                same(q, base_q, ("q", m, k, m_major, tile))
                same(s, base_s, ("scale", m, k, m_major, tile))
    # the default launch takes the tiles from QUANT_TILE_MIN_ROWS rows, the one-row programs below it
    x = (torch.randn(20, 300, generator=g) * 3 + 0.01).bfloat16()
    want = fp8_gemm.quantize_act_1x128(x, tile=(1, 1))
    fp8_gemm.QUANT_TILE_MIN_ROWS, fp8_gemm.QUANT_TILE = 20, (8, 2)
    one_row = fp8_gemm._quant_act_kernel
    fp8_gemm._quant_act_kernel = None  # launching it now would fail
    got = fp8_gemm.quantize_act_1x128(x)
    same(got[0], want[0], "default q")
    same(got[1], want[1], "default scale")
    fp8_gemm._quant_act_kernel = one_row
    tiled = fp8_gemm._quant_act_tile_kernel
    small_q, small_s = fp8_gemm.quantize_act_1x128(x[:19], tile=(1, 1))
    fp8_gemm._quant_act_tile_kernel = None
    got_q, got_s = fp8_gemm.quantize_act_1x128(x[:19])  # 19 < 20 rows: the one-row kernel, no tile launch
    same(got_q, small_q, "small q")
    same(got_s, small_s, "small scale")
    fp8_gemm._quant_act_tile_kernel = tiled
    print("ok")
""")

ROTARY = textwrap.dedent("""
    import torch
    from kvrelay.kernels import fused
    from kvrelay.kernels.reference import apply_rotary, rotary_cos_sin, write_kv, yarn_inv_freq

    g = torch.Generator().manual_seed(1)
    inv_cache = {}
    for t, nq, nkv, d, page, tiles in [(37, 6, 2, 32, 4, [(16, 4, 4), (8, 8, 2), (4, 1, 1)]),
                                       (19, 64, 8, 64, 16, [(16, 8, 4), (8, 16, 4)]),
                                       (11, 3, 1, 16, 2, [(4, 2, 4), (16, 4, 1)])]:
        qkv = torch.randn(t, (nq + 2 * nkv) * d, generator=g)
        qkv = (qkv + torch.sign(qkv) * 1e-2).bfloat16()
        inv, conc = yarn_inv_freq(d, 150000.0, 32.0, 4096, beta_fast=32.0, beta_slow=1.0)
        cos, sin = rotary_cos_sin(torch.randint(0, 100000, (t,), generator=g), inv, conc, torch.bfloat16)
        n_pages = -(-t // page) + 3
        group = torch.randn(2, n_pages, 2, page, nkv, d, generator=g).bfloat16()  # a group pool, layer 1 used
        slots = torch.randperm(n_pages * page, generator=g)[:t]
        pages, offsets = (slots // page).to(torch.int32), (slots % page).to(torch.int32)
        before = group.clone()
        base_pool = group.clone()
        base_q = fused.rotary_kv_write(qkv, cos, sin, nq, nkv, d, base_pool[1], pages, offsets, tile=(1, 1, 4))
        # the decode launch against rotary_qk + write_kv and a float32 rotation
        q0, k0 = fused.rotary_qk(qkv, cos, sin, nq, nkv, d)
        v0 = qkv[:, (nq + nkv) * d:].view(t, nkv, d)
        want_pool = group.clone()
        write_kv(want_pool[1], k0, v0, pages.long(), offsets.long())
        assert torch.equal(base_q, q0) and torch.equal(base_pool, want_pool), (t, nq)
        kref = apply_rotary(qkv[:, nq * d:(nq + nkv) * d].float().view(t, nkv, d), cos.float(), sin.float())
        assert torch.allclose(base_pool[1][pages.long(), 0, offsets.long()].float(), kref, rtol=2 ** -7, atol=1e-2)
        assert not torch.equal(base_pool, before)
        for tile in tiles:
            pool = group.clone()
            q = fused.rotary_kv_write(qkv, cos, sin, nq, nkv, d, pool[1], pages, offsets, tile=tile)
            assert q.shape == base_q.shape and q.stride() == base_q.stride()
            assert torch.equal(q, base_q), (t, nq, tile)
            assert torch.equal(pool, base_pool), (t, nq, tile, "pool")  # nothing else of the pool touched
    # the default launch: tiles from ROTARY_TILE_MIN_TOKENS tokens on
    fused.ROTARY_TILE_MIN_TOKENS, fused.ROTARY_TILE = 11, (4, 2, 4)
    one = fused._rotary_kv_write_kernel
    fused._rotary_kv_write_kernel = None
    pool = group.clone()
    q = fused.rotary_kv_write(qkv, cos, sin, nq, nkv, d, pool[1], pages, offsets)
    fused._rotary_kv_write_kernel = one
    want = group.clone()
    assert torch.equal(q, fused.rotary_kv_write(qkv, cos, sin, nq, nkv, d, want[1], pages, offsets, tile=(1, 1, 4)))
    assert torch.equal(pool, want)
    tiled = fused._rotary_kv_write_tile_kernel
    fused._rotary_kv_write_tile_kernel = None
    pool = group.clone()
    q = fused.rotary_kv_write(qkv[:10], cos[:10], sin[:10], nq, nkv, d, pool[1], pages[:10], offsets[:10])
    fused._rotary_kv_write_tile_kernel = tiled
    assert torch.equal(q, fused.rotary_kv_write(qkv[:10], cos[:10], sin[:10], nq, nkv, d, group.clone()[1],
                                                pages[:10], offsets[:10], tile=(4, 2, 4)))
    print("ok")
""")


def _run(code: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-3000:] + res.stderr[-3000:]


def test_quant_act_tiles_equal_one_row_programs_interpreted() -> None:
    _run(QUANT)


def test_rotary_kv_write_tiles_equal_per_head_programs_interpreted() -> None:
    _run(ROTARY)
