"""The decode MoE's two GEMVs in one launch (kernels/moe_fused.py, KVRELAY_MOE_FUSED_GEMV): under TRITON_INTERPRET=1
on CPU tensors (where the kernel runs as its two phases, GEMM1's parts then GEMM2's, with the counters) it gives
the bits of kernels/moe_gemv.py's GEMV1 + GEMV2 in the same tiles, leaves its counters zero and repeats itself;
it declines what it cannot tile (the caller's two GEMVs then run); the tiny model's logits are equal with the
fusion on and off; the occupancy bound; and its sm_90 compile with PDL: the wait first, the acquire poll and
the release count in the SASS. The GPU side (one launch, polling across programs) is
tests/gpu/test_moe_fused_gpu.py."""

from __future__ import annotations

import os
import re

import pytest
import torch
from interp_helpers import interpreted, refs
from test_moe_norm_fuse import _experts

_interpreted = interpreted(__file__)
_same = refs.assert_same


@_interpreted
def test_fused_equals_the_two_gemvs_in_the_same_tiles():
    """bf16 and fp8 experts, 1-3 tokens of 4 experts, GEMM1 in one or several tiles a program: act and y are
    gemv1's and gemv2's bit for bit (same K step and reduction), the counters are zero after, a second launch
    gives the same bits, and moe_experts(fused_counters=...) returns the same uncombined outputs."""
    from kvrelay.kernels import moe, moe_fused, moe_gemv

    g = torch.Generator().manual_seed(0)
    e, k, h, inter = 8, 4, 256, 128
    for fp8_weights in (False, True):
        ex = _experts(e, h, inter, fp8_weights, g)
        for launch in (moe_fused.FusedLaunch(rows2=32, block_n1=32, block_k=128, late=True),
                       moe_fused.FusedLaunch(rows2=64, block_n1=32, block_k=64, late=False)):
            for t in (1, 3):
                x = torch.randn(t, h, generator=g).bfloat16()
                ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).reshape(-1)
                rw = torch.softmax(torch.randn(t * k, generator=g), -1).bfloat16()
                cnt = moe_fused.new_fused_counters("cpu")
                act = torch.full((t * k, inter), float("nan"), dtype=torch.bfloat16)
                y = torch.full((t * k, h), float("nan"), dtype=torch.bfloat16)
                assert moe_fused.moe_gemv_fused(x, ids, k, rw, ex, 1.702, 7.0, act, y, cnt, launch)
                assert not cnt.any(), launch  # the last program past its poll reset the pair's counters
                r1, bn1 = launch.rows1(h, inter)
                want_act = torch.empty_like(act)
                moe_gemv.gemv1(x, ids, k, ex, 1.702, 7.0, want_act,
                               moe_gemv.GemvLaunch(bn1, launch.block_k, late=launch.late))
                want_y = torch.empty_like(y)
                moe_gemv.gemv2(want_act, ids, rw, ex, want_y,
                               moe_gemv.GemvLaunch(launch.rows2, launch.block_k, late=launch.late))
                case = (fp8_weights, launch.label(), t)
                _same(act, want_act, ("act", case))
                _same(y, want_y, ("y", case))
                act2, y2 = torch.empty_like(act), torch.empty_like(y)
                assert moe_fused.moe_gemv_fused(x, ids, k, rw, ex, 1.702, 7.0, act2, y2, cnt, launch)
                _same(y2, y, ("again", case))
        # through moe_experts with the default launch (GEMM1: 64 rows a program in two tiles of 32)
        x = torch.randn(2, h, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(2)])
        rw = torch.softmax(torch.randn(2, k, generator=g), -1).bfloat16()
        cnt = moe_fused.new_fused_counters("cpu")
        got = moe.moe_experts(x, ids, rw, ex, combine=False, fused_counters=cnt)
        plain = moe.moe_experts(x, ids, rw, ex, combine=False)
        assert got.shape == plain.shape == (2, k, h) and not cnt.any()
        assert refs.rel_err(got, plain) < 1e-2, refs.rel_err(got, plain)  # other tiles: another fp32 order


