"""The batch-1 backend pin of Fp8BlockLinear (kernels/fp8_gemm.py: M1_PINNED, KVRELAY_FP8_M1): launch labels
parse back to their launch, a gemv-<label> backend outside GEMV_TILES is accepted, and bad pins are refused by
name. The pick itself (checked against cuBLAS, never timed) needs a GPU: tests/gpu/test_fp8_gemm.py."""

from __future__ import annotations

import pytest
import torch

from kvrelay.bench.sweep_gemv_dense import EXTRA
from kvrelay.kernels.fp8 import quantize_weight_block128
from kvrelay.kernels.fp8_gemm import Fp8BlockLinear
from kvrelay.kernels.fp8_gemv import Fp8GemvLaunch


def _lin(n: int, k: int, backend: str = "auto") -> Fp8BlockLinear:
    wq, ws = quantize_weight_block128(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02)
    return Fp8BlockLinear(wq, ws, None, backend=backend)


def test_launch_labels_parse_back():
    for launch in (*Fp8BlockLinear.GEMV_TILES.values(), *EXTRA):
        assert Fp8GemvLaunch.parse(launch.label()) == launch
    for bad in ("n16-k512-s8-w2", "n16-k512-s8-w2-st2-late", "gemv-n16-k512-s8-w2-st2", ""):
        with pytest.raises(ValueError, match="not an FP8 GEMV launch label"):
            Fp8GemvLaunch.parse(bad)


def test_backend_names():
    lin = _lin(96, 300, backend="gemv-n16-k256-s2-w2-st2")  # not one of GEMV_TILES
    assert lin._gemv_launch(lin.backend) == Fp8GemvLaunch(16, 256, 2, 2, 2)
    name = next(iter(Fp8BlockLinear.GEMV_TILES))
    assert lin._gemv_launch(name) is Fp8BlockLinear.GEMV_TILES[name]
    with pytest.raises(ValueError, match="not an FP8 GEMV launch label"):
        _lin(96, 300, backend="gemv-n16")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        _lin(96, 300, backend="nope")


def test_m1_pin_from_env_and_table(monkeypatch):
    lin, other = _lin(96, 300), _lin(128, 256)
    monkeypatch.delenv("KVRELAY_FP8_M1", raising=False)
    assert lin._m1_pin() is None and other._m1_pin() is None
    monkeypatch.setattr(Fp8BlockLinear, "M1_PINNED", {(96, 300): "gemv-n16-k256-s2-w2-st2"})
    assert lin._m1_pin() == "gemv-n16-k256-s2-w2-st2" and other._m1_pin() is None
    # the environment overrides the table per shape; "auto" switches the pin off
    monkeypatch.setenv("KVRELAY_FP8_M1", " 96x300=cublas , 128x256=gemv-n8-k128-s4-w1-st2")
    assert lin._m1_pin() == "cublas" and other._m1_pin() == "gemv-n8-k128-s4-w1-st2"
    monkeypatch.setenv("KVRELAY_FP8_M1", "96x300=auto")
    assert lin._m1_pin() is None
    for bad, match in (("96-300=cublas", "is not NxK=backend"), ("96x300", "is not NxK=backend"),
                       ("96x300=fast", "unknown backend 'fast'"), ("96x300=gemv-n3", "not an FP8 GEMV launch")):
        monkeypatch.setenv("KVRELAY_FP8_M1", bad)
        with pytest.raises(ValueError, match=match):
            lin._m1_pin()


@pytest.mark.parametrize("pin_out,want", [("same", "pin"), ("zeros", "cublas"), ("raise", "cublas")])
def test_pick_keeps_a_pin_that_agrees_with_cublas(pin_out, want, monkeypatch, caplog):
    """_pick's batch-1 pin, with the kernels replaced by stand-ins (the real ones: tests/gpu/test_fp8_gemm.py):
    the pin and cuBLAS run once each, nothing is timed, and the pin is kept only if it ran and agreed; M=2 is
    timed as before and the fastest backend kept."""
    import triton.testing

    from kvrelay.kernels import fp8_gemm

    pin = "gemv-n16-k256-s2-w2-st2"
    monkeypatch.setenv("KVRELAY_FP8_M1", f"96x300={pin}")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(fp8_gemm, "quantize_act_1x128", lambda x, kp: (torch.zeros(x.shape[0], kp), None))
    timed = []
    speed = {"cublas": 3.0, "triton": 1.0}
    ran = []  # every backend _run ran, in order; do_bench's stand-in times the one its fn runs
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), timed.append(ran[-1]),
                                                                       speed.get(ran[-1], 2.0))[2])
    lin = _lin(96, 300)
    dev_probe = torch.zeros(1)  # _pick reads only its device
    ref = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))

    def run(name, xq, sx, m=None):
        ran.append(name)
        if name == pin and pin_out == "raise":
            raise RuntimeError("no launch")
        return torch.zeros_like(ref) if name == pin and pin_out == "zeros" else ref

    lin._run = run
    with caplog.at_level("WARNING", logger="kvrelay.kernels.fp8_gemm"):
        assert lin._pick(1, dev_probe, None) == (pin if want == "pin" else "cublas")
    assert ran == ["cublas", pin] and not timed, (ran, timed)
    assert ("disagrees" in caplog.text) == (pin_out == "zeros") and ("failed" in caplog.text) == (pin_out == "raise")
    picked = lin._pick(2, dev_probe, None)
    assert picked == "triton" and "cublas" in timed and pin not in timed, (picked, timed)
