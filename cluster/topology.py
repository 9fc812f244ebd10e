"""Topology YAML -> frozen, typed dataclasses.

Every error names the file, the key path and the problem (`TopologyError`), because a serving config is
usually edited by hand on a machine far from the person who wrote the code. Validation happens once,
here, so nothing downstream re-checks a topology.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from kvrelay.engine.config import DEFAULT_GRAPH_BATCH_SIZES
from kvrelay.engine.partition import ParallelConfigError, check_partition, valid_tp_sizes

Quant = Literal["fp8-block128", "bf16", "fp8-block128-lmhead", "mxfp4", "mxfp4-bf16"]  # engine/config.MODEL_QUANTS
Device = Literal["cpu", "cuda"]
Policy = Literal["least-loaded", "round-robin", "kv-aware"]  # cluster/routing.py: kv-aware
LogFormat = Literal["text", "json"]

DEFAULT_CONFIG = "cpu-tiny.yaml"


class TopologyError(ValueError):
    """A topology file is invalid; the message is `FILE: key.path: problem`."""


@dataclass(frozen=True)
class ModelSection:
    name: str  # a preset (gpt-oss-20b, gpt-oss-120b, tiny ...) or a checkpoint directory
    dummy: bool = False  # random full-size weights from `seed`, no checkpoint on disk
    quant: Quant = "bf16"
    max_context: int = 8192
    seed: int = 0


@dataclass(frozen=True)
class PrefillSection:
    workers: int = 1
    tp: int = 1
    max_prompt_tokens: int = 8192
    chunk_tokens: int = 8192  # prompt tokens per prefill forward: queued prompts batched, long ones chunked
    # Keep the KV of whole prompt pages (and the sliding window before each page boundary) for later
    # prompts that start with the same tokens, which then skip that part of the prefill (engine/
    # prefix_cache.py); evicted, least recently used first, whenever the pages are wanted. At tp > 1
    # every rank keeps the same cache over its own KV heads (prefill_worker/ranks.py).
    prefix_cache: bool = False
    # With prefix_cache: GiB of host memory per caching worker (each prefill worker, split evenly over
    # its TP ranks, or each colocated worker), pinned on CUDA, where the pages the device evicts go instead of being dropped; a hit there
    # is copied back instead of recomputed (engine/host_tier.py). 0: off.
    prefix_cache_host_gib: float = 0.0
    # With prefix_cache (prefill and colocated workers sized on the GPU): share of the KV budget given to
    # sliding-window pages beyond the running sequences' windows, so that cached prompts keep the window
    # before the boundary a later prompt resumes at (engine/memory.py, engine/prefix_windows.py).
    prefix_cache_sliding_share: float = 0.05
    # Share of one GPU's memory each prefill worker process may use (weights, activations, graphs, KV),
    # as vLLM's --gpu-memory-utilization; set with decode.gpu_memory_fraction (colocate: false) to run the
    # two pools as separate processes on the same GPUs (Ray places them with this fractional GPU).
    # null: a worker has whole GPUs of its own.
    gpu_memory_fraction: float | None = None


@dataclass(frozen=True)
class DecodeSection:
    workers: int = 1
    ep: int = 1
    tp: int = 1
    max_batch: int = 64
    cuda_graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES
    kv_memory_fraction: float = 0.5  # GPU: share of what weights, activations and graphs leave free
    page_size: int = 16
    # Plan and queue decode step N+1 while step N runs (greedy batches; vLLM's async scheduling).
    overlap_steps: bool = True
    # Share of one GPU's memory each decode worker process may use (see prefill.gpu_memory_fraction).
    gpu_memory_fraction: float | None = None


@dataclass(frozen=True)
class RouterSection:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    policy: Policy = "least-loaded"
    # Requests that may wait for a decode worker with room; beyond it new ones get HTTP 429 /
    # RESOURCE_EXHAUSTED with a retry hint instead of queueing without bound.
    max_waiting_requests: int = 1024
    # Name of an environment variable holding comma-separated API keys (never the keys themselves: this
    # file is shared). Set: /v1 routes and gRPC calls need `Authorization: Bearer KEY`.
    api_keys_env: str | None = None
    # TLS on both front-ends (HTTPS, gRPC over TLS): PEM files, relative to this file; both or neither.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # Generation requests a minute per API key (per client address without keys), `rate_limit_burst` at once
    # (default: 10 s worth); over it HTTP 429 with Retry-After / gRPC RESOURCE_EXHAUSTED. null: no limit.
    rate_limit_rpm: int | None = None
    rate_limit_burst: int | None = None
    # Seconds a request whose workers died (or a new one, while none is live) waits for a healthy or
    # replacement worker pair before it fails: HTTP 503 + Retry-After, or an in-band error on a started
    # stream / gRPC UNAVAILABLE. Covers a replacement's weight load on a one-pair topology.
    resume_timeout_s: float = 120.0
    # Seconds a worker may go without answering (a health check, a call, a token for a request it holds)
    # before it is taken for hung, as a stopped process or a stuck device call is: the supervisor kills
    # and replaces it, and its requests resume as a dead worker's do (within resume_timeout_s).
    worker_timeout_s: float = 30.0
    # Seconds a worker's step loop may go without progress while it has work (a forward, a queued op, a
    # prefill that does not finish) although the worker still answers: a step stuck in a kernel or a
    # collective. Such a worker is taken for hung too. Generous: the first forward of a new shape on the GPU
    # compiles Triton kernels (tens of seconds).
    worker_step_timeout_s: float = 120.0


@dataclass(frozen=True)
class KVTransferSection:
    ucx_tls: str = "tcp,cma,self"
    lease_seconds: float = 30.0


@dataclass(frozen=True)
class RaySection:
    # None: always start a private local Ray (never one found via RAY_ADDRESS or /tmp/ray/ray_current_cluster,
    # e.g. a leftover `ray start --head`); "auto" or host:port: join
    address: str | None = None
    namespace: str = "kvrelay"


@dataclass(frozen=True)
class Topology:
    model: ModelSection
    prefill: PrefillSection = field(default_factory=PrefillSection)
    decode: DecodeSection = field(default_factory=DecodeSection)
    router: RouterSection = field(default_factory=RouterSection)
    kv_transfer: KVTransferSection = field(default_factory=KVTransferSection)
    ray: RaySection = field(default_factory=RaySection)
    device: Device = "cpu"
    gpus: int = 0  # GPUs this topology provides (per cluster); 0 on CPU
    colocate: bool = False  # one worker per GPU holds both roles (weights once, KV handed over in place)
    # Router and worker log lines: text, or one JSON object per line with the request id (workers/logs.py).
    log_format: LogFormat = "text"
    source: str = "<memory>"  # the file it came from, for messages

    @property
    def prefill_gpus(self) -> int:
        return 0 if self.device == "cpu" else self.prefill.workers * self.prefill.tp

    @property
    def decode_gpus(self) -> int:
        # "EPn TPn" is n ranks: experts and attention heads are partitioned over the same ranks.
        return 0 if self.device == "cpu" else self.decode.workers * self.decode.tp

    @property
    def shares_gpus(self) -> bool:
        """Prefill and decode worker processes share GPUs, each within its pool's gpu_memory_fraction
        (one prefill and one decode process per GPU; the KV still moves over NIXL, GPU to same GPU)."""
        return self.device == "cuda" and self.prefill.gpu_memory_fraction is not None

    @property
    def gpus_needed(self) -> int:
        if self.shares_gpus:
            return self.prefill.workers
        if self.colocate:
            return max(self.prefill_gpus, self.decode_gpus)
        return self.prefill_gpus + self.decode_gpus

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d


# ---------------------------------------------------------------- parsing


def _type_name(tp: Any) -> str:
    if tp is bool:
        return "a boolean"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is tuple:
        return "a list of " + _type_name(typing.get_args(tp)[0]).removeprefix("a ").removeprefix("an ") + "s"
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return str(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; returns the value in the dataclass's type."""
    origin = typing.get_origin(tp)
    bad = TopologyError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            if arm is type(None) and value is None:
                return None
            if arm is not type(None):
                try:
                    return _coerce(value, arm, where)
                except TopologyError:
                    pass
        raise bad
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise TopologyError(f"{where}: {value!r} is not {_type_name(tp)}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise bad
        return tuple(_coerce(v, typing.get_args(tp)[0], f"{where}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise TypeError(f"unsupported annotation {tp!r}")


# Keys older files may still carry, with why they went (rather than a bare "unknown key").
_REMOVED = {"KVTransferSection": {"backend": "the handoff is always NIXL between processes and in place "
                                            "between the colocated roles of one worker; delete the line"}}


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise TopologyError(f"{where}: expected a mapping, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls) if f.name != "source"]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else str(key)
        if key in _REMOVED.get(cls.__name__, {}):
            raise TopologyError(f"{path}: this key was removed: {_REMOVED[cls.__name__][key]}")
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (valid keys: {', '.join(known)})"
            raise TopologyError(f"{path}: unknown key{hint}")
        sub = hints[key]
        if dataclasses.is_dataclass(sub):
            kwargs[key] = _build(sub, value, path)
        else:
            kwargs[key] = _coerce(value, sub, path)
    for f in fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in kwargs:
            raise TopologyError(f"{where + '.' if where else ''}{f.name}: required key is missing")
    return cls(**kwargs)


def _model_config(model: ModelSection, base_dir: Path) -> tuple[str, Any]:
    """(resolved name or path, the model's ModelConfig) without importing torch."""
    from kvrelay.engine.config import PRESETS, load_model_config

    if model.name in PRESETS:
        return model.name, PRESETS[model.name]
    path = Path(os.path.expanduser(model.name))
    if not path.is_absolute() and not path.exists():
        path = base_dir / path
    if not path.exists():
        raise TopologyError(
            f"model.name: {model.name!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
            f"nor an existing checkpoint directory")
    try:
        return str(path), load_model_config(str(path))
    except Exception as e:  # the loader's message says what is wrong with the checkpoint
        raise TopologyError(f"model.name: cannot read the model config in {path}: {e}") from e


def _check(t: Topology, base_dir: Path) -> Topology:
    def pos(path: str, v: int | float) -> None:
        if v <= 0:
            raise TopologyError(f"{path}: must be > 0, got {v}")

    for path, v in [("model.max_context", t.model.max_context), ("prefill.workers", t.prefill.workers),
                    ("prefill.tp", t.prefill.tp), ("prefill.max_prompt_tokens", t.prefill.max_prompt_tokens),
                    ("prefill.chunk_tokens", t.prefill.chunk_tokens),
                    ("decode.workers", t.decode.workers), ("decode.ep", t.decode.ep), ("decode.tp", t.decode.tp),
                    ("decode.max_batch", t.decode.max_batch), ("decode.page_size", t.decode.page_size),
                    ("kv_transfer.lease_seconds", t.kv_transfer.lease_seconds),
                    ("router.max_waiting_requests", t.router.max_waiting_requests),
                    ("router.resume_timeout_s", t.router.resume_timeout_s),
                    ("router.worker_timeout_s", t.router.worker_timeout_s),
                    ("router.worker_step_timeout_s", t.router.worker_step_timeout_s)]:
        pos(path, v)
    if not 0.0 < t.decode.kv_memory_fraction <= 0.95:
        raise TopologyError(f"decode.kv_memory_fraction: must be in (0, 0.95], got {t.decode.kv_memory_fraction}")
    for i, b in enumerate(t.decode.cuda_graph_batch_sizes):
        pos(f"decode.cuda_graph_batch_sizes[{i}]", b)
    if list(t.decode.cuda_graph_batch_sizes) != sorted(set(t.decode.cuda_graph_batch_sizes)):
        raise TopologyError("decode.cuda_graph_batch_sizes: must be strictly increasing")
    if t.prefill.max_prompt_tokens > t.model.max_context:
        raise TopologyError(f"prefill.max_prompt_tokens: {t.prefill.max_prompt_tokens} exceeds "
                            f"model.max_context {t.model.max_context}")
    for path, port in [("router.grpc_port", t.router.grpc_port), ("router.http_port", t.router.http_port)]:
        if not 0 <= port <= 65535:
            raise TopologyError(f"{path}: {port} is not a TCP port (0-65535; 0 picks a free one)")
    if t.router.grpc_port == t.router.http_port != 0:
        raise TopologyError(f"router.http_port: {t.router.http_port} is also router.grpc_port")

    t = _check_router_files(t, base_dir)
    name, cfg = _model_config(t.model, base_dir)
    n_exp = cfg.num_experts
    for pool in ("prefill", "decode"):
        # The engine's own rule (engine/partition.py): more ranks than KV heads replicate a KV head.
        tp = getattr(t, pool).tp
        expert_parallel = pool == "prefill" or t.decode.ep == tp
        try:
            check_partition(cfg, tp, expert_parallel=expert_parallel)
        except ParallelConfigError as e:
            ok = valid_tp_sizes(cfg, expert_parallel=expert_parallel)
            raise TopologyError(f"{pool}.tp: {e} (use one of {', '.join(map(str, ok))})") from None
    if n_exp % t.decode.ep:
        raise TopologyError(f"decode.ep: {t.decode.ep} does not divide the model's {n_exp} experts")
    if t.decode.ep not in (1, t.decode.tp):
        raise TopologyError(f"decode.ep: {t.decode.ep} must be 1 or equal decode.tp ({t.decode.tp}): "
                            "EPn TPn partitions experts over the same n ranks as the attention heads")
    host_gib = t.prefill.prefix_cache_host_gib
    if not (math.isfinite(host_gib) and host_gib >= 0):
        raise TopologyError(f"prefill.prefix_cache_host_gib: must be a number >= 0 (GiB; 0 is off), got {host_gib}")
    share = t.prefill.prefix_cache_sliding_share
    if not (math.isfinite(share) and 0.0 <= share <= 0.5):
        raise TopologyError(f"prefill.prefix_cache_sliding_share: must be a number in [0, 0.5] (a share of the KV "
                            f"budget), got {share}")
    if host_gib and not t.prefill.prefix_cache:
        raise TopologyError("prefill.prefix_cache_host_gib: a host tier sits under the prefix cache; set "
                            "prefill.prefix_cache: true too (or 0 here)")
    _check_gpu_shares(t)
    if t.colocate:
        # One worker per GPU holds both roles over one copy of the weights and one KV pool.
        if t.prefill.workers != t.decode.workers:
            raise TopologyError(f"colocate: prefill.workers ({t.prefill.workers}) and decode.workers "
                                f"({t.decode.workers}) must be equal: each colocated worker serves both roles")
        for pool in ("prefill", "decode"):
            if getattr(t, pool).tp != 1:
                raise TopologyError(f"{pool}.tp: colocated workers run at tp 1 (got {getattr(t, pool).tp}); "
                                    f"set colocate: false to give the pools their own GPUs")
    if t.device == "cpu":
        if t.gpus:
            raise TopologyError(f"gpus: device is cpu but gpus is {t.gpus} (use 0 or device: cuda)")
    else:
        if t.gpus_needed > t.gpus:
            how = "max" if t.colocate or t.shares_gpus else "sum"
            raise TopologyError(
                f"gpus: the pools ask for {t.gpus_needed} GPUs ({how} of prefill {t.prefill.workers}x tp "
                f"{t.prefill.tp} = {t.prefill_gpus} and decode {t.decode.workers}x tp {t.decode.tp} = "
                f"{t.decode_gpus}) but the topology provides {t.gpus}")
    return dataclasses.replace(t, model=dataclasses.replace(t.model, name=name))


def _check_gpu_shares(t: Topology) -> None:
    """prefill/decode.gpu_memory_fraction: both or neither, each in (0, 1], together at most 1 (one of each
    pool's processes per GPU), only where the pools are separate processes at tp 1 (a TP group's ranks
    need a GPU each, and fractional Ray bundles could put two of them on one). Whether the weights, KV
    and activations fit each share is measured against the GPU's size before start (cluster/preflight.py)."""
    fp, fd = t.prefill.gpu_memory_fraction, t.decode.gpu_memory_fraction
    if fp is None and fd is None:
        return
    for key, v in (("prefill.gpu_memory_fraction", fp), ("decode.gpu_memory_fraction", fd)):
        if v is None:
            other = "decode" if key.startswith("prefill") else "prefill"
            raise TopologyError(f"{key}: required with {other}.gpu_memory_fraction (the pools share a GPU "
                                f"only when each process's share is stated), or null both")
        if not (math.isfinite(v) and 0.0 < v <= 1.0):
            raise TopologyError(f"{key}: must be in (0, 1] (a share of one GPU's memory), got {v}")
        if round(v, 4) != v:  # Ray's fractional resources have 4 decimals
            raise TopologyError(f"{key}: at most 4 decimals (Ray's fractional GPUs), got {v}")
    if t.colocate:
        raise TopologyError("prefill.gpu_memory_fraction: colocate: true runs one process per GPU holding both "
                            "roles (its KV is decode.kv_memory_fraction); set colocate: false to run the pools as "
                            "separate processes sharing the GPU, or null both fractions")
    if fp + fd > 1.0 + 1e-9:
        raise TopologyError(f"decode.gpu_memory_fraction: prefill's {fp:g} + decode's {fd:g} = {fp + fd:g} of one "
                            f"GPU's memory, more than all of it; lower them (their sum at most 1)")
    for pool in ("prefill", "decode"):
        if getattr(t, pool).tp != 1:
            raise TopologyError(f"{pool}.tp: pools sharing GPUs (gpu_memory_fraction) run at tp 1 (got "
                                f"{getattr(t, pool).tp}); null the fractions to give the pools their own GPUs")
    if t.prefill.workers != t.decode.workers:
        raise TopologyError(f"decode.workers: pools sharing GPUs put one prefill and one decode worker on each "
                            f"GPU: prefill.workers ({t.prefill.workers}) and decode.workers ({t.decode.workers}) "
                            f"must be equal")


def _check_router_files(t: Topology, base_dir: Path) -> Topology:
    """TLS files exist and are given as a pair (resolved against the topology's folder); rate limits > 0."""
    r = t.router
    if (r.tls_cert_file is None) != (r.tls_key_file is None):
        given, missing = (("router.tls_cert_file", "router.tls_key_file") if r.tls_key_file is None
                          else ("router.tls_key_file", "router.tls_cert_file"))
        raise TopologyError(f"{missing}: required with {given} (TLS needs the certificate and its key)")
    files = {}
    for key in ("tls_cert_file", "tls_key_file"):
        value = getattr(r, key)
        if value is None:
            continue
        path = Path(os.path.expanduser(value))
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise TopologyError(f"router.{key}: {value!r} is not a file ({path})")
        files[key] = str(path)
    for key in ("rate_limit_rpm", "rate_limit_burst"):
        value = getattr(r, key)
        if value is not None and value <= 0:
            raise TopologyError(f"router.{key}: must be > 0 (or null for no limit), got {value}")
    if r.rate_limit_burst is not None and r.rate_limit_rpm is None:
        raise TopologyError("router.rate_limit_burst: set router.rate_limit_rpm too (the burst is of that limit)")
    return dataclasses.replace(t, router=dataclasses.replace(r, **files)) if files else t


def parse_topology(text: str, source: str = "<memory>", base_dir: Path | None = None) -> Topology:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TopologyError(f"{source}: not valid YAML: {e}") from e
    if raw is None:
        raw = {}
    try:
        t = _build(Topology, raw, "")
        t = _check(t, base_dir or Path.cwd())
    except TopologyError as e:
        raise TopologyError(f"{source}: {e}") from None
    return dataclasses.replace(t, source=source)


def resolve_config_path(path: str | os.PathLike[str] | None) -> Path:
    """A file path, or the name of a shipped config (e.g. `cpu-tiny.yaml`), or None for the default."""
    if path is None:
        path = DEFAULT_CONFIG
    p = Path(path)
    if p.exists():
        return p
    shipped = resources.files("kvrelay.configs").joinpath(p.name)
    if shipped.is_file():
        return Path(str(shipped))
    raise TopologyError(f"{path}: no such file (shipped configs: {', '.join(shipped_configs())})")


def shipped_configs() -> list[str]:
    return sorted(p.name for p in resources.files("kvrelay.configs").iterdir() if p.name.endswith(".yaml")
                  and p.name != "cluster.yaml")


def load_topology(path: str | os.PathLike[str] | None = None) -> Topology:
    p = resolve_config_path(path)
    return parse_topology(p.read_text(), source=str(path or p), base_dir=p.parent)


def describe(t: Topology) -> str:
    """Human summary printed by `kvrelay config check`."""
    lines = [
        f"topology {t.source}",
        f"  model      {t.model.name} (quant {t.model.quant}{', dummy weights' if t.model.dummy else ''}, "
        f"max_context {t.model.max_context})",
        f"  device     {t.device}",
        f"  prefill    {t.prefill.workers} worker(s) x TP{t.prefill.tp}, max_prompt_tokens "
        f"{t.prefill.max_prompt_tokens}, chunk_tokens {t.prefill.chunk_tokens}"
        + (", prefix cache" if t.prefill.prefix_cache else "")
        + (f" + {t.prefill.prefix_cache_host_gib:g} GiB host tier" if t.prefill.prefix_cache_host_gib else ""),
        f"  decode     {t.decode.workers} worker(s) x EP{t.decode.ep} TP{t.decode.tp}, max_batch "
        f"{t.decode.max_batch}, graphs {list(t.decode.cuda_graph_batch_sizes)}",
        f"  router     gRPC {t.router.host}:{t.router.grpc_port}, HTTP{'S' if t.router.tls_cert_file else ''} "
        f"{t.router.host}:{t.router.http_port}, policy {t.router.policy}"
        + (", TLS" if t.router.tls_cert_file else "")
        + (f", {t.router.rate_limit_rpm} requests/min per client" if t.router.rate_limit_rpm else ""),
        f"  kv         {'in place (colocated)' if t.colocate else 'NIXL'} (UCX_TLS={t.kv_transfer.ucx_tls}), lease "
        f"{t.kv_transfer.lease_seconds:g} s",
        f"  ray        {t.ray.address or 'local'} namespace {t.ray.namespace}",
        f"  GPUs       {t.gpus_needed} needed of {t.gpus} provided"
        + (" (prefill and decode colocated)" if t.colocate else "")
        + (f" (prefill and decode processes share each GPU: {t.prefill.gpu_memory_fraction:g} + "
           f"{t.decode.gpu_memory_fraction:g} of its memory)" if t.shares_gpus else ""),
    ]
    return "\n".join(lines)


def to_json(t: Topology) -> str:
    return json.dumps({"source": t.source, "gpus_needed": t.gpus_needed, **t.to_dict()}, indent=2)
