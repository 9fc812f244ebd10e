"""L2 prefetch of the next GEMM's weights (kernels/l2.py) changes where bytes come from, never a result: the
prefetching launches of the fused glue give the bits of the plain ones, and the model's CUDA-graph decode
steps with KVRELAY_L2_PREFETCH=1 give the logits of KVRELAY_L2_PREFETCH=0 bit for bit.
(What the prefetching variants compile to is checked on the CPU: tests/cpu/test_l2.py.)
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _device():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs compute capability 9 (Hopper) or later")
    return torch.device("cuda", torch.cuda.current_device())


def _weight(dev, n=5120, k=2944, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    return (torch.randn(n, k, device=dev, generator=g) * 0.1).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("t", [1, 4, 64])
def test_add_rms_norm_with_prefetch_is_bit_equal(t, monkeypatch):
    from kvrelay.kernels import fused, l2

    dev = _device()
    monkeypatch.delenv("KVRELAY_L2_PREFETCH", raising=False)
    g = torch.Generator(device=dev).manual_seed(t)
    x = torch.randn(t, 2880, device=dev, generator=g).bfloat16()
    d = torch.randn(t, 4, 2880, device=dev, generator=g)
    w = torch.randn(2880, device=dev, generator=g).bfloat16()
    target = l2.Target.of(_weight(dev))
    assert target is not None and l2.launch_args(target, x, t)[0] == l2.PARTS
    plain = fused.add_rms_norm(x, d, w, 1e-5, quant_k=2944)
    for _ in range(3):
        pf = fused.add_rms_norm(x, d, w, 1e-5, quant_k=2944, prefetch=target)
        assert torch.equal(plain[0], pf[0])
        assert torch.equal(plain[1][0].view(torch.uint8), pf[1][0].view(torch.uint8))
        assert torch.equal(plain[1][1], pf[1][1])


@pytest.mark.parametrize("t", [1, 8])
def test_rotary_kv_write_with_prefetch_is_bit_equal(t, monkeypatch):
    from kvrelay.kernels import fused, l2

    dev = _device()
    monkeypatch.delenv("KVRELAY_L2_PREFETCH", raising=False)
    g = torch.Generator(device=dev).manual_seed(100 + t)
    n_q, n_kv, hd = 64, 8, 64
    qkv = torch.randn(t, (n_q + 2 * n_kv) * hd, device=dev, generator=g).bfloat16()
    cos = torch.randn(t, hd // 2, device=dev, generator=g).bfloat16()
    sin = torch.randn(t, hd // 2, device=dev, generator=g).bfloat16()
    pages = torch.randperm(32, device=dev)[:t].int()
    offs = torch.randint(0, 16, (t,), device=dev).int()
    target = l2.Target.of(_weight(dev, 2880, 4096, seed=1))
    outs = []
    for pf in (None, target):
        pool = torch.zeros(32, 2, 16, n_kv, hd, device=dev, dtype=torch.bfloat16)
        outs.append((fused.rotary_kv_write(qkv, cos, sin, n_q, n_kv, hd, pool, pages, offs, prefetch=pf), pool))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][1].abs().sum() > 0


def test_model_decode_steps_equal_with_and_without_prefetch(monkeypatch):
    from kvrelay.engine.config import PRESETS
    from kvrelay.engine.layers.linear import TensorDictWeights
    from kvrelay.engine.runner import Runner
    from kvrelay.engine.weights import canonical_shapes, open_weights
    from kvrelay.kernels import l2

    dev = _device()
    cfg = PRESETS["tiny"].replace(
        name="tiny-attn64", head_dim=64, num_attention_heads=64, num_key_value_heads=8, hidden_size=256,
        intermediate_size=256, sliding_window=128, num_hidden_layers=4, initial_context_length=4096,
        max_context=4096)
    dummy = open_weights(None, cfg, dummy=True, seed=5)
    w = TensorDictWeights({n: dummy.get(n, device="cpu") for n in canonical_shapes(cfg)})
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 150, 40)]
    feed = torch.randint(0, cfg.vocab_size, (10, 3), generator=g).tolist()
    steps = {}
    for flag in ("0", "1"):
        # read at each launch: it must hold while the graphs are captured (at the first decode)
        monkeypatch.setenv("KVRELAY_L2_PREFETCH", flag)
        assert l2.enabled(dev, 1) == (flag == "1")
        r = Runner(cfg, w, device=dev, quant="fp8-block128", page_size=16, kv_tokens=8192,
                   cuda_graph_batch_sizes=(1, 2, 4))
        assert r.model.blocks[0].attn.qkv.l2_target is not None and r.model.blocks[0].attn.out.l2_target is not None
        out = [r.prefill_batch([(i, p) for i, p in enumerate(prompts)])]
        for i, toks in enumerate(feed):
            ids = [0, 1, 2][: 3 - (i % 3)]
            out.append(r.decode(ids, toks[: len(ids)]))
        torch.cuda.synchronize()
        steps[flag] = [t.cpu() for t in out]
    for i, (off, on) in enumerate(zip(steps["0"], steps["1"])):
        assert torch.equal(off, on), f"step {i}: the prefetch changed the logits ({(off.float() - on.float()).abs().max()})"
