"""kernels/pdl.py: when Programmatic Dependent Launch is on, and what the decode kernels compile to with it.

The switch: off on CPU, under the Triton interpreter, with KVRELAY_PDL=0 and on GPUs/tritons without
it; on (both the USE_PDL constexpr and the launch_pdl option) elsewhere, read at each launch.

The kernels: each decode-step kernel is compiled here for sm_90 with USE_PDL (triton ships ptxas and
cuobjdump, no GPU needed) and its SASS is read: griddepcontrol.wait (ACQBULK) must come before every
global load, store and atomic (kernels/pdl.py's rule) and before any branch or exit (so it dominates all
of them in every program), and launch_dependents (PREEXIT) after it. Two kernels load layer parameters
first (add_norm_route: norm and router weights, bias; the FP8 GEMV: its first weight tile and weight
scales): for them each load before the wait is traced, in the PTX, back to the kernel parameters its
address derives from, which must be those weights only, and the SASS holds no more loads before the wait
than the PTX (ptxas hoisted none above it). The GPU side (bit-equal decode steps with PDL on and off) is
tests/gpu/test_pdl_gpu.py.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import triton

from kvrelay.kernels import (attention, decode_rotary, fp8_gemm, fp8_gemv, fused, moe, moe_gemv, moe_sort, pdl,
                             router, triton_attention)


@pytest.fixture
def supported(monkeypatch):
    """A CUDA device that supports PDL, as far as pdl.enabled can tell (this machine has none)."""
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    monkeypatch.delenv("KVRELAY_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_on_by_default_where_supported(supported, monkeypatch):
    dev = torch.device("cuda", 0)
    assert pdl.enabled(dev) and pdl.enabled("cuda:0")
    assert pdl.pdl_kwargs(dev) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setenv("KVRELAY_PDL", "1")
    assert pdl.enabled(dev)
    kw = pdl.pdl_kwargs(dev)
    kw.clear()  # a caller's dict is its own
    assert pdl.pdl_kwargs(dev) == {"USE_PDL": True, "launch_pdl": True}


def test_env_off_is_read_at_each_launch(supported, monkeypatch):
    dev = torch.device("cuda", 0)
    monkeypatch.setenv("KVRELAY_PDL", "0")
    assert not pdl.enabled(dev) and pdl.pdl_kwargs(dev) == {}
    monkeypatch.setenv("KVRELAY_PDL", "1")
    assert pdl.pdl_kwargs(dev) == {"USE_PDL": True, "launch_pdl": True}


def test_off_on_cpu_and_under_the_interpreter(supported, monkeypatch):
    for dev in ("cpu", torch.device("cpu"), "meta"):
        assert not pdl.enabled(dev) and pdl.pdl_kwargs(dev) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 0)) and pdl.pdl_kwargs("cuda:0") == {}


def test_off_where_the_gpu_or_triton_lacks_it(monkeypatch):
    monkeypatch.delenv("KVRELAY_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pdl._device_supports.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    assert not pdl.enabled(torch.device("cuda", 0))
    pdl._device_supports.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    assert pdl.enabled(torch.device("cuda", 0)) == pdl.triton_supports_pdl()
    pdl._device_supports.cache_clear()
    monkeypatch.setattr(pdl, "triton_supports_pdl", lambda: False)
    assert not pdl.enabled(torch.device("cuda", 0))
    pdl._device_supports.cache_clear()


def test_installed_triton_supports_it():
    # pyproject's triton>=3.4 has launch_pdl and tl.extra.cuda.gdc_*; the H200 runs 3.6
    assert pdl.triton_supports_pdl(), triton.__version__


# ---- the kernels' SASS with USE_PDL ---------------------------------------------------------------------
I32, F32 = "i32", "fp32"
P = {"bf16": "*bf16", "f32": "*fp32", "i64": "*i64", "i32": "*i32", "fp8": "*fp8e4nv"}


def _spec(kernel, types: dict, consts: dict, *, early_loads: tuple[str, ...] = (), id_keys=("DELTA", "ROWS"),
          divisible: tuple[str, ...] = (), **options):
    """early_loads: the pointer parameters whose loads may precede the wait. divisible: the arguments the
    launcher specialises as multiples of 16 at the real launches (strides, sizes), so the compile has the
    real one's vector widths."""
    tag = "-".join(f"{k}{v}" for k, v in consts.items() if k in id_keys)
    return pytest.param(kernel, types, consts, early_loads, divisible, options,
                        id=kernel.__name__ + ("-" + tag if tag and ({"DELTA", "SPLIT_K", "EARLY"} & set(consts)) else ""))


