"""bench.profile_prefill: the kernel-name categoriser on real kernel names (ours, cuBLAS, FlashInfer, aten,
the profiler's memcpy rows) and on every Triton kernel in kernels/*.py; the GPU-idle gaps (bench/gpu_idle.py)
of synthetic kernel timelines, overlapping streams included; the profiler run on CPU with the tiny model (the
categories add up to the kernel total, the JSON has its fields, no device events: no idle report); and its
RESULTS.md table from synthetic results (absent when there are none)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import git_revs
import pytest

from kvrelay.bench import gpu_idle, profile_prefill as pp, provenance, results_tuning

REPO = Path(__file__).resolve().parents[2]

# Names as the H200 profiles spell them (bench/results/profile-decode-*.json) or as kernels/*.py defines them.
NAMES = {
    "_gemv1_kernel": "MoE expert GEMM",
    "_gemv2_kernel": "MoE expert GEMM",
    "_grouped_kernel": "MoE expert GEMM",
    "_sort_pairs_kernel": "MoE routing/sort/permute/combine",
    "_sort_count_kernel": "MoE routing/sort/permute/combine",
    "_sort_place_kernel": "MoE routing/sort/permute/combine",
    "_route_kernel": "MoE routing/sort/permute/combine",
    "_router_route_kernel": "MoE routing/sort/permute/combine",
    "_add_norm_route_kernel": "MoE routing/sort/permute/combine",
    "combine_kernel": "MoE routing/sort/permute/combine",
    "_quant_act_kernel": "activation quantisation",
    "_quant_act_tile_kernel": "activation quantisation",
    "_rotary_kv_write_tile_kernel": "rotary/KV write",
    "nvjet_sm90_qqtst_64x8_128x16_4x1_v_bz_algo2_Avec128_Bvec128_bias_TNT": "dense linear",
    "nvjet_sm90_tst_512x8_64x3_2x1_v_bz_TNT": "dense linear",
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::MainloopSm90TmaGmma":
        "dense linear",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off":
        "dense linear",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, false, true>": "dense linear",
    "_fp8_gemm_kernel": "dense linear",
    "_fp8_gemv_kernel": "dense linear",
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<true, flashinfer::KernelTraits<(flashi": "attention",
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>": "attention",
    "_sink_prefill_kernel": "attention",
    "_sink_correction_kernel": "attention",
    "_sink_quant_kernel": "attention",
    "_add_rms_norm_kernel": "norms/residual",
    "_rms_norm_kernel": "norms/residual",
    "_rotary_kv_write_kernel": "rotary/KV write",
    "_rotary_qk_kernel": "rotary/KV write",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
    "long, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>)": "LM head/sampling",
    "Memcpy HtoD (Pinned -> Device)": "memcpy/memset",
    "Memcpy DtoH (Device -> Pageable)": "memcpy/memset",
    "Memset (Device)": "memcpy/memset",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, std::array<char*, 1ul> >"
    "(int, at::native::FillFunctor<int>, std::array<char*, 1ul>)": "other",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...>": "other",
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_categorise_real_kernel_names(name):
    assert pp.categorise(name) == NAMES[name]


def _triton_kernels() -> list[str]:
    """Every launched Triton kernel of ours: @triton.jit functions named *_kernel (the others are
    device helpers inlined into them: topk_softmax, swiglu, _gemv_tile, ...)."""
    names = []
    for path in sorted((REPO / "kernels").glob("*.py")):
        names += re.findall(r"@triton\.jit[^\n]*\ndef (\w+_kernel)\(", path.read_text())
    return names


def test_every_triton_kernel_of_ours_has_a_category():
    names = _triton_kernels()
    assert len(names) >= 18 and "_grouped_kernel" in names and "_rotary_kv_write_kernel" in names
    assert {n: pp.categorise(n) for n in names if pp.categorise(n) == pp.OTHER} == {}


# Frames as torch.profiler's stack tracer names them (absolute path, the function's def line, its name),
# innermost first, for kernels whose names say only which library ran them.
SITES = [
    # the router's bf16 cuBLAS GEMM at prefill sizes (above kernels.router.ROUTE_MAX_TOKENS)
    (["/r/engine/layers/linear.py(103): __call__", "/r/engine/layers/moe.py(95): _gpu_forward",
      "/r/engine/layers/moe.py(61): __call__", "/r/engine/model.py(85): attention_out_deferred"],
     "MoE routing/sort/permute/combine"),
    # kernels.moe_sort.sort_by_expert's torch ops (argsort, cumsum, scatter_add) under the grouped experts
    (["/r/kernels/moe_sort.py(120): sort_by_expert", "/r/kernels/moe.py(336): _moe_grouped",
      "/r/kernels/moe.py(417): moe_experts"], "MoE routing/sort/permute/combine"),
    (["/r/kernels/moe.py(188): sort_by_expert", "/r/kernels/moe.py(359): _moe_grouped",
      "/r/kernels/moe.py(417): moe_experts", "/r/engine/layers/moe.py(118): _experts",
      "/r/engine/layers/moe.py(95): _gpu_forward"], "MoE routing/sort/permute/combine"),
    # the LM head's GEMM: Unembedding under the model's head (the last block's MoE is not on this path)
    (["/r/engine/layers/embedding.py(45): __call__", "/r/engine/model.py(183): head",
      "/r/engine/model.py(157): forward", "/r/engine/runner.py(208): _run"], "LM head/sampling"),
    (["/r/engine/runner.py(446): sample", "/r/bench/profile_prefill.py(150): call"], "LM head/sampling"),
    # a dense projection's cuBLAS GEMM: no call-site rule, its name decides
    (["/r/kernels/fp8_gemm.py(120): cublas_fp8_gemm", "/r/engine/layers/linear.py(103): __call__",
      "/r/engine/layers/attention.py(76): project_in", "/r/engine/model.py(68): residual_attention_in",
      "/r/engine/model.py(157): forward"], None),
    (["/r/engine/layers/attention.py(91): rotate_and_write", "/r/engine/layers/attention.py(76): project_in"],
     "rotary/KV write"),
    (["/r/kernels/reference.py(40): paged_attention", "/r/engine/layers/attention.py(162): run"], "attention"),
    (["/r/engine/layers/norm.py(21): __call__", "/r/engine/model.py(183): head"], "LM head/sampling"),
    (["/r/engine/layers/norm.py(21): __call__", "/r/engine/model.py(59): attention_in"], "norms/residual"),
    (["/r/engine/model.py(178): embed", "/r/engine/model.py(157): forward"], None),
]


@pytest.mark.parametrize("frames,want", SITES)
def test_call_site_categories(frames, want):
    assert pp.site_category(frames) == want


def test_call_site_replaces_only_library_names():
    router = SITES[0][0]
    assert pp.event_category("nvjet_sm90_tst_128x64_64x8_1x2_h_bz_TNN", pp.site_category(router)) == \
        "MoE routing/sort/permute/combine"
    assert pp.event_category("void at::native::index_elementwise_kernel<128, 4>", "LM head/sampling") == \
        "LM head/sampling"
    # ours keep their name's category wherever they were launched from
    assert pp.event_category("_quant_act_kernel", "MoE routing/sort/permute/combine") == "activation quantisation"
    assert pp.event_category("Memcpy HtoD (Pinned -> Device)", "LM head/sampling") == "memcpy/memset"
    assert pp.event_category("nvjet_sm90_qqtst_64x8_128x16_4x1_v_bz_algo2_Avec128_Bvec128_bias_TNT", None) == \
        "dense linear"


def _ev(name, device, start, us, id_=0, linked=None, parent=None, kernels=()):
    e = SimpleNamespace(name=name, device_type=SimpleNamespace(name=device), id=id_, cpu_parent=parent,
                        time_range=SimpleNamespace(start=start), self_device_time_total=us,
                        kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels], is_python_function=False)
    if linked is not None:
        e.linked_correlation_id = linked
    return e


@pytest.mark.parametrize("linked", [True, False])
def test_launchers(linked):
    """A kernel's op: by the profiler's correlation link, or (a torch without it) by each op's kernel list in
    launch order; a runtime event sharing an op's id (CUPTI counts its own) is never taken for the op."""
    frame = _ev("/r/engine/model.py(183): head", "CPU", 0, 0)
    frame.is_python_function = True
    a = _ev("aten::mm", "CPU", 1, 0, id_=7, linked=0 if linked else None, parent=frame, kernels=[("gemm", 5.0)])
    b = _ev("aten::mm", "CPU", 3, 0, id_=8, linked=0 if linked else None, kernels=[("gemm", 5.0), ("fill", 1.0)])
    runtime = _ev("cudaLaunchKernel", "CPU", 1.5, 0, id_=8, linked=7 if linked else None)
    k1 = _ev("gemm", "CUDA", 10, 5.0, linked=7 if linked else None)
    k2 = _ev("gemm", "CUDA", 20, 5.0, linked=8 if linked else None)
    k3 = _ev("fill", "CUDA", 30, 1.0, linked=8 if linked else None)
    triton = _ev("_grouped_kernel", "CUDA", 40, 9.0, linked=0 if linked else None)
    got = pp._launchers([frame, a, runtime, b, k1, k2, k3, triton], [k1, k2, k3, triton])
    assert got == [a, b, b, None]
    assert pp._frames(a) == ["/r/engine/model.py(183): head"] and pp.site_category(pp._frames(a)) == "LM head/sampling"


