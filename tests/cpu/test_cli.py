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


def test_config_check_into_a_closed_pipe_exits_quietly() -> None:
    """`kvrelay config check FILE --json | head -1`: the reader is gone before the output is written.
    Quiet, with a SIGPIPE'd tool's status (141), as `cat` would; no BrokenPipeError traceback."""
    exe = shutil.which("kvrelay", path=str(Path(sys.executable).parent)) or "kvrelay"
    proc = subprocess.Popen([exe, "config", "check", "cpu-tiny.yaml", "--json"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before it writes: every write then meets a pipe with no reader
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_served_model_name_before_the_config() -> None:
    """`--served-model-name` takes words up to the next option (nargs="+", as vLLM's): a topology after
    the names is still the topology, in either order."""
    from kvrelay.cluster.cli import build_parser
    from kvrelay.cluster.serve import config_after_names

    parser = build_parser()
    for argv, names in ((["serve", "--served-model-name", "foo", "configs/cpu-tiny.yaml"], ["foo"]),
                        (["serve", "--served-model-name", "foo", "bar", "x.yaml"], ["foo", "bar"]),
                        (["serve", "configs/cpu-tiny.yaml", "--served-model-name", "foo"], ["foo"]),
                        (["serve", "--served-model-name", "foo", "--", "configs/cpu-tiny.yaml"], ["foo"])):
        args = parser.parse_args(argv)
        assert config_after_names(args) is None
        assert args.served_model_name == names and args.config.endswith(".yaml"), argv
    args = parser.parse_args(["serve", "--served-model-name", "foo", "bar"])  # names only: the default topology
    assert config_after_names(args) is None and args.config is None and args.served_model_name == ["foo", "bar"]
    r = kvrelay("serve", "--served-model-name", "configs/cpu-tiny.yaml")
    assert r.returncode == 1 and r.stderr.startswith("error: --served-model-name configs/cpu-tiny.yaml: a topology")
