"""Sink attention on the GPU (FlashInfer and Triton backends) against the float32 reference.

Each case uses large sink logits (+4) and short contexts, where dropping the sink changes the output
by far more than the tolerance (at 8192 keys a sink moves the output by <1e-3 and proves nothing).
"""

from __future__ import annotations

import pytest
import torch

from kernel_refs import make_paged_batch, rel_err, sink_attention_ref

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE = 64, 8, 64, 16
SM = 0.125
TOL = 1.5e-2  # bf16 operands and output
KV_LENS = [1, 2, 15, 16, 17, 127, 128, 129, 200, 300]


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return torch.device("cuda")


def _sinks(gen):
    return (torch.randn(HQ, generator=gen) + 4.0).bfloat16().cuda()


def _edge_values(b, window):
    """Put huge V rows at the keys just outside and just inside the last query's window, so a window
    that is off by one in either direction fails loudly."""
    if not window:
        return
    page = b.pool.shape[2]
    for s, n in enumerate(b.kv_lens):
        for pos in (n - 1 - window, n - window):
            if pos < 0:
                continue
            p = int(b.kv_indices[int(b.kv_indptr[s]) + pos // page])
            b.pool[p, 1, pos % page] = 200.0 * (1 if pos == n - window else -1)


def _last_rows(b, window):
    """Rows of each sequence's last query whose window edge lies inside the KV."""
    return [int(b.qo_indptr[s + 1]) - 1 for s, n in enumerate(b.kv_lens) if n > window and b.q_lens[s] > 0]


def _run_prefill(backend, q, b, sinks, window):
    out = torch.full_like(q, float("nan"))
    if backend == "flashinfer":
        from kvrelay.kernels.attention import FlashInferSinkAttention
        att = FlashInferSinkAttention(HQ, HKV, D, PAGE, window, SM, q.device)
        att.plan_prefill(b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_last_page_len)
        att.prefill(q, b.pool, sinks, out=out)
    else:
        from kvrelay.kernels import triton_attention as ta
        ta.sink_prefill(q, b.pool, sinks, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_last_page_len,
                        sm_scale=SM, window=window, out=out)
    torch.cuda.synchronize()
    return out


def _run_decode(backend, q, b, sinks, window, splits=None):
    if backend == "flashinfer":
        from kvrelay.kernels.attention import FlashInferSinkAttention
        att = FlashInferSinkAttention(HQ, HKV, D, PAGE, window, SM, q.device)
        att.plan_decode(b.kv_indptr, b.kv_indices, b.kv_last_page_len)
        out = att.decode(q, b.pool, sinks)
    else:
        from kvrelay.kernels import triton_attention as ta
        out = torch.full_like(q, float("nan"))
        ta.sink_decode(q, b.pool, sinks, b.kv_indptr, b.kv_indices, b.kv_last_page_len, sm_scale=SM,
                       window=window, out=out, num_splits=splits)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
@pytest.mark.parametrize("window", [None, 128])
def test_prefill_sink_short_contexts(backend, window):
    dev = _cuda()
    g = torch.Generator().manual_seed(10 + (window or 0))
    # ragged batch: full prefills and chunked appends (q shorter than kv)
    kv = KV_LENS
    ql = [min(n, m) for n, m in zip(kv, [1, 2, 15, 3, 17, 127, 5, 129, 200, 64])]
    b = make_paged_batch(kv, ql, HKV, D, PAGE, dev, gen=g)
    _edge_values(b, window)
    q = torch.randn(sum(ql), HQ, D, generator=g).bfloat16().to(dev)
    sinks = _sinks(g)
    out = _run_prefill(backend, q, b, sinks, window)
    ref = sink_attention_ref(q, b, sinks, SM, window)
    err = rel_err(out, ref)
    assert err < TOL, err
    assert rel_err(out, sink_attention_ref(q, b, sinks, SM, window, use_sink=False)) > 5 * TOL
    if window:
        rows = _last_rows(b, window)
        for wrong in (window - 1, window + 1):
            assert rel_err(out[rows], sink_attention_ref(q, b, sinks, SM, wrong)[rows]) > 5 * TOL, wrong


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
@pytest.mark.parametrize("window", [None, 128])
def test_decode_sink_short_contexts(backend, window):
    dev = _cuda()
    g = torch.Generator().manual_seed(20 + (window or 0))
    b = make_paged_batch(KV_LENS, [1] * len(KV_LENS), HKV, D, PAGE, dev, gen=g)
    _edge_values(b, window)
    q = torch.randn(len(KV_LENS), HQ, D, generator=g).bfloat16().to(dev)
    sinks = _sinks(g)
    out = _run_decode(backend, q, b, sinks, window)
    ref = sink_attention_ref(q, b, sinks, SM, window)
    assert rel_err(out, ref) < TOL
    assert rel_err(out, sink_attention_ref(q, b, sinks, SM, window, use_sink=False)) > 5 * TOL
    if window:
        rows = _last_rows(b, window)
        for wrong in (window - 1, window + 1):
            assert rel_err(out[rows], sink_attention_ref(q, b, sinks, SM, wrong)[rows]) > 5 * TOL, wrong


@pytest.mark.parametrize("splits", [1, 2, 7])
def test_triton_decode_splits_long(splits):
    """Split-KV merge at a longer, odd context with the sink entering exactly once."""
    dev = _cuda()
    g = torch.Generator().manual_seed(30 + splits)
    lens = [1, 999, 2049, 4097]
    b = make_paged_batch(lens, [1] * 4, HKV, D, PAGE, dev, gen=g)
    q = torch.randn(4, HQ, D, generator=g).bfloat16().to(dev)
    sinks = _sinks(g)
    out = _run_decode("triton", q, b, sinks, None, splits=splits)
    assert rel_err(out, sink_attention_ref(q, b, sinks, SM, None)) < TOL


def test_sink_correction_kernel_matches_torch():
    from kvrelay.kernels.attention import apply_sink_correction, apply_sink_correction_torch
    dev = _cuda()
    g = torch.Generator().manual_seed(40)
    o = torch.randn(37, HQ, D, generator=g).bfloat16().to(dev)
    lse = (torch.randn(37, HQ, generator=g) * 5).to(dev)
    s = torch.randn(HQ, generator=g).bfloat16().to(dev)
    a = apply_sink_correction(o.clone(), lse, s)
    ref = o.float() * torch.sigmoid(lse.float() * 0.6931471805599453 - s.float())[..., None]
    assert rel_err(a, ref) < 5e-3
    assert rel_err(apply_sink_correction_torch(o.clone(), lse, s), ref) < 5e-3


def test_backends_agree_on_random_batch():
    """FlashInfer and Triton agree with each other (a third opinion besides the reference)."""
    dev = _cuda()
    g = torch.Generator().manual_seed(50)
    lens = [513, 77, 1000]
    b = make_paged_batch(lens, lens, HKV, D, PAGE, dev, gen=g)
    q = torch.randn(sum(lens), HQ, D, generator=g).bfloat16().to(dev)
    sinks = _sinks(g)
    for window in (None, 128):
        a = _run_prefill("flashinfer", q, b, sinks, window)
        t = _run_prefill("triton", q, b, sinks, window)
        assert rel_err(a, t) < TOL
