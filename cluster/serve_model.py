"""`kvrelay serve MODEL` (vLLM's `vllm serve MODEL`): a topology from a model alone, the shipped one-machine
topology that fits the model and the device with model.name set to it."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from kvrelay.cluster.topology import Topology, TopologyError, parse_topology, resolve_config_path

def is_model_ref(ref: str) -> bool:
    """A preset name or a checkpoint directory (what `kvrelay serve MODEL` takes instead of a YAML)."""
    from kvrelay.engine.config import PRESETS

    return ref in PRESETS or Path(os.path.expanduser(ref)).is_dir()


# GPUs with less memory than this get the 80 GB H100 topologies (MXFP4 experts: 120b's FP8 experts do not fit)
H100_CLASS_MAX_BYTES = 100 * 2**30


def shipped_template(num_experts: int, device: str, gpu_memory_bytes: int | None) -> str:
    """The shipped one-GPU topology for a model with `num_experts` experts on a GPU of that much memory."""
    if device == "cpu":
        return "cpu-tiny.yaml"
    size = "120b" if num_experts > 32 else "20b"
    gpu = "h100" if gpu_memory_bytes is not None and gpu_memory_bytes < H100_CLASS_MAX_BYTES else "h200"
    return f"{gpu}-1gpu-{size}.yaml"


def topology_for_model(ref: str, *, device: str, max_context: int | None = None,
                       gpu_memory_bytes: int | None = None) -> Topology:
    """vLLM's `vllm serve MODEL`: the shipped one-machine topology that fits the model and the device
    (cpu-tiny.yaml on CPU; on a GPU h200-1gpu-20b.yaml or, for 120b-sized models, h200-1gpu-120b.yaml, and the
    h100-1gpu-* files where the GPU has under 100 GiB: shipped_template), with model.name set to `ref`. A preset carries no weights: it is served with dummy weights only when
    asked (`--dummy`); `kvrelay serve` says so before starting anything."""
    from kvrelay.engine.config import load_model_config

    if device not in ("cpu", "cuda"):
        raise TopologyError(f"--device: {device!r} is neither cpu nor cuda")
    try:
        cfg = load_model_config(os.path.expanduser(ref))
    except Exception as e:  # the loader's message says what is wrong with the directory
        raise TopologyError(f"{ref}: {e}") from None
    template = shipped_template(cfg.num_experts, device, gpu_memory_bytes)
    path = resolve_config_path(template)
    raw = yaml.safe_load(path.read_text())
    raw["model"]["name"] = str(Path(os.path.expanduser(ref)).resolve()) if Path(os.path.expanduser(ref)).is_dir() else ref
    raw["model"]["dummy"] = False
    if max_context is not None:
        raw["model"]["max_context"] = max_context
        raw["prefill"]["max_prompt_tokens"] = min(raw["prefill"]["max_prompt_tokens"], max_context)
    return parse_topology(yaml.safe_dump(raw), source=f"{template} for {ref}", base_dir=path.parent)
