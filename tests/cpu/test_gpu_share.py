"""Pools sharing a GPU (issue 43): prefill and decode as separate worker processes on one GPU, each within
its `gpu_memory_fraction` of the GPU's memory. The topology checks the shares, Ray gets them as fractional
GPUs, each worker is told its own, and the pre-start check refuses shares the GPU cannot hold (both
processes load the weights) with the numbers: in `kvrelay config check` and `kvrelay serve` alike."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvrelay.cluster.preflight import GIB, PreflightError, run_checks, with_dummy
from kvrelay.cluster.topology import TopologyError, load_topology, parse_topology

H100 = 81_559 << 20  # nvidia-smi --query-gpu=memory.total on an H100 80GB HBM3, MiB
H200 = 143_771 << 20

SPLIT = """
model: {name: MODEL, dummy: true, quant: QUANT, max_context: 131072}
prefill: {max_prompt_tokens: 131072, chunk_tokens: 8192, gpu_memory_fraction: FP}
decode: {max_batch: 256, gpu_memory_fraction: FD}
router: {grpc_port: 0, http_port: 0}
kv_transfer: {ucx_tls: "cuda_ipc,cuda_copy,tcp"}
device: cuda
gpus: 1
"""


def split(model="gpt-oss-20b", quant="mxfp4", fp=0.35, fd=0.6):
    text = SPLIT.replace("MODEL", model).replace("QUANT", quant).replace("FP", str(fp)).replace("FD", str(fd))
    return parse_topology(text, source="split.yaml")


@pytest.mark.parametrize("text, message", [
    ("prefill: {gpu_memory_fraction: 0.5}\n",
     "decode.gpu_memory_fraction: required with prefill.gpu_memory_fraction (the pools share a GPU only when "
     "each process's share is stated), or null both"),
    ("prefill: {gpu_memory_fraction: 0.6}\ndecode: {gpu_memory_fraction: 0.5}\n",
     "decode.gpu_memory_fraction: prefill's 0.6 + decode's 0.5 = 1.1 of one GPU's memory, more than all of it; "
     "lower them (their sum at most 1)"),
    ("prefill: {gpu_memory_fraction: 0}\ndecode: {gpu_memory_fraction: 0.5}\n",
     "prefill.gpu_memory_fraction: must be in (0, 1] (a share of one GPU's memory), got 0.0"),
    ("prefill: {gpu_memory_fraction: 0.33333}\ndecode: {gpu_memory_fraction: 0.5}\n",
     "prefill.gpu_memory_fraction: at most 4 decimals (Ray's fractional GPUs), got 0.33333"),
    ("prefill: {gpu_memory_fraction: 0.4}\ndecode: {gpu_memory_fraction: 0.5}\ncolocate: true\n",
     "prefill.gpu_memory_fraction: colocate: true runs one process per GPU holding both roles (its KV is "
     "decode.kv_memory_fraction); set colocate: false to run the pools as separate processes sharing the GPU, "
     "or null both fractions"),
    ("prefill: {gpu_memory_fraction: 0.4, tp: 2}\ndecode: {gpu_memory_fraction: 0.5}\ngpus: 2\n",
     "prefill.tp: pools sharing GPUs (gpu_memory_fraction) run at tp 1 (got 2); null the fractions to give the "
     "pools their own GPUs"),
    ("prefill: {gpu_memory_fraction: 0.4, workers: 2}\ndecode: {gpu_memory_fraction: 0.5}\ngpus: 2\n",
     "decode.workers: pools sharing GPUs put one prefill and one decode worker on each GPU: prefill.workers (2) "
     "and decode.workers (1) must be equal"),
    ("prefill: {gpu_memory_fraction: 0.4, workers: 2}\ndecode: {gpu_memory_fraction: 0.5, workers: 2}\n",
     "gpus: the pools ask for 2 GPUs (max of prefill 2x tp 1 = 2 and decode 2x tp 1 = 2) but the topology "
     "provides 1"),
])
def test_the_shares_are_validated_with_file_and_key(text, message):
    with pytest.raises(TopologyError) as e:
        parse_topology("model: {name: gpt-oss-20b}\ndevice: cuda\ngpus: 1\n" + text, source="t.yaml")
    assert str(e.value) == f"t.yaml: {message}"


@pytest.mark.parametrize("name", ["h100-1gpu-20b-split.yaml", "h200-1gpu-20b-split.yaml"])
def test_the_shipped_split_topologies_put_both_pools_on_one_gpu(name):
    from kvrelay.cluster.placement import bundles, gpu_share, roles
    from kvrelay.cluster.specs import worker_spec
    from kvrelay.cluster.topology import shipped_configs

    assert name in shipped_configs()  # `kvrelay config list`
    t = load_topology(name)
    assert t.shares_gpus and not t.colocate and (t.gpus, t.gpus_needed) == (1, 1)
    fp, fd = t.prefill.gpu_memory_fraction, t.decode.gpu_memory_fraction
    assert fp + fd <= 1 and roles(t) == ("prefill", "decode")
    assert t.model.quant == ("mxfp4" if name.startswith("h100") else "fp8-block128")
    # Ray: a fractional GPU per process, so both fit on the one GPU and never more than it in sum.
    assert bundles(t, "prefill") == [{"GPU": fp, "CPU": 1}] and bundles(t, "decode") == [{"GPU": fd, "CPU": 1}]
    assert (gpu_share(t, "prefill"), gpu_share(t, "decode")) == (fp, fd)
    # Each worker is told its own share (it sizes its KV pool within it, engine/memory.py).
    assert worker_spec(t, "prefill").gpu_memory_fraction == fp
    assert worker_spec(t, "decode").gpu_memory_fraction == fd
    gpu = H100 if name.startswith("h100") else H200
    line = run_checks(with_dummy(t, True), gpu_bytes=lambda: [gpu])[2]
    assert line.startswith(f"memory     shared GPU of {gpu / GIB:.1f} GiB: prefill "), line
    assert f"of its {fp:g}" in line and f"of its {fd:g}" in line


def test_whole_gpus_without_shares():
    """The other topologies are as before: a whole GPU per rank, no share in the specs."""
    from kvrelay.cluster.placement import bundles
    from kvrelay.cluster.specs import worker_spec

    t = load_topology("h200-2gpu-20b.yaml")
    assert not t.shares_gpus and t.gpus_needed == 2 and bundles(t, "decode") == [{"GPU": 1, "CPU": 1}]
    assert worker_spec(t, "prefill").gpu_memory_fraction is None
    assert worker_spec(t, "decode").gpu_memory_fraction is None
    assert worker_spec(load_topology("h200-1gpu-20b.yaml"), "colocated").decode.gpu_memory_fraction is None


def test_120b_split_on_one_gpu_is_refused_unless_its_weights_fit_twice():
    with pytest.raises(PreflightError) as e:
        run_checks(split("gpt-oss-120b", "fp8-block128", 0.45, 0.5), gpu_bytes=lambda: [H200])
    assert str(e.value) == (
        "split.yaml: model.name: gpt-oss-120b (fp8-block128) weights take 109.9 GiB, and the prefill and the "
        "decode process sharing a GPU each load them: 219.7 GiB, but a GPU here has 140.4 GiB (90% usable); set "
        "colocate: true (one process per GPU, weights once), a smaller model.quant, or give each pool its own "
        "GPUs (null prefill/decode.gpu_memory_fraction)")
    with pytest.raises(PreflightError, match=r"model.name: gpt-oss-120b \(mxfp4\) weights take 59.8 GiB, .*: "
                                             r"119.6 GiB, but a GPU here has 79.6 GiB"):
        run_checks(split("gpt-oss-120b", "mxfp4", 0.45, 0.5), gpu_bytes=lambda: [H100])
    # MXFP4 weights fit twice in an H200: then the shares decide.
    assert "shared GPU of 140.4 GiB" in run_checks(split("gpt-oss-120b", "mxfp4", 0.5, 0.5),
                                                   gpu_bytes=lambda: [H200])[2]


def test_a_share_too_small_for_its_process_names_the_key_and_the_numbers():
    with pytest.raises(PreflightError) as e:
        run_checks(split(fp=0.2, fd=0.75), gpu_bytes=lambda: [H100])
    msg = str(e.value)
    assert msg.startswith("split.yaml: prefill.gpu_memory_fraction: the prefill worker needs "), msg
    # Every part of the need, the share in GiB, and what both processes need together.
    for part in ("12.2 GiB weights + 3.0 GiB KV of one 131072-token sequence + ",
                 "activations of a 8192-token forward + 2.0 GiB CUDA graphs + 0.5 GiB CUDA context)",
                 "but 0.2 of a 79.6 GiB GPU is 15.9 GiB; both processes need ",
                 "raise prefill.gpu_memory_fraction (and lower decode.gpu_memory_fraction, 0.75)"):
        assert part in msg, msg
    # The decode side is checked the same way.
    with pytest.raises(PreflightError, match=r"^split.yaml: decode.gpu_memory_fraction: the decode worker needs "):
        run_checks(split(fp=0.75, fd=0.2), gpu_bytes=lambda: [H100])


def test_config_check_and_serve_refuse_it_from_nvidia_smi(tmp_path):
    """End to end: the GPU's size as nvidia-smi says (a stand-in on PATH), both commands exit 1 with the line."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f"#!/bin/sh\necho {H100 >> 20}\n")
    smi.chmod(0o755)
    cfg = tmp_path / "t.yaml"
    cfg.write_text(textwrap.dedent(SPLIT.replace("MODEL", "gpt-oss-120b").replace("QUANT", "mxfp4")
                                   .replace("FP", "0.45").replace("FD", "0.5")))
    env = {**os.environ, "PATH": f"{smi.parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    for args in (["config", "check", str(cfg)], ["serve", str(cfg)]):
        out = subprocess.run([sys.executable, "-m", "kvrelay.cluster.cli", *args], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 1, out.stdout + out.stderr[-2000:]
        last = out.stderr.strip().splitlines()[-1]
        assert "model.name: gpt-oss-120b (mxfp4) weights take 59.8 GiB" in last and "79.6 GiB" in last, last


def test_room_is_the_share_less_what_this_process_holds():
    from kvrelay.engine.memory import room_bytes

    total = 80 * GIB
    assert room_bytes(free=50 * GIB, total=total, held=10 * GIB, share=None) == 50 * GIB  # own GPU: what is free
    # Shared: the other process has not allocated yet (70 GiB free), still only our share less our weights.
    assert room_bytes(free=70 * GIB, total=total, held=10 * GIB, share=0.5) == 30 * GIB
    # ... and never more than is free (someone else on the GPU).
    assert room_bytes(free=20 * GIB, total=total, held=10 * GIB, share=0.5) == 20 * GIB
    assert room_bytes(free=70 * GIB, total=total, held=45 * GIB, share=0.5) == 0


def test_cpu_topology_takes_the_shares_as_a_no_op():
    """On CPU the keys are checked (so a file moves between devices) but nothing shares a GPU."""
    t = parse_topology("model: {name: tiny}\nprefill: {gpu_memory_fraction: 0.4}\n"
                       "decode: {gpu_memory_fraction: 0.5}\n", source="t.yaml")
    assert not t.shares_gpus and t.gpus_needed == 0
    assert dataclasses.replace(t, device="cuda", gpus=1).shares_gpus
