"""What a worker is told about its job: frozen per-role specs, built by cluster/specs.py from the
topology, so a worker reads its own settings and nothing else of the topology (and this package never
imports cluster/). Each spec holds exactly what its role's actor and its follower ranks read; the
prefill role's limits are checked here for both roles that prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.transfer.ucx import UcxSettings


@dataclass(frozen=True)
class ModelSpec:
    """Which weights a worker loads (engine.runner.Runner.load's arguments)."""

    name: str  # a preset or a checkpoint directory
    dummy: bool  # random weights of the model's shape from `seed`
    quant: str  # "bf16" | "fp8-block128"
    seed: int
    max_context: int  # prompt + generated positions per request


@dataclass(frozen=True)
class PrefillSpec:
    """A prefill worker (split topologies) and its follower ranks."""

    model: ModelSpec
    device: str  # "cpu" | "cuda"
    tp: int
    page_size: int  # the decode pool's: pages are copied one for one
    max_prompt_tokens: int
    chunk_tokens: int  # prompt tokens per forward (queued prompts batched, long ones chunked)
    lease_seconds: float  # how long pinned KV waits for its pull
    ucx: UcxSettings
    prefix_cache: bool = False  # reuse cached prompt prefixes (engine/prefix_cache.py)
    prefix_cache_host_bytes: int = 0  # its host-memory tier (engine/host_tier.py); 0: evicted pages are dropped
    prefix_cache_sliding_share: float = 0.0  # of the KV budget, sliding pages for the cache (engine/memory.py)
    gpu_memory_fraction: float | None = None  # this process's share of a GPU it shares with a decode worker

    @property
    def pool_tokens(self) -> int:
        """Room for a few prompts in flight: one running plus the ones whose KV still waits for a pull."""
        return 4 * self.max_prompt_tokens


@dataclass(frozen=True)
class DecodeSpec:
    """A decode worker and its follower ranks (and the decode half of a colocated worker)."""

    model: ModelSpec
    device: str
    tp: int
    ep: int  # 1 or tp: "EPn TPn" puts whole experts on each rank, "EP1 TPn" slices every expert
    page_size: int
    max_batch: int
    graph_sizes: tuple[int, ...]  # decode batch sizes captured as CUDA graphs
    kv_memory_fraction: float  # GPU: share of the memory left after weights, activations, graphs (engine/memory.kv_budget)
    overlap_steps: bool  # plan and queue step N+1 while step N runs
    need_tokens: int  # positions one request may hold: the pool must fit at least that
    ucx: UcxSettings
    gpu_memory_fraction: float | None = None  # this process's share of a GPU it shares with a prefill worker

    @property
    def expert_parallel(self) -> bool:
        return self.ep == self.tp


@dataclass(frozen=True)
class ColocatedSpec:
    """A colocated worker: a decode worker that also prefills its own prompts, in its decode steps."""

    decode: DecodeSpec
    max_prompt_tokens: int
    chunk_tokens: int  # prompt tokens a step takes into its forward
    prefix_cache: bool = False  # reuse cached prompt prefixes (engine/prefix_cache.py)
    prefix_cache_host_bytes: int = 0  # its host-memory tier (engine/host_tier.py); 0: evicted pages are dropped
    prefix_cache_sliding_share: float = 0.0  # of the KV budget, sliding pages for the cache (engine/memory.py)


def check_prompt_limits(request_id: str, n: int, generated: int, max_prompt_tokens: int, max_context: int) -> None:
    """The prefill role's limits (a prefill worker's and a colocated worker's): a retried request may
    carry the tokens it already streamed on top of a full-size prompt."""
    if n == 0:
        raise ValueError(f"request {request_id}: empty prompt")
    if n > max_prompt_tokens + generated or n >= max_context:
        raise ValueError(f"request {request_id}: prompt of {n} tokens exceeds this worker's limit "
                         f"({max_prompt_tokens} prompt tokens, {max_context} context)")
