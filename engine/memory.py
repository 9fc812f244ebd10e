"""How many KV pages fit on a worker's device, decided after the weights are in place.

Why after: a pool sized from free memory *before* the weights (117 GB for 120b) asked for more than the
GPU had left. The order is: load weights -> measure the peak of one full-size prefill forward (the
activations every later forward needs room for) -> leave room for CUDA graphs -> give a share of what
remains to KV. Each group gets its own page count: sliding-window layers keep only the last window of
every sequence, so they need far fewer pages than full-attention layers. A worker with the prefix cache
gives the sliding group a share of the budget more (`prefill.prefix_cache_sliding_share`): a cached
chain resumes at a block boundary only while the window before it is cached too, so the cache needs a
window's pages (9 for gpt-oss at 16-token pages) for each resume point it keeps (engine/prefix_windows.py
decides which), not one sliding page per cached block.

`decode.kv_memory_fraction` has one meaning in every topology (kv_budget): the share of the memory left
after the weights, the activations and the CUDA-graph reserve. A one-GPU worker measures the activations
(plan_cuda_pool); a TP decode rank sizes its pool before any rank loads (decode_worker/ranks.pool_tokens),
so it takes the weights and activations from their estimates (decode_activation_bytes) instead.

On CPU there is nothing to measure (the pool lives in RAM): the caller's token cap decides.

A worker that shares its GPU with another worker process (prefill.gpu_memory_fraction and
decode.gpu_memory_fraction) sizes from its own share instead: what the GPU has free says nothing of what
is ours while the other process loads and allocates too, so the room is the share of the GPU's total
less what this process's allocator already holds (`room_bytes`), and never more than is free.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.engine import kv_geometry
from kvrelay.engine.kv_geometry import FULL, SLIDING

GIB = 1 << 30
GRAPH_RESERVE_BYTES = 2 * GIB  # kept free for CUDA graphs' private pools and the allocator's slack
# A CUDA context, cuBLAS/NCCL handles and the like: outside the caching allocator (so outside its share
# cap), counted by the pre-start check for each process on a shared GPU.
CUDA_CONTEXT_BYTES = GIB // 2


class KVDoesNotFit(ValueError):
    """The topology asks for more KV than the device can hold; the message names the key and numbers."""


@dataclass(frozen=True)
class MemoryPlan:
    pages: dict[str, int]  # per page group (kv_geometry.GROUPS)
    page_bytes: dict[str, int]  # one page of one group, all its layers
    total_bytes: int = 0  # device memory
    free_after_weights_bytes: int = 0  # free once weights (and the profiling pool) were freed of KV
    activation_bytes: int = 0  # peak of the profiling forward above its start
    reserve_bytes: int = 0  # kept free for activations, CUDA graphs and allocator slack
    kv_bytes: int = 0

    def describe(self) -> str:
        g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        return (f"KV pool {self.pages} pages ({g(self.kv_bytes)}) of {g(self.total_bytes)}: "
                f"{g(self.free_after_weights_bytes)} free after weights, {g(self.activation_bytes)} "
                f"activation peak, {g(self.reserve_bytes)} kept free")


def kv_budget(free_after_weights: int, *, activation: int, fraction: float,
              graph_reserve: int = GRAPH_RESERVE_BYTES) -> int:
    """Bytes of KV for `decode.kv_memory_fraction` = `fraction`: its share of what the weights (already taken
    off `free_after_weights`), the activations and the CUDA-graph reserve leave. The one meaning of the key,
    for every topology."""
    return max(0, int((free_after_weights - activation - graph_reserve) * fraction))


def decode_activation_bytes(cfg, *, batch: int) -> int:
    """An upper estimate of a decode forward's activation peak for `batch` sequences, where it cannot be
    measured (a TP rank sizes its pool before loading): the logits and their log-softmax in fp32 (the bulk:
    1.6 MB a sequence for gpt-oss's 201k vocabulary) plus a dozen hidden-size fp32 buffers a sequence,
    doubled for the allocator's rounding."""
    per_seq = 2 * cfg.vocab_size * 4 + 12 * cfg.hidden_size * 4
    return 2 * batch * per_seq


def page_bytes(cfg, *, page_size: int, kv_heads: int, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes of one page in each group (K and V, every layer of the group)."""
    one = kv_geometry.page_bytes(page_size, kv_heads, cfg.head_dim, dtype_bytes)
    return {FULL: one * len(cfg.full_layers), SLIDING: one * len(cfg.sliding_layers)}


def chunk_headroom(*, chunk_tokens: int, page_size: int, max_seqs: int) -> int:
    """Sliding pages one forward's prompt chunks hold beyond their sequences' windows until the forward
    ends: the chunk's own pages, plus one page boundary per sequence it may straddle."""
    return kv_geometry.pages_spanned(chunk_tokens, page_size) + 1 + max_seqs


def cache_sliding_pages(cfg, *, budget_bytes: int, page_size: int, kv_heads: int, share: float) -> int:
    """Sliding pages a prefix cache keeps beyond the running sequences' windows: `share` of the budget
    (whole windows of `window_pages`, so that the count says how many resume points fit)."""
    if share <= 0:
        return 0
    pb = page_bytes(cfg, page_size=page_size, kv_heads=kv_heads)[SLIDING]
    window = kv_geometry.window_pages(cfg.sliding_window, page_size)
    return int(share * budget_bytes) // pb // window * window


def split_pages(cfg, *, budget_bytes: int, page_size: int, kv_heads: int, max_seqs: int,
                chunk_tokens: int, max_tokens: int, cache_share: float = 0.0) -> dict[str, int]:
    """Pages per group for `budget_bytes`: the sliding group holds every sequence's window plus one
    forward's chunk headroom, plus `cache_share` of the budget for the prefix cache's windows
    (`cache_sliding_pages`; 0 without a cache); the rest goes to the full group; each capped at
    `max_tokens` positions (more could never be used). Arithmetic on its arguments alone: the same
    split wherever it runs."""
    pb = page_bytes(cfg, page_size=page_size, kv_heads=kv_heads)
    cap_pages = kv_geometry.pages_spanned(max_tokens, page_size)
    headroom = chunk_headroom(chunk_tokens=chunk_tokens, page_size=page_size, max_seqs=max_seqs)
    cache = cache_sliding_pages(cfg, budget_bytes=budget_bytes, page_size=page_size, kv_heads=kv_heads,
                                share=cache_share)
    sliding = min(cap_pages, max_seqs * kv_geometry.window_pages(cfg.sliding_window, page_size) + headroom + cache)
    full = min(cap_pages, max(0, (budget_bytes - sliding * pb[SLIDING]) // pb[FULL]))
    return {FULL: int(full), SLIDING: int(sliding)}


def room_bytes(*, free: int, total: int, held: int, share: float | None) -> int:
    """Device bytes this process may still allocate: what is free, or on a shared GPU its `share` of the
    total less what its own allocator `held` already (weights, buffers), whichever is smaller."""
    if share is None:
        return free
    return max(0, min(free, int(share * total) - held))


def forward_activation_bytes(cfg, tokens: int, logit_rows: int) -> int:
    """Estimate, before anything loads, of one forward's activation peak over `tokens` tokens with
    `logit_rows` rows of logits (a decode step: every row; a prefill: one a prompt): bf16 hidden-sized
    buffers, Q/K/V and the attention output, each token's routed experts' gate/up, activation and output
    rows, their FP8 copies, fp32 logits; doubled for the allocator's rounding and what lives alongside.
    For the pre-start check only: a worker measures its real peak (plan_cuda_pool)."""
    h, d, i, k = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.experts_per_token
    attn = (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d * 2
    moe = k * (2 * i + i + h) * 2 + k * (h + i) + cfg.num_experts * 4
    per_token = 6 * h * 2 + attn + moe
    return 2 * (tokens * per_token + logit_rows * cfg.vocab_size * 4)


def plan_cuda_pool(runner, *, fraction: float, max_seqs: int, chunk_tokens: int, max_tokens: int,
                   need_tokens: int, key: str, graph_reserve_bytes: int = GRAPH_RESERVE_BYTES,
                   cache_share: float = 0.0, share: float | None = None, share_key: str = "") -> MemoryPlan:
    """Measure this process's GPU after its weights were loaded into `runner` (whose pool is still the
    small profiling one), and size the real pool (`cache_share`: split_pages'). Raises KVDoesNotFit,
    naming `key`, when fewer than `need_tokens` positions of full-attention KV would fit. `share`: this
    process may use that share of the GPU's memory (another worker process shares it; `room_bytes`),
    named `share_key` in errors."""
    import torch

    dev = runner.device
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    start = torch.cuda.memory_allocated(dev)
    runner.profile_forward(chunk_tokens)
    torch.cuda.synchronize(dev)
    activation = max(0, torch.cuda.max_memory_allocated(dev) - start)
    runner.drop_kv()  # the profiling pool goes; the real one replaces it
    torch.cuda.empty_cache()
    gpu_free, total = torch.cuda.mem_get_info(dev)
    free = room_bytes(free=gpu_free, total=total, held=torch.cuda.memory_reserved(dev), share=share)
    reserve = activation + graph_reserve_bytes
    budget = kv_budget(free, activation=activation, fraction=fraction, graph_reserve=graph_reserve_bytes)
    pages = split_pages(runner.cfg, budget_bytes=budget, page_size=runner.page_size,
                        kv_heads=runner.kv.kv_heads, max_seqs=max_seqs, chunk_tokens=chunk_tokens,
                        max_tokens=max_tokens, cache_share=cache_share)
    pb = page_bytes(runner.cfg, page_size=runner.page_size, kv_heads=runner.kv.kv_heads)
    plan = MemoryPlan(pages=pages, page_bytes=pb, total_bytes=total, free_after_weights_bytes=free,
                      activation_bytes=activation, reserve_bytes=reserve,
                      kv_bytes=sum(pages[g] * pb[g] for g in pages))
    if pages[FULL] * runner.page_size < need_tokens and share is not None:
        raise KVDoesNotFit(
            f"{share_key}: this process's {share:g} of the GPU's {total / GIB:.2f} GiB leaves {free / GIB:.2f} GiB "
            f"after its weights ({torch.cuda.memory_reserved(dev) / GIB:.2f} GiB held); less activations "
            f"({activation / GIB:.2f} GiB) and CUDA graphs ({graph_reserve_bytes / GIB:.2f} GiB), {fraction:g} of "
            f"the rest holds {pages[FULL] * runner.page_size} KV positions, fewer than the {need_tokens} one "
            f"request may need; raise {share_key} (the other pool's lower), or lower model.max_context")
    if pages[FULL] * runner.page_size < need_tokens:
        raise KVDoesNotFit(
            f"{key}: {fraction:g} of the {(free - reserve) / GIB:.2f} GiB left after weights "
            f"({(total - free) / GIB:.2f} GiB in use), activations ({activation / GIB:.2f} GiB) and CUDA "
            f"graphs ({graph_reserve_bytes / GIB:.2f} GiB) holds {pages[FULL] * runner.page_size} KV "
            f"positions, fewer than the {need_tokens} one request may need; raise {key}, lower "
            f"model.max_context, or give this role its own GPU")
    return plan
