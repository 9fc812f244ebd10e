"""The decode attention kernel choice under TRITON_INTERPRET=1 on CPU tensors: bench/attn_decode.py's Triton
candidates and their check, sink_decode's window-aware split default, GpuAttention sending the layer kinds
that kernels/select.py picks to the Triton split-KV decode (and only the others to FlashInfer), and the
fused model path taking the Triton decode's finished output. Split from test_triton_interpret.py, whose
re-run machinery (tests/cpu/interp_helpers.py) it shares.
"""

from __future__ import annotations

import os

import torch
from interp_helpers import interpreted, refs

_interpreted = interpreted(__file__)


@_interpreted
def test_attndec_bench_candidates_check_interpreted():
    # bench/attn_decode.py: its decode cases (a full layer; a sliding layer holding 9 pages of which the
    # window sees 128 keys), the Triton variants it times agree with the float32 reference on a short
    # context (every sliding one; the full kind's first few, the interpreter being slow), and its check
    # refuses a kernel that drops the sink or one that returns NaN.
    from kvrelay.bench import attn_decode as ad
    from kvrelay.kernels import triton_attention as ta
    g = torch.Generator().manual_seed(11)
    for window, batch, n_variants in ((None, 1, 3), (ad.WINDOW, 2, None)):
        case = ad.decode_case(batch, 192, window, "cpu", gen=g)  # 192 = 8192 mod 16, as timed
        if window:
            assert case["kv_indices"].numel() == 9 * batch and case["visible"] == 128 < case["held"]
        ref = ad.reference(case)
        variants = ad.triton_variants(window, batch)
        assert variants[0][0] is None  # the engine's default is among them
        for v in variants[:n_variants]:
            fn, n = ad.triton_candidate(case, *v)
            if window:
                assert n <= 4, v
            assert ad.checked(fn, ref)[0], (window, batch, v)
        no_sink = lambda: ta.sink_decode(case["q"], case["pool"], case["sinks"] - 1e4, case["kv_indptr"],  # noqa: E731
                                         case["kv_indices"], case["last"], sm_scale=ad.SM_SCALE, window=window)
        assert not ad.checked(no_sink, ref)[0]
        assert not ad.checked(lambda: torch.full_like(case["q"], float("nan")), ref)[0]


@_interpreted
def test_sink_decode_window_aware_default_splits_interpreted():
    # The split count sink_decode picks by itself (default_num_splits with the window): for a window no
    # more splits than BLOCK_N chunks of it (a 128-key window at batch 1 on 132 SMs: 2, not 64), and the
    # output equals kernels/reference.py's with sinks large enough to matter, windows shorter and longer
    # than the contexts, on the counts a 132-SM GPU would pick and on the interpreter's own (8 "SMs").
    from kvrelay.kernels import reference as R
    from kvrelay.kernels import triton_attention as ta
    assert ta.default_num_splits(1, 8, num_sms=132, block_n=64, window=128) == 2
    assert ta.default_num_splits(1, 8, num_sms=132, block_n=64, window=None) == 64  # full layers: as before
    assert ta.default_num_splits(1, 8, num_sms=132, block_n=32, window=128) == 4
    assert ta.default_num_splits(64, 8, num_sms=132, block_n=64, window=128) == 2
    assert ta.default_num_splits(64, 8, num_sms=132, block_n=64, window=None) == 2
    g = torch.Generator().manual_seed(12)
    heads, kv_heads, d, page = 8, 2, 64, 16
    kv_lens = [1, 9, 40, 129, 300]
    b = refs.make_paged_batch(kv_lens, [1] * len(kv_lens), kv_heads, d, page, "cpu", gen=g)
    q = torch.randn(len(kv_lens), heads, d, generator=g).bfloat16()
    sinks = torch.randn(heads, generator=g) + 4  # float32, as Attention.sinks; +4: dropping them must fail
    kv = R.PagedKV(b.kv_indptr, b.kv_indices, b.kv_last_page_len)
    qo = torch.arange(len(kv_lens) + 1, dtype=torch.int32)
    for window in (None, 8, 128, 1000):
        ref = R.paged_attention(q.float(), b.pool.float(), qo, kv, sinks, 0.125, window)
        no_sink = R.paged_attention(q.float(), b.pool.float(), qo, kv, sinks - 1e4, 0.125, window)
        for splits in (None, ta.default_num_splits(len(kv_lens), kv_heads, num_sms=132, window=window)):
            out = torch.full_like(q, float("nan"))
            ta.sink_decode(q, b.pool, sinks, b.kv_indptr, b.kv_indices, b.kv_last_page_len, sm_scale=0.125,
                           window=window, out=out, num_splits=splits)
            assert refs.rel_err(out, ref) < 1e-2, (window, splits)
            assert refs.rel_err(out, no_sink) > 0.1, (window, splits)
    # a workspace too small for the launch is refused, not overrun
    ws = ta.decode_workspace(1, heads, d, 1, "cpu")
    try:
        ta.sink_decode(q, b.pool, sinks, b.kv_indptr, b.kv_indices, b.kv_last_page_len, sm_scale=0.125,
                       window=None, num_splits=2, workspace=ws)
    except ValueError as exc:
        assert "workspace" in str(exc)
    else:
        raise AssertionError("an undersized workspace must be refused")


