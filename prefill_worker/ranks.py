"""The follower ranks of a TP prefill worker (rank 0 is the `PrefillWorker` actor itself).

The group plumbing (spawning, rendezvous, lockstep fan-out, health) is workers/rank_group.py; what is
prefill-specific is here: a follower runs the leader's prefill on its shard and describes where its
pages are, so the leader can put every rank's pages into the one handle it leases. Leases live on the
leader, which frees the pages on every rank once its lease is released or reclaimed.
"""

from __future__ import annotations

from kvrelay.transfer.ucx import UcxSettings
from kvrelay.workers.loading import load_runner as load_model_runner
from kvrelay.workers.rank_group import FollowerRank, follower_op, join_group


def pool_tokens(topology) -> int:
    """Room for a few prompts in flight: one running plus the ones whose KV still waits for a pull."""
    return 4 * topology.prefill.max_prompt_tokens


def load_runner(topology, kv_tokens: int, shard=None):
    """This worker's Runner (this rank's shard of it when `shard` is a TP rank's ParallelContext)."""
    # decode's page size: both pools must share it for pages to be copyable.
    return load_model_runner(topology.model, device=topology.device, page_size=topology.decode.page_size,
                             kv_tokens=kv_tokens, shard=shard)


class PrefillRank(FollowerRank):
    """A follower rank (tp_rank >= 1) of a TP prefill worker."""

    role = "prefill"

    def __init__(self, topology, worker: int, tp_rank: int, port: int):
        from kvrelay.transfer.handle import layout_of
        from kvrelay.transfer.nixl import KVExporter

        UcxSettings(topology.kv_transfer.ucx_tls, "lo" if topology.device == "cpu" else None).apply()
        ctx = join_group(topology.device, tp_rank, topology.prefill.tp, port)
        runner = load_runner(topology, kv_tokens=pool_tokens(topology), shard=ctx)
        layout, pools = layout_of(runner.kv)
        # Leases live on the leader; this exporter only registers the pool and describes pages.
        exporter = KVExporter(layout, pools, name_prefix=f"prefill{worker}r{tp_rank}")
        super().__init__(worker, tp_rank, topology.prefill.tp, runner, exporter)

    def prefill(self, rid: str, prompt_ids: list[int], all_logits: bool = False):
        """The leader's prefill, on this rank's shard; returns where this rank's pages are."""
        with self._lock:
            follower_op(lambda: self.runner.prefill(rid, prompt_ids, all_logits=all_logits))
            kv = self.runner.export_sequence(rid)
            return self.transfer.describe(kv.pages, kv.length, first_blocks=kv.first_page)
