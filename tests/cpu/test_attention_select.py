"""kernels/select.py's choice of the decode attention kernel per layer kind, and its env overrides."""

from __future__ import annotations

import pytest

from kvrelay.kernels import select


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("KVRELAY_DECODE_ATTENTION", "KVRELAY_DECODE_SLIDING"):
        monkeypatch.delenv(name, raising=False)


def _kinds(backend, batch=1):
    return (select.decode_attention_backend(backend, None, batch), select.decode_attention_backend(backend, 128, batch))


def test_default_is_the_table():
    # select.DECODE_DEFAULT is the one line to flip when the H200 numbers say so (FlashInfer for both
    # kinds as landed); without an override it alone decides, at every batch size.
    assert set(select.DECODE_DEFAULT) == {"full", "sliding"}
    assert set(select.DECODE_DEFAULT.values()) <= set(select.DECODE_KERNELS)
    for batch in (None, 1, 8, 64, 256):
        assert _kinds("flashinfer", batch) == (select.default_decode_kernel("full", batch),
                                               select.default_decode_kernel("sliding", batch))


def test_default_follows_the_measurement():
    # The H200 attndec measurement: Triton for sliding layers at every batch, for full layers up to 64
    # sequences; FlashInfer for full layers above that and when the batch is not known.
    assert [_kinds("flashinfer", b) for b in (1, 8, 64)] == [("triton", "triton")] * 3
    assert _kinds("flashinfer", 65) == ("flashinfer", "triton")
    assert _kinds("flashinfer", None) == ("flashinfer", "triton")


def test_other_backends_keep_their_kernel(monkeypatch):
    # Without FlashInfer there is nothing to choose: the override cannot send a layer to it.
    monkeypatch.setenv("KVRELAY_DECODE_ATTENTION", "flashinfer")
    monkeypatch.setenv("KVRELAY_DECODE_SLIDING", "flashinfer")
    assert _kinds("triton") == ("triton", "triton")
    assert _kinds("reference") == ("reference", "reference")


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("KVRELAY_DECODE_SLIDING", "flashinfer")
    assert _kinds("flashinfer") == ("triton", "flashinfer")  # full layers keep the default (Triton at b1)
    monkeypatch.setenv("KVRELAY_DECODE_SLIDING", "triton")
    assert _kinds("flashinfer", 256) == ("flashinfer", "triton")
    monkeypatch.setenv("KVRELAY_DECODE_ATTENTION", "triton")
    assert _kinds("flashinfer") == ("triton", "triton")
    monkeypatch.setenv("KVRELAY_DECODE_SLIDING", "flashinfer")  # the sliding override wins for sliding layers
    assert _kinds("flashinfer") == ("triton", "flashinfer")
    monkeypatch.delenv("KVRELAY_DECODE_SLIDING")
    monkeypatch.setenv("KVRELAY_DECODE_ATTENTION", "flashinfer")
    assert _kinds("flashinfer", 64) == ("flashinfer", "flashinfer")


def test_default_table_is_what_runs(monkeypatch):
    # The flip the lead makes from the measurement: the table alone decides, per kind.
    monkeypatch.setitem(select.DECODE_DEFAULT, "full", "flashinfer")
    monkeypatch.setitem(select.DECODE_DEFAULT, "sliding", "triton")
    assert _kinds("flashinfer") == ("flashinfer", "triton")
    monkeypatch.setenv("KVRELAY_DECODE_SLIDING", "flashinfer")
    assert _kinds("flashinfer") == ("flashinfer", "flashinfer")


@pytest.mark.parametrize("name", ["KVRELAY_DECODE_ATTENTION", "KVRELAY_DECODE_SLIDING"])
def test_bad_value_names_the_variable(monkeypatch, name):
    monkeypatch.setenv(name, "fa3")
    with pytest.raises(ValueError, match=f"{name}='fa3'.*flashinfer, triton"):
        _kinds("flashinfer")


def test_decode_fusions_default_off_and_the_variable_wins(monkeypatch):
    # kernels.select.DECODE_FUSIONS: each opt-in decode fusion off by default (not yet timed in the model on the
    # H200), its variable "1"/"0" turning it on/off whatever the default, and every named switch reading it
    from kvrelay.engine import runner
    from kvrelay.engine.layers import embedding, rotary
    from kvrelay.kernels import decode_rotary, moe_gemv, select

    named = {"KVRELAY_DECODE_MERGE_FUSE": decode_rotary.merge_fuse_enabled, "KVRELAY_MOE_NORM_FUSE": moe_gemv.norm_fuse,
             "KVRELAY_EMBED_FUSE": embedding.embed_fuse_enabled, "KVRELAY_ROTARY_GATHER": rotary.gather_in_attention,
             "KVRELAY_GRAPH_HEAD_LOGITS": runner.graph_head_logits, "KVRELAY_MOE_FUSED_GEMV": moe_gemv.fused_gemv}
    assert set(named) == set(select.DECODE_FUSIONS)
    for name, fn in named.items():
        monkeypatch.delenv(name, raising=False)
        assert fn() is select.DECODE_FUSIONS[name] is False
        monkeypatch.setenv(name, "1")
        assert fn() is True
        monkeypatch.setitem(select.DECODE_FUSIONS, name, True)
        monkeypatch.setenv(name, "0")
        assert fn() is False
        monkeypatch.delenv(name)
        assert fn() is True