def test_summarise_adds_up():
    routing = "MoE routing/sort/permute/combine"
    events = [("_grouped_kernel", 300.0, None), ("_grouped_kernel", 100.0, routing), ("nvjet_sm90_tst_x", 40.0, None),
              ("nvjet_sm90_tst_x", 10.0, routing), ("aten_fill", 25.0, None),
              ("Memcpy HtoD (Pinned -> Device)", 25.0, "LM head/sampling")]
    s = pp.summarise(events, top=2)
    assert s["kernel_us"] == 500.0 and s["launches"] == 6 and s["by_call_site"] == 1
    assert s["top"] == [{"kernel": "_grouped_kernel", "calls": 2, "total_us": 400.0, "share": 0.8,
                         "category": "MoE expert GEMM"},
                        {"kernel": "nvjet_sm90_tst_x", "calls": 2, "total_us": 50.0, "share": 0.1,
                         "category": "dense linear", "split": {"dense linear": 40.0, routing: 10.0}}]
    cats = {c["category"]: (c["calls"], c["us"], c["share"]) for c in s["categories"]}
    assert cats == {"MoE expert GEMM": (2, 400.0, 0.8), "dense linear": (1, 40.0, 0.08), routing: (1, 10.0, 0.02),
                    "other": (1, 25.0, 0.05), "memcpy/memset": (1, 25.0, 0.05)}


