"""The grouped FP8 expert GEMM's main loop, compiled for sm_90 on CPU (kernels/moe.py; no GPU needed).

Each 128-wide K step runs the tensor-core MMA (QGMMA), waits for it (WARPGROUP.DEPBAR), then promotes the
block's fp32 sum into the accumulator with the activation and weight scales. With N tiles of at most 128
columns the weight scale is one number per tile, so the promotion is a row scale: two multiplies a thread
and one FMA per accumulator element. The per-column form it replaced also multiplied every element's two
scales (64 more FMULs a thread for a 64x128 tile) and moved the scale vector through shared memory: 176-192
instructions from the wait to the back edge, against 95-114 now (sm_90, triton 3.6 and 3.9; 2026-12-05).
This pins the lean form. Compiled with the installed triton here, and with the H200's
triton 3.6 by tests/cpu/test_h200_triton.py.
"""

from __future__ import annotations

import os

import pytest
import triton
from test_pdl import _opcodes  # same folder; pytest puts it on sys.path

P = {"f32": "*fp32", "bf16": "*bf16", "i32": "*i32", "fp8": "*fp8e4nv"}
INTS = ("num_m", "n_pairs", "E", "N", "KDIM", "ROW_DIV", "s_am", "s_sam", "s_sak", "s_we", "s_wn", "s_swe",
        "s_swn", "s_be", "s_om")
# what the launcher specialises at gpt-oss's launches (pointers 16-byte aligned; K 2944, N 5760/2880, row
# strides 2944): the compile then has the real launch's vector widths
DIVISIBLE = ("a", "sa", "w", "sw", "b", "rw", "out", "sorted_ids", "block_expert", "KDIM", "N", "s_am", "s_we",
             "s_wn", "s_om")