@_interpreted
def test_merge_quantize_equals_merge_then_quantize_interpreted():
    # MergePending.quantize (the split partials merged with the sink straight into the output projection's
    # 1x128 FP8 input, one launch) against the merge kernel's output quantised by quantize_act_1x128: the
    # same scales and values (up to the fp32 order of the sums over splits), padding rows zero with the
    # floor scale, and K padded past the heads' columns; the merged values are the reference attention's.
    from kvrelay.kernels import reference as R
    from kvrelay.kernels import triton_attention as ta
    from kvrelay.kernels.fp8_gemm import quantize_act_1x128

    g = torch.Generator().manual_seed(21)
    heads, kv_heads, d, page = 8, 2, 64, 16
    for kv_lens, window, splits, quant_k in (([1, 9, 40, 129, 300], None, 3, 512), ([77], 8, 1, 512),
                                             ([5, 260], None, 8, 640)):
        b = refs.make_paged_batch(kv_lens, [1] * len(kv_lens), kv_heads, d, page, "cpu", gen=g)
        q = torch.randn(len(kv_lens), heads, d, generator=g).bfloat16()
        sinks = torch.randn(heads, generator=g) + 4
        pending = ta.sink_decode(q, b.pool, sinks, b.kv_indptr, b.kv_indices, b.kv_last_page_len, sm_scale=0.125,
                                 window=window, num_splits=splits, merge=False)
        assert isinstance(pending, ta.MergePending) and pending.num_splits == splits
        merged = pending.apply()
        kv = R.PagedKV(b.kv_indptr, b.kv_indices, b.kv_last_page_len)
        qo = torch.arange(len(kv_lens) + 1, dtype=torch.int32)
        assert refs.rel_err(merged, R.paged_attention(q.float(), b.pool.float(), qo, kv, sinks, 0.125, window)) < 1e-2
        xq, sx = pending.quantize(quant_k)
        wq, wsx = quantize_act_1x128(merged.reshape(len(kv_lens), -1), quant_k)
        assert xq.shape == wq.shape and sx.shape == wsx.shape and sx.stride() == wsx.stride()
        assert torch.allclose(sx, wsx, rtol=1e-2, atol=0), (kv_lens, (sx - wsx).abs().max())
        got, want = xq.float() * sx.repeat_interleave(128, 1), wq.float() * wsx.repeat_interleave(128, 1)
        assert refs.rel_err(got, want) < 2e-2, (kv_lens, refs.rel_err(got, want))
        assert not got[len(kv_lens):].any() and not got[:, heads * d:].any()
    try:
        pending.quantize(100)
    except ValueError as exc:
        assert "quant_k" in str(exc)
    else:
        raise AssertionError("a quant_k that is not a multiple of 128 must be refused")


class _RecordingFlashInfer:
    """Stands in for kernels.attention.FlashInferSinkAttention (no flashinfer on CPU): records which layer
    kinds were built and planned; its decode returns zeros, enough to tell who answered."""

    built: list = []
    planned: list = []

    def __init__(self, hq, hkv, d, page, window, sm_scale, device, **kw):
        self.window = window
        _RecordingFlashInfer.built.append(window)

    def plan_decode(self, *args):
        _RecordingFlashInfer.planned.append(self.window)

    def decode_nosink(self, q, pool):
        return torch.zeros_like(q), torch.zeros(q.shape[:2])