def test_idle_gaps_of_a_two_stream_timeline():
    """(start, end, name) in us, the call's window [0, 100]: a kernel on a second stream overlapping two of the
    first stream's (and ending last, so the gap after it is counted from its end), a kernel inside another's
    span, a zero gap (back to back), and the largest gaps first with their neighbours."""
    ivs = [(5.0, 20.0, "A"),  # 5 us before the first kernel
           (18.0, 40.0, "void at::native::side_stream_kernel<4, F<int> >(int, F<int>)"),  # overlaps A and B
           (22.0, 30.0, "B"),  # inside the side kernel: no gap
           (45.0, 50.0, "C"),  # 5 us after the side kernel's end (40), not B's (30)
           (50.0, 60.0, "D"),  # back to back: no gap
           (61.5, 70.0, "Memcpy DtoH (Device -> Pageable)"),  # 1.5 us
           (80.0, 90.0, "E")]  # 10 us; then 10 us to the window's end
    r = gpu_idle.idle_report(list(reversed(ivs)), (0.0, 100.0), largest=2)  # any order in
    assert r["before_first_ms"] == pytest.approx(0.005) and r["after_last_ms"] == pytest.approx(0.010)
    assert r["between_ms"] == pytest.approx((5 + 1.5 + 10) / 1e3) and r["gaps"] == 3
    assert r["busy_ms"] == pytest.approx((35 + 15 + 8.5 + 10) / 1e3) and r["device_events"] == 7
    assert r["idle_ms"] + r["busy_ms"] == pytest.approx(r["window_ms"]) and r["window_ms"] == pytest.approx(0.1)
    assert r["largest"] == [{"gap_us": 10.0, "at_ms": 0.07, "prev": "Memcpy DtoH (Device -> Pageable)", "next": "E"},
                            {"gap_us": 5.0, "at_ms": 0.04, "prev": "side_stream_kernel<4, F<int> >", "next": "C"}]
    # no window: the events' own span; the call returning before its last kernel ended: no tail
    assert gpu_idle.idle_report(ivs, None)["before_first_ms"] == 0 == gpu_idle.idle_report(ivs, None)["after_last_ms"]
    assert gpu_idle.idle_report(ivs, (0.0, 85.0))["after_last_ms"] == 0
    assert gpu_idle.idle_report([], (0.0, 1.0)) is None


