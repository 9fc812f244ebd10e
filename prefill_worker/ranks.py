"""The follower ranks of a TP prefill worker (rank 0 is the `PrefillWorker` actor itself).

The group plumbing (spawning, rendezvous, lockstep fan-out, health) is workers/rank_group.py; what is
prefill-specific is here: a follower runs the leader's prefill on its shard and describes where its
pages are, so the leader can put every rank's pages into the one handle it leases. Leases live on the
leader, which frees the pages on every rank once its lease is released or reclaimed.
"""

from __future__ import annotations

from kvrelay.workers.loading import load_runner
from kvrelay.workers.rank_group import FollowerRank, follower_op, join_group
from kvrelay.workers.specs import PrefillSpec


def load_rank_runner(spec: PrefillSpec, shard):
    """A TP rank's shard of the prefill Runner (every rank alike, so their allocators mirror)."""
    return load_runner(spec.model, device=spec.device, page_size=spec.page_size, kv_tokens=spec.pool_tokens,
                       shard=shard)


class PrefillRank(FollowerRank):
    """A follower rank (tp_rank >= 1) of a TP prefill worker."""

    role = "prefill"

    def __init__(self, spec: PrefillSpec, worker: int, tp_rank: int, port: int):
        from kvrelay.transfer.handle import layout_of
        from kvrelay.transfer.nixl import KVExporter

        spec.ucx.apply()
        ctx = join_group(spec.device, tp_rank, spec.tp, port)
        runner = load_rank_runner(spec, ctx)
        layout, pools = layout_of(runner.kv)
        # Leases live on the leader; this exporter only registers the pool and describes pages.
        exporter = KVExporter(layout, pools, name_prefix=f"prefill{worker}r{tp_rank}")
        super().__init__(worker, tp_rank, spec.tp, runner, exporter)

    def prefill(self, rid: str, prompt_ids: list[int], all_logits: bool = False):
        """The leader's prefill, on this rank's shard; returns where this rank's pages are."""
        with self._lock:
            follower_op(lambda: self.runner.prefill(rid, prompt_ids, all_logits=all_logits))
            kv = self.runner.export_sequence(rid)
            return self.transfer.describe(kv.pages, kv.length, first_blocks=kv.first_page)
