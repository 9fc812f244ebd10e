"""The follower ranks of a TP prefill worker (rank 0 is the `PrefillWorker` actor itself).

The group plumbing (spawning, rendezvous, lockstep fan-out, health) is workers/rank_group.py; what is
prefill-specific is here: a follower runs the leader's prefill on its shard and describes where its
pages are, so the leader can put every rank's pages into the one handle it leases. Leases live on the
leader, which frees the pages on every rank once its lease is released or reclaimed.

With the prefix cache (prefill.prefix_cache) every rank keeps the same cache over its shard of the KV
heads: each prefill is the same `begin_cached` (lookup, room check) and `finish_cached` (the forward of
what the hit leaves) on every rank, so every rank's cache sees the same calls in the same order and
decides the same hits, evictions and host slots (engine/prefix_cache.py). The leader decides first and
sends its decision (hit, room, cache digest) with the op; a follower that decides otherwise leaves
before any collective, and the leader, whose forward then fails, takes the group down
(workers/rank_group.py); the leader also checks every rank's pages.
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


class RanksDisagree(RuntimeError):
    """A follower's prefix cache decided otherwise than the leader's: the group is broken."""


@dataclass(frozen=True)
class CacheDecision:
    """What one rank's cache decided for a prompt (`begin_cached`): positions it supplies (`start`; `host`
    of them from the host tier), whether the rest fits the pool (`room`), and the cache's digest after
    the lookup. Every rank of a group must decide the same."""

    start: int
    host: int
    room: bool
    digest: int


def begin_cached(runner, rid: str, prompt_ids: list[int], all_logits: bool = False) -> CacheDecision:
    """The first half of a prompt under the prefix cache, on one rank: the sequence resumes after the
    longest cached prefix (none when the prompt wants every position's logits), and is dropped again,
    its lookup uncounted, if the rest does not fit the pool (the caller tries again once pages come
    back). No collective: the leader decides first and every follower checks its own decision against
    it before the forward (`PrefillRank.prefill_cached`). Deterministic in the rank's cache state, which
    every rank's same calls keep equal."""
    kv = runner.kv
    start = kv.begin_prefix(rid, prompt_ids, lookup=not all_logits)
    host = kv.host_hit(rid)
    room = runner.can_admit(len(prompt_ids) - start, length=start)
    if not room:
        runner.free(rid)
        if not all_logits:
            kv.prefix.retract(len(prompt_ids), start, host)
    return CacheDecision(start, host, room, kv.prefix.digest)


def finish_cached(runner, rid: str, prompt_ids: list[int], begun: CacheDecision, all_logits: bool = False):
    """The second half: the forward of what the hit leaves (the logits; None without room)."""
    if not begun.room:
        return None
    try:
        return runner.extend(rid, prompt_ids[begun.start:], all_logits=all_logits)
    except BaseException:
        if runner.has_sequence(rid):
            runner.free(rid)
        raise


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

    def prefill_cached(self, rid: str, prompt_ids: list[int], all_logits: bool, expect: CacheDecision):
        """The leader's prompt under the prefix cache, on this rank's shard: this rank's cache decides,
        and must decide what the leader's did (`expect`), else this rank leaves at once, before the
        forward, whose collectives then fail on the leader, which takes the group down (a mismatched
        forward would pair collectives of other shapes). Returns where this rank's pages are (None
        without room)."""
        def run():
            mine = begin_cached(self.runner, rid, prompt_ids, all_logits)
            if mine != expect:
                raise RanksDisagree(f"request {rid}: rank {self.tp_rank}'s prefix cache decided {mine}, "
                                    f"rank 0's {expect}")
            finish_cached(self.runner, rid, prompt_ids, mine, all_logits)
            return mine.room

        with self._lock:
            if not follower_op(run):
                return None
            kv = self.runner.export_sequence(rid)
            return self.transfer.describe(kv.pages, kv.length, first_blocks=kv.first_page)

    def prefix_cache(self) -> dict | None:
        """This rank's cache summary (PrefixCache.summary(), its digest too): equal to the leader's
        status row's while the ranks agree. Not in this rank's status row: the group counts once."""
        with self._lock:
            prefix = self.runner.kv.prefix
            return None if prefix is None else prefix.summary()
