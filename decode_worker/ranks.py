"""The follower ranks of a TP/EP decode worker (rank 0 is the `DecodeWorker` actor itself), and the
leader's view of the whole group as one Runner.

The group plumbing (spawning, rendezvous, lockstep fan-out, health) is workers/rank_group.py; what is
decode-specific is here: every rank imports, decodes and frees in lockstep and pulls only its own KV
heads, from whichever prefill ranks hold them, into pages that must be the same ids on every rank
(checked on import, not assumed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrelay.workers.loading import load_runner
from kvrelay.workers.rank_group import Followers, FollowerRank, join_group
from kvrelay.workers.specs import DecodeSpec


def pool_tokens(spec: DecodeSpec, free_bytes: int | None = None) -> int:
    """KV positions per group of a TP>1 decode rank: decode.kv_memory_fraction of the memory left after
    weights, activations and the CUDA-graph reserve (engine/memory.kv_budget, the meaning it has on one GPU),
    but never more than a full batch of full contexts. Every rank of a TP group gets the same count (its
    allocator must mirror the leader's), sized on rank 0 before any rank loads weights, so the weights per
    rank and the activations are estimates taken off the measured free memory (`free_bytes`: the tests').
    (TP1 workers size their pool after loading instead: workers/loading.load_sized_runner.)"""
    cap = spec.max_batch * spec.model.max_context
    if spec.device == "cuda":
        from kvrelay.engine.config import load_model_config
        from kvrelay.engine.kv_geometry import bytes_per_token
        from kvrelay.engine.memory import decode_activation_bytes, kv_budget
        from kvrelay.engine.partition import head_range

        cfg = load_model_config(spec.model.name)
        # Heads per rank from the same rule as the cache: more ranks than KV heads replicate one.
        local_kv = head_range(cfg.num_attention_heads, cfg.num_key_value_heads, 0, spec.tp).num_kv
        per_token = bytes_per_token(cfg.num_hidden_layers, local_kv, cfg.head_dim, 2)  # bf16
        if free_bytes is None:
            free_bytes, _ = torch.cuda.mem_get_info()
        free = free_bytes - cfg.weight_bytes(spec.model.quant) // spec.tp
        budget = kv_budget(free, activation=decode_activation_bytes(cfg, batch=spec.max_batch),
                           fraction=spec.kv_memory_fraction)
        cap = min(cap, budget // per_token)
    return cap


def load_rank_runner(spec: DecodeSpec, kv_tokens: int, shard):
    """A TP rank's shard of the decode Runner, with the leader's pool size (the allocators must mirror)."""
    return load_runner(spec.model, device=spec.device, page_size=spec.page_size, kv_tokens=kv_tokens,
                       shard=shard, graph_sizes=spec.graph_sizes)


def decode_join(spec: DecodeSpec, tp_rank: int, port: int):
    """This rank's ParallelContext. "EPn TPn": whole experts per rank; "EP1 TPn": a slice of every
    expert's intermediate units."""
    return join_group(spec.device, tp_rank, spec.tp, port, expert_parallel=spec.expert_parallel)


class DecodeRank(FollowerRank):
    """A follower rank (tp_rank >= 1) of a TP/EP decode worker."""

    role = "decode"

    def __init__(self, spec: DecodeSpec, worker: int, tp_rank: int, port: int, kv_tokens: int):
        from kvrelay.transfer.handle import layout_of
        from kvrelay.transfer.nixl import KVImporter

        spec.ucx.apply()
        ctx = decode_join(spec, tp_rank, port)
        # The leader's pool size, not this rank's own free-memory share: the allocators must mirror.
        runner = load_rank_runner(spec, kv_tokens, ctx)
        layout, pools = layout_of(runner.kv)
        importer = KVImporter(layout, pools, name_prefix=f"decode{worker}r{tp_rank}")
        super().__init__(worker, tp_rank, spec.tp, runner, importer)

    def import_sequence(self, rid: str, length: int):
        return self.op(lambda: self.runner.import_sequence(rid, length))

    def fork_sequence(self, src: str, dst: str):
        return self.op(lambda: self.runner.fork_sequence(src, dst))

    def decode(self, rids: Sequence[str], last_tokens: Sequence[int]) -> None:
        self.op(lambda: self.runner.decode(rids, last_tokens))  # logits are the leader's to sample

    def pull(self, handle, dst_pages: dict[str, Sequence[int]]):
        """READ this rank's KV heads of `handle` into its pages (runs beside the engine ops: the sequence
        is not in the batch yet, so no step touches these pages, and the leader frees them only once
        every rank's READ has ended)."""
        return self.transfer.pull(handle, dst_pages)


class GroupRunner:
    """The leader's Runner as the Scheduler sees it: every call that changes KV (import, decode, free) runs
    on all ranks in lockstep; everything else (capacity, lengths, sampling) is the leader's, which is
    every rank's, since their caches go through the same calls. Its KV-changing calls block on Ray round
    trips: the worker makes them from threads, never from its event loop."""

    overlap_capable = False  # every rank must run each step; decode_launch is the leader's alone

    def __init__(self, runner, group: Followers):
        self._runner = runner
        self.group = group
        self.follower_pages: dict[str, list[dict[str, tuple[int, ...]]]] = {}  # rid -> per follower

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def import_sequence(self, rid: str, length: int):
        kv, peers = self.group.run("import_sequence", (rid, length),
                                   lambda: self._runner.import_sequence(rid, length))
        if any(p.pages != kv.pages for p in peers):
            self.group.fail(f"request {rid}: follower ranks allocated other pages than rank 0")
        self.follower_pages[rid] = [p.pages for p in peers]
        return kv

    def fork_sequence(self, src: str, dst: str):
        kv, peers = self.group.run("fork_sequence", (src, dst), lambda: self._runner.fork_sequence(src, dst))
        if any(p.pages != kv.pages for p in peers):
            self.group.fail(f"request {dst}: follower ranks forked into other pages than rank 0")
        return kv

    def decode(self, rids: Sequence[str], last_tokens: Sequence[int]):
        rids, last_tokens = list(rids), [int(t) for t in last_tokens]
        logits, _ = self.group.run("decode", (rids, last_tokens), lambda: self._runner.decode(rids, last_tokens))
        return logits

    def free(self, rid: str) -> None:
        self.follower_pages.pop(rid, None)
        self.group.run("free", (rid,), lambda: self._runner.free(rid))

    def pull_refs(self, handle, rid: str) -> list:
        """Start every follower's READ of its heads; the caller awaits the refs (ObjectRefs)."""
        return [a.pull.remote(handle, pages) for a, pages in zip(self.group.actors, self.follower_pages[rid])]
