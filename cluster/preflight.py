"""What `kvrelay serve` checks before Ray or any worker starts, and `kvrelay config check` runs too.

Each check fails with one line naming the topology file and key (`PreflightError`), found in a second
instead of after Ray and every worker started (tens of seconds to minutes) as an actor traceback:

- weights: a preset has no weights on disk (needs `model.dummy`); a checkpoint directory is opened the
  way the workers open it (format detected, every tensor's name, shape and dtype checked from the
  safetensors headers; nothing is loaded);
- ports: the router's ports are free on `router.host`;
- memory: the workers' weights and KV pools fit the memory of this machine (CPU: the RAM available; GPU:
  each GPU's memory, as nvidia-smi reports it), when the cluster is a local one (no `ray.address`);
- host tier: the prefix cache's host tiers (`prefill.prefix_cache_host_gib` per caching worker) fit
  the RAM available, with the CPU workers' own needs on a CPU cluster;
- vocabulary: the o200k vocabulary harmony's tokenizer needs (engine/vocab.py: shipped with kvrelay, or
  $TIKTOKEN_ENCODINGS_BASE) is there, is o200k_base, and openai-harmony loads it; without it a server
  would say it is ready and then answer every chat, completion and /tokenize with a 500. Not a key of the
  topology, so its line names the variable or the install instead of the file.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
from typing import Callable

GIB = 1 << 30
# GPU: the share of a GPU's memory that weights plus one full-context sequence may take; the rest is for
# activations, CUDA graphs and the allocator (the workers size their pool from what is measured free).
GPU_USABLE = 0.9


class PreflightError(ValueError):
    """A check failed; the message is `FILE: key: problem` on one line."""


def run_checks(topo, *, memory_bytes: Callable[[], int | None] | None = None,
               gpu_bytes: Callable[[], list[int] | None] | None = None) -> list[str]:
    """Every check in turn; raises PreflightError at the first failure, else returns one line per check.
    `memory_bytes` / `gpu_bytes` read this machine (overridable for tests)."""
    where = topo.source
    try:
        lines = [check_weights(topo), check_ports(topo),
                 check_memory(topo, memory_bytes or available_memory, gpu_bytes or gpu_memory),
                 check_host_tier(topo, memory_bytes or available_memory)]
    except PreflightError as e:
        raise PreflightError(f"{where}: {e}") from None
    return lines + [check_vocabulary()]  # last, so the topology's checks keep their places in the list


def check_vocabulary() -> str:
    """The vocabulary as the router will load it (the same cached encoding: loading it here costs the
    serve process nothing later, ~0.4 s for `kvrelay config check`)."""
    from kvrelay.engine import vocab
    from kvrelay.router import harmony

    try:
        vocab.vocab_file()  # first: the encoding below is cached once loaded, the file is checked every time
        harmony.load_encoding()
    except vocab.VocabularyError as e:
        raise PreflightError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - openai-harmony's HarmonyError on a file whose hash was right
        raise PreflightError(f"openai-harmony cannot load {vocab.vocab_dir() / vocab.VOCAB_FILE}: "
                             f"{' '.join(str(e).split())}") from None
    where = f"{vocab.ENV}={vocab.override()}" if vocab.override() else "shipped with kvrelay"
    return f"vocabulary {vocab.VOCAB_FILE} ({where}): sha256 as tiktoken publishes it, harmony loads it"


def check_weights(topo) -> str:
    from kvrelay.engine.config import PRESETS

    m = topo.model
    if m.dummy:
        return f"weights    random (model.dummy), shape of {m.name}"
    if m.name in PRESETS:
        raise PreflightError(f"model.name: {m.name!r} is a preset, which has no weights on disk: point model.name "
                             "at a checkpoint directory, or pass --dummy (model.dummy: true) for random weights "
                             "of its shape")
    from kvrelay.engine.config import load_model_config
    from kvrelay.engine.weights import WeightError, detect_format, open_weights

    try:
        fmt = detect_format(m.name)
        open_weights(m.name, load_model_config(m.name))
    except (WeightError, OSError, ValueError) as e:
        raise PreflightError(f"model.name: {' '.join(str(e).split())}") from None
    return f"weights    {m.name} ({fmt.kind} format): every tensor present with its shape and dtype"


def check_ports(topo) -> str:
    r = topo.router
    for key, port in (("router.grpc_port", r.grpc_port), ("router.http_port", r.http_port)):
        if port == 0:
            continue
        with socket.socket(socket.AF_INET6 if ":" in r.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((r.host, port))
            except OSError as e:
                raise PreflightError(f"{key}: {r.host}:{port} is already in use ({e.strerror}); pick another or 0") \
                    from None
    return f"ports      gRPC {r.host}:{r.grpc_port or 'any'}, HTTP {r.host}:{r.http_port or 'any'}: free"


def _worker_needs(topo, cfg) -> list[tuple[str, int, int]]:
    """(pool, processes, bytes each) of the workers this topology starts: weights plus the KV pool a CPU
    worker allocates (a GPU worker's pool is sized from measured free memory, so only one full-context
    sequence of it is counted there)."""
    from kvrelay.engine.partition import head_range

    def per_token(tp: int) -> int:
        kv = head_range(cfg.num_attention_heads, cfg.num_key_value_heads, 0, tp).num_kv
        return 2 * kv * cfg.head_dim * 2 * cfg.num_hidden_layers

    weights = cfg.weight_bytes(topo.model.quant)
    ctx = min(topo.model.max_context, cfg.max_context)
    out = []
    pools = [("decode", topo.decode)] if topo.colocate else [("prefill", topo.prefill), ("decode", topo.decode)]
    for name, pool in pools:
        tp = pool.tp
        if topo.device == "cpu":  # the pool holds this many positions in every layer group
            tokens = 4 * topo.prefill.max_prompt_tokens if name == "prefill" else topo.decode.max_batch * ctx
            kv = tokens * per_token(tp)
        else:  # one full-context sequence: full layers hold all of it, sliding ones their window
            layers = cfg.num_hidden_layers
            held = len(cfg.full_layers) * ctx + len(cfg.sliding_layers) * min(ctx, cfg.sliding_window + 1)
            kv = per_token(tp) * held // layers
        out.append((name, pool.workers * tp, weights // tp + kv))
    return out


def check_memory(topo, memory_bytes: Callable[[], int | None], gpu_bytes: Callable[[], list[int] | None]) -> str:
    from kvrelay.engine.config import load_model_config

    if topo.ray.address is not None:
        return "memory     not checked here: the workers run on the Ray cluster at ray.address"
    cfg = load_model_config(topo.model.name)
    needs = _worker_needs(topo, cfg)
    if topo.device == "cpu":
        have = memory_bytes()
        total = sum(n * each for _, n, each in needs)
        if have is None:
            return f"memory     {total / GIB:.2f} GiB needed; not checked (no /proc/meminfo)"
        if total > have:
            parts = " + ".join(f"{n} {name} x {each / GIB:.2f} GiB" for name, n, each in needs)
            weights = sum(n * cfg.weight_bytes(topo.model.quant) // getattr(topo, name).tp for name, n, _ in needs)
            key = "model.name" if 2 * weights > total else "decode.max_batch"  # the bigger share
            raise PreflightError(
                f"{key}: the workers need {total / GIB:.2f} GiB ({parts}: weights and KV pools of "
                f"decode.max_batch x model.max_context and 4 x prefill.max_prompt_tokens positions) but this "
                f"machine has {have / GIB:.2f} GiB available; lower decode.max_batch or model.max_context")
        return f"memory     {total / GIB:.2f} GiB of the {have / GIB:.2f} GiB available"
    gpus = gpu_bytes()
    if not gpus:
        return "memory     not checked: no GPU visible here (nvidia-smi)"
    smallest = min(gpus)
    if topo.shares_gpus:
        return check_shared_gpu(topo, cfg, needs, smallest)
    for name, _, each in needs:
        if each > GPU_USABLE * smallest:
            pool = getattr(topo, name)
            raise PreflightError(
                f"{name}.tp: {topo.model.name} ({topo.model.quant}) needs {each / GIB:.1f} GiB per GPU at {name}.tp "
                f"{pool.tp} (weights / tp + one model.max_context sequence of KV) but a GPU here has "
                f"{smallest / GIB:.1f} GiB ({GPU_USABLE:.0%} usable); raise {name}.tp or use "
                f"quant: fp8-block128")
    worst = max(each for _, _, each in needs)
    return f"memory     {worst / GIB:.1f} GiB per GPU at most, of {smallest / GIB:.1f} GiB"


def check_shared_gpu(topo, cfg, needs: list[tuple[str, int, int]], gpu: int) -> str:
    """Pools sharing each GPU (prefill/decode.gpu_memory_fraction): both processes load the weights, so
    they must fit twice; then each process's weights, one full-context sequence of KV, a forward's
    activations (estimated), CUDA graphs and its CUDA context must fit its share of the smallest GPU."""
    from kvrelay.engine.memory import CUDA_CONTEXT_BYTES, GRAPH_RESERVE_BYTES, forward_activation_bytes

    g = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    m = topo.model
    weights = cfg.weight_bytes(m.quant)
    if 2 * weights > GPU_USABLE * gpu:
        raise PreflightError(
            f"model.name: {m.name} ({m.quant}) weights take {g(weights)}, and the prefill and the decode process "
            f"sharing a GPU each load them: {g(2 * weights)}, but a GPU here has {g(gpu)} ({GPU_USABLE:.0%} "
            f"usable); set colocate: true (one process per GPU, weights once), a smaller model.quant, or give "
            f"each pool its own GPUs (null prefill/decode.gpu_memory_fraction)")
    forwards = {"prefill": (min(topo.prefill.chunk_tokens, topo.prefill.max_prompt_tokens), 64),
                "decode": (max(topo.decode.max_batch, 16), topo.decode.max_batch)}
    parts, total = {}, 0
    for name, _, each in needs:  # each: weights + one full-context sequence of KV
        act = forward_activation_bytes(cfg, *forwards[name])
        need = each + act + GRAPH_RESERVE_BYTES + CUDA_CONTEXT_BYTES
        parts[name] = (need, f"{g(weights)} weights + {g(each - weights)} KV of one {min(m.max_context, cfg.max_context)}"
                             f"-token sequence + {g(act)} activations of a {forwards[name][0]}-token forward + "
                             f"{g(GRAPH_RESERVE_BYTES)} CUDA graphs + {g(CUDA_CONTEXT_BYTES)} CUDA context")
        total += need
    for name, (need, why) in parts.items():
        share = getattr(topo, name).gpu_memory_fraction
        if need > share * gpu:
            other = "decode" if name == "prefill" else "prefill"
            raise PreflightError(
                f"{name}.gpu_memory_fraction: the {name} worker needs {g(need)} ({why}) but {share:g} of a "
                f"{g(gpu)} GPU is {g(share * gpu)}; both processes need {g(total)} of it: raise "
                f"{name}.gpu_memory_fraction (and lower {other}.gpu_memory_fraction, {getattr(topo, other).gpu_memory_fraction:g}),"
                f" or lower model.max_context")
    shares = ", ".join(f"{name} {g(need)} of its {getattr(topo, name).gpu_memory_fraction:g} "
                       f"({g(getattr(topo, name).gpu_memory_fraction * gpu)})" for name, (need, _) in parts.items())
    return f"memory     shared GPU of {g(gpu)}: {shares}"


def check_host_tier(topo, memory_bytes: Callable[[], int | None]) -> str:
    """The prefix cache's host tiers (prefill.prefix_cache_host_gib on every caching worker: each prefill
    worker, or each colocated one) fit this machine's available memory, next to what the CPU workers'
    weights and pools take there (a GPU worker's pool is on the GPU)."""
    from kvrelay.engine.config import load_model_config

    gib = topo.prefill.prefix_cache_host_gib if topo.prefill.prefix_cache else 0.0
    if not gib:
        return "host tier  off (prefill.prefix_cache_host_gib 0)"
    n = topo.prefill.workers
    tiers = int(n * gib * GIB)
    if topo.ray.address is not None:
        return f"host tier  {n} x {gib:g} GiB, not checked here: the workers run on the Ray cluster at ray.address"
    have = memory_bytes()
    if have is None:
        return f"host tier  {n} x {gib:g} GiB; not checked (no /proc/meminfo)"
    workers = 0
    if topo.device == "cpu":
        workers = sum(k * each for _, k, each in _worker_needs(topo, load_model_config(topo.model.name)))
    if tiers + workers > have:
        also = f" besides the CPU workers' {workers / GIB:.2f} GiB" if workers else ""
        raise PreflightError(
            f"prefill.prefix_cache_host_gib: {n} caching worker(s) x {gib:g} GiB = {tiers / GIB:.2f} GiB of host "
            f"memory{' (pinned)' if topo.device == 'cuda' else ''}{also}, but this machine has {have / GIB:.2f} GiB "
            f"available; lower it")
    pinned = " pinned" if topo.device == "cuda" else ""
    return f"host tier  {n} x {gib:g} GiB{pinned}, of {have / GIB:.2f} GiB available"


def available_memory() -> int | None:
    """MemAvailable of this machine, bytes (None where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gpu_memory() -> list[int] | None:
    """Each visible GPU's total memory, bytes, from nvidia-smi (no CUDA context in this process)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    sizes = [int(v) * (1 << 20) for v in out.split() if v.isdigit()]  # "[N/A]" (MIG, some drivers): skipped
    if not sizes:
        return None
    if visible:
        keep = [int(i) for i in visible.split(",") if i.strip().isdigit()]
        sizes = [sizes[i] for i in keep if i < len(sizes)] or sizes
    return sizes


def with_dummy(topo, dummy: bool):
    return dataclasses.replace(topo, model=dataclasses.replace(topo.model, dummy=True)) if dummy else topo
