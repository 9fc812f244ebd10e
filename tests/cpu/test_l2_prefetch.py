"""kernels/l2_prefetch.py on the CPU: the switch (which points, the policy, where it never launches), the byte
budget, and the kernel compiled for sm_90 (triton ships ptxas; no GPU needed): its SASS issues the bulk L2
prefetch (UBLKPF, with the evict-last descriptor or without), writes nothing, loads nothing but the expert ids
(rows form), and triggers its dependents (PREEXIT) BEFORE its wait (ACQBULK), the documented exception to
kernels/pdl.py's order. The GPU side (no byte touched, the model's decode bit for bit with every point on):
tests/gpu/test_l2_prefetch_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch
import triton

from kvrelay.kernels import l2_prefetch as lp
from test_pdl import _GLOBAL_MEM, _LOADS, _opcodes, _ptx_loads_before_wait


def test_points_parse_and_reject_unknown_names(monkeypatch):
    monkeypatch.delenv("KVRELAY_L2_PREFETCH", raising=False)
    assert lp.points() == frozenset()  # off by default until measured
    for off in ("", "0", "off", "none"):
        monkeypatch.setenv("KVRELAY_L2_PREFETCH", off)
        assert lp.points() == frozenset()
    monkeypatch.setenv("KVRELAY_L2_PREFETCH", "qkv, moe")
    assert lp.points() == {"qkv", "moe"}
    monkeypatch.setenv("KVRELAY_L2_PREFETCH", "all")
    assert lp.points() == set(lp.POINTS)
    monkeypatch.setenv("KVRELAY_L2_PREFETCH", "qkv,mlp")
    with pytest.raises(ValueError, match="mlp"):
        lp.points()
    monkeypatch.delenv("KVRELAY_L2_PREFETCH_POLICY", raising=False)
    assert lp.evict_last()
    monkeypatch.setenv("KVRELAY_L2_PREFETCH_POLICY", "normal")
    assert not lp.evict_last()


def test_never_wanted_on_cpu_big_batches_or_points_off(monkeypatch):
    monkeypatch.setattr(lp, "_supported", lambda index: True)
    monkeypatch.setenv("KVRELAY_L2_PREFETCH", "all")
    w = torch.zeros(4, 16, dtype=torch.uint8)
    assert not lp.wanted("qkv", w, 1)  # a CPU tensor
    cuda_w = torch.empty(4, 16, dtype=torch.uint8, device="meta")
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    assert lp.wanted("qkv", cuda_w, 1) and lp.wanted("o", cuda_w, lp.MAX_TOKENS)
    assert not lp.wanted("o", cuda_w, lp.MAX_TOKENS + 1)
    monkeypatch.setenv("KVRELAY_L2_PREFETCH", "o")
    assert not lp.wanted("qkv", cuda_w, 1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not lp.wanted("o", cuda_w, 1)


def test_byte_budget_skips_rows_that_would_not_fit(monkeypatch):
    launched = []
    monkeypatch.setattr(lp, "wanted", lambda point, t, tokens: True)
    monkeypatch.setattr(lp, "l2_prefetch", lambda t, rows=None: launched.append((t.shape, rows)))
    experts = torch.empty(32, 1 << 20, 8, dtype=torch.uint8, device="meta")  # 8 MiB an expert
    ids4 = torch.zeros(4, dtype=torch.int32)
    lp.maybe_prefetch("moe", [experts], 1, rows=ids4)  # 32 MiB: within MAX_BYTES
    assert len(launched) == 1
    lp.maybe_prefetch("moe", [experts], 2, rows=torch.zeros(8, dtype=torch.int32))  # 64 MiB: skipped
    lp.maybe_prefetch("qkv", [experts], 1)  # a whole 256 MiB tensor: skipped
    lp.maybe_prefetch("qkv", [None], 1)
    assert len(launched) == 1


SIG = {"base": "*u8", "ids": "*i32", "row_bytes": "i32", "row_stride": "i32", "CHUNK": "constexpr",
       "ROWS": "constexpr", "EVICT_LAST": "constexpr", "USE_PDL": "constexpr"}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("evict_last", [True, False])
def test_kernel_prefetches_triggers_then_waits_and_writes_nothing(rows, evict_last):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {"CHUNK": lp.CHUNK, "ROWS": rows, "EVICT_LAST": evict_last, "USE_PDL": True}
    src = ASTSource(lp._l2_prefetch_kernel, signature=SIG, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True, "num_warps": 1})
    sass = compiled.asm["sass"]
    ops = _opcodes(sass)
    prefetches = [line for line in sass.splitlines() if "UBLKPF" in line]
    assert prefetches and all(("desc[" in line) == evict_last for line in prefetches), prefetches
    assert ops.index("UBLKPF") < ops.index("PREEXIT") < ops.index("ACQBULK")  # prefetch, trigger, then wait
    assert not set(ops) & (_GLOBAL_MEM - _LOADS), "the prefetch kernel must write nothing"
    loads = [op for op in ops if op in _LOADS]
    early = _ptx_loads_before_wait(compiled.asm["ptx"], [n for n, t in SIG.items() if t != "constexpr"])
    if rows:  # the expert ids, and nothing else, read ahead of the wait (the module docstring's argument)
        assert loads == ["LDG"] and early == [{"ids"}], (loads, early)
    else:
        assert loads == [] and early == [], (loads, early)
