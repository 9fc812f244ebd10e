"""The `attndec` group of bench/kernels.py: decode attention of one gpt-oss layer (64 query / 8 KV heads,
head dim 64, 16-token pages) at batch 1, 8 and 64, context 8192, for a full layer and a sliding layer
(window 128), every candidate inside a CUDA graph as the engine's decode steps run it (issue #11).

Candidates:
- FlashInfer as the engine runs it: FlashInferSinkAttention with graph_batch set, plan_decode outside the
  graph (a sliding layer's plan does not split, kernels/attention.py), then `decode` (tensor-core decode +
  fused sink correction); beside it `decode_nosink`, what the fused engine path launches (its sink
  correction rides in the O projection's quantisation), and for sliding layers the planner's own split.
- The Triton split-KV sink decode (kernels/triton_attention.sink_decode) over (num_splits, block_n,
  num_warps, num_stages) variants, window-aware split counts included; `default` is what the engine's
  Triton path picks (triton_attention.default_num_splits), timed also with KVRELAY_PDL=0 (its two kernels
  launch with Programmatic Dependent Launch by default, kernels/pdl.py).

Each Triton variant is first checked against the float32 torch reference (kernels/reference.paged_attention)
and skipped (a NaN row saying why) when it disagrees, as Fp8BlockLinear._pick refuses a candidate.
Times: `ms` is triton.testing.do_bench_cudagraph (the call unrolled in one graph: warm L2, as the "CUDA
graph" row of the attn group); the note adds the time of one graph replay after a 256 MB L2 flush
(`cold`), nearer a real step where the layers between evict this layer's KV. TB/s counts the K and V
bytes of the visible keys (a sliding layer: the window).
"""

from __future__ import annotations

import contextlib
import os

import torch

HQ, HKV, D, PAGE, SM_SCALE = 64, 8, 64, 16, 0.125
CTX, WINDOW = 8192, 128
BATCHES = (1, 8, 64)

# (num_splits, block_n, num_warps, num_stages); None splits = the engine's default for that shape.
_CONFIGS = ((64, 4, 2), (128, 4, 2), (64, 4, 3), (128, 8, 2))
FULL_SPLITS = {1: (8, 16, 32, 64), 8: (4, 8, 16, 32), 64: (1, 2, 4, 8)}
SLIDING_VARIANTS = ((None, 64, 4, 2), (1, 128, 4, 2), (1, 64, 4, 2), (1, 32, 2, 2), (2, 64, 4, 2), (2, 64, 2, 2),
                    (2, 32, 4, 2), (4, 32, 4, 2), (4, 32, 2, 2), (4, 16, 2, 2))


def triton_variants(window: int | None, batch: int) -> list[tuple[int | None, int, int, int]]:
    """The Triton launch variants timed for one layer kind at one batch size."""
    if window:
        return list(SLIDING_VARIANTS)
    return [(None, 64, 4, 2)] + [(s, *c) for s in FULL_SPLITS.get(batch, (1, 4, 16)) for c in _CONFIGS]


def decode_case(batch: int, ctx: int, window: int | None, dev, *, gen: torch.Generator | None = None):
    """One decode batch as the engine lays it out: q [B, Hq, D], a pool whose page tables hold each
    sequence's live pages (all of them for a full layer; for a sliding layer the pages of its last
    `window` positions, kv_geometry.live_pages, so 9 pages / 136 keys of which 128 are visible), float32
    sinks (Attention.sinks) spread wide enough (+-2 around 1) that a kernel dropping them fails the check."""
    from kvrelay.engine.kv_geometry import FULL, SLIDING, live_pages

    length = ctx + 8 if window else ctx  # sliding: a length mid-page, so the window's edge is masked
    pages = live_pages(SLIDING if window else FULL, length, PAGE, window or 0)
    n_pages = len(pages)
    held = (n_pages - 1) * PAGE + (length - (pages.stop - 1) * PAGE)
    kw = dict(device=dev, generator=gen)
    pool = torch.randn(batch * n_pages, 2, PAGE, HKV, D, **kw).to(torch.bfloat16)
    i32 = dict(dtype=torch.int32, device=dev)
    kv_indptr = torch.arange(batch + 1, **i32) * n_pages
    kv_indices = torch.randperm(batch * n_pages, **kw).to(device=dev, dtype=torch.int32)
    last = torch.full((batch,), held - (n_pages - 1) * PAGE, **i32)
    q = torch.randn(batch, HQ, D, **kw).to(torch.bfloat16)
    sinks = (torch.randn(HQ, **kw) * 2 + 1).float()
    visible = min(window, held) if window else held
    return dict(q=q, pool=pool, sinks=sinks, kv_indptr=kv_indptr, kv_indices=kv_indices, last=last,
                held=held, visible=visible, window=window, batch=batch)


def reference(case) -> torch.Tensor:
    """float32 torch attention with sinks (kernels/reference.paged_attention), as float32."""
    from kvrelay.kernels.reference import PagedKV, paged_attention

    b = case["batch"]
    qo = torch.arange(b + 1, dtype=torch.int32, device=case["q"].device)
    kv = PagedKV(case["kv_indptr"], case["kv_indices"], case["last"])
    return paged_attention(case["q"].float(), case["pool"].float(), qo, kv, case["sinks"], SM_SCALE,
                           case["window"])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-12))


TOLERANCE = 2e-2  # bf16 output vs the float32 reference, relative L2 (a bf16 kernel lands near 5e-3)


