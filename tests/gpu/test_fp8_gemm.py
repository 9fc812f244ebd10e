"""FP8 block GEMM with bias (cuBLAS blockwise, Triton with its prefill and decode tiles) against the float32
dequantised product."""

from __future__ import annotations

import pytest
import torch

from kernel_refs import rel_err

pytestmark = pytest.mark.gpu


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return torch.device("cuda")


def _ref(xq, sx, wq, ws, bias, n):
    """float32: dequantise both operands exactly, multiply in fp64 for a clean oracle."""
    kb = ws.shape[1]
    a = xq.double() * sx.double().repeat_interleave(128, 1)[:, : xq.shape[1]]
    w = wq.double() * ws.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, : kb * 128][:, : wq.shape[1]]
    return (a @ w.t() + (bias.double() if bias is not None else 0)).float()


@pytest.mark.parametrize("m,k,n", [(1, 2880, 5120), (37, 2880, 4096), (300, 4096, 2880), (129, 200, 333)])
@pytest.mark.parametrize("backend", ["cublas", "triton", "triton-m16n32", "triton-m16n64"])
def test_fp8_block_linear(m, k, n, backend):
    from kvrelay.kernels.fp8 import fp8_block_linear_ref, quantize_weight_block128
    from kvrelay.kernels.fp8_gemm import Fp8BlockLinear, quantize_act_1x128
    dev = _cuda()
    if backend == "cublas" and (n % 16 or k % 16):
        pytest.skip("cuBLAS fp8 needs N, K multiples of 16")
    g = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=g).bfloat16().to(dev)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dev)
    bias = torch.randn(n, generator=g).bfloat16().to(dev)
    wq, ws = quantize_weight_block128(w)
    lin = Fp8BlockLinear(wq, ws, bias, backend=backend)
    xq, sx = quantize_act_1x128(x, lin.kp)
    ref = _ref(xq[:m, :k], sx[:m], wq, ws, bias.float(), n)  # rows >= m are cuBLAS alignment padding
    out = lin(x)
    torch.cuda.synchronize()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2
    # and the weights engineer's torch reference of the same served GEMM (activation quant included)
    assert rel_err(out, fp8_block_linear_ref(x, wq, ws, bias)) < 1e-2
    # a GEMM that forgot the bias must fail: the bias is as large as the product here
    assert rel_err(out, ref - bias.float()) > 5e-2


def test_act_quant_matches_reference():
    from kvrelay.kernels.fp8 import quantize_act_1x128 as ref_quant
    from kvrelay.kernels.fp8_gemm import quantize_act_1x128
    dev = _cuda()
    x = torch.randn(77, 2880, device=dev).bfloat16() * 3
    q, s = quantize_act_1x128(x)
    rq, rs = ref_quant(x)
    assert torch.allclose(s[:77], rs, rtol=1e-6)
    assert (q[:77, :2880].float() == rq.float()).float().mean() > 0.999
    assert (q[:, 2880:].float() == 0).all() and (q[77:].float() == 0).all()