def _decode_batch(kv_lens, windows, heads, kv_heads, d, page, g):
    # One decode BatchLayout over a full and a sliding pool (as the engine's two page groups).
    from kvrelay.engine.batch_plan import BatchLayout
    from kvrelay.kernels.reference import PagedKV
    n = len(kv_lens)
    pools, kv, host = {}, {}, {"kv_indptr": {}, "kv_last_page_len": {}}
    for grp in windows:
        b = refs.make_paged_batch(kv_lens, [1] * n, kv_heads, d, page, "cpu", gen=g)
        pools[grp], kv[grp] = b.pool, PagedKV(b.kv_indptr, b.kv_indices, b.kv_last_page_len)
        host["kv_indptr"][grp], host["kv_last_page_len"][grp] = b.kv_indptr, b.kv_last_page_len
    z = torch.zeros(n, dtype=torch.long)
    qo = torch.arange(n + 1, dtype=torch.int32)
    host["qo_indptr"] = qo
    lay = BatchLayout(qo_indptr=qo, positions=z, logit_rows=z, kv=kv, write_pages={w: z for w in windows},
                      write_offsets={w: z for w in windows}, num_tokens=n, num_seqs=n, host=host)
    return lay, pools


@_interpreted
def test_gpu_attention_sends_chosen_groups_to_triton_decode_interpreted():
    # GpuAttention under the flashinfer backend with KVRELAY_DECODE_SLIDING=triton: a graph-size object
    # builds and plans FlashInfer for the full group only, decodes the sliding group with the Triton kernel
    # (a finished tensor even when the fused path asks to defer the sink; kernels/reference.py's output)
    # from a workspace allocated once; an eager object re-decides per batch and grows its workspace only
    # when a batch needs more. Without the env the groups decode as select.default_decode_kernel says.
    from types import SimpleNamespace

    from kvrelay.engine.layers.attention import GpuAttention, SinkPending
    from kvrelay.kernels.triton_attention import MergePending
    from kvrelay.kernels import attention as fa
    from kvrelay.kernels import reference as R
    from kvrelay.kernels import select
    real = fa.FlashInferSinkAttention
    fa.FlashInferSinkAttention = _RecordingFlashInfer
    heads, kv_heads, d, page, window = 8, 2, 64, 16, 8
    cfg = SimpleNamespace(head_dim=d, sm_scale=0.125, sliding_window=window)
    windows = {"full": None, "sliding": window}
    g = torch.Generator().manual_seed(13)
    sinks = torch.randn(heads, generator=g) + 4
    make = lambda **kw: GpuAttention(cfg, kv_heads, heads, page, "cpu", torch.bfloat16, "flashinfer", **kw)  # noqa: E731
    try:
        os.environ.pop("KVRELAY_DECODE_ATTENTION", None)
        os.environ.pop("KVRELAY_DECODE_SLIDING", None)
        lay, pools = _decode_batch([3, 20, 40], windows, heads, kv_heads, d, page, g)
        default = make(graph_batch=3, graph_max_pages={"full": 16, "sliding": 16})
        assert default.decode_kind == select.DECODE_DEFAULT
        assert (default._ws is None) == ("triton" not in select.DECODE_DEFAULT.values())
        default.plan_replay(lay, {w: 0 for w in windows})
        assert sorted(map(str, _RecordingFlashInfer.planned)) == sorted(
            str(windows[g]) for g, k in select.DECODE_DEFAULT.items() if k == "flashinfer")
        os.environ["KVRELAY_DECODE_SLIDING"] = "triton"
        os.environ["KVRELAY_DECODE_ATTENTION"] = "flashinfer"  # full layers on FlashInfer whatever the default
        _RecordingFlashInfer.built.clear()
        _RecordingFlashInfer.planned.clear()
        att = make(graph_batch=3, graph_max_pages={"full": 16, "sliding": 16})
        assert att.decode_kind == {"full": "flashinfer", "sliding": "triton"}
        assert _RecordingFlashInfer.built == [None] and set(att.fi) == {"full"}
        ws = att._ws
        assert ws is not None and att.decode_splits == {"sliding": 1}  # window 8 < one 64-key block
        q = torch.randn(3, heads, d, generator=g).bfloat16()
        for _ in range(2):
            att.plan_replay(lay, {w: 0 for w in windows})
            assert isinstance(att.run(q, pools["full"], "full", sinks, 0.125, None, defer_sink=True), SinkPending)
            pending = att.run(q, pools["sliding"], "sliding", sinks, 0.125, window, defer_sink=True)
            assert isinstance(pending, MergePending) and att._ws is ws and pending.num_splits == 1
            out = pending.apply()
            assert torch.equal(out, att.run(q, pools["sliding"], "sliding", sinks, 0.125, window))
        assert _RecordingFlashInfer.planned == [None, None]  # the sliding group never planned by FlashInfer
        ref = R.paged_attention(q.float(), pools["sliding"].float(), lay.qo_indptr, lay.kv["sliding"], sinks, 0.125,
                                window)
        assert refs.rel_err(out, ref) < 1e-2
        # eager: both kinds built (prefill needs the full one), the sliding decode still never planned
        os.environ["KVRELAY_DECODE_ATTENTION"] = "triton"
        os.environ.pop("KVRELAY_DECODE_SLIDING")
        _RecordingFlashInfer.planned.clear()
        eager = make()
        assert set(eager.fi) == {"full", "sliding"}
        eager.plan(lay)
        assert eager.decode_kind == {"full": "triton", "sliding": "triton"} and not _RecordingFlashInfer.planned
        ws = eager._ws
        out = eager.run(q, pools["full"], "full", sinks, 0.125, None, defer_sink=True).apply()
        ref = R.paged_attention(q.float(), pools["full"].float(), lay.qo_indptr, lay.kv["full"], sinks, 0.125, None)
        assert refs.rel_err(out, ref) < 1e-2
        small, _ = _decode_batch([5], windows, heads, kv_heads, d, page, g)
        eager.plan(small)
        assert eager._ws is ws  # big enough already
        big, _ = _decode_batch([5] * 20, windows, heads, kv_heads, d, page, g)
        eager.plan(big)
        assert eager._ws[1].numel() >= 20 * heads * max(eager.decode_splits.values()) > ws[1].numel()
    finally:
        fa.FlashInferSinkAttention = real
        os.environ.pop("KVRELAY_DECODE_ATTENTION", None)
        os.environ.pop("KVRELAY_DECODE_SLIDING", None)


