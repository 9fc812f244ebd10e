"""The MXFP4 expert kernels (kernels/moe_mxfp4.py) compile for sm_90 on CPU with their served launches, with PDL's
wait before any global load, and without spilling to local memory (a spill in a weight-streaming loop costs more
than the bytes it saves). tests/cpu/test_h200_triton.py runs this again under the device's triton (3.6)."""

from __future__ import annotations

import re

import pytest
import triton

P = {"u8": "*u8", "bf16": "*bf16", "i64": "*i64", "i32": "*i32", "f32": "*fp32"}


# what the launches specialise as divisible by 16 at gpt-oss's shapes (every pointer; K 2880, the byte strides
# 1440 and 90 x 2880 x 2 ... ; not the scale rows' 90), so the compiled loads are the served ones
DIVISIBLE = ("x", "ids", "w", "s", "b", "act", "route_w", "y", "a", "sw", "rw", "out", "sorted_ids", "block_expert",
             "Kdim", "KDIM", "Ndim", "N", "s_xt", "s_we", "s_wn", "s_se", "s_be", "s_at", "s_yt", "s_am", "s_swe", "s_om")


def _compile(kernel, types: dict, consts: dict, num_warps: int, num_stages: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE if n in names and n not in consts}
    return triton.compile(ASTSource(kernel, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def _cases():
    from kvrelay.kernels import moe_mxfp4 as m

    g1, g2 = m.GEMV1, m.GEMV2
    yield "gemv1", m._mx_gemv1_kernel, {
        "x": P["bf16"], "ids": P["i64"], "w": P["u8"], "s": P["u8"], "b": P["bf16"], "act": P["bf16"]}, {
        "BLOCK_N": g1.block_n, "BLOCK_K": g1.block_k, "ALPHA": 1.702, "LIMIT": 7.0, "ASM": True, "USE_PDL": True}, g1
    yield "gemv2", m._mx_gemv2_kernel, {
        "act": P["bf16"], "ids": P["i64"], "route_w": P["bf16"], "w": P["u8"], "s": P["u8"], "b": P["bf16"],
        "y": P["bf16"]}, {"BLOCK_N": g2.block_n, "BLOCK_K": g2.block_k, "ASM": True, "USE_PDL": True}, g2
    for n_pairs, swiglu in ((16, True), (16, False), (100_000, True), (100_000, False)):
        launch = m.grouped_launch(n_pairs, 32)
        yield f"grouped-m{launch.block_m}-{'gemm1' if swiglu else 'gemm2'}", m._mx_grouped_kernel, {
            "a": P["bf16"], "w": P["u8"], "sw": P["u8"], "b": P["bf16"], "rw": P["bf16"], "out": P["bf16"],
            "sorted_ids": P["i32"], "block_expert": P["i32"]}, {
            "SWIGLU": swiglu, "MUL_ROUTE": not swiglu, "BLOCK_M": launch.block_m, "BLOCK_N": launch.block_n,
            "BLOCK_K": launch.block_k, "GROUP_M": launch.group_m, "ALPHA": 1.702, "LIMIT": 7.0, "DOT_F32": False,
            "ASM": True, "USE_PDL": True}, launch


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mxfp4_kernel_compiles_for_sm90_without_spills(case):
    _, kernel, types, consts, launch = case
    out = _compile(kernel, types, consts, launch.num_warps, launch.num_stages)
    ptx = out.asm["ptx"]
    assert "griddepcontrol.wait" in ptx
    # the wait comes before the first global load (kernels/pdl.py's rule)
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    assert not re.search(r"\.local\.", ptx), "local memory (spills or a stack) in the kernel"
    assert "prmt.b32" in ptx  # the weights decoded by e2m1_pairs' PTX, four bytes at a time
    if "grouped" in case[0]:
        assert "wgmma" in ptx or "mma.sync" in ptx  # bf16 tensor-core MMAs, not FMA loops


def _asm_model(word: int) -> tuple[list[float], list[float]]:
    """e2m1_pairs' PTX, instruction by instruction, on one 32-bit word of four bytes: (low, high) nibbles' values."""
    import numpy as np

    t0 = (word & 0xFF) | (((word >> 8) & 0xFF) << 16)  # prmt 0x4140: byte 0 -> bits 0-7, byte 1 -> 16-23
    t1 = ((word >> 16) & 0xFF) | (((word >> 24) & 0xFF) << 16)  # prmt 0x4342

    def pair(t, s_mag, s_sign):
        m = (((t << s_mag) & 0x0E000E00) | ((t << s_sign) & 0x80008000)) & 0xFFFFFFFF
        h = np.array([m & 0xFFFF, m >> 16], dtype=np.uint16).view(np.float16).astype(np.float32)
        return [float(v) for v in h]

    return pair(t0, 9, 12) + pair(t1, 9, 12), pair(t0, 5, 8) + pair(t1, 5, 8)


def test_the_ptx_decode_gives_every_code_its_value():
    """The shifts and masks of e2m1_pairs' PTX, modelled in Python: every byte (both nibbles, at every position of
    the word) decodes to its E2M1 values times 2^-14, as the Triton ops (e2m1_x2m14) and the table do."""
    from kvrelay.engine.mxfp4 import FP4_E2M1_VALUES

    for b in range(256):
        for pos in range(4):
            word = (b << (8 * pos)) | (0xA5 << (8 * ((pos + 1) % 4)))  # a neighbour byte that must not leak in
            lo, hi = _asm_model(word)
            assert lo[pos] == FP4_E2M1_VALUES[b & 15] * 2.0 ** -14, (b, pos, lo)
            assert hi[pos] == FP4_E2M1_VALUES[b >> 4] * 2.0 ** -14, (b, pos, hi)
