"""The `kvrelay` console command: exit codes and output of `config check`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def kvrelay(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kvrelay", path=str(Path(sys.executable).parent)) or "kvrelay"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ})


def test_config_check_ok() -> None:
    r = kvrelay("config", "check", "configs/h200-8gpu-120b.yaml", "--dummy")
    assert r.returncode == 0, r.stderr
    assert "decode     1 worker(s) x EP4 TP4" in r.stdout
    assert "GPUs       8 needed of 8 provided" in r.stdout


def test_config_check_shipped_name_and_json() -> None:
    r = kvrelay("config", "check", "cpu-tiny.yaml", "--json")
    assert r.returncode == 0, r.stderr
    assert '"gpus_needed": 0' in r.stdout and '"device": "cpu"' in r.stdout


def test_config_check_invalid_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: gpt-oss-20b}\nprefill: {tp: 3}\n")
    r = kvrelay("config", "check", str(bad))
    assert r.returncode == 1
    assert r.stderr.strip() == (f"error: {bad}: prefill.tp: gpt-oss-20b cannot be sharded over 3 ranks: attention: "
                                "num_attention_heads=64 is not divisible by 3 ranks; experts: num_experts=32 is "
                                "not divisible by 3 ranks (EP3 needs a whole number of experts per rank) (use one "
                                "of 1, 2, 4, 8, 16, 32)")
    assert r.stdout == ""


def test_config_check_missing_file_exits_1() -> None:
    r = kvrelay("config", "check", "nope.yaml")
    assert r.returncode == 1 and "nope.yaml: no such file (shipped configs: cpu-tiny.yaml" in r.stderr


def test_usage_errors_exit_2() -> None:
    assert kvrelay().returncode == 2
    assert kvrelay("frobnicate").returncode == 2
    assert kvrelay("config").returncode == 2


def test_help_lists_commands() -> None:
    r = kvrelay("--help")
    assert r.returncode == 0 and "config" in r.stdout