@_interpreted
def test_model_fused_path_takes_finished_triton_decode_interpreted():
    # The fused model path asks GpuAttention.run to defer the sink (defer_sink=True); a Triton-decoded
    # group answers with its split partials (a MergePending), which Attention.project_out merges (bf16
    # weights: MergePending.apply; FP8: merged straight into the quantised input): the same GPU-kernel model (fused glue) with its attention on the
    # Triton kernels and on kernels/reference.py gives the same logits, prefill and decode steps, sliding
    # window (8) crossed. (The interpreted glue itself is compared with the CPU path in test_fused_kernels.)
    from kvrelay.engine.config import PRESETS
    from kvrelay.engine.layers.attention import GpuAttention
    from kvrelay.engine.runner import Runner
    from kvrelay.engine.weights import open_weights

    cfg = PRESETS["tiny"].replace(num_hidden_layers=2)
    prompt = [3, 141, 59, 26, 535, 8, 97, 93, 23, 84, 62, 64]

    def run(attention):
        os.environ["KVRELAY_KERNELS"] = "triton"
        os.environ["KVRELAY_ATTENTION"] = attention
        try:
            r = Runner(cfg, open_weights(None, cfg, dummy=True, seed=3), page_size=4, kv_tokens=64)
        finally:
            os.environ.pop("KVRELAY_KERNELS", None)
            os.environ.pop("KVRELAY_ATTENTION", None)
        assert r.model.blocks[0].fused
        out = [r.prefill("a", prompt).float()] + [r.decode(["a"], [t]).float() for t in (7, 900, 12)]
        return r, torch.stack([o.reshape(-1) for o in out])

    gpu, got = run("triton")
    assert isinstance(gpu.attn, GpuAttention) and gpu.attn.decode_kind == {"full": "triton", "sliding": "triton"}
    _, want = run("reference")
    for step, (a, b) in enumerate(zip(got, want)):
        assert refs.rel_err(a, b) < 1e-2, (step, refs.rel_err(a, b))
