"""What `kvrelay serve` checks before Ray or any worker starts (cluster/preflight.py), and `kvrelay config
check` runs the same checks: weights that cannot be served, a port in use, workers that do not fit the
memory of the machine. Each failure is one line naming the file and key, within seconds."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrelay.cluster.preflight import GIB, PreflightError, run_checks, with_dummy
from kvrelay.cluster.topology import load_topology, parse_topology

TINY = Path(__file__).resolve().parents[1] / "data" / "gpt-oss-tiny-original"
CONFIG = """
model: {name: MODEL, dummy: DUMMY, max_context: 2048}
prefill: {max_prompt_tokens: 1024}
decode: {max_batch: BATCH}
router: {host: 127.0.0.1, grpc_port: 0, http_port: PORT}
device: cpu
"""


def _yaml(tmp_path: Path, *, model: str = "gpt-oss-tiny", dummy: bool = True, batch: int = 8, port: int = 0) -> Path:
    cfg = tmp_path / "topology.yaml"
    cfg.write_text(CONFIG.replace("MODEL", model).replace("DUMMY", str(dummy).lower()).replace(
        "BATCH", str(batch)).replace("PORT", str(port)))
    return cfg


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvrelay.cluster.cli", *args], capture_output=True, text=True,
                         timeout=120)
    return out, time.monotonic() - t0


def _last_error(out: subprocess.CompletedProcess) -> str:
    return out.stderr.strip().splitlines()[-1]


def _both(cfg: Path) -> tuple[str, str]:
    """`serve` and `config check` on the same file: both refuse at once, with the same line."""
    served, took = _cli("serve", str(cfg))
    assert served.returncode == 1 and "kvrelay: starting" not in served.stdout and took < 30, served.stderr[-2000:]
    checked, _ = _cli("config", "check", str(cfg))
    assert checked.returncode == 1, checked.stdout
    return _last_error(served), _last_error(checked)


def test_a_checkpoint_directory_without_weights(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(TINY / "config.json", ckpt / "config.json")
    served, checked = _both(_yaml(tmp_path, model=str(ckpt), dummy=False))
    assert served == checked == (f"error: {tmp_path / 'topology.yaml'}: model.name: {ckpt}: no *.safetensors files "
                                 f"(nor in {ckpt / 'original'})")


def test_a_checkpoint_with_a_truncated_weights_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(TINY / "config.json", ckpt / "config.json")
    data = (TINY / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    served, checked = _both(_yaml(tmp_path, model=str(ckpt), dummy=False))
    assert served == checked and served.startswith(f"error: {tmp_path / 'topology.yaml'}: model.name: "), served
    assert "model.safetensors" in served


def test_a_port_in_use(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        served, checked = _both(_yaml(tmp_path, port=port))
    assert served == checked
    assert served.startswith(f"error: {tmp_path / 'topology.yaml'}: router.http_port: 127.0.0.1:{port} is already "
                             "in use (")


def test_workers_that_do_not_fit_this_machine(tmp_path):
    # tiny: 768 bytes of KV per position; 10^6 x 2048 positions is ~1.4 TiB.
    served, checked = _both(_yaml(tmp_path, batch=1_000_000))
    available = re.compile(r"has [0-9.]+ GiB available")  # moves between the two runs
    assert available.sub("", served) == available.sub("", checked)
    assert served.startswith(f"error: {tmp_path / 'topology.yaml'}: decode.max_batch: the workers need "), served
    assert "GiB available; lower decode.max_batch or model.max_context" in served


def test_config_check_lists_the_checks_it_ran(tmp_path):
    out, _ = _cli("config", "check", str(_yaml(tmp_path, model=str(TINY), dummy=False)))
    assert out.returncode == 0, out.stderr
    assert f"weights    {TINY} (original format): every tensor present with its shape and dtype" in out.stdout
    assert "ports      gRPC 127.0.0.1:any, HTTP 127.0.0.1:any: free" in out.stdout
    assert "GiB available" in out.stdout


def test_a_preset_needs_dummy_weights_in_config_check_too():
    out, _ = _cli("config", "check", "h200-1gpu-20b.yaml")
    assert out.returncode == 1 and "'gpt-oss-20b' is a preset, which has no weights on disk" in _last_error(out)
    out, _ = _cli("config", "check", "h200-1gpu-20b.yaml", "--dummy")
    assert out.returncode == 0, out.stderr
    assert "memory     not checked: no GPU visible here (nvidia-smi)" in out.stdout or "per GPU at most" in out.stdout


def test_gpu_memory_fit_is_checked_per_gpu():
    """The GPU rule from nvidia-smi's sizes (given here): weights / tp + one full-context sequence's KV
    must leave a tenth of a GPU free."""
    one = with_dummy(load_topology("h200-1gpu-120b.yaml"), True)
    assert "of 140.0 GiB" in run_checks(one, gpu_bytes=lambda: [140 * GIB])[2]
    with pytest.raises(PreflightError) as e:
        run_checks(one, gpu_bytes=lambda: [80 * GIB, 40 * GIB])
    assert str(e.value).startswith("h200-1gpu-120b.yaml: decode.tp: gpt-oss-120b (fp8-block128) needs ")
    assert "but a GPU here has 40.0 GiB (90% usable); raise decode.tp" in str(e.value)


def test_a_joined_cluster_is_not_measured_here():
    topo = parse_topology(CONFIG.replace("MODEL", "gpt-oss-tiny").replace("DUMMY", "true").replace(
        "BATCH", "1000000").replace("PORT", "0") + "ray: {address: 10.0.0.1:6379}\n", source="joined.yaml")
    assert run_checks(topo)[2] == "memory     not checked here: the workers run on the Ray cluster at ray.address"


@pytest.mark.parametrize("name", ["h200-1gpu-20b.yaml", "h200-1gpu-120b.yaml", "h200-2gpu-20b.yaml"])
def test_the_shipped_h200_topologies_fit_an_h200(name):
    """The rule must not refuse what runs: each shipped one-machine topology fits 141 GB per GPU."""
    topo = with_dummy(load_topology(name), True)
    line = run_checks(topo, gpu_bytes=lambda: [143_771 << 20] * 8)[2]  # nvidia-smi: 143771 MiB
    assert line.startswith("memory     ") and "per GPU at most" in line, line


@pytest.mark.parametrize("name", ["h100-1gpu-20b.yaml", "h100-1gpu-120b.yaml"])
def test_the_shipped_h100_topologies_fit_an_80gb_h100(name):
    """MXFP4 experts: 120b's weights (~61 GiB) fit an 80 GB H100 (nvidia-smi: 81559 MiB) with room for KV; its FP8
    topology does not."""
    topo = with_dummy(load_topology(name), True)
    line = run_checks(topo, gpu_bytes=lambda: [81_559 << 20])[2]
    assert line.startswith("memory     ") and "per GPU at most" in line, line
    if "120b" in name:
        with pytest.raises(PreflightError, match="gpt-oss-120b \\(fp8-block128\\) needs "):
            run_checks(with_dummy(load_topology("h200-1gpu-120b.yaml"), True), gpu_bytes=lambda: [81_559 << 20])


def test_serve_model_picks_the_topology_for_the_gpu():
    from kvrelay.cluster.serve_model import shipped_template, topology_for_model

    assert shipped_template(128, "cuda", 81_559 << 20) == "h100-1gpu-120b.yaml"
    assert shipped_template(32, "cuda", 81_559 << 20) == "h100-1gpu-20b.yaml"
    assert shipped_template(128, "cuda", 143_771 << 20) == "h200-1gpu-120b.yaml"
    assert shipped_template(32, "cuda", None) == "h200-1gpu-20b.yaml"
    assert shipped_template(128, "cpu", None) == "cpu-tiny.yaml"
    topo = topology_for_model("gpt-oss-120b", device="cuda", gpu_memory_bytes=81_559 << 20)
    assert topo.model.quant == "mxfp4" and topo.model.name == "gpt-oss-120b"
