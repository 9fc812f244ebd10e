"""kernels/l2.py: when the decode kernels prefetch the next GEMM's weights into L2, how a range is split
into bulk requests, and what the prefetching kernel variants compile to.

The switch: off on CPU, under the Triton interpreter, above MAX_ROWS rows and with KVRELAY_L2_PREFETCH=0.
The split: PARTS x LANES requests of one 16-byte-multiple chunk cover [0, nbytes) exactly once. The kernels
(compiled here for sm_90, as tests/cpu/test_pdl.py compiles them; no GPU needed): the prefetch programs
issue `cp.async.bulk.prefetch.L2` (SASS UBLKPF) before their griddepcontrol.wait, touch no other memory
before it, and every path through the kernel still waits (kernels/pdl.py's rule). That the prefetch
changes no result is checked on the H200: tests/gpu/test_l2_gpu.py.
"""

from __future__ import annotations

import os
import random
import re

import pytest
import torch
import triton

from interp_helpers import interpreted
from kvrelay.kernels import fused, l2


@pytest.fixture
def sm90(monkeypatch):
    """A CUDA device of compute capability 9, as far as l2.enabled can tell (this machine has none)."""
    monkeypatch.setattr(l2, "_sm90", lambda index: True)
    monkeypatch.delenv("KVRELAY_L2_PREFETCH", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_on_for_decode_rows_on_hopper(sm90, monkeypatch):
    dev = torch.device("cuda", 0)
    assert l2.enabled(dev, 1) and l2.enabled("cuda:0", l2.MAX_ROWS)
    assert not l2.enabled(dev, l2.MAX_ROWS + 1), "prefill-sized launches reuse each weight tile: no prefetch"
    monkeypatch.setenv("KVRELAY_L2_PREFETCH", "0")
    assert not l2.enabled(dev, 1)
    monkeypatch.setenv("KVRELAY_L2_PREFETCH", "1")
    assert l2.enabled(dev, 1)


def test_off_on_cpu_under_the_interpreter_and_before_hopper(sm90, monkeypatch):
    for dev in ("cpu", torch.device("cpu"), "meta"):
        assert not l2.enabled(dev, 1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not l2.enabled(torch.device("cuda", 0), 1)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(l2, "_sm90", lambda index: False)
    assert not l2.enabled(torch.device("cuda", 0), 1)


def test_launch_args(sm90, monkeypatch):
    dummy = torch.zeros(4)
    w = torch.zeros(5120, 2944, dtype=torch.float8_e4m3fn)
    # off (a CPU launch): no extra programs, the dummy in the pointer slot
    parts, kw = l2.launch_args(l2.Target(w), dummy, 1)
    assert parts == 0 and kw["PF_PARTS"] == 0 and kw["pf_ptr"] is dummy and kw["pf_bytes"] == 0
    assert l2.launch_args(None, dummy, 1)[0] == 0
    # on (a CUDA launch, as far as enabled() can tell): PARTS programs over the weight's bytes, as bytes
    monkeypatch.setattr(l2, "enabled", lambda device, rows: rows <= l2.MAX_ROWS)
    parts, kw = l2.launch_args(l2.Target(w), dummy, 1)
    assert parts == l2.PARTS == kw["PF_PARTS"] and kw["PF_LANES"] == l2.LANES
    assert kw["pf_bytes"] == 5120 * 2944 and kw["pf_ptr"].dtype == torch.uint8
    assert kw["pf_ptr"].data_ptr() == w.data_ptr() and kw["pf_ptr"].numel() == w.numel()
    bf = torch.zeros(64, 96, dtype=torch.bfloat16)
    assert l2.launch_args(l2.Target(bf), dummy, 8)[1]["pf_bytes"] == 64 * 96 * 2
    assert l2.launch_args(l2.Target(w), dummy, l2.MAX_ROWS + 1)[0] == 0


def test_target_of_cpu_or_odd_tensors_is_none():
    assert l2.Target.of(None) is None
    assert l2.Target.of(torch.zeros(64, 64)) is None  # not a CUDA tensor


@pytest.mark.parametrize("seed", range(5))
def test_shares_cover_the_range_once(seed):
    rng = random.Random(seed)
    for nbytes in [16, 4096, 5120 * 2944, 2880 * 4096] + [16 * rng.randrange(1, 2_000_000) for _ in range(20)]:
        parts, lanes = rng.choice([(32, 128), (1, 1), (4, 32), (l2.PARTS, l2.LANES)])
        reqs = l2.shares(nbytes, parts, lanes)
        assert 0 < len(reqs) <= parts * lanes
        at = 0
        for off, size in reqs:
            assert off == at and size > 0 and off % 16 == 0 and size % 16 == 0
            at += size
        assert at == nbytes
        assert len({s for _, s in reqs[:-1]}) <= 1, "one chunk size but for the last request"


# ---- the prefetching variants' SASS / PTX ----------------------------------------------------------------
I32, F32 = "i32", "fp32"
_NORM = {"x_ptr": "*bf16", "d_ptr": "*fp32", "w_ptr": "*bf16", "rows_ptr": "*i64", "xo_ptr": "*bf16",
         "out_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "T": I32, "H": I32, "eps": F32,
         **{n: I32 for n in ("s_x", "s_dt", "s_dk", "s_xo", "s_o", "s_q", "s_sm", "s_sk")},
         "pf_ptr": "*u8", "pf_bytes": I32}
_ROT = {**{k: "*bf16" for k in ("qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "pool_ptr")},
        "pages_ptr": "*i32", "offsets_ptr": "*i32",
        **{n: I32 for n in ("stride_qkv", "stride_cs", "n_q", "n_kv", "s_pg", "s_kv", "s_off", "s_head")},
        "pf_ptr": "*u8", "pf_bytes": I32}
_LOADS_STORES = {"LDG", "LD", "LDGSTS", "STG", "ST", "ATOMG", "ATOM", "RED", "REDG", "UTMALDG", "UBLKCP"}


def _ops(sass: str) -> list[str]:
    ops = []
    for line in sass.splitlines():
        m = re.match(r"^\s*(?:[-\w]+:){4}\w+\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]+)?\b", line)
        if m:
            ops.append(m.group(1))
    return ops


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("kernel,types,consts", [
    (fused._add_rms_norm_kernel, _NORM, {"DELTA": 2, "K_SUM": 4, "ROWS": False, "STORE_X": True, "NORM": True,
                                         "QUANT": True, "N_GROUPS": 23, "BLOCK": 4096}),
    (fused._rotary_kv_write_kernel, _ROT, {"HALF": 32, "BLOCK": 32}),
], ids=["add_rms_norm", "rotary_kv_write"])
def test_prefetch_programs_prefetch_then_wait(kernel, types, consts):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    consts = {**consts, "PF_PARTS": l2.PARTS, "PF_LANES": l2.LANES, "USE_PDL": True}
    assert set(types) | set(consts) == set(names), set(names) ^ (set(types) | set(consts))
    signature = {n: ("constexpr" if n in consts else types[n]) for n in names}
    compiled = triton.compile(ASTSource(kernel, signature=signature, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True})
    ptx, ops = compiled.asm["ptx"], _ops(compiled.asm["sass"])
    head = ptx[: ptx.index("griddepcontrol.wait")]
    assert "cp.async.bulk.prefetch.L2.global" in head, "the prefetch is issued before the first wait"
    assert "ld.global" not in head and "st.global" not in head, "nothing but the prefetch before the wait"
    assert "UBLKPF" in ops and ops.index("UBLKPF") < ops.index("ACQBULK")
    assert not set(ops[: ops.index("ACQBULK")]) & _LOADS_STORES
    # every EXIT is preceded by a wait on its path: the prefetch programs' own, then the main programs'
    exits = [i for i, op in enumerate(ops) if op == "EXIT"]
    waits = [i for i, op in enumerate(ops) if op == "ACQBULK"]
    assert len(waits) >= 2 and exits and all(any(w < e for w in waits) for e in exits)
    assert waits[1] < min(i for i, op in enumerate(ops) if op in {"LDG", "STG"}), \
        "the main programs' first load or store follows their wait"


@interpreted(__file__)
def test_interpreted_glue_with_a_prefetch_target_is_unchanged():
    from kvrelay.kernels import fused, l2

    # on CPU the prefetch is off: the same outputs whatever the target (the launch takes the dummy pointer)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 256, generator=g).bfloat16()
    d = torch.randn(3, 4, 256, generator=g)
    w = torch.randn(256, generator=g).bfloat16()
    target = l2.Target(torch.zeros(128, 256, dtype=torch.float8_e4m3fn))
    t = torch.zeros(3, 4 * 64 * 3, dtype=torch.bfloat16).normal_(generator=g)
    cos, sin = torch.randn(3, 32, generator=g).bfloat16(), torch.randn(3, 32, generator=g).bfloat16()
    pools = [torch.zeros(4, 2, 16, 4, 64, dtype=torch.bfloat16) for _ in range(2)]
    pages, offs = torch.tensor([0, 1, 3]), torch.tensor([5, 0, 15])
    qa = fused.rotary_kv_write(t, cos, sin, 4, 4, 64, pools[0], pages, offs)
    qb = fused.rotary_kv_write(t, cos, sin, 4, 4, 64, pools[1], pages, offs, prefetch=target)
    assert torch.equal(qa, qb) and torch.equal(pools[0], pools[1]) and pools[0].abs().sum() > 0
    a = fused.add_rms_norm(x, d, w, 1e-5, quant_k=256)
    b = fused.add_rms_norm(x, d, w, 1e-5, quant_k=256, prefetch=target)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1][0].float(), b[1][0].float()) and torch.equal(a[1][1], b[1][1])
