"""Loading a worker's Runner, for both roles and every rank: one function, so a prefill pool and a decode
pool are built alike (same page size, dtype, model seed), which is what makes their pages copyable.
`load_sized_runner` sizes a single-rank pool after the weights (engine/memory.py); a TP group's ranks take
the pool size their leader computed (decode_worker/ranks.py), since their allocators must mirror.
"""

from __future__ import annotations

from typing import Any


def load_runner(model, *, device: str, page_size: int, kv_tokens: int, shard=None,
                graph_sizes: tuple[int, ...] | None = None):
    """The engine Runner a worker serves: `model` is the topology's model section (name, dummy, seed,
    quant), `shard` this rank's ParallelContext in a TP group (None: the whole model), with a pool of
    `kv_tokens` positions per group. Both roles must use the same page size for pages to be copyable.
    `graph_sizes`: the decode batch sizes captured as CUDA graphs (None: the engine's default; () none)."""
    import torch

    from kvrelay.engine.runner import Runner

    extra: dict[str, Any] = {} if shard is None else {"shard": shard}
    if graph_sizes is not None:
        extra.update(cuda_graphs=bool(graph_sizes), cuda_graph_batch_sizes=tuple(graph_sizes))
    return Runner.load(model.name, dummy=model.dummy, seed=model.seed,
                       device="cuda" if device == "cuda" else "cpu", dtype=torch.bfloat16,
                       quant=model.quant, page_size=page_size, num_pages=-(-kv_tokens // page_size), **extra)


def load_sized_runner(model, *, device: str, page_size: int, fraction: float, max_seqs: int,
                      chunk_tokens: int, max_tokens: int, need_tokens: int, key: str,
                      graph_sizes: tuple[int, ...] | None = None, log=None, cache_share: float = 0.0,
                      gpu_share: float | None = None, share_key: str = ""):
    """A single-rank Runner whose KV pool is sized after its weights (engine/memory.py): loaded with a
    pool just big enough to profile one `chunk_tokens` forward, then resized to the measured budget and
    its decode graphs captured (`cache_share`: the sliding group's share for a prefix cache,
    memory.split_pages). On CPU the pool holds `max_tokens` positions in each group (the old rule).
    Raises memory.KVDoesNotFit naming `key` when one `need_tokens` request would not fit.
    `gpu_share`: this process may use only that share of the GPU (another worker process allocates on the
    same GPU, so its free memory says nothing of ours): the caching allocator is capped to it before the
    weights load, and the pool is sized within it (`share_key` names the topology key in errors)."""
    from kvrelay.engine.memory import plan_cuda_pool

    if device != "cuda":
        return load_runner(model, device=device, page_size=page_size, kv_tokens=max_tokens,
                           graph_sizes=graph_sizes)
    if gpu_share is not None:
        import torch

        # An allocation past the share fails here (OOM in this process) instead of in the other one.
        torch.cuda.set_per_process_memory_fraction(gpu_share)
    profile_tokens = chunk_tokens + 2 * page_size
    runner = load_runner(model, device=device, page_size=page_size, kv_tokens=profile_tokens,
                         graph_sizes=graph_sizes)
    plan = plan_cuda_pool(runner, fraction=fraction, max_seqs=max_seqs, chunk_tokens=chunk_tokens,
                          max_tokens=max_tokens, need_tokens=need_tokens, key=key, cache_share=cache_share,
                          share=gpu_share, share_key=share_key)
    runner.resize_kv(plan.pages)
    runner.warmup()
    if log is not None:
        log(plan.describe())
    return runner