def triton_candidate(case, splits, bn, nw, ns):
    """-> (fn writing into fixed buffers, the split count it launches) for one Triton variant."""
    from kvrelay.kernels import triton_attention as ta

    q = case["q"]
    n = splits
    if n is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
        n = ta.default_num_splits(case["batch"], HKV, num_sms=sms, block_n=bn, window=case["window"])
    ws = ta.decode_workspace(case["batch"], HQ, D, n, q.device)
    out = torch.empty_like(q)

    def fn():
        return ta.sink_decode(q, case["pool"], case["sinks"], case["kv_indptr"], case["kv_indices"], case["last"],
                              sm_scale=SM_SCALE, window=case["window"], out=out, num_splits=n, block_n=bn,
                              num_warps=nw, num_stages=ns, workspace=ws)
    return fn, n


def checked(fn, ref) -> tuple[bool, float]:
    """Run fn once and compare with the reference: (agrees, relative error). A NaN never agrees."""
    err = rel_err(fn(), ref)
    return err <= TOLERANCE, err


def graph_cold_ms(fn, rep: int = 50) -> float:
    """Median time of one CUDA-graph replay of fn right after a 256 MB write (the L2 holds none of its
    inputs); the flush is queued before the start event, so the replay's launch is hidden behind it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(rep):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in times)
    return ms[len(ms) // 2]


@contextlib.contextmanager
def _pdl(on: bool):
    """KVRELAY_PDL=0 while off (read at each launch, so also by the graphs captured meanwhile)."""
    old = os.environ.get("KVRELAY_PDL")
    if not on:
        os.environ["KVRELAY_PDL"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVRELAY_PDL", None)
        else:
            os.environ["KVRELAY_PDL"] = old


def _label(batch: int, window: int | None) -> str:
    return f"b{batch} " + (f"sliding win{WINDOW} ctx{CTX}" if window else f"full ctx{CTX}")


def bench_attention_decode(dev, record) -> None:
    """Time every candidate of every (batch, layer kind); `record` is bench/kernels.record. A case that
    fails is one NaN row, the other cases still run."""
    gen = torch.Generator(device=dev).manual_seed(0)
    for window in (None, WINDOW):
        for batch in BATCHES:
            try:
                _bench_case(batch, window, dev, gen, record)
            except Exception as exc:  # noqa: BLE001 - keep the other cases' numbers
                record("attndec", f"{_label(batch, window)} CASE FAILED", float("nan"), note=repr(exc)[:300])
            torch.cuda.empty_cache()


def _bench_case(batch: int, window: int | None, dev, gen, record) -> None:
    import triton
    from kvrelay.kernels import attention as fa

    case = decode_case(batch, CTX, window, dev, gen=gen)
    label = _label(batch, window)
    nbytes = batch * case["visible"] * HKV * D * 2 * 2
    ref = reference(case)

    def timed(name, fn, note=""):
        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        cold = graph_cold_ms(fn)
        cold_note = f"cold L2 {cold * 1e3:.1f} us ({nbytes / cold / 1e9:.2f} TB/s)"
        record("attndec", f"{label} {name}", ms, nbytes=nbytes, note=(note + "; " if note else "") + cold_note)
        print(f"{'':6s}   {cold_note}", flush=True)

    q, pool, sinks = case["q"], case["pool"], case["sinks"]
    host_ip, host_last = case["kv_indptr"].cpu(), case["last"].cpu()
    for fi_split in ((False, True) if window else (False,)):
        tag = "FI TC" + (" planner split (KVRELAY_FI_SLIDING_SPLIT=1)" if fi_split else "")
        try:
            att = fa.FlashInferSinkAttention(HQ, HKV, D, PAGE, window, SM_SCALE, dev, graph_batch=batch,
                                             graph_max_pages=case["kv_indices"].numel())
            if fi_split:
                att._no_split = False  # the planner's own split, as KVRELAY_FI_SLIDING_SPLIT=1 sets it
            att.plan_decode(host_ip, case["kv_indices"], host_last)
            ok, err = checked(lambda: att.decode(q, pool, sinks), ref)
            note = f"rel err {err:.2g}" + ("" if ok else " DISAGREES with the reference")
            timed(f"{tag} decode+sink (engine, unfused)", lambda: att.decode(q, pool, sinks), note)
            timed(f"{tag} decode_nosink (engine fused path)", lambda: att.decode_nosink(q, pool))
            del att
        except Exception as exc:  # noqa: BLE001 - recorded, the Triton rows still run
            record("attndec", f"{label} {tag}", float("nan"), note=f"failed: {repr(exc)[:120]}")
    # the engine's default launch also without PDL (kernels/pdl.py; the setting a graph captures)
    variants = [(v, True) for v in triton_variants(window, batch)] + [(triton_variants(window, batch)[0], False)]
    for (splits, bn, nw, ns), use_pdl in variants:
        name = f"triton split{splits} bn{bn} w{nw} s{ns}"
        try:
            with _pdl(use_pdl):
                fn, n = triton_candidate(case, splits, bn, nw, ns)
                name = (f"triton split{n}{' (default)' if splits is None else ''} bn{bn} w{nw} s{ns}"
                        + ("" if use_pdl else " KVRELAY_PDL=0"))
                ok, err = checked(fn, ref)
                if not ok:
                    record("attndec", f"{label} {name}", float("nan"),
                           note=f"skipped: rel err {err:.3g} vs the float32 reference")
                    continue
                timed(name, fn, f"rel err {err:.2g}")
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is skipped
            record("attndec", f"{label} {name}", float("nan"), note=f"failed: {repr(exc)[:120]}")