def test_tiling_rule():
    """J = hidden / rows2 programs a pair; GEMM1's 2I rows split in J whole tiles inside 128-row scale blocks."""
    from kvrelay.kernels.moe_fused import FusedLaunch

    assert FusedLaunch(rows2=32).rows1(2880, 2880) == (64, 32)  # gpt-oss: 90 programs a pair
    assert FusedLaunch(rows2=64, block_n1=128).rows1(2880, 2880) == (128, 128)
    assert FusedLaunch(rows2=16, block_n1=64).rows1(2880, 2880) == (32, 32)  # fewer rows than the tile
    assert FusedLaunch(rows2=32, block_n1=16).rows1(128, 96) == (48, 16)  # the tiny preset: 3 tiles of 16
    assert FusedLaunch(rows2=32, block_n1=32).rows1(128, 96) is None  # 48 rows are no whole 32-row tiles
    assert FusedLaunch(rows2=48).rows1(2880, 2880) is None  # a GEMM2 tile across a 128-row scale block
    assert FusedLaunch(rows2=32).rows1(2880 + 16, 2880) is None  # hidden not a multiple of rows2


@_interpreted
def test_untileable_shapes_run_the_two_gemvs():
    """moe_gemv_fused declines (False, nothing written) what it cannot tile, and moe_experts with counters then
    returns the two GEMVs' outputs, bit for bit."""
    from kvrelay.kernels import moe, moe_fused

    g = torch.Generator().manual_seed(2)
    e, k, h, inter = 8, 4, 128, 96
    ex = _experts(e, h, inter, True, g)
    x = torch.randn(1, h, generator=g).bfloat16()
    ids = torch.randperm(e, generator=g)[:k].reshape(1, k)
    rw = torch.softmax(torch.randn(1, k, generator=g), -1).bfloat16()
    cnt = moe_fused.new_fused_counters("cpu")
    act = torch.zeros(k, inter, dtype=torch.bfloat16)
    y = torch.zeros(k, h, dtype=torch.bfloat16)
    assert moe_fused.DEFAULT_LAUNCH.rows1(h, inter) is None
    assert not moe_fused.moe_gemv_fused(x, ids.reshape(-1), k, rw.reshape(-1), ex, 1.702, 7.0, act, y, cnt,
                                        moe_fused.DEFAULT_LAUNCH)
    assert not act.any() and not y.any() and not cnt.any()
    _same(moe.moe_experts(x, ids, rw, ex, combine=False, fused_counters=cnt), moe.moe_experts(x, ids, rw, ex,
                                                                                            combine=False), "fallback")