def test_short_names():
    assert gpu_idle.short_name("void cublasLt::splitKreduce_kernel<32, 16, int, float>(cublasLt::Params)") == \
        "splitKreduce_kernel<32, 16, int, float>"
    assert gpu_idle.short_name("_grouped_kernel") == "_grouped_kernel"
    assert gpu_idle.short_name("Memset (Device)") == "Memset (Device)"
    long = gpu_idle.short_name("void flashinfer::BatchPrefillWithPagedKVCacheKernel<true, flashinfer::KernelTraits<"
                               "(flashinfer::MaskMode)0, 128u, 1u, 4u, 8u, 8u, 1u, 1u>>(Params)", width=40)
    assert long == "BatchPrefillWithPagedKVCacheKernel<tr..." and len(long) == 40


def test_profiler_intervals():
    """Device events as (start, end, name) from FunctionEvent.time_range, a record_function's GPU range and the
    CPU ops left out; the window from the first StopWatch mark's cudaEventRecord to the last one's."""
    def ev(name, device, start, end, annotation=False):
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device), is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [ev("cudaEventRecord", "CPU", 1.0, 1.5), ev("range", "CUDA", 3.0, 90.0, True),
              ev("aten::mm", "CPU", 2.0, 4.0), ev("nvjet_x", "CUDA", 5.0, 9.0), ev("cudaEventRecord", "CPU", 40, 41),
              ev("Memset (Device)", "CUDA", 9.5, 9.75), ev("cudaEventRecord", "CPU", 98.0, 99.0)]
    kernels = [(5.0, 9.0, "nvjet_x"), (9.5, 9.75, "Memset (Device)")]
    assert gpu_idle.profiler_intervals(SimpleNamespace(events=lambda: events)) == (kernels, (1.0, 99.0))
    no_marks = [e for e in events if e.name != "cudaEventRecord"]
    assert gpu_idle.profiler_intervals(SimpleNamespace(events=lambda: no_marks)) == (kernels, None)


