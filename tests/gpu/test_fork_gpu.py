"""The n-choices fork on the GPU (KVCache.fork through Runner on device="cuda", CUDA graphs on): one
prefill forked into three sequences holds, position for position, the bytes of three prompts prefilled
apart (whole pages shared, the partial last one copied on the device); the three then decode apart in
one graph batch with the logits of the three separate sequences fed the same tokens, and every page
comes back. Both attention paths: the MXFP4 fixture (Triton, window 8) and gpt-oss's shape (FlashInfer,
window 128)."""

from __future__ import annotations

import pytest
import torch

from test_model_gpu import GRAPH_SIZES, _cuda, _model, rel_err
from test_prefix_cache_gpu import kv_rows

pytestmark = pytest.mark.gpu

N_DECODE = 16


@pytest.mark.parametrize("kind", ["fixture", "attn64"])
def test_forked_choices_decode_as_separate_prompts(kind):
    from kvrelay.engine.runner import Runner

    device = _cuda()
    cfg, w = _model(kind)
    forked, apart = (Runner(cfg, w, device=device, page_size=16, kv_tokens=8192,
                            cuda_graph_batch_sizes=GRAPH_SIZES) for _ in range(2))
    for r in (forked, apart):
        r.warmup()
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, min(cfg.vocab_size, 200000), (300,), generator=g).tolist()  # 18 pages + 12
    forked.prefill("p", prompt)
    kids = ["c0", "c1", "c2"]
    for c in kids:
        forked.fork_sequence("p", c)
    forked.free("p")
    for c in kids:
        apart.prefill(c, prompt)
    torch.cuda.synchronize()
    for c in kids:  # the prompt's KV, every position each group still holds, bit for bit
        got, want = kv_rows(forked.kv, c, 0, len(prompt)), kv_rows(apart.kv, c, 0, len(prompt))
        assert got.keys() == want.keys()
        for grp in got:
            assert torch.equal(got[grp], want[grp]), (kind, c, grp)
    toks = [1, 2, 3]
    for step in range(N_DECODE):
        lf, la = forked.decode(kids, toks).float(), apart.decode(kids, toks).float()
        for i in range(3):
            assert rel_err(lf[i], la[i]) < 1e-2, (kind, step, i)
        toks = [int(la[i].topk(3).indices[i]) for i in range(3)]  # each choice its own way
    for c in kids:
        forked.free(c)
        apart.free(c)
    for r in (forked, apart):
        free = r.kv.free_pages()
        assert all(free[g] == r.kv.allocators[g].num_pages - r.internal_pages()[g] for g in free)