def _ints(*names):
    return {n: I32 for n in names}


KERNELS = [
    _spec(fused._rms_norm_kernel, {"x_ptr": P["bf16"], "w_ptr": P["bf16"], "out_ptr": P["bf16"],
                                   **_ints("stride_x", "stride_o", "n_cols"), "eps": F32}, {"BLOCK": 256}),
    _spec(fused._rotary_qk_kernel, {**{k: P["bf16"] for k in ("qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr")},
                                    **_ints("stride_qkv", "stride_cs", "n_q")}, {"HALF": 32, "BLOCK": 32}),
    # the decode step's two uses: the MoE's outputs combined + add + norm + FP8 quantisation; the head's rows
    _spec(fused._add_rms_norm_kernel,
          {"x_ptr": P["bf16"], "d_ptr": P["f32"], "w_ptr": P["bf16"], "rows_ptr": P["i64"], "xo_ptr": P["bf16"],
           "out_ptr": P["bf16"], "q_ptr": P["fp8"], "s_ptr": P["f32"], "T": I32, "H": I32, "eps": F32,
           **_ints("s_x", "s_dt", "s_dk", "s_xo", "s_o", "s_q", "s_sm", "s_sk")},
          {"DELTA": 2, "K_SUM": 4, "ROWS": False, "STORE_X": True, "NORM": True, "QUANT": True, "N_GROUPS": 2,
           "BLOCK": 256}, num_warps=fused.NORM_WIDE_WARPS),
    _spec(fused._add_rms_norm_kernel,
          {"x_ptr": P["bf16"], "d_ptr": P["bf16"], "w_ptr": P["bf16"], "rows_ptr": P["i64"], "xo_ptr": P["bf16"],
           "out_ptr": P["bf16"], "q_ptr": P["fp8"], "s_ptr": P["f32"], "T": I32, "H": I32, "eps": F32,
           **_ints("s_x", "s_dt", "s_dk", "s_xo", "s_o", "s_q", "s_sm", "s_sk")},
          {"DELTA": 1, "K_SUM": 1, "ROWS": True, "STORE_X": False, "NORM": True, "QUANT": False, "N_GROUPS": 1,
           "BLOCK": 256}),
    # KVRELAY_EMBED_FUSE: the token rows looked up in the embedding table, stored, normed and quantised
    _spec(fused._add_rms_norm_kernel,
          {"x_ptr": P["bf16"], "d_ptr": P["bf16"], "w_ptr": P["bf16"], "rows_ptr": P["i64"], "xo_ptr": P["bf16"],
           "out_ptr": P["bf16"], "q_ptr": P["fp8"], "s_ptr": P["f32"], "T": I32, "H": I32, "eps": F32,
           **_ints("s_x", "s_dt", "s_dk", "s_xo", "s_o", "s_q", "s_sm", "s_sk")},
          {"DELTA": 0, "K_SUM": 1, "ROWS": True, "STORE_X": True, "NORM": True, "QUANT": True, "N_GROUPS": 2,
           "BLOCK": 256}, id_keys=("DELTA", "ROWS", "STORE_X"), num_warps=fused.NORM_WIDE_WARPS),
    _spec(fused._rotary_kv_write_kernel,
          {**{k: P["bf16"] for k in ("qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "pool_ptr")},
           "pages_ptr": P["i32"], "offsets_ptr": P["i32"],
           **_ints("stride_qkv", "stride_cs", "n_q", "n_kv", "s_pg", "s_kv", "s_off", "s_head")},
          {"HALF": 32, "BLOCK": 32}),
    # its prefill-size launch: (tokens x heads) tiles
    _spec(fused._rotary_kv_write_tile_kernel,
          {**{k: P["bf16"] for k in ("qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "pool_ptr")},
           "pages_ptr": P["i32"], "offsets_ptr": P["i32"],
           **_ints("T", "stride_qkv", "stride_cs", "n_q", "n_kv", "s_pg", "s_kv", "s_off", "s_head")},
          {"HALF": 32, "BLOCK": 32, "BLOCK_T": 16, "BLOCK_H": 8}),
    _spec(fused._sink_quant_kernel,
          {"out_ptr": P["bf16"], "lse_ptr": P["f32"], "sinks_ptr": P["f32"], "q_ptr": P["fp8"], "s_ptr": P["f32"],
           **_ints("B", "n_cols", "s_ob", "s_oh", "s_lb", "s_q", "s_sm", "s_sk")}, {"HEAD_DIM": 64}, num_warps=1),
    _spec(fused._router_gemv_kernel, {**{k: P["bf16"] for k in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")},
                                      **_ints("E", "K", "s_xt", "s_we", "s_ot")},
          {"HAS_BIAS": True, "BLOCK_E": 4, "BLOCK_K": 256}),
    _spec(router._router_route_kernel,
          {**{k: P["bf16"] for k in ("x_ptr", "w_ptr", "b_ptr", "logit_ptr", "w_out")}, "cnt_ptr": P["i32"],
           "id_out": P["i64"], **_ints("E", "K", "s_xt", "s_we")},
          {"HAS_BIAS": True, "TOP_K": 4, "E_P2": 32, "BLOCK_E": 4, "BLOCK_K": 256}),
    # loads before its wait: the layer's norm weight, router weight and bias
    _spec(router._add_norm_route_kernel,
          {**{k: P["bf16"] for k in ("x_ptr", "d_ptr", "nw_ptr", "xo_ptr", "h_ptr", "w_ptr", "b_ptr", "logit_ptr",
                                     "w_out")},
           "cnt_ptr": P["i32"], "id_out": P["i64"], "H": I32, "E": I32, "eps": F32,
           **_ints("s_x", "s_d", "s_xo", "s_h", "s_we")},
          {"HAS_BIAS": True, "TOP_K": 4, "E_P2": 32, "BLOCK": 256, "BLOCK_E": 4},
          early_loads=("nw_ptr", "w_ptr", "b_ptr"), num_warps=router._ROUTE_WARPS),
    _spec(moe_gemv._gemv1_kernel,
          {"x": P["bf16"], "ids": P["i64"], "w": P["fp8"], "s": P["f32"], "b": P["bf16"], "act": P["bf16"],
           **_ints("K_TOP", "Kdim", "s_xt", "s_we", "s_wn", "s_se", "s_sn", "s_be", "s_at")},
          {"FP8": True, "BLOCK_N": 32, "BLOCK_K": 512, "ALPHA": 1.702, "LIMIT": 7.0, "LATE": False},
          num_warps=2, num_stages=2),
    # loads before its wait: the router's ids and routing weights (two kernels back), the expert's bias, first
    # weight tile and scales (EARLY, the default); and the variant that waits first (KVRELAY_MOE_EARLY=0)
    *(_spec(moe_gemv._gemv2_kernel,
            {"act": P["bf16"], "ids": P["i64"], "route_w": P["bf16"], "w": P["fp8"], "s": P["f32"], "b": P["bf16"],
             "y": P["bf16"], **_ints("Kdim", "Ndim", "s_at", "s_we", "s_wn", "s_se", "s_sn", "s_be", "s_yt")},
            {"FP8": True, "BLOCK_N": 16, "BLOCK_K": 512, "LATE": late, "EARLY": early},
            early_loads=("ids", "route_w", "w", "s", "b") if early else (), id_keys=("EARLY", "LATE"),
            num_warps=4, num_stages=3)
      for early, late in ((True, False), (True, True), (False, False))),
    # the decode QKV / O projections (Fp8BlockLinear's gemv-* backends): loads its first K step's weight tile and
    # weight scales before its wait; split 1 (the direct store) and split-K (partials, arrival counters), one
    # row and a decode batch's row group, with the launcher's multiple-of-16 specialisations
    *(_spec(fp8_gemv._fp8_gemv_kernel,
            {"a": P["fp8"], "b": P["fp8"], "sa": P["f32"], "sb": P["f32"], "bias": P["bf16"], "c": P["bf16"],
             "part": P["f32"], "cnt": P["i32"],
             **_ints("M", "N", "KP", "K_SPLIT", "s_am", "s_bn", "s_sam", "s_sak", "s_sbn", "s_sbk", "s_cm")},
            {"HAS_BIAS": True, "ROWS": rows, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "LATE_TRIGGER": late},
            early_loads=("b", "sb"), id_keys=("ROWS", "SPLIT_K", "LATE_TRIGGER"), num_warps=warps, num_stages=2,
            divisible=("a", "b", "sa", "sb", "bias", "c", "part", "cnt", "N", "KP", "K_SPLIT", "s_am", "s_bn", "s_cm"))
      # the last: KVRELAY_PDL_LATE_TRIGGER=fp8_gemv (launch_dependents after the K loop, still after the wait)
      for rows, bn, bk, split, warps, late in ((1, 32, 512, 1, 2, False), (1, 32, 256, 4, 4, False),
                                               (4, 16, 512, 4, 4, False), (1, 32, 256, 8, 4, True))),
    _spec(moe_gemv.combine_kernel, {"y": P["bf16"], "out": P["bf16"], "Ndim": I32}, {"K_TOP": 4, "BLOCK": 256}),
    _spec(attention._sink_correction_kernel,
          {"out": P["bf16"], "lse": P["f32"], "sinks": P["f32"], **_ints("n_rows", "n_heads", "s_ob", "s_oh")},
          {"HEAD_DIM": 64, "ROWS": 16}, num_warps=2),
    # the Triton split-KV decode (GpuAttention's per-layer-kind alternative to FlashInfer's)
    _spec(triton_attention._sink_decode_split_kernel,
          {"q": P["bf16"], "pool": P["bf16"], "kv_indptr": P["i32"], "kv_indices": P["i32"], "kv_last": P["i32"],
           "o_part": P["f32"], "lse_part": P["f32"], **_ints("s_qb", "s_qh", "s_page", "s_kv", "s_tok", "s_head"),
           "qk_scale": F32, "WINDOW": I32},
          {"GROUP": 8, "BLOCK_H": 16, "HEAD_DIM": 64, "PAGE": 16, "BLOCK_N": 64, "NUM_SPLITS": 2, "F32": False},
          num_warps=4, num_stages=2),
    # the same with the layer's rotary and KV write inside (kernels/decode_rotary.py, KVRELAY_DECODE_ROTARY=1)
    _spec(decode_rotary._sink_decode_rotary_split_kernel,
          {**{k: P["bf16"] for k in ("qkv", "cos", "sin", "pool")}, "pos": P["i64"], "kv_indptr": P["i32"],
           "kv_indices": P["i32"],
           "kv_last": P["i32"], "pages": P["i64"], "offsets": P["i64"], "o_part": P["f32"], "lse_part": P["f32"],
           **{k: P["f32"] for k in ("sinks", "cnt", "q_ptr", "s_ptr")}, **_ints("BP", "s_q", "s_sm", "s_sk"),
           **_ints("s_qkv", "s_cs", "s_page", "s_kv", "s_tok", "s_head"), "qk_scale": F32,
           **_ints("WINDOW", "N_Q", "N_KV")},
          {"GROUP": 8, "BLOCK_H": 16, "HEAD_DIM": 64, "PAGE": 16, "BLOCK_N": 64, "NUM_SPLITS": 2, "F32": False,
           "MERGE": False, "SPLITS_P2": 1, "QK_P2": 128, "LATE_TRIGGER": False, "GATHER_CS": False},
          num_warps=4, num_stages=2),
    # ... and with the merge + the output projection's quantisation inside (its last split program a KV head)
    _spec(decode_rotary._sink_decode_rotary_split_kernel,
          {**{k: P["bf16"] for k in ("qkv", "cos", "sin", "pool")}, "pos": P["i64"], "kv_indptr": P["i32"],
           "kv_indices": P["i32"],
           "kv_last": P["i32"], "pages": P["i64"], "offsets": P["i64"], "o_part": P["f32"], "lse_part": P["f32"],
           "sinks": P["f32"], "cnt": P["i32"], "q_ptr": P["fp8"], "s_ptr": P["f32"], **_ints("BP", "s_q", "s_sm", "s_sk"),
           **_ints("s_qkv", "s_cs", "s_page", "s_kv", "s_tok", "s_head"), "qk_scale": F32,
           **_ints("WINDOW", "N_Q", "N_KV")},
          {"GROUP": 8, "BLOCK_H": 16, "HEAD_DIM": 64, "PAGE": 16, "BLOCK_N": 64, "NUM_SPLITS": 64, "F32": False,
           "MERGE": True, "SPLITS_P2": 64, "QK_P2": 4096, "LATE_TRIGGER": True, "GATHER_CS": True},
          num_warps=4, num_stages=2),
    _spec(triton_attention._sink_decode_merge_kernel,
          {"o_part": P["f32"], "lse_part": P["f32"], "sinks": P["f32"], "out": P["bf16"], **_ints("s_ob", "s_oh")},
          {"HEAD_DIM": 64, "NUM_SPLITS": 2, "SPLITS_P2": 2}, num_warps=1),
    # the merge fused with the output projection's quantisation (the fused decode path's)
    _spec(triton_attention._sink_decode_merge_quant_kernel,
          {"o_part": P["f32"], "lse_part": P["f32"], "sinks": P["f32"], "q_ptr": P["fp8"], "s_ptr": P["f32"],
           **_ints("B", "n_cols", "s_q", "s_sm", "s_sk")},
          {"HEAD_DIM": 64, "NUM_SPLITS": 2, "SPLITS_P2": 2}, num_warps=4),
    # the 1x128 activation quantiser (the grouped MoE GEMMs' inputs, the unfused path): one-row and tiled
    _spec(fp8_gemm._quant_act_kernel, {"x": P["bf16"], "q": P["fp8"], "s": P["f32"],
                                       **_ints("M", "K", "s_xm", "s_qm", "s_sm", "s_sk")}, {"BLOCK_K": 128}),
    _spec(fp8_gemm._quant_act_tile_kernel, {"x": P["bf16"], "q": P["fp8"], "s": P["f32"],
                                            **_ints("M", "MP", "K", "s_xm", "s_qm", "s_sm", "s_sk")},
          {"BLOCK_M": 64, "BLOCK_K": 128}),
    _spec(moe._route_kernel, {"logits": P["bf16"], "bias": P["bf16"], "w_out": P["bf16"], "id_out": P["i64"],
                              **_ints("T", "E", "s_lt")},
          {"HAS_BIAS": False, "K": 4, "E_P2": 32, "BLOCK_T": 16}),
    _spec(moe._grouped_kernel,
          {"a": P["fp8"], "a_desc": P["fp8"], "sa": P["f32"], "w": P["fp8"], "w_desc": P["fp8"], "sw": P["f32"],
           "b": P["bf16"],
           "rw": P["bf16"], "out": P["bf16"], "sorted_ids": P["i32"], "block_expert": P["i32"],
           **_ints("num_m", "n_pairs", "E", "N", "KDIM", "ROW_DIV", "s_am", "s_sam", "s_sak", "s_we", "s_wn",
                   "s_swe", "s_swn", "s_be", "s_om")},
          {"FP8": True, "SWIGLU": True, "MUL_ROUTE": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128,
           "GROUP_M": 8, "MASKED": False, "EVEN_K": True, "TMA": False, "ALPHA": 1.702, "LIMIT": 7.0,
           "A_SORTED": False, "OUT_SORTED": False},
          num_warps=4, num_stages=3),
    # the grouped GEMMs' input in the sort's slots (GemmConfig.sorted_a)
    _spec(moe_sort._quant_sorted_kernel, {"x": P["bf16"], "sorted_ids": P["i32"], "block_expert": P["i32"],
                                          "q": P["fp8"], "s": P["f32"],
                                          **_ints("n_pairs", "E", "K", "ROW_DIV", "SORT_BM", "s_xm", "s_qm", "s_sm")},
          {"BLOCK_M": 16, "SLOT_ROWS": False}),
    _spec(moe_sort._sort_pairs_kernel, {"ids": P["i64"], "sorted_ids": P["i32"], "block_expert": P["i32"],
                                   "counts_out": P["i32"], **_ints("n", "E", "max_blocks")},
          {"E_P2": 32, "BLOCK": 256, "BLOCK_M": 16, "NB": 64}, num_warps=8),
    _spec(moe_sort._sort_count_kernel, {"ids": P["i64"], "chunk_counts": P["i32"], **_ints("n", "E", "CHUNK")},
          {"E_P2": 32, "BLOCK": 256}, num_warps=4),
    _spec(moe_sort._sort_place_kernel, {"ids": P["i64"], "chunk_counts": P["i32"], "sorted_ids": P["i32"],
                                   "block_expert": P["i32"], "counts_out": P["i32"],
                                   **_ints("n", "E", "CHUNK", "num_chunks", "max_blocks")},
          {"E_P2": 32, "BLOCK": 256, "BLOCK_M": 64, "QB": 128, "NB": 64}, num_warps=4),
]

_GLOBAL_MEM = {"LDG", "LD", "LDGSTS", "STG", "ST", "ATOMG", "ATOM", "RED", "REDG", "UTMALDG", "UTMASTG",
               "UBLKCP", "UTMAPF", "CCTL"}
_LOADS = {"LDG", "LD", "LDGSTS", "UTMALDG", "UBLKCP", "UTMAPF"}
_FLOW = {"BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "WARPSYNC", "BSSY", "BREAK"}


def _opcodes(sass: str) -> list[str]:
    """The base opcode of each instruction (predicate and modifiers dropped), in program order."""
    ops = []
    for line in sass.splitlines():
        # cuobjdump via triton: "<control codes>\t[@P0 ]OPCODE.MODS operands ;"
        m = re.match(r"^\s*(?:[-\w]+:){4}\w+\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]+)?\b", line)
        if m:
            ops.append(m.group(1))
    return ops


_PTX_REG = re.compile(r"%[a-z]+\d+")


def _ptx_loads_before_wait(ptx: str, params: list[str]) -> list[set[str]]:
    """Each ld.global before the first griddepcontrol.wait in `ptx`: the kernel parameters (by name; params are
    the non-constexpr arguments in order, PTX's _param_<i>) its address register derives from. The code
    before the wait is straight-line (the SASS check rules out branches), so a register's definitions there
    are all that feed it."""
    head = ptx[: ptx.index("griddepcontrol.wait")]
    head = head[head.index(".entry"):]
    srcs: dict[str, set[str]] = {}  # register -> registers and parameters its definitions read
    loads = []
    for line in head.splitlines():
        line = line.split("//")[0].strip().rstrip(";")
        line = re.sub(r"^@!?%p\d+\s+", "", line)
        if not line or line.startswith((".", "$", "{", "}")) or " " not in line.replace("\t", " "):
            continue
        op, rest = re.split(r"\s+", line, maxsplit=1)
        param = re.search(r"\[\s*\w+_param_(\d+)\s*\]", rest)
        dst, _, operands = rest.partition("}," if rest.startswith("{") else ",")
        if op.startswith("st.") or op.startswith("atom") or op.startswith("red"):
            continue  # no definitions (the SASS check already forbids them here)
        feeds = {f"param:{params[int(param.group(1))]}"} if param else set(_PTX_REG.findall(operands))
        for reg in _PTX_REG.findall(dst):
            srcs.setdefault(reg, set()).update(feeds)
        if op.startswith("ld.global"):
            loads.append(set(_PTX_REG.findall(operands.split("]")[0])))
    out = []
    for regs in loads:
        seen, todo = set(), list(regs)
        while todo:
            r = todo.pop()
            if r not in seen:
                seen.add(r)
                todo.extend(srcs.get(r, ()))
        out.append({r[6:] for r in seen if r.startswith("param:")})
    return out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("kernel,types,consts,early_loads,divisible,options", KERNELS)
def test_kernel_waits_before_touching_memory(kernel, types, consts, early_loads, divisible, options):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    assert "USE_PDL" in names, f"{kernel.__name__} takes no USE_PDL"
    signature = {n: ("constexpr" if n in consts or n == "USE_PDL" else types[n]) for n in names}
    assert set(types) | set(consts) | {"USE_PDL"} == set(names), set(names) ^ (set(types) | set(consts))
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(kernel, signature=signature, constexprs={**consts, "USE_PDL": True}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True, **options})
    assert compiled.metadata.launch_pdl
    ops = _opcodes(compiled.asm["sass"])
    assert len(ops) > 20 and "ACQBULK" in ops and "PREEXIT" in ops, ops[:40]
    first_wait = ops.index("ACQBULK")
    before = ops[:first_wait]
    assert not set(before) & _FLOW, f"{kernel.__name__}: control flow before the wait: {before}"
    touched = set(before) & (_GLOBAL_MEM - _LOADS if early_loads else _GLOBAL_MEM)
    assert not touched, f"{kernel.__name__}: {sorted(touched)} before griddepcontrol.wait"
    assert ops.index("PREEXIT") > first_wait
    if consts.get("LATE_TRIGGER"):  # the trigger after the main loop: the kernel's own loads come before it
        assert set(ops[first_wait:ops.index("PREEXIT")]) & _LOADS, f"{kernel.__name__}: no load before the trigger"
    assert set(ops[first_wait:]) & _LOADS, "the kernel's own loads should follow the wait"
    if early_loads:
        params = [n for n in names if signature[n] != "constexpr"]
        early = _ptx_loads_before_wait(compiled.asm["ptx"], params)
        assert early, f"{kernel.__name__}: no load before the wait (its early loads were the point)"
        pointers = {n for n in params if types[n].startswith("*")}
        for reads in early:
            assert reads & pointers, f"{kernel.__name__}: a load before the wait from no pointer parameter: {reads}"
            assert reads & pointers <= set(early_loads), \
                f"{kernel.__name__}: a load before the wait reads {sorted(reads & pointers - set(early_loads))}"
        sass_early = sum(op in _LOADS for op in before)
        assert 0 < sass_early <= len(early), (sass_early, len(early))


def test_late_trigger_switch_names_kernels(monkeypatch):
    from kvrelay.kernels.pdl import late_trigger

    monkeypatch.delenv("KVRELAY_PDL_LATE_TRIGGER", raising=False)
    assert not late_trigger("fp8_gemv") and not late_trigger("decode")
    monkeypatch.setenv("KVRELAY_PDL_LATE_TRIGGER", "fp8_gemv, decode")
    assert late_trigger("fp8_gemv") and late_trigger("decode") and not late_trigger("fp8")
