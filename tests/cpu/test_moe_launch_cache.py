"""The grouped expert GEMM's per-launch host work done once (kernels/moe.py): the weights' TMA descriptors
kept in MoEWeights.descs, the launch's constexpr mapping cached per distinct launch. The grouped path run
with both: tests/gpu/test_moe.py; its FP8 GEMMs also under the interpreter on CPU, descriptors kept
(tests/cpu/test_grouped_moe_interpret.py; the interpreter's bf16 tl.dot is wrong, so not the bf16 ones)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.kernels import moe
from kvrelay.kernels.moe_configs import GemmConfig


def test_weight_descriptor_built_once_per_weight_and_tile():
    assert moe.tma_available()  # triton >= 3.4 (pyproject): host TMA descriptors are always there
    w = torch.zeros(4, 256, 384, dtype=torch.float8_e4m3fn)
    other = torch.zeros_like(w)
    cache: dict = {}
    d = moe._weight_desc(w, 128, 128, cache)
    assert moe._weight_desc(w, 128, 128, cache) is d  # same weight, same tile: the kept one
    assert list(d.shape) == [4 * 256, 384] and list(d.block_shape) == [128, 128]
    assert d.base.data_ptr() == w.data_ptr()
    assert moe._weight_desc(w, 64, 128, cache) is not d  # another tile
    assert moe._weight_desc(other, 128, 128, cache) is not d  # another weight of the same shape
    assert len(cache) == 3
    assert moe._weight_desc(w, 128, 128, None) is not d  # no cache: a fresh one each call
    # every MoEWeights holds its own cache, left out of equality and repr
    a = moe.MoEWeights(w, torch.zeros(4, 256), w, torch.zeros(4, 256))
    b = dataclasses.replace(a, descs={})
    a.descs["x"] = 1
    assert b.descs == {} and a == b and "descs" not in repr(a)


def test_grouped_meta_is_the_launch_dict_and_kept():
    cfg = GemmConfig(128, 8, 3, group_m=4, masked=False, tma=True)
    m = moe._grouped_meta(True, True, False, 64, cfg, 128, True, 1.702, 7.0, ())
    assert dict(m) == dict(FP8=True, SWIGLU=True, MUL_ROUTE=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=4,
                           MASKED=False, EVEN_K=True, TMA=True, ALPHA=1.702, LIMIT=7.0, A_SORTED=False,
                           OUT_SORTED=False, num_warps=8, num_stages=3)
    srt = moe._grouped_meta(True, True, False, 128, GemmConfig(128, 4, 3, tma=True, sorted_a=True), 128,
                            True, 1.702, 7.0, (), True)
    assert (srt["A_SORTED"], srt["OUT_SORTED"]) == (True, True)
    assert moe._grouped_meta(True, True, False, 64, GemmConfig(128, 8, 3, group_m=4, masked=False, tma=True), 128,
                             True, 1.702, 7.0, ()) is m
    pdl = moe._grouped_meta(True, True, False, 64, cfg, 128, True, 1.702, 7.0,
                            (("USE_PDL", True), ("launch_pdl", True)))
    assert pdl is not m and pdl["USE_PDL"] is True and pdl["launch_pdl"] is True
    with pytest.raises(TypeError):
        m["FP8"] = False  # shared between launches: read-only