def _compile(tma: bool, block_n: int, swiglu: bool, *, sorted_a: bool = False, block_m: int = 64,
             num_warps: int | None = None):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvrelay.kernels import moe
    k = moe._grouped_kernel
    types = {"a": P["fp8"], "sa": P["f32"], "w": P["fp8"], "sw": P["f32"], "b": P["bf16"], "rw": P["bf16"],
             "out": P["bf16"], "sorted_ids": P["i32"], "block_expert": P["i32"], **{n: "i32" for n in INTS},
             "w_desc": f"tensordesc<fp8e4nv[{block_n}, 128]>" if tma else P["fp8"],
             "a_desc": f"tensordesc<fp8e4nv[{block_m}, 128]>" if sorted_a else P["fp8"]}
    consts = {"FP8": True, "SWIGLU": swiglu, "MUL_ROUTE": not swiglu, "BLOCK_M": block_m, "BLOCK_N": block_n,
              "BLOCK_K": 128, "GROUP_M": 16, "MASKED": False, "EVEN_K": True, "TMA": tma, "ALPHA": 1.702,
              "LIMIT": 7.0, "A_SORTED": sorted_a, "OUT_SORTED": sorted_a and swiglu, "USE_PDL": False}
    names = k.arg_names
    sig = {n: ("constexpr" if n in consts else types[n]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE if n in names}
    return triton.compile(ASTSource(k, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps or (4 if block_n <= 128 else 8),
                                   "num_stages": 4 if block_n <= 128 else 3})


def _promotion(ops: list[str]) -> list[str]:
    """The instructions from the wait on the K step's MMAs to the next branch (the loop's back edge)."""
    assert "QGMMA" in ops and "WARPGROUP" in ops, "no Hopper tensor-core MMA in the loop"
    waits = [i for i, op in enumerate(ops) if op == "WARPGROUP" and i > ops.index("QGMMA")]
    start = waits[0]
    end = next(i for i in range(start, len(ops)) if ops[i] == "BRA")
    return ops[start:end]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("tma", [False, True], ids=["ldgsts", "tma"])
@pytest.mark.parametrize("swiglu", [True, False], ids=["gemm1", "gemm2"])
def test_promotion_is_a_row_scale(tma, swiglu):
    compiled = _compile(tma, 128, swiglu)
    body = _promotion(_opcodes(compiled.asm["sass"]))
    # 64x128 fp32 accumulator over 128 threads: 64 elements a thread, one FMA each
    assert body.count("FFMA") == 64, body
    assert body.count("FMUL") <= 4, body
    # the per-column form stored its scale vector to shared memory here and read it back (11 LDS, 1 STS on
    # triton 3.6 and 3.9); the pipeline's own barriers and loads of the next stage stay
    assert "STS" not in body and body.count("LDS") <= 4, body


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
def test_wide_tiles_keep_the_column_scales():
    """A 256-wide tile spans two weight-scale blocks: the per-column form (a product per element) stays."""
    compiled = _compile(True, 256, True)
    ops = _opcodes(compiled.asm["sass"])
    assert ops.count("FMUL") >= 64, "the 256-wide tile lost its per-column scales"


def _compile_ws(swiglu: bool, block_m: int = 128, block_n: int = 128):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvrelay.kernels import moe_ws
    k = moe_ws._grouped_ws_kernel
    w_desc = f"tensordesc<fp8e4nv[{block_n // 2}, 1, 128]>" if swiglu else f"tensordesc<fp8e4nv[{block_n}, 128]>"
    types = {"a_desc": f"tensordesc<fp8e4nv[{block_m}, 128]>", "sa": P["f32"], "w_desc": w_desc, "sw": P["f32"],
             "b": P["bf16"], "rw": P["bf16"], "out": P["bf16"], "sorted_ids": P["i32"], "block_expert": P["i32"],
             **{n: "i32" for n in ("num_m", "n_pairs", "E", "N", "KDIM", "s_sam", "s_sak", "s_swe", "s_swn", "s_be",
                                   "s_om")}}
    consts = {"SWIGLU": swiglu, "MUL_ROUTE": not swiglu, "OUT_SORTED": swiglu, "BLOCK_M": block_m,
              "BLOCK_N": block_n, "BLOCK_K": 128, "GROUP_M": 16, "ALPHA": 1.702, "LIMIT": 7.0, "USE_PDL": True}
    names = k.arg_names
    sig = {n: ("constexpr" if n in consts else types[n]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("sa", "sw", "b", "rw", "out", "sorted_ids",
                                                                     "block_expert", "N", "KDIM", "s_om")}
    return triton.compile(ASTSource(k, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 3, "launch_pdl": True})


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("swiglu", [True, False], ids=["gemm1", "gemm2"])
def test_ws_kernel_is_cooperative(swiglu):
    """kernels/moe_ws.py at 128x128 on 4 warps: triton makes its K loop a TMA producer warp group and two consumer
    warp groups, each the MMAs of its 64-row half (GEMM1: the gate and up half tiles, 64x64 each; GEMM2 64x128)
    with the row-scale promotion, registers moved to them (setmaxnreg). With a gathered A (a pointer load in the
    loop), a return before the loop or the accumulator reshaped for the SwiGLU, triton's pass failed to compile
    the loop, and at 64-row tiles both consumers ran the whole tile (2x the MMAs): checked 2026-12-05."""
    if not triton.__version__.startswith("3.6"):
        # triton 3.9 (the venv's) fails its warp-specialisation pass on this kernel (2026-12-05): a loud compile
        # error, never a silently different kernel; the structure below is checked under 3.6
        # (tests/cpu/test_h200_triton.py)
        with pytest.raises(Exception, match="PassManager"):
            _compile_ws(swiglu)
        return
    sass = _compile_ws(swiglu).asm["sass"]
    ops = _opcodes(sass)
    assert "USETMAXREG" in ops, "not warp-specialised"
    # per 128-wide K block: 2 consumers x 4 k32 steps, x 2 half tiles (gate, up) in GEMM1
    if swiglu:
        assert sass.count("QGMMA.64x64x32") == 16, sass.count("QGMMA")
    else:
        assert sass.count("QGMMA.64x128x32") == 8, sass.count("QGMMA")
    assert ops.count("UTMALDG") >= 2 and "LDGSTS" not in ops
    # as prefill launches it (PDL on Hopper): the default warp group waits for the previous kernel (ACQBULK)
    # before it releases the others (named barrier 1), so no partition reads the sort's outputs early
    wait = ops.index("ACQBULK")
    assert "BAR" in ops[wait:] and ops.count("ACQBULK") == 1
