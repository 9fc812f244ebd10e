"""FP8 block GEMM with bias (cuBLAS blockwise, Triton with its prefill and decode tiles, the decode GEMV) against
the float32 dequantised product."""

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
@pytest.mark.parametrize("backend", ["cublas", "triton", "triton-m16n32", "triton-m16n64", "gemv-n32-k512-s1-w2-st2",
                                     "gemv-n32-k256-s4-w4-st2", "gemv-n64-k512-s4-w8-st2"])
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


# gpt-oss-20b and -120b share the attention shapes: QKV 2880 -> (64 + 2 * 8) * 64 = 5120, O 4096 -> 2880 (K=2880
# is not a multiple of 128: padded to 2944); the TP=2 shards of both, QKV 2880 -> 2560 and O 2048 -> 2880.
GPT_OSS_SHAPES = [(2880, 5120), (4096, 2880), (2880, 2560), (2048, 2880)]


def _act(m, k, dev, g):
    kblk = 1 + (torch.arange(k) // 128 % 5).float()
    return (torch.randn(m, k, generator=g) * kblk).bfloat16().to(dev)


def _operands(m, k, n, dev, seed):
    from kvrelay.kernels.fp8 import quantize_weight_block128
    g = torch.Generator().manual_seed(seed)
    # per-block magnitudes that differ (a GEMV applying another block's scale is far off); no zeros
    x = _act(m, k, dev, g)
    nblk = 1 + (torch.arange(n) // 128 % 7).float()
    w = (torch.randn(n, k, generator=g) * 0.02 * nblk[:, None]).to(dev)
    bias = torch.randn(n, generator=g).bfloat16().to(dev)
    wq, ws = quantize_weight_block128(w)
    return x, wq, ws, bias


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(v.abs().clamp_min(1e-30))
    return torch.ldexp(torch.ones_like(v), e - 8)  # bf16: 8 significant bits


@pytest.mark.parametrize("k,n", GPT_OSS_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_fp8_gemv_decode_shapes(m, k, n):
    """Every GEMV tile at decode batch sizes on the served shapes: each output within one bf16 ulp (plus the
    fp32 accumulation's share) of the float64 product of the same quantised operands, i.e. what a correctly
    rounded fp32 GEMM gives; within the fp8 tests' bound of the torch reference and of cuBLAS."""
    from kvrelay.kernels.fp8 import fp8_block_linear_ref
    from kvrelay.kernels.fp8_gemm import Fp8BlockLinear, quantize_act_1x128
    dev = _cuda()
    x, wq, ws, bias = _operands(m, k, n, dev, seed=m * 131 + k + n)
    cublas = Fp8BlockLinear(wq, ws, bias, backend="cublas")
    xq, sx = quantize_act_1x128(x, cublas.kp)
    ref = _ref(xq[:m, :k], sx[:m], wq, ws, bias.float(), n).double()
    a = (xq[:m, :k].double() * sx[:m].double().repeat_interleave(128, 1)[:, :k]).abs()
    wd = (wq.double() * ws.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).abs()
    tol = _bf16_ulp(ref) + 1e-5 * (a @ wd.t())
    torch_ref = fp8_block_linear_ref(x, wq, ws, bias)
    want_cublas = cublas.run_quantized(xq, sx, m)
    for name in Fp8BlockLinear.GEMV_TILES:
        lin = Fp8BlockLinear(wq, ws, bias, backend=name)
        out = lin.run_quantized(xq, sx, m)
        torch.cuda.synchronize()
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        bad = ((out.double() - ref).abs() > tol).sum().item()
        assert bad == 0, (name, bad, (out.double() - ref).abs().max().item())
        assert rel_err(out, torch_ref) < 1e-2 and rel_err(out, want_cublas) < 1e-2, (name, rel_err(out, torch_ref), rel_err(out, want_cublas))
        assert torch.equal(lin(x), out), name  # the unquantised entry point: the same kernel, same bits
        assert rel_err(out, ref - bias.double()) > 5e-2  # the bias is in


@pytest.mark.parametrize("k,n", GPT_OSS_SHAPES[:2])
def test_fp8_gemv_graph_replay_is_bit_exact(k, n):
    """A CUDA graph of the GEMV (how decode runs it) replays to exactly the eager bits, for new inputs copied
    into its static buffers too, split-K included (its last-arriving program sums the partials in split
    order, whichever program arrives last), and leaves the split-K counters at zero."""
    from kvrelay.kernels.fp8_gemm import Fp8BlockLinear, quantize_act_1x128
    dev = _cuda()
    for name in Fp8BlockLinear.GEMV_TILES:
        x, wq, ws, bias = _operands(4, k, n, dev, seed=k + n)
        lin = Fp8BlockLinear(wq, ws, bias, backend=name)
        xq, sx = quantize_act_1x128(x, lin.kp)
        static_q, static_s = xq.clone(), sx.clone()
        for m in (1, 4):
            lin.run_quantized(static_q, static_s, m)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = lin.run_quantized(static_q, static_s, m)
            for seed in range(3):
                x2 = _act(4, k, dev, torch.Generator().manual_seed(100 + seed))
                q2, s2 = quantize_act_1x128(x2, lin.kp)
                static_q.copy_(q2)
                static_s.copy_(s2)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, lin.run_quantized(q2, s2, m)), (name, m, seed)
                assert not lin._counters.any(), name


def test_auto_times_the_gemv_at_decode_sizes(caplog, monkeypatch):
    """backend="auto" with KVRELAY_FP8_GEMV=1 times the GEMV tiles beside cuBLAS and the 16-row tiles for
    M <= 8 (and only there), keeps one per M bucket, and the product is right whichever won; a candidate
    whose output disagrees with cuBLAS on the input (here one GEMV tile made to return zeros) is never
    picked. Switched off (KVRELAY_FP8_GEMV=0) the GEMV tiles are not timed at all."""
    from kvrelay.kernels.fp8_gemm import Fp8BlockLinear
    dev = _cuda()
    x0, wq0, ws0, bias0 = _operands(16, 2880, 5120, dev, seed=8)
    lin0 = Fp8BlockLinear(wq0, ws0, bias0, backend="auto", choice_cache={})
    seen = []
    monkeypatch.setenv("KVRELAY_FP8_GEMV", "0")  # off whatever Fp8BlockLinear.GEMV_DEFAULT says
    run0 = lin0._run
    lin0._run = lambda name, *a, **kw: (seen.append(name), run0(name, *a, **kw))[1]
    lin0(x0[:1])
    assert seen and not set(seen) & set(Fp8BlockLinear.GEMV_TILES), seen
    monkeypatch.setenv("KVRELAY_FP8_GEMV", "1")
    x, wq, ws, bias = _operands(16, 2880, 5120, dev, seed=7)
    choices: dict[int, str] = {}
    lin = Fp8BlockLinear(wq, ws, bias, backend="auto", choice_cache=choices)
    timed = []
    orig, broken = lin._run, "gemv-n32-k256-s4-w4-st2"

    def run(name, *a, **kw):
        timed.append(name)
        out = orig(name, *a, **kw)
        return out * 0 if name == broken else out

    lin._run = run
    gemvs = set(Fp8BlockLinear.GEMV_TILES)
    # M=4 arrives with a NaN in row 0 (a warm-up step's attention over an uninitialised KV pool): the
    # candidates are checked on their own random input, so that must not reject them all
    x_nan = x.clone()
    x_nan[0, 0] = float("nan")
    for m in (1, 2, 4, 16):
        timed.clear()
        xm = (x_nan if m == 4 else x)[:m]
        with caplog.at_level("WARNING", logger="kvrelay.kernels.fp8_gemm"):
            out = lin(xm)
        rows = slice(1, m) if m == 4 else slice(0, m)
        assert rel_err(out[rows], _ref(*_quantized(lin, xm), wq, ws, bias.float(), 5120)[rows]) < 1e-2
        names = set(timed)
        assert (gemvs <= names) if m <= 8 else not (gemvs & names), (m, names)
        assert choices[1 << max(0, (m - 1).bit_length())] != broken
        # the broken tile ran once (the check), never under the timer
        assert timed.count(broken) == (1 if m <= 8 else 0), timed.count(broken)
    assert f"backend {broken} disagrees with cublas" in caplog.text
    assert caplog.text.count("disagrees") == 3, caplog.text  # M=1, 2, 4: the broken tile only
    print("auto choices", choices)


def _quantized(lin, x):
    from kvrelay.kernels.fp8_gemm import quantize_act_1x128
    xq, sx = quantize_act_1x128(x, lin.kp)
    return xq[: x.shape[0], : lin.k], sx[: x.shape[0]]


def test_auto_keeps_the_pinned_backend_at_batch_1(caplog, monkeypatch):
    """A batch-1 pin (KVRELAY_FP8_M1 here; Fp8BlockLinear.M1_PINNED by default) is run beside cuBLAS once, not
    timed, and kept when it agrees; M=2 is timed as before; a pin whose output disagrees with cuBLAS (made to
    return zeros) is dropped for cuBLAS with a warning."""
    from kvrelay.kernels.fp8_gemm import Fp8BlockLinear
    dev = _cuda()
    pin = "gemv-n32-k512-s6-w2-st2"  # not one of GEMV_TILES: any launch label can be pinned
    monkeypatch.setenv("KVRELAY_FP8_M1", f"5120x2880={pin},2880x4096=cublas")
    x, wq, ws, bias = _operands(4, 2880, 5120, dev, seed=9)
    choices: dict[int, str] = {}
    lin = Fp8BlockLinear(wq, ws, bias, backend="auto", choice_cache=choices)
    ran, timed = [], []
    orig = lin._run
    lin._run = lambda name, *a, **kw: (ran.append(name), orig(name, *a, **kw))[1]
    import triton.testing
    bench = triton.testing.do_bench
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (timed.append(1), bench(fn, **kw))[1])
    out = lin(x[:1])
    assert choices == {1: pin} and ran == ["cublas", pin, pin] and not timed, (choices, ran, timed)
    assert rel_err(out, _ref(*_quantized(lin, x[:1]), wq, ws, bias.float(), 5120)) < 1e-2
    lin(x[:2])
    assert timed and choices[2] != pin  # M=2 is timed; the pin is not a candidate there
    # a disagreeing pin falls back to cuBLAS
    choices2: dict[int, str] = {}
    lin2 = Fp8BlockLinear(wq, ws, bias, backend="auto", choice_cache=choices2)
    orig2 = lin2._run
    lin2._run = lambda name, *a, **kw: orig2(name, *a, **kw) * (0 if name == pin else 1)
    with caplog.at_level("WARNING", logger="kvrelay.kernels.fp8_gemm"):
        lin2(x[:1])
    assert choices2 == {1: "cublas"} and f"backend {pin} disagrees with cublas" in caplog.text
