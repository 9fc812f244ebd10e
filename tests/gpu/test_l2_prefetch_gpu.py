"""L2 prefetch of the next kernel's weights (kernels/l2_prefetch.py) on the GPU: the kernel launches on whole
tensors and on chosen rows (sizes that end mid-request included) without touching any byte, inside a CUDA graph
with PDL too; and the model's decode with every prefetch point on is bit for bit the decode without, graph-replayed
and eager, with the prefetch launches counted (so the points really ran). (The SASS: tests/cpu/test_l2_prefetch.py.)
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import assert_same_logits, attn64_cfg, decode_logits, dummy_weights, prompts_and_feed

pytestmark = pytest.mark.gpu


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk L2 prefetch is sm_90")
    return torch.device("cuda")


@pytest.mark.parametrize("policy", ["last", "normal"])
def test_prefetch_launches_leave_every_byte_alone(monkeypatch, policy):
    from kvrelay.kernels.l2_prefetch import PROGRAM_BYTES, l2_prefetch

    dev = _cuda()
    monkeypatch.setenv("KVRELAY_L2_PREFETCH_POLICY", policy)
    g = torch.Generator(device=dev).manual_seed(3)
    w = torch.randn(32, 2880, 2944 // 2, device=dev, generator=g).to(torch.float8_e4m3fn)  # rows of 4.2 MB
    odd = torch.randn(3 * PROGRAM_BYTES // 2 + 48, device=dev, generator=g).to(torch.bfloat16).view(-1, 8)
    before_w, before_odd = w.clone(), odd.clone()
    ids = torch.tensor([5, 31, 0, 5], dtype=torch.int32, device=dev)
    l2_prefetch(w)
    l2_prefetch(w, ids)
    l2_prefetch(odd)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2_prefetch(w, ids)
        l2_prefetch(odd)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w.view(torch.uint8), before_w.view(torch.uint8)) and torch.equal(odd, before_odd)


def test_prefetch_rejects_what_it_cannot_address():
    from kvrelay.kernels.l2_prefetch import l2_prefetch

    dev = _cuda()
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(torch.zeros(64, 64, device=dev).t())
    with pytest.raises(ValueError, match="multiple of 16"):
        l2_prefetch(torch.zeros(4, 3, dtype=torch.uint8, device=dev), torch.zeros(1, dtype=torch.int32, device=dev))


@pytest.mark.parametrize("quant", ["fp8-block128", "bf16"])
def test_model_decode_with_prefetch_equals_without(monkeypatch, quant):
    from kvrelay.kernels import l2_prefetch

    dev = _cuda()
    cfg = attn64_cfg()
    w = dummy_weights(cfg, seed=21)
    prompts, feed = prompts_and_feed(cfg, 9, (5, 180), 5)
    launches = []
    orig = l2_prefetch.l2_prefetch
    monkeypatch.setattr(l2_prefetch, "l2_prefetch", lambda t, rows=None: (launches.append(rows is None), orig(t, rows)))
    logits = {}
    for on in ("all", "0"):
        monkeypatch.setenv("KVRELAY_L2_PREFETCH", on)
        for graphs in (True, False):
            launches.clear()
            logits[on, graphs] = decode_logits(cfg, w, dev, prompts, feed, tail=[([1], [feed[0][0]])], kv_tokens=4096,
                                               quant=quant, cuda_graphs=graphs, cuda_graph_batch_sizes=(1, 2))
            if on == "all":  # qkv and o in every layer of a decode step; the experts' rows (the moe point) too
                assert launches.count(True) >= 2 * cfg.num_hidden_layers and False in launches, launches
            else:
                assert not launches
    for graphs in (True, False):
        assert_same_logits(logits["all", graphs], logits["0", graphs], ("graphs", graphs))
