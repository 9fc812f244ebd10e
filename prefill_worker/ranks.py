"""The follower ranks of a TP prefill worker (rank 0 is the `PrefillWorker` actor itself).

The group plumbing (spawning, rendezvous, lockstep fan-out, health) is engine/rank_group.py; what is
prefill-specific is here: a follower runs the leader's prefill on its shard and describes where its
pages are, so the leader can put every rank's pages into the one handle it leases. Leases live on the
leader, which frees the pages on every rank once its lease is released or reclaimed.
"""

from __future__ import annotations

from kvrelay.engine.rank_group import FollowerRank, follower_op, join_group


class PrefillRank(FollowerRank):
    """A follower rank (tp_rank >= 1) of a TP prefill worker."""

    role = "prefill"

    def __init__(self, topology, worker: int, tp_rank: int, port: int):
        from kvrelay.engine.kv_transfer import KVExporter, configure_ucx, layout_of
        from kvrelay.prefill_worker.worker import load_runner, pool_tokens

        configure_ucx(topology.kv_transfer.ucx_tls, "lo" if topology.device == "cpu" else None)
        ctx = join_group(topology.device, tp_rank, topology.prefill.tp, port)
        runner = load_runner(topology, kv_tokens=pool_tokens(topology), shard=ctx)
        layout, pools = layout_of(runner.kv)
        # Leases live on the leader; this exporter only registers the pool and describes pages.
        exporter = KVExporter(layout, pools, name_prefix=f"prefill{worker}r{tp_rank}")
        super().__init__(worker, tp_rank, topology.prefill.tp, runner, exporter)

    def prefill(self, rid: str, prompt_ids: list[int]):
        """The leader's prefill, on this rank's shard; returns where this rank's pages are."""
        with self._lock:
            follower_op(lambda: self.runner.prefill(rid, prompt_ids))
            kv = self.runner.export_sequence(rid)
            return self.transfer.describe(kv.pages, kv.length, first_blocks=kv.first_page)
