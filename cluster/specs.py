"""The topology, cut into what each worker role is told (workers/specs.py): the one place that knows both
the topology's layout and the workers' settings, so neither side reads the other's types.
"""

from __future__ import annotations

from kvrelay.cluster.placement import COLOCATED, ucx_settings
from kvrelay.cluster.topology import Topology
from kvrelay.workers.specs import ColocatedSpec, DecodeSpec, ModelSpec, PrefillSpec


def model_spec(t: Topology) -> ModelSpec:
    m = t.model
    return ModelSpec(name=m.name, dummy=m.dummy, quant=m.quant, seed=m.seed, max_context=m.max_context)


def host_bytes(t: Topology) -> int:
    """Bytes of the prefix cache's host tier on each caching worker (prefill.prefix_cache_host_gib)."""
    return int(t.prefill.prefix_cache_host_gib * (1 << 30)) if t.prefill.prefix_cache else 0


def sliding_share(t: Topology) -> float:
    """Share of a caching worker's KV budget for the cache's sliding windows (prefill.prefix_cache_sliding_share)."""
    return t.prefill.prefix_cache_sliding_share if t.prefill.prefix_cache else 0.0


def prefill_spec(t: Topology) -> PrefillSpec:
    p = t.prefill
    return PrefillSpec(model=model_spec(t), device=t.device, tp=p.tp, page_size=t.decode.page_size,
                       max_prompt_tokens=p.max_prompt_tokens, chunk_tokens=p.chunk_tokens,
                       lease_seconds=t.kv_transfer.lease_seconds, ucx=ucx_settings(t),
                       prefix_cache=p.prefix_cache, prefix_cache_host_bytes=host_bytes(t),
                       prefix_cache_sliding_share=sliding_share(t), gpu_memory_fraction=gpu_share(t, "prefill"))


def gpu_share(t: Topology, pool: str) -> float | None:
    """A pool's share of each GPU where the pools share GPUs (engine/memory.py sizes its KV within it)."""
    return getattr(t, pool).gpu_memory_fraction if t.shares_gpus else None


def decode_spec(t: Topology) -> DecodeSpec:
    d = t.decode
    return DecodeSpec(model=model_spec(t), device=t.device, tp=d.tp, ep=d.ep, page_size=d.page_size,
                      max_batch=d.max_batch, graph_sizes=tuple(d.cuda_graph_batch_sizes),
                      kv_memory_fraction=d.kv_memory_fraction, overlap_steps=d.overlap_steps,
                      need_tokens=min(t.model.max_context, t.prefill.max_prompt_tokens + 1), ucx=ucx_settings(t),
                      gpu_memory_fraction=gpu_share(t, "decode"))


def colocated_spec(t: Topology) -> ColocatedSpec:
    return ColocatedSpec(decode=decode_spec(t), max_prompt_tokens=t.prefill.max_prompt_tokens,
                         chunk_tokens=t.prefill.chunk_tokens, prefix_cache=t.prefill.prefix_cache,
                         prefix_cache_host_bytes=host_bytes(t), prefix_cache_sliding_share=sliding_share(t))


def worker_spec(t: Topology, role: str) -> PrefillSpec | DecodeSpec | ColocatedSpec:
    """The spec a worker of `role` ("prefill", "decode" or "colocated") is built from."""
    if role == COLOCATED:
        return colocated_spec(t)
    return prefill_spec(t) if role == "prefill" else decode_spec(t)
