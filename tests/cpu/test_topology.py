"""Topology YAML: every shipped config is valid, every validation rule fails with its exact message."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from kvrelay.cluster.topology import (
    Topology,
    TopologyError,
    load_topology,
    parse_topology,
    shipped_configs,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "data" / "gpt-oss-tiny-original"

BASE = """
model: {name: gpt-oss-20b, quant: fp8-block128, max_context: 8192}
prefill: {workers: 1, tp: 1, max_prompt_tokens: 8192}
decode: {workers: 1, ep: 1, tp: 1}
device: cuda
gpus: 2
"""


def write(tmp_path: Path, text: str, name: str = "topo.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def expect_error(tmp_path: Path, text: str, message: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(TopologyError) as info:
        load_topology(p)
    assert str(info.value) == f"{p}: {message}"


def test_shipped_configs_are_valid() -> None:
    names = shipped_configs()
    assert {"cpu-tiny.yaml", "h200-1gpu-20b.yaml", "h200-1gpu-120b.yaml", "h200-8gpu-120b.yaml"} <= set(names)
    for name in names:
        t = load_topology(REPO / "configs" / name)
        assert isinstance(t, Topology)
    eight = load_topology(REPO / "configs" / "h200-8gpu-120b.yaml")
    assert (eight.prefill.tp, eight.decode.ep, eight.decode.tp, eight.gpus_needed) == (4, 4, 4, 8)
    one = load_topology(REPO / "configs" / "h200-1gpu-120b.yaml")
    assert one.colocate and one.gpus_needed == 1


def test_default_is_cpu_tiny() -> None:
    t = load_topology(None)
    assert t.device == "cpu" and t.gpus_needed == 0 and t.model.dummy
    assert t.router.host == "127.0.0.1"


def test_frozen_and_typed(tmp_path: Path) -> None:
    t = load_topology(write(tmp_path, BASE))
    assert t.decode.cuda_graph_batch_sizes == (1, 2, 4, 8, 16, 32, 64, 128)
    assert isinstance(t.kv_transfer.lease_seconds, float)
    with pytest.raises(AttributeError):
        t.device = "cpu"  # type: ignore[misc]


def test_checkpoint_path_relative_to_file(tmp_path: Path) -> None:
    (tmp_path / "ckpt").symlink_to(FIXTURE)
    t = load_topology(write(tmp_path, "model: {name: ckpt}\ndevice: cpu\n"))
    assert Path(t.model.name) == tmp_path / "ckpt"


@pytest.mark.parametrize(
    "text, message",
    [
        ("model: {name: gpt-oss-20b}\ndecode: {max_bach: 4}\n",
         "decode.max_bach: unknown key (did you mean 'max_batch'?)"),
        ("model: {name: gpt-oss-20b}\nprefil: {tp: 1}\n",
         "prefil: unknown key (did you mean 'prefill'?)"),
        ("model: {name: gpt-oss-20b}\nrouter: {zzz: 1}\n",
         "router.zzz: unknown key (valid keys: host, grpc_port, http_port, policy, max_waiting_requests, api_keys_env, "
         "tls_cert_file, tls_key_file, rate_limit_rpm, rate_limit_burst, resume_timeout_s, worker_timeout_s, "
         "worker_step_timeout_s)"),
        ("model: {name: gpt-oss-20b}\ndecode: {max_batch: many}\n",
         "decode.max_batch: expected an integer, got str 'many'"),
        ("model: {name: gpt-oss-20b}\ndecode: {max_batch: true}\n",
         "decode.max_batch: expected an integer, got bool True"),
        ("model: {name: gpt-oss-20b, dummy: 'yes'}\n",
         "model.dummy: expected a boolean, got str 'yes'"),
        ("model: {name: gpt-oss-20b, quant: int4}\n",
         "model.quant: 'int4' is not one of 'fp8-block128', 'bf16', 'fp8-block128-lmhead', 'mxfp4', 'mxfp4-bf16'"),
        ("model: {name: gpt-oss-20b}\ndecode: {cuda_graph_batch_sizes: [1, two]}\n",
         "decode.cuda_graph_batch_sizes[1]: expected an integer, got str 'two'"),
        ("model: {name: gpt-oss-20b}\ndecode: {cuda_graph_batch_sizes: [4, 2]}\n",
         "decode.cuda_graph_batch_sizes: must be strictly increasing"),
        ("model: {name: gpt-oss-20b}\ndecode: 3\n",
         "decode: expected a mapping, got int 3"),
        ("prefill: {tp: 1}\n", "model: required key is missing"),
        ("model: {dummy: true}\n", "model.name: required key is missing"),
        ("model: {name: gpt-oss-20b}\nprefill: {tp: 3}\n",
         "prefill.tp: gpt-oss-20b cannot be sharded over 3 ranks: attention: num_attention_heads=64 is not "
         "divisible by 3 ranks; experts: num_experts=32 is not divisible by 3 ranks (EP3 needs a whole number "
         "of experts per rank) (use one of 1, 2, 4, 8, 16, 32)"),
        ("model: {name: gpt-oss-20b}\ndecode: {tp: 64, ep: 64}\n",
         "decode.tp: gpt-oss-20b cannot be sharded over 64 ranks: experts: num_experts=32 is not divisible by "
         "64 ranks (EP64 needs a whole number of experts per rank) (use one of 1, 2, 4, 8, 16, 32)"),
        ("model: {name: tiny}\ndecode: {tp: 3, ep: 1}\n",
         "decode.tp: tiny cannot be sharded over 3 ranks: attention: num_attention_heads=8 is not divisible by "
         "3 ranks (use one of 1, 2, 4, 8)"),
        ("model: {name: gpt-oss-20b}\ndecode: {tp: 1, ep: 3}\n",
         "decode.ep: 3 does not divide the model's 32 experts"),
        ("model: {name: gpt-oss-20b}\ndecode: {tp: 4, ep: 2}\n",
         "decode.ep: 2 must be 1 or equal decode.tp (4): EPn TPn partitions experts over the same n ranks "
         "as the attention heads"),
        ("model: {name: gpt-oss-120b}\nprefill: {tp: 4}\ndecode: {tp: 4, ep: 4}\ndevice: cuda\ngpus: 4\n",
         "gpus: the pools ask for 8 GPUs (sum of prefill 1x tp 4 = 4 and decode 1x tp 4 = 4) but the "
         "topology provides 4"),
        ("model: {name: gpt-oss-20b}\nprefill: {workers: 3}\ndecode: {workers: 3}\ndevice: cuda\ngpus: 2\n"
         "colocate: true\n",
         "gpus: the pools ask for 3 GPUs (max of prefill 3x tp 1 = 3 and decode 3x tp 1 = 3) but the "
         "topology provides 2"),
        ("model: {name: gpt-oss-20b}\ndevice: cpu\ngpus: 1\n",
         "gpus: device is cpu but gpus is 1 (use 0 or device: cuda)"),
        ("model: {name: gpt-oss-20b}\ndevice: tpu\n",
         "device: 'tpu' is not one of 'cpu', 'cuda'"),
        ("model: {name: no-such-model}\n",
         "model.name: 'no-such-model' is neither a preset (gpt-oss-120b, gpt-oss-20b, gpt-oss-tiny, tiny, "
         "tiny-attn64) nor an existing checkpoint directory"),
        ("model: {name: gpt-oss-20b, max_context: 0}\n", "model.max_context: must be > 0, got 0"),
        ("model: {name: gpt-oss-20b, max_context: 1024}\nprefill: {max_prompt_tokens: 2048}\n",
         "prefill.max_prompt_tokens: 2048 exceeds model.max_context 1024"),
        ("model: {name: gpt-oss-20b}\ndecode: {kv_memory_fraction: 1.5}\n",
         "decode.kv_memory_fraction: must be in (0, 0.95], got 1.5"),
        ("model: {name: gpt-oss-20b}\nrouter: {grpc_port: 70000}\n",
         "router.grpc_port: 70000 is not a TCP port (0-65535; 0 picks a free one)"),
        ("model: {name: gpt-oss-20b}\nrouter: {grpc_port: 9000, http_port: 9000}\n",
         "router.http_port: 9000 is also router.grpc_port"),
        ("model: {name: gpt-oss-20b}\nkv_transfer: {backend: nixl}\n",
         "kv_transfer.backend: this key was removed: the handoff is always NIXL between processes and in "
         "place between the colocated roles of one worker; delete the line"),
        ("model: {name: gpt-oss-20b}\nprefill: {chunk_tokens: 0}\n", "prefill.chunk_tokens: must be > 0, got 0"),
        ("model: {name: gpt-oss-20b}\ncolocate: true\nprefill: {workers: 2}\n",
         "colocate: prefill.workers (2) and decode.workers (1) must be equal: each colocated worker serves "
         "both roles"),
        ("model: {name: gpt-oss-20b}\ncolocate: true\ndevice: cuda\ngpus: 2\nprefill: {tp: 2}\n",
         "prefill.tp: colocated workers run at tp 1 (got 2); set colocate: false to give the pools their "
         "own GPUs"),
        ("model: {name: gpt-oss-20b}\nkv_transfer: {lease_seconds: -1}\n",
         "kv_transfer.lease_seconds: must be > 0, got -1.0"),
        ("model: {name: gpt-oss-20b}\nray: {address: 5}\n",
         "ray.address: expected a string or null, got int 5"),
        ("model: [1, 2\n", None),
    ],
)
def test_validation_messages(tmp_path: Path, text: str, message: str | None) -> None:
    if message is None:  # YAML syntax errors carry the parser's own position text
        p = write(tmp_path, text)
        with pytest.raises(TopologyError, match=rf"^{p}: not valid YAML: "):
            load_topology(p)
        return
    expect_error(tmp_path, text, message)


def test_bad_checkpoint_dir(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    p = write(tmp_path, "model: {name: empty}\n")
    with pytest.raises(TopologyError, match=r"model.name: cannot read the model config in .*empty: no config.json"):
        load_topology(p)


def test_parse_from_text_names_source() -> None:
    with pytest.raises(TopologyError, match=r"^inline.yaml: decode.tp: gpt-oss-120b cannot be sharded over 5 ranks"):
        parse_topology("model: {name: gpt-oss-120b}\ndecode: {tp: 5}\n", source="inline.yaml")
    t = parse_topology(BASE, source="inline.yaml")
    d = json.loads(json.dumps(t.to_dict()))
    assert d["model"]["name"] == "gpt-oss-20b" and d["gpus"] == 2


def test_config_check_fits_the_nodes_of_a_ray_up_file(tmp_path, capsys):
    from kvrelay.cluster.cli import main

    shipped = str(REPO / "configs" / "cluster.yaml")
    assert main(["config", "check", "h200-8gpu-120b.yaml", "--dummy", "--cluster", shipped]) == 0
    assert "cluster " + shipped + ": 1 node(s) x 8 GPUs: 8 needed, fits" in capsys.readouterr().out
    assert main(["config", "check", "h200-8gpu-120b.yaml", "--dummy", "--cluster", shipped, "--gpus-per-node", "4"]) == 1
    assert capsys.readouterr().err.strip().endswith(
        f"gpus: the topology needs 8 GPUs but {shipped} lists 1 node(s) x 4 GPUs = 4 (provider.head_ip + "
        "provider.worker_ips)")
    two = tmp_path / "two.yaml"
    two.write_text("provider: {type: local, head_ip: 10.0.0.1, worker_ips: [10.0.0.2]}\n")
    assert main(["config", "check", "h200-8gpu-120b.yaml", "--dummy", "--cluster", str(two), "--gpus-per-node", "4"]) == 0
    aws = tmp_path / "aws.yaml"
    aws.write_text("provider: {type: aws}\n")
    assert main(["config", "check", "h200-8gpu-120b.yaml", "--dummy", "--cluster", str(aws)]) == 1
    assert "provider.type: only the local provider lists its nodes" in capsys.readouterr().err


def test_each_role_is_told_only_its_own_settings():
    """cluster/specs.py cuts the topology into frozen per-role specs; the workers never see a Topology."""
    import dataclasses

    from kvrelay.cluster.specs import worker_spec
    from kvrelay.workers.specs import ColocatedSpec, DecodeSpec, PrefillSpec

    t = parse_topology("model: {name: tiny, max_context: 512}\nprefill: {max_prompt_tokens: 256, chunk_tokens: 64}\n"
                       "decode: {page_size: 8, max_batch: 4, cuda_graph_batch_sizes: [1, 2]}\n"
                       "kv_transfer: {ucx_tls: 'tcp,self', lease_seconds: 7}\n", source="t.yaml")
    p, d = worker_spec(t, "prefill"), worker_spec(t, "decode")
    assert isinstance(p, PrefillSpec) and isinstance(d, DecodeSpec)
    assert (p.page_size, p.max_prompt_tokens, p.chunk_tokens, p.lease_seconds, p.pool_tokens) == (8, 256, 64, 7.0, 1024)
    assert (d.max_batch, d.graph_sizes, d.need_tokens, d.model.max_context) == (4, (1, 2), 257, 512)
    assert p.ucx == d.ucx and p.ucx.env() == {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}  # CPU: loopback
    c = worker_spec(dataclasses.replace(t, colocate=True), "colocated")
    assert isinstance(c, ColocatedSpec) and c.decode == d and c.chunk_tokens == 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.tp = 2  # type: ignore[misc]
    # Nothing of a spec is a topology section: a worker could not reach the rest of the file through it.
    parts = [getattr(spec, f.name) for spec in (p, d, c) for f in dataclasses.fields(spec)]
    assert not [x for x in parts if type(x).__module__.startswith("kvrelay.cluster")]


def test_the_topology_accepts_every_split_the_engine_runs():
    """The topology once refused any tp that did not divide the KV heads ("decode.tp: 16 does not divide 64
    query heads and 8 KV heads"), while the engine (parallel.head_range, the KV cache, the handoff plan)
    replicates a KV head over the ranks of its GQA group when ranks outnumber KV heads: TP4 over the tiny
    model's 2 KV heads ran in tests/cpu/test_kv_transfer_tp.py but could not be configured. Both now ask
    engine/partition.py, so a split is accepted exactly when every rank gets its heads (and experts)."""
    from kvrelay.engine.config import PRESETS
    from kvrelay.engine.partition import ParallelConfigError, check_partition, head_range

    t = parse_topology("model: {name: tiny}\nprefill: {tp: 4}\ndecode: {tp: 4, ep: 4}\n", source="t.yaml")
    assert (t.prefill.tp, t.decode.tp) == (4, 4)
    # What the engine does with it: 2 query heads per rank, each pair of ranks holding one KV head.
    assert [(h.kv0, h.kv1) for h in (head_range(8, 2, r, 4) for r in range(4))] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    for name in ("tiny", "gpt-oss-20b"):
        cfg = PRESETS[name]
        for tp in range(1, 2 * cfg.num_attention_heads + 1):
            for ep in sorted({1, tp}):
                try:
                    check_partition(cfg, tp, expert_parallel=ep == tp)
                    engine_runs = True
                except ParallelConfigError:
                    engine_runs = False
                try:
                    parse_topology(f"model: {{name: {name}}}\ndecode: {{tp: {tp}, ep: {ep}}}\n", source="t.yaml")
                    accepted = True
                except TopologyError as e:
                    assert "decode.tp" in str(e) or "decode.ep" in str(e), e
                    accepted = False
                assert accepted == engine_runs, (name, tp, ep)


def test_worker_timeout_must_be_positive():
    with pytest.raises(TopologyError, match=r"router.worker_timeout_s: must be > 0, got 0"):
        parse_topology("model: {name: gpt-oss-20b}\nrouter: {worker_timeout_s: 0}\n", source="t")
    assert parse_topology("model: {name: gpt-oss-20b}\n", source="t").router.worker_timeout_s == 30.0


def test_worker_step_timeout_must_be_positive():
    with pytest.raises(TopologyError, match=r"router.worker_step_timeout_s: must be > 0, got -1"):
        parse_topology("model: {name: gpt-oss-20b}\nrouter: {worker_step_timeout_s: -1}\n", source="t")
    with pytest.raises(TopologyError, match=r"router.worker_step_timeout_s: expected a number"):
        parse_topology("model: {name: gpt-oss-20b}\nrouter: {worker_step_timeout_s: soon}\n", source="t")
    assert parse_topology("model: {name: gpt-oss-20b}\n", source="t").router.worker_step_timeout_s == 120.0