@_interpreted
def test_tiny_model_logits_equal_with_the_fusion_on_and_off():
    """The tiny model on the GPU kernels under the interpreter (KVRELAY_KERNELS=triton, bf16): prefills and decode
    steps give the same logits with KVRELAY_MOE_FUSED_GEMV=1 and 0 (the tiny experts in a launch whose tiles are
    the two GEMVs' tuned ones, so the same bits), and the fused launch ran in every block of each forward on the
    GEMV path."""
    from kvrelay.engine.config import PRESETS
    from kvrelay.engine.runner import Runner
    from kvrelay.engine.weights import open_weights
    from kvrelay.kernels import moe, moe_fused, moe_gemv

    cfg = PRESETS["tiny"]
    h, inter = cfg.hidden_size, cfg.intermediate_size
    cfg_gemv = moe_gemv.gemv_config(h, inter)
    # 4 programs a pair: GEMM2 in 32-row tiles, GEMM1's 48 rows in 3 tiles of 16 (the interpreter's per-row sums
    # do not depend on a tile's rows: the two GEMVs' bits, whose tiles are 32 and 16 rows)
    launch = moe_fused.FusedLaunch(rows2=32, block_n1=16, block_k=cfg_gemv.w1.block_k, num_warps=4,
                                   late=cfg_gemv.w1.late)
    assert (cfg_gemv.w1.block_k, cfg_gemv.w1.late) == (cfg_gemv.w2.block_k, cfg_gemv.w2.late)
    calls = []
    orig = moe_fused.moe_gemv_fused

    def counted(*args, **kwargs):
        ran = orig(*args, **kwargs)
        calls.append(ran)
        return ran

    def forward_all(flag):
        os.environ["KVRELAY_MOE_FUSED_GEMV"] = flag
        r = Runner(cfg, open_weights(None, cfg, dummy=True, seed=3), page_size=4, kv_tokens=128)
        out = [r.prefill("a", [3, 141, 59]), r.prefill("b", list(range(7, 7 + moe.GEMV_MAX_PAIRS // 4 + 3)))]
        for toks in ([897, 5], [12, 40], [100, 3]):
            out.append(r.decode(["a", "b"], toks))
            out.append(r.decode(["a"], toks[:1]))
        return out

    env = {k: os.environ.get(k) for k in ("KVRELAY_MOE_FUSED_GEMV", "KVRELAY_KERNELS", "KVRELAY_ATTENTION")}
    os.environ.update(KVRELAY_KERNELS="triton", KVRELAY_ATTENTION="reference")  # attention: not what this checks
    moe_fused.moe_gemv_fused = counted
    moe_fused.TUNED[(h, inter)] = launch
    try:
        on = forward_all("1")
        on_calls = list(calls)
        calls.clear()
        off = forward_all("0")
    finally:
        moe_fused.moe_gemv_fused = orig
        moe_fused.TUNED.pop((h, inter), None)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    # the 3-token prefill and the 6 decode steps take the GEMV path in every layer; the longer prefill does not
    assert on_calls == [True] * 7 * cfg.num_hidden_layers, on_calls
    assert calls == []
    for i, (a, b) in enumerate(zip(on, off)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max())


def test_resident_programs_bound(monkeypatch):
    """The occupancy the fused launch checks its grid against: registers in 256-register units a warp, warps,
    shared memory with the 1 KB a block the driver keeps, at most 32 blocks; H200 figures."""
    from kvrelay.kernels import moe_fused

    monkeypatch.setattr(moe_fused, "_sm_room", lambda index: (132, 65536, 2048, 233472))
    assert moe_fused.resident_programs(128, 0, 8, 0) == 132 * 2  # 4096 registers a warp: 16 warps
    assert moe_fused.resident_programs(90, 0, 8, 0) == 132 * 2  # 96 a thread: 5 warps a quarter -> 2 programs
    assert moe_fused.resident_programs(90, 0, 4, 0) == 132 * 5  # 20 warps, not 65536 / 3072 = 21
    assert moe_fused.resident_programs(79, 1024, 8, 0) == 132 * 3  # the default launch's compile (sm_90, 3.6)
    assert moe_fused.resident_programs(64, 0, 8, 0) == 132 * 4
    assert moe_fused.resident_programs(32, 0, 4, 0) == 132 * 16  # warps bound it (64 a SM)
    assert moe_fused.resident_programs(32, 100_000, 4, 0) == 132 * 2  # shared memory bounds it
    assert moe_fused.resident_programs(32, 0, 1, 0) == 132 * 32  # the block limit


def test_fusion_is_off_by_default(monkeypatch):
    from kvrelay.kernels import moe_gemv, select

    assert select.DECODE_FUSIONS["KVRELAY_MOE_FUSED_GEMV"] is False
    monkeypatch.delenv("KVRELAY_MOE_FUSED_GEMV", raising=False)
    assert not moe_gemv.fused_gemv()
    monkeypatch.setenv("KVRELAY_MOE_FUSED_GEMV", "1")
    assert moe_gemv.fused_gemv()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
def test_fused_kernel_compiles_with_the_poll_after_the_wait():
    """_moe_fused_kernel at gpt-oss's shapes, compiled for sm_90 with PDL as launched (PHASES 3): the PDL wait
    precedes every memory access and branch (tests/cpu/test_pdl.py's check); the SASS holds the release count
    (a RED/ATOM after a MEMBAR) and the poll: an acquire atomic in a loop, with loads of act after it."""
    import test_pdl as checks

    from kvrelay.kernels import moe_fused

    ptr = checks.P
    types = {"x": ptr["bf16"], "ids": ptr["i64"], "route_w": ptr["bf16"], "w1": ptr["fp8"], "s1": ptr["f32"],
             "b1": ptr["bf16"], "act": ptr["bf16"], "w2": ptr["fp8"], "s2": ptr["f32"], "b2": ptr["bf16"],
             "y": ptr["bf16"], "cnt": ptr["i32"],
             **checks._ints("K_TOP", "H", "INTER", "MAXP", "PARTS", "UNITS", "s_xt", "s_w1e", "s_w1n", "s_s1e", "s_s1n", "s_b1e", "s_at",
                            "s_w2e", "s_w2n", "s_s2e", "s_s2n", "s_b2e", "s_yt")}
    consts = {"FP8": True, "ROWS1": 64, "BLOCK_N1": 32, "ROWS2": 32, "BLOCK_K": 256, "ALPHA": 1.702, "LIMIT": 7.0,
              "LATE": True, "PHASES": 3}
    # what the launcher specialises as multiples of 16 at gpt-oss's launches (pointers, sizes, strides; the scale
    # strides and K_TOP are not): the compile then has the real launch's vector widths
    divisible = ("x", "ids", "route_w", "w1", "s1", "b1", "act", "w2", "s2", "b2", "y", "cnt", "H", "INTER", "MAXP",
                 "s_xt", "s_w1e", "s_w1n", "s_b1e", "s_at", "s_w2e", "s_w2n", "s_b2e", "s_yt")
    checks.test_kernel_waits_before_touching_memory(moe_fused._moe_fused_kernel, types, consts, (), divisible,
                                                    {"num_warps": 8, "num_stages": 3})
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton

    k = moe_fused._moe_fused_kernel
    names = k.arg_names
    sig = {n: ("constexpr" if n in consts or n == "USE_PDL" else types[n]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    launch = moe_fused.DEFAULT_LAUNCH
    compiled = triton.compile(ASTSource(k, signature=sig, constexprs={**consts, "USE_PDL": False}, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "num_stages": 3, "maxnreg": launch.maxnreg})
    ptx = compiled.asm["ptx"]
    release = re.search(r"(red|atom)\.global\.gpu\.release\.add", ptx)
    acquire = re.search(r"(ld|atom)\.global\.gpu\.acquire", ptx)
    assert release and acquire, [line for line in ptx.splitlines() if "atom" in line or "red." in line]
    # GEMM1's parts counted, then the first W2 tile loaded (16-byte vectors), then the poll, then act from L2
    between = ptx[release.start():acquire.start()]
    assert "ld.global.v4" in between, "no W2 tile loaded ahead of the poll"
    assert "ld.global.cg" not in ptx[:acquire.start()] and "ld.global.cg" in ptx[acquire.start():]
    # the poll: a first read, then the loop's (spin_until)
    assert len(re.findall(r"(?:ld|atom)\.global\.gpu\.acquire", ptx)) == 2
    # the default launch's registers (cuobjdump, which triton ships; under its cap, without spills) leave room on an
    # H200 (132 SMs) for a program per unit at batch 1: 4 pairs x 90 (with fewer, programs would take two units)
    import subprocess
    import tempfile

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, timeout=60).stdout
    n_regs = int(re.search(r"REG:(\d+)", usage).group(1))
    assert "STL" not in compiled.asm["sass"], "the register cap spills"
    assert (consts["ROWS2"], consts["BLOCK_N1"], consts["BLOCK_K"], consts["LATE"]) == \
        (launch.rows2, launch.block_n1, launch.block_k, launch.late) and launch.num_warps == 8
    room = moe_fused.fit_programs(n_regs, compiled.metadata.shared, 8, 132, 65536, 2048, 233472)
    assert room >= 4 * (2880 // launch.rows2), (n_regs, room)