def test_profile_prefill_cpu(tmp_path, capsys):
    out = pp.main(["--model", "gpt-oss-tiny", "--dummy", "--device", "cpu", "--length", "32", "--top", "400",
                   "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "profile-prefill-gpt-oss-tiny-32.json").read_text())
    for key in ("env", "model", "quant", "length", "wall_ms", "profiled_wall_ms", "kernel_ms", "launches", "top",
                "categories", "tflops"):
        assert key in saved, key
    assert saved["kind"] == "profile-prefill" and saved["model"] == "gpt-oss-tiny" and saved["length"] == 32
    assert saved["env"]["command"].endswith("--length 32 --top 400 --out " + str(tmp_path))
    assert saved["wall_ms"] > 0 and saved["profiled_wall_ms"] > 0 and saved["kernel_ms"] > 0
    cats = saved["categories"]
    assert abs(sum(c["us"] for c in cats) - saved["kernel_ms"] * 1e3) <= 0.1 * len(cats)
    assert sum(c["calls"] for c in cats) == saved["launches"] > 0
    assert abs(sum(c["share"] for c in cats) - 1.0) < 1e-3
    top = saved["top"]
    assert top == sorted(top, key=lambda r: -r["total_us"]) and len(top) < 400  # every op name: the CPU run's
    assert sum(r["calls"] for r in top) == saved["launches"]
    assert not any(".py(" in r["kernel"] for r in top)  # the stack tracer's Python frames are not ops
    # On CPU the ops are the events: the first token's argmax (Runner.sample) and the unembedding's matmul
    # (under the model's head) are told by where they ran, not by their names
    rows = {r["kernel"]: r for r in top}
    assert rows["aten::argmax"]["category"] == "LM head/sampling"
    assert rows["aten::mm"]["split"]["LM head/sampling"] > 0
    assert saved["by_call_site"] > 0
    moe = saved["tflops"]["MoE expert GEMM"]
    cfg = pp.C.resolve_config("gpt-oss-tiny")
    assert moe["flops"] == 2 * 32 * cfg.experts_per_token * 3 * cfg.hidden_size * cfg.intermediate_size \
        * cfg.num_hidden_layers
    assert out["launches"] == saved["launches"]
    # a CPU run has no device events: no idle figures, and the report says why
    assert "idle" in saved and saved["idle"] is None
    assert "GPU idle: no device events" in capsys.readouterr().out


def test_results_table(tmp_path):
    assert results_tuning.prefill_profile_section(provenance.collect([tmp_path])) == []  # none: no section
    head = git_revs.rev("HEAD")
    env = {"gpu": "NVIDIA H200", "git_commit": head, "git_dirty": False, "timestamp": "2026-12-01T20:00:00+00:00",
           "command": "python -m kvrelay.bench.profile_prefill --length 8192", "kvrelay_env": {}}
    data = {"kind": "profile-prefill", "env": env, "model": "gpt-oss-20b", "quant": "fp8-block128", "length": 8192,
            "wall_ms": 250.0, "kernel_ms": 240.0, "launches": 1500,
            "categories": [{"category": "MoE expert GEMM", "us": 120000.0, "share": 0.5, "calls": 48},
                           {"category": "attention", "us": 60000.0, "share": 0.25, "calls": 24},
                           {"category": "other", "us": 60000.0, "share": 0.25, "calls": 1428}],
            "tflops": {"MoE expert GEMM": {"flops": 6e13, "us": 120000.0, "tflops": 500.0},
                       "dense linear": {"flops": 1e13, "us": None, "tflops": None},
                       "attention": {"flops": 3e13, "us": 60000.0, "tflops": 500.0}}}
    (tmp_path / "profile-prefill-gpt-oss-20b-8192.json").write_text(json.dumps(data))
    (tmp_path / "profile-prefill-dirty.json").write_text(json.dumps({**data, "env": {**env, "git_dirty": True}}))
    col = provenance.collect([tmp_path])
    lines = results_tuning.prefill_profile_section(col)
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| ---")]
    cols = [c.strip() for c in rows[0].strip("|").split("|")]
    assert len(rows) == 2  # the dirty one is not tabled
    row = dict(zip(cols, [c.strip() for c in rows[1].strip("|").split("|")]))
    assert (row["length"], row["wall ms"], row["kernel ms"], row["launches"]) == ("8192", "250.0", "240.0", "1500")
    assert row["GPU idle ms"] == "-"  # profiled before the idle report existed
    assert (row["MoE expert GEMM"], row["attention"], row["other"], row["dense linear"]) == \
        ("50.0%", "25.0%", "25.0%", "0.0%")
    assert (row["MoE GEMM TFLOP/s"], row["dense TFLOP/s"], row["attention TFLOP/s"]) == ("500", "-", "500")
    assert row["measured at"] == f"`{head[:7]}` 2026-12-01 20:00 (profile-prefill-gpt-oss-20b-8192.json)"
    assert results_tuning.used(col) == {"profile-prefill-gpt-oss-20b-8192.json": 1}
    idle = {"before_first_ms": 0.5, "between_ms": 9.0, "after_last_ms": 0.75, "idle_ms": 10.25, "largest": []}
    (tmp_path / "profile-prefill-gpt-oss-20b-8192.json").write_text(json.dumps({**data, "idle": idle}))
    rows = [ln for ln in results_tuning.prefill_profile_section(provenance.collect([tmp_path]))
            if ln.startswith("| ") and not ln.startswith("| ---")]
    assert dict(zip(cols, [c.strip() for c in rows[1].strip("|").split("|")]))["GPU idle ms"] == "10.2"


def test_profile_prefill_host_profile_cpu(tmp_path, capsys):
    """--host-profile: one more call under cProfile, its top functions in the file and a summary in the JSON;
    the timed call stays unwrapped."""
    host = tmp_path / "host.txt"
    pp.main(["--model", "gpt-oss-tiny", "--dummy", "--device", "cpu", "--length", "32", "--out", str(tmp_path),
             "--host-profile", str(host)])
    saved = json.loads((tmp_path / "profile-prefill-gpt-oss-tiny-32.json").read_text())
    h = saved["host_profile"]
    assert h["file"] == str(host) and h["wall_ms"] >= h["host_ms"] > 0
    assert "alloc_deltas" not in h  # CPU: no caching allocator, no sync pass
    text = host.read_text()
    assert "top 40 by cumulative time" in text and "top 40 by own time" in text
    assert "callers of the top 10 by own time" in text and "was called by" in text
    assert "runner.py" in text and "(prefill)" in text  # the call's own frames, by cumulative time
    assert "host profile (cProfile, one more call)" in capsys.readouterr().out


def test_sync_pass_names_each_synchronising_site():
    """The sync pass keeps torch's sync-debug warnings (one entry per message and stack, counted) and passes
    any other warning on; the debug mode is switched back after the call."""
    import warnings

    from kvrelay.bench import host_profile as hp

    modes = []

    class _Cuda:
        @staticmethod
        def set_sync_debug_mode(mode):
            modes.append(mode)

        @staticmethod
        def synchronize():
            pass

    class _Torch:
        cuda = _Cuda

    def item():
        warnings.warn("called a synchronizing CUDA operation (cudaMemcpyAsync)", UserWarning)

    def call():
        for _ in range(3):
            item()
        warnings.warn("called a synchronizing CUDA operation (cudaStreamSynchronize)", UserWarning)
        warnings.warn("something else", UserWarning)

    with warnings.catch_warnings(record=True) as other:
        warnings.simplefilter("always")
        syncs = hp._sync_pass(call, _Torch)
    assert modes == ["warn", "default"]
    assert [(e["count"], e["message"]) for e in syncs] == [
        (3, "called a synchronizing CUDA operation (cudaMemcpyAsync)"),
        (1, "called a synchronizing CUDA operation (cudaStreamSynchronize)")]
    assert syncs[0]["stack"][0].endswith(" item")  # innermost frame first
    assert [str(w.message) for w in other] == ["something else"]
