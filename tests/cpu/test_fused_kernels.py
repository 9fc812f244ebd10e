"""kernels/fused.py (Triton RMSNorm and q/k rotary) under TRITON_INTERPRET=1 on CPU tensors, against the
torch reference path the CPU model uses, on random inputs of odd sizes. The interpreter flag must be set
before triton is imported, so the checks run in a child interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import torch
    from kvrelay.engine.layers.norm import RMSNorm
    from kvrelay.engine.layers.linear import TensorDictWeights
    from kvrelay.kernels import fused
    from kvrelay.kernels.reference import apply_rotary, rotary_cos_sin, yarn_inv_freq

    g = torch.Generator().manual_seed(0)
    for t, h in [(1, 2880), (7, 100), (3, 64)]:
        x = (torch.randn(t, h, generator=g) * 3).to(torch.bfloat16)
        w = torch.rand(h, generator=g) + 0.5
        ref = RMSNorm(TensorDictWeights({"n": w.to(torch.bfloat16)}), "n", 1e-5, "cpu")
        want = ref(x).float()
        got = fused.rms_norm(x, ref.scale, 1e-5).float()
        assert got.dtype == want.dtype and got.shape == want.shape
        err = ((got - want).abs() / want.abs().clamp_min(1e-2)).max().item()
        assert err <= 2 ** -7, ("rmsnorm", t, h, err)  # at most one bf16 rounding step apart

    for t, nq, nkv, d in [(1, 64, 8, 64), (5, 6, 2, 32), (4, 3, 1, 16)]:
        qkv = torch.randn(t, (nq + 2 * nkv) * d, generator=g).to(torch.bfloat16)
        inv, conc = yarn_inv_freq(d, 150000.0, 32.0, 4096, beta_fast=32.0, beta_slow=1.0)
        pos = torch.randint(0, 5000, (t,), generator=g)
        cos, sin = rotary_cos_sin(pos, inv, conc, torch.bfloat16)
        q, k, _ = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        # float32 reference of the same rotation (the bf16 torch path rounds after each op)
        want_q = apply_rotary(q.float().view(t, nq, d), cos.float(), sin.float())
        want_k = apply_rotary(k.float().view(t, nkv, d), cos.float(), sin.float())
        got_q, got_k = fused.rotary_qk(qkv, cos, sin, nq, nkv, d)
        assert got_q.shape == (t, nq, d) and got_k.shape == (t, nkv, d) and got_q.dtype == torch.bfloat16
        for got, want in [(got_q, want_q), (got_k, want_k)]:
            assert torch.allclose(got.float(), want, rtol=2 ** -7, atol=1e-2), (t, nq, nkv, d)
        # and dropping the rotation (or swapping halves) would not pass
        assert not torch.allclose(got_q.float(), q.float().view(t, nq, d), rtol=2 ** -7, atol=1e-2) or t == 0
    print("ok")
""")


def test_fused_kernels_interpreted() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-3000:] + res.stderr[-3000:]
