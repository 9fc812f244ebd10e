"""CUDA-graph replay of a decode step (sink attention + MoE routing + expert GEMV) equals eager exactly,
at padded batch sizes, with the plan done outside the graph and new inputs every step."""

from __future__ import annotations

import pytest
import torch

from kernel_refs import make_paged_batch, rel_err, sink_attention_ref

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE, E, TOPK = 64, 8, 64, 16, 8, 4
MAX_BS, MAX_PAGES = 8, 96  # 8 sequences of < 100 keys need <= 56 pages


class ToyDecode:
    """Fixed buffers + a step that only reads them (the contract engine/cuda_graph.py documents)."""

    def __init__(self, backend, dev, gen):
        from kvrelay.kernels import triton_attention as ta
        from kvrelay.kernels.moe import MoEWeights
        self.backend, self.dev = backend, dev
        self.pool = torch.randn(MAX_PAGES, 2, PAGE, HKV, D, generator=gen).bfloat16().to(dev)
        self.sinks = (torch.randn(HQ, generator=gen) + 3).bfloat16().to(dev)
        self.q = torch.zeros(MAX_BS, HQ, D, dtype=torch.bfloat16, device=dev)
        self.indptr = {bs: torch.zeros(bs + 1, dtype=torch.int32, device=dev) for bs in (1, 4, 8)}
        self.indices = torch.zeros(MAX_PAGES, dtype=torch.int32, device=dev)
        self.last = {bs: torch.ones(bs, dtype=torch.int32, device=dev) for bs in (1, 4, 8)}
        self.gate = (torch.randn(E, HQ * D, generator=gen) * 0.05).bfloat16().to(dev)
        hid = HQ * D
        self.ex = MoEWeights.from_bf16((torch.randn(E, 256, hid, generator=gen) * 0.02).bfloat16().to(dev),
                                       torch.randn(E, 256, generator=gen).bfloat16().to(dev),
                                       (torch.randn(E, hid, 128, generator=gen) * 0.05).bfloat16().to(dev),
                                       torch.randn(E, hid, generator=gen).bfloat16().to(dev))
        self.ws = {bs: ta.decode_workspace(bs, HQ, D, 4, dev) for bs in (1, 4, 8)}
        self.fi = {}
        if backend == "flashinfer":
            from kvrelay.kernels.attention import FlashInferSinkAttention
            self.fi = {bs: FlashInferSinkAttention(HQ, HKV, D, PAGE, None, 0.125, dev, graph_batch=bs,
                                                   graph_max_pages=MAX_PAGES) for bs in (1, 4, 8)}
        self.request = None

    def prepare(self, bs, n):
        """Host work outside the graph: copy the real sequences' metadata, pad with 1-key sequences."""
        lens, pages, q = self.request
        indptr, idx = [0], []
        for i in range(bs):
            p = pages[i] if i < n else [0]
            idx += p
            indptr.append(indptr[-1] + len(p))
        last = [((lens[i] - 1) % PAGE) + 1 if i < n else 1 for i in range(bs)]
        self.indptr[bs].copy_(torch.tensor(indptr, dtype=torch.int32))
        self.indices[: len(idx)].copy_(torch.tensor(idx, dtype=torch.int32))
        self.last[bs].copy_(torch.tensor(last, dtype=torch.int32))
        self.q[:n].copy_(q[:n])
        if self.fi:
            self.fi[bs].plan_decode(self.indptr[bs], self.indices[: len(idx)], self.last[bs])

    def step(self, bs):
        from kvrelay.kernels import triton_attention as ta
        from kvrelay.kernels.moe import moe_experts, route_topk
        q = self.q[:bs]
        if self.fi:
            att = self.fi[bs].decode(q, self.pool, self.sinks)
        else:
            att = ta.sink_decode(q, self.pool, self.sinks, self.indptr[bs], self.indices, self.last[bs],
                                 sm_scale=0.125, window=None, num_splits=4, workspace=self.ws[bs])
        x = att.reshape(bs, HQ * D)
        w, ids = route_topk(torch.nn.functional.linear(x, self.gate), TOPK)
        return att, moe_experts(x, ids, w, self.ex, path="gemv")


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_graph_replay_equals_eager(backend):
    from kvrelay.engine.cuda_graph import DecodeGraphs
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    toy = ToyDecode(backend, dev, g)
    graphs = DecodeGraphs(toy.step, toy.prepare, batch_sizes=(1, 4, 8))
    perm = torch.randperm(MAX_PAGES - 1, generator=g) + 1  # page 0 is the padding scratch page

    def new_request(n):
        lens = torch.randint(1, 100, (n,), generator=g).tolist()
        pages, used = [], 0
        for L in lens:
            np_ = -(-L // PAGE)
            pages.append(perm[used: used + np_].tolist())
            used += np_
        return lens, pages, torch.randn(n, HQ, D, generator=g).bfloat16().to(dev)

    toy.request = new_request(8)
    graphs.capture()
    for n in (1, 3, 4, 5, 8):
        toy.request = new_request(n)
        (att_g, moe_g), bs = graphs.run(n)
        att_g, moe_g = att_g[:n].clone(), moe_g[:n].clone()
        assert bs == graphs.padded_size(n)
        toy.prepare(bs, n)
        att_e, moe_e = toy.step(bs)
        torch.cuda.synchronize()
        assert torch.equal(att_g, att_e[:n]) and torch.equal(moe_g, moe_e[:n]), n
        # and the replayed attention is right, not just repeatable
        lens, pages, q = toy.request
        b = make_paged_batch([1], [1], HKV, D, PAGE, dev)
        b.pool, b.kv_lens, b.q_lens = toy.pool, lens, [1] * n
        b.qo_indptr = torch.arange(n + 1, dtype=torch.int32, device=dev)
        b.kv_indptr = toy.indptr[bs][: n + 1]
        b.kv_indices = toy.indices
        ref = sink_attention_ref(q, b, toy.sinks, 0.125, None)
        assert rel_err(att_g, ref) < 1.5e-2
