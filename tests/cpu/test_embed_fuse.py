"""The token lookup fused into the first block's norm launch (kernels.fused.add_rms_norm(..., gather=True),
engine/layers/embedding.EmbeddingRows, KVRELAY_EMBED_FUSE=1) under TRITON_INTERPRET=1 on CPU tensors: bit for
bit F.embedding followed by add_rms_norm (the new residual, the normed rows or their FP8 quantisation with the
M-padding rows), and the tiny model's logits equal with the switch on and off. The sm_90 compile and PDL wait
placement of the kernel (ROWS mode) are test_pdl.py's."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from interp_helpers import interpreted, refs

_interpreted = interpreted(__file__)


@_interpreted
def test_gathered_norm_equals_lookup_then_norm_interpreted():
    from kvrelay.kernels import fused

    g = torch.Generator().manual_seed(9)
    for vocab, h, kp in ((50, 256, 256), (37, 200, 256)):
        table = (torch.randn(vocab, h, generator=g) * 2).bfloat16()
        w = (torch.rand(h, generator=g) + 0.5).bfloat16()
        for ids in (torch.tensor([7]), torch.tensor([3, 3, vocab - 1]), torch.randint(0, vocab, (6,), generator=g)):
            x = F.embedding(ids, table)
            for quant in (kp, None):
                want = fused.add_rms_norm(x, None, w, 1e-5, quant_k=quant)[1]
                got_x, got = fused.add_rms_norm(table, None, w, 1e-5, quant_k=quant, rows=ids, gather=True)
                refs.assert_same(got_x, x, ("x", vocab, len(ids)))
                if quant is None:
                    refs.assert_same(got, want, ("normed", vocab, len(ids)))
                else:
                    refs.assert_same(got[0], want[0], ("q", vocab, len(ids)))  # the M-padding rows included
                    refs.assert_same(got[1], want[1], ("scale", vocab, len(ids)))
    with pytest.raises(ValueError, match="gather"):
        fused.add_rms_norm(table, None, w, 1e-5, gather=True)
    with pytest.raises(ValueError, match="gather"):
        fused.add_rms_norm(table, table[:2], w, 1e-5, rows=torch.tensor([0, 1]), gather=True)


@_interpreted
def test_tiny_model_logits_equal_with_the_lookup_fused_and_not_interpreted():
    """The model's fused GPU glue under the interpreter (KVRELAY_KERNELS=triton): a prefill and decode steps of
    two sequences give the same logits with KVRELAY_EMBED_FUSE=1 and 0; with it on, the first block's norm
    looked the rows up itself in every forward (and F.embedding never ran on the model's table)."""
    from kvrelay.engine.config import PRESETS
    from kvrelay.engine.layers import embedding
    from kvrelay.engine.runner import Runner
    from kvrelay.engine.weights import open_weights

    cfg = PRESETS["tiny"]
    lookups = []
    orig = embedding.EmbeddingRows.lookup

    def counted(self):
        lookups.append(1)
        return orig(self)

    def forward_all(flag):
        os.environ["KVRELAY_EMBED_FUSE"] = flag
        made = []
        orig_init = embedding.EmbeddingRows.__init__

        def init(self, *a, **k):
            made.append(1)
            orig_init(self, *a, **k)

        embedding.EmbeddingRows.__init__ = init
        try:
            r = Runner(cfg, open_weights(None, cfg, dummy=True, seed=3), page_size=4, kv_tokens=128)
            assert r.model.blocks[0].fused
            out = [r.prefill("a", [3, 141, 59]), r.prefill("b", [7, 8, 9, 10, 11, 12])]
            for toks in ([897, 5], [12, 40]):
                out.append(r.decode(["a", "b"], toks))
                out.append(r.decode(["a"], toks[:1]))
        finally:
            embedding.EmbeddingRows.__init__ = orig_init
        return out, len(made)

    env = {k: os.environ.get(k) for k in ("KVRELAY_EMBED_FUSE", "KVRELAY_KERNELS", "KVRELAY_ATTENTION")}
    os.environ.update(KVRELAY_KERNELS="triton", KVRELAY_ATTENTION="reference")  # attention: not what this checks
    embedding.EmbeddingRows.lookup = counted
    try:
        on, made_on = forward_all("1")
        off, made_off = forward_all("0")
    finally:
        embedding.EmbeddingRows.lookup = orig
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert made_on == 6 and made_off == 0 and not lookups  # every forward, and never a fallback lookup
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max())
