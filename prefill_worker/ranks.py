"""The follower ranks of a TP prefill worker (rank 0 is the `PrefillWorker` actor itself).

The group plumbing (spawning, rendezvous, lockstep fan-out, health) is workers/rank_group.py; what is
prefill-specific is here: a follower runs the leader's prefill on its shard and describes where its
pages are, so the leader can put every rank's pages into the one handle it leases. Leases live on the
leader, which frees the pages on every rank once its lease is released or reclaimed.

With the prefix cache (prefill.prefix_cache) every rank keeps the same cache over its shard of the KV
heads: each prefill is one `cached_prefill` on every rank (lookup, room check, forward of what the hit
leaves), so every rank's cache sees the same calls in the same order and decides the same hits,
evictions and host slots (engine/prefix_cache.py); the leader checks each rank's hit, pages and cache
digest against its own and takes the group down on any difference (workers/rank_group.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.workers.loading import load_runner
from kvrelay.workers.rank_group import FollowerRank, follower_op, join_group
from kvrelay.workers.specs import PrefillSpec


def load_rank_runner(spec: PrefillSpec, shard):
    """A TP rank's shard of the prefill Runner (every rank alike, so their allocators mirror), with the
    prefix cache if the spec asks for it (its host tier split over the ranks: KVCache.enable_prefix_cache)."""
    runner = load_runner(spec.model, device=spec.device, page_size=spec.page_size, kv_tokens=spec.pool_tokens,
                         shard=shard)
    if spec.prefix_cache:
        runner.kv.enable_prefix_cache(spec.prefix_cache_host_bytes)
    return runner


@dataclass(frozen=True)
class CachedPrefill:
    """What one rank's `cached_prefill` did: positions the cache supplied (`start`; `host` of them from
    the host tier), its cache's digest after the op, and the logits (None: no room, nothing kept)."""

    start: int
    host: int
    digest: int
    logits: object = None


def cached_prefill(runner, rid: str, prompt_ids: list[int], all_logits: bool = False) -> CachedPrefill:
    """A prompt under the prefix cache on one rank, the same on every rank of the group: resume after
    the longest cached prefix (none when the prompt wants every position's logits), then compute the
    rest in one forward if the pool has room for it; without room the sequence is dropped and its
    lookup uncounted (the caller tries again once pages come back). Deterministic in the rank's cache
    state, which every rank's same calls keep equal."""
    kv = runner.kv
    start = kv.begin_prefix(rid, prompt_ids, lookup=not all_logits)
    host = kv.host_hit(rid)
    if not runner.can_admit(len(prompt_ids) - start, length=start):
        runner.free(rid)
        if not all_logits:
            kv.prefix.retract(len(prompt_ids), start, host)
        return CachedPrefill(start, host, kv.prefix.digest)
    try:
        logits = runner.extend(rid, prompt_ids[start:], all_logits=all_logits)
    except BaseException:
        if runner.has_sequence(rid):
            runner.free(rid)
        raise
    return CachedPrefill(start, host, kv.prefix.digest, logits)


class PrefillRank(FollowerRank):
    """A follower rank (tp_rank >= 1) of a TP prefill worker."""

    role = "prefill"

    def __init__(self, spec: PrefillSpec, worker: int, tp_rank: int, port: int):
        from kvrelay.transfer.handle import layout_of
        from kvrelay.transfer.nixl import KVExporter

        spec.ucx.apply()
        ctx = join_group(spec.device, tp_rank, spec.tp, port)
        runner = load_rank_runner(spec, ctx)  # the prefix cache too, if the spec asks for it
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

    def prefill_cached(self, rid: str, prompt_ids: list[int], all_logits: bool = False):
        """The leader's `cached_prefill`, on this rank's shard: (what it did, without the logits, which
        are the leader's; where this rank's pages are, or None without room)."""
        with self._lock:
            done = follower_op(lambda: cached_prefill(self.runner, rid, prompt_ids, all_logits))
            if done.logits is None:
                return done, None
            kv = self.runner.export_sequence(rid)
            return (CachedPrefill(done.start, done.host, done.digest),
                    self.transfer.describe(kv.pages, kv.length, first_blocks=kv.first_page))

    def prefix_cache(self) -> dict | None:
        """This rank's cache summary (PrefixCache.summary(), its digest too): equal to the leader's
        status row's while the ranks agree. Not in this rank's status row: the group counts once."""
        with self._lock:
            prefix = self.runner.kv.prefix
            return None if prefix is None else prefix.summary()
