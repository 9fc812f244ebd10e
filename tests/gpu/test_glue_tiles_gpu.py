"""The glue kernels' prefill (tiled) launches on the GPU, at the served sizes: bit for bit the decode
launches (one row / one (token, head) per program), and near kernels.fp8's quantiser / equal to
rotary_qk + reference.write_kv as the decode launches are. The same equalities under the interpreter:
tests/cpu/test_glue_tiles.py."""

from __future__ import annotations

import pytest
import torch

from kernel_refs import poison_allocator

pytestmark = pytest.mark.gpu


def _u8(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("m,k,kp", [(8192, 2880, 2944), (32768, 2880, 2944), (1001, 4096, 4096), (513, 300, 384)])
def test_quant_tiles_equal_one_row_programs_and_reference(m, k, kp):
    from kvrelay.kernels import fp8, fp8_gemm

    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).add(0.1) * 10).bfloat16().cuda()
    rq, rs = fp8.quantize_act_1x128(x)
    for m_major in (True, False):
        want_q, want_s = fp8_gemm.quantize_act_1x128(x, kp, m_major, tile=(1, 1))
        for tile in (None, fp8_gemm.QUANT_TILE, (32, 4), (128, 8), (16, 2)):
            poison_allocator(1 << 26)
            q, s = fp8_gemm.quantize_act_1x128(x, kp, m_major, tile=tile)
            torch.cuda.synchronize()
            assert q.stride() == want_q.stride() and s.stride() == want_s.stride() and s.shape == want_s.shape
            assert torch.equal(_u8(q), _u8(want_q)) and torch.equal(s, want_s), (m_major, tile)
        # the torch reference as tests/gpu/test_fp8_gemm.py holds the one-row kernel to it (Triton's fp32
        # division is not torch's correctly rounded one: a rare fp8 value one step apart)
        assert torch.allclose(want_s[:m, : rs.shape[1]], rs, rtol=1e-6)
        assert (want_q[:m, :k].float() == rq.float()).float().mean() > 0.999


@pytest.mark.parametrize("t", [8192, 300, 129])
def test_rotary_tiles_equal_per_head_programs_and_reference(t):
    from kvrelay.kernels.fused import ROTARY_TILE, rotary_kv_write, rotary_qk
    from kvrelay.kernels.reference import rotary_cos_sin, write_kv, yarn_inv_freq

    nq, nkv, d, page = 64, 8, 64, 16
    g = torch.Generator().manual_seed(t)
    qkv = torch.randn(t, (nq + 2 * nkv) * d, generator=g).bfloat16().cuda()
    inv, conc = yarn_inv_freq(d, 150000.0, 32.0, 4096, beta_fast=32.0, beta_slow=1.0)
    cos, sin = rotary_cos_sin(torch.randint(0, 100000, (t,), generator=g).cuda(), inv, conc, torch.bfloat16)
    n_pages = -(-t // page) + 3
    group = torch.randn(2, n_pages, 2, page, nkv, d, generator=g).bfloat16().cuda()
    slots = torch.randperm(n_pages * page, generator=g)[:t].cuda()
    pages, offsets = (slots // page).int(), (slots % page).int()
    want = group.clone()
    q0, k0 = rotary_qk(qkv, cos, sin, nq, nkv, d)
    write_kv(want[1], k0, qkv[:, (nq + nkv) * d:].view(t, nkv, d), pages.long(), offsets.long())
    for tile in ((1, 1, 4), None, ROTARY_TILE, (8, 8, 4), (32, 8, 8), (16, 16, 4), (4, 8, 2)):
        pool = group.clone()
        poison_allocator(1 << 26)
        q = rotary_kv_write(qkv, cos, sin, nq, nkv, d, pool[1], pages, offsets, tile=tile)
        torch.cuda.synchronize()
        assert torch.equal(q, q0) and torch.equal(pool, want), tile
