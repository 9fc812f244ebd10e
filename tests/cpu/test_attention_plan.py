"""GpuAttention's prefill planning order, on CPU with a recording stand-in for FlashInfer's wrapper (the
real one needs a GPU; tests/gpu runs the same path through the model against float32 attention).

FlashInfer's prefill plan costs ~2 ms of host time at 8k tokens, and layer 0 is a sliding layer that runs
on the Triton kernel: so the plan of a FlashInfer-prefilled group is made at that group's first run, after
the GPU has been given layer 0, instead of in plan() before the first kernel."""

from __future__ import annotations

import torch

from kvrelay.engine.config import PRESETS
from kvrelay.engine.kv_cache import KVCache
from kvrelay.engine.kv_geometry import FULL, SLIDING

CFG = PRESETS["tiny"]


class _RecordingWrapper:
    """Stands in for kernels.attention.FlashInferSinkAttention: records plan/run calls in order."""

    calls: list = []

    def __init__(self, *args, **kwargs):
        self.window = args[4]

    def plan_prefill(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len):
        self.calls.append(("plan", self.window, qo_indptr.tolist(), kv_indptr.tolist(), kv_indices.tolist()))

    def prefill(self, q, pool, sinks):
        self.calls.append(("run", self.window))
        return q


def _attention(monkeypatch):
    from kvrelay.engine.layers.attention import GpuAttention
    from kvrelay.kernels import attention as fi_module

    monkeypatch.setattr(fi_module, "FlashInferSinkAttention", _RecordingWrapper)
    _RecordingWrapper.calls = []
    return GpuAttention(CFG, CFG.num_key_value_heads, CFG.num_attention_heads, 4, "cpu", torch.bfloat16,
                        "flashinfer")


def test_flashinfer_prefill_plan_waits_for_the_groups_first_run(monkeypatch):
    att = _attention(monkeypatch)
    assert att.prefill_kind == {FULL: "flashinfer", SLIDING: "triton"}
    kv = KVCache(CFG, num_pages=64, page_size=4)
    for sid, n in (("a", 13), ("b", 6)):
        kv.reserve(sid, n)
    batch = kv.plan([("a", 13), ("b", 6)])
    att.plan(batch)
    assert _RecordingWrapper.calls == []  # nothing planned before the first kernel
    assert att.tiles is not None  # the Triton sliding layers' tiles are planned at once
    q = torch.randn(19, CFG.num_attention_heads, CFG.head_dim).bfloat16()
    for _ in range(3):  # three full layers: one plan, before the first of them
        assert att.run(q, None, FULL, None, CFG.sm_scale, None) is q
    want_plan = ("plan", None, [0, 13, 19], batch.host["kv_indptr"][FULL].tolist(),
                 batch.kv[FULL].kv_indices.tolist())
    assert _RecordingWrapper.calls == [want_plan, ("run", None), ("run", None), ("run", None)]
    # the next forward plans again, with its own batch
    kv.commit("a", 13)
    kv.commit("b", 6)
    kv.reserve("a", 5)
    batch2 = kv.plan([("a", 5)])
    att.plan(batch2)
    att.run(q[:5], None, FULL, None, CFG.sm_scale, None)
    assert _RecordingWrapper.calls[4][:3] == ("plan", None, [0, 5])
    assert _RecordingWrapper.calls[4][3] == batch2.host["kv_indptr"][FULL].tolist() != want_plan[3]
    assert len(_RecordingWrapper.calls) == 6
