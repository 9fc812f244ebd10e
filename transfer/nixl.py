"""The NIXL backend of the KV handoff between a prefill pool and a decode pool (the messages are in
transfer/handle.py, which heads go where in transfer/sharding.py, UCX's settings in transfer/ucx.py).

The prefill side (`KVExporter`) registers its paged KV pool with a NIXL agent once, and for each finished
prompt pins the sequence's pages under a lease and hands out a `KVHandle`: everything the decode side
needs to READ those pages without asking the prefill worker anything else (agent name + metadata, the
remote address of every page of every layer, a hash of the memory layout). The decode side (`KVImporter`)
checks the layout hash before touching the network, then pulls exactly the needed pages into pages it
allocated itself. Pulling (READ) rather than pushing (WRITE) lets decode admit a request only once it has
the pages, so prefill never waits on decode's memory.

Pool layout (FlashInfer NHD, engine/kv_cache.py's): one tensor per layer,
`[num_pages, 2, page_size, kv_heads, head_dim]`, so one page of one layer is one contiguous block of
`2 * page_size * kv_heads * head_dim * itemsize` bytes, and a transfer is a list of such blocks.
Layers come in two page groups, "full" and "sliding"; a sliding-window layer only ever attends to the last
`sliding_window` positions, so only the pages covering those are sent.

Tensor parallelism: each rank of a TPp prefill group holds only its KV heads, in its own pool behind its
own NIXL agent, so a handle lists one `KVShard` per prefill rank. The layout hash deliberately leaves the
TP shape out (it travels in `KVLayout.tp_size`): a TPd decode rank asks `sharding.plan_kv_handoff`
which prefill ranks hold its heads and READs exactly those heads' bytes from each (`page_copy_runs`),
whole pages when both sides shard alike.

Lease timing, so a READ can never observe a page that was already given to another request: the handle
carries `expires_at` (after which the importer refuses to start) and `reclaim_at = expires_at + grace`
(when the exporter actually frees the pages). An importer that started before `expires_at` must finish
before `reclaim_at` or it gives up and reports the lease as expired. Both sides use wall-clock time,
which is shared on one node and NTP-close across nodes; the grace covers the skew.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.engine.kv_geometry import GROUPS, live_pages
from kvrelay.transfer.handle import (KVHandle, KVLayout, KVLayoutMismatch, KVLeaseExpired, KVReadInFlight, KVShard,
                                     KVTransferError, PageGroupDescriptor, TransferStats)
from kvrelay.transfer.sharding import HeadSlice, KVHandoffPlan, page_copy_runs, plan_kv_handoff


@functools.lru_cache(maxsize=64)
def _plan(q_heads: int, kv_heads: int, prefill_tp: int, decode_tp: int) -> KVHandoffPlan:
    return plan_kv_handoff(q_heads, kv_heads, prefill_tp, decode_tp)


def _check_pools(layout: KVLayout, pools: Mapping[str, Sequence[torch.Tensor]]) -> None:
    dtype = getattr(torch, layout.dtype)
    want = (2, layout.page_size, layout.local_kv_heads, layout.head_dim)
    for group in GROUPS:
        layers = layout.group_layers(group)
        tensors = pools.get(group, ())
        if len(tensors) != len(layers):
            raise ValueError(f"group {group!r}: layout has {len(layers)} layers, pool has {len(tensors)}")
        for t in tensors:
            if tuple(t.shape[1:]) != want or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"group {group!r}: pool tensor {tuple(t.shape)} {t.dtype} does not match "
                                 f"[pages, *{want}] {dtype} contiguous")


def _nixl_api():
    """NIXL's Python API. `nixl` (the meta package) picks the build matching the machine's CUDA; we
    depend on the CUDA 13 build directly (`nixl-cu13`, which also runs UCX on CPU-only machines), so
    import it by its own name when the meta package is absent."""
    try:
        from nixl import _api
    except ImportError:
        from nixl_cu13 import _api
    return _api


# NIXL's progress thread polls UCX in a loop whose pause (pthrDelay) its Python API fixes at 0 us: an idle
# worker burned 98% of a core (two idle workers starved a 2-core box). Without the thread a READ never
# finishes (the exporting side must progress too, e.g. for UCX's wire-up), so the thread stays and pauses
# this long between polls: under 1% of a core idle, measured; the importer still polls its own transfers
# without pause while it waits for them.
PROGRESS_PAUSE_US = 5000
_agent_lock = threading.Lock()


def _new_agent(prefix: str):
    _api = _nixl_api()
    nixl_agent, nixl_agent_config = _api.nixl_agent, _api.nixl_agent_config
    base = _api.nixlBind.nixlAgentConfig

    class PausedConfig(base):  # the C++ config with a floor on the progress pause
        @property
        def pthrDelay(self):  # noqa: N802 - NIXL's name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, us):  # noqa: N802
            base.pthrDelay.__set__(self, max(int(us), PROGRESS_PAUSE_US))

    # The listener thread stays off: metadata travels inside the KVHandle, so NIXL needs no socket of
    # its own (fewer ports, and nothing can bind a non-loopback address behind our back).
    name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with _agent_lock:  # the swap is process-wide for as long as the agent is being built
        _api.nixlBind.nixlAgentConfig = PausedConfig
        try:
            return name, nixl_agent(name, nixl_agent_config(enable_listen_thread=False, backends=["UCX"]))
        finally:
            _api.nixlBind.nixlAgentConfig = base


def _mem_type(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.is_cuda else ("DRAM", 0)


def _register(agent, pools: Mapping[str, Sequence[torch.Tensor]]):
    tensors = [t for g in GROUPS for t in pools.get(g, ())]
    return agent.register_memory(tensors) if tensors else None


@dataclass
class _Lease:
    handle: KVHandle
    on_release: Callable[[], None] | None


class KVExporter:
    """Prefill side: owns a NIXL agent over the pool and the leases on pinned sequences."""

    def __init__(self, layout: KVLayout, pools: Mapping[str, Sequence[torch.Tensor]], *,
                 lease_seconds: float = 30.0, grace_seconds: float = 5.0, name_prefix: str = "prefill"):
        _check_pools(layout, pools)
        self.layout = layout
        self._pools = {g: list(pools.get(g, ())) for g in GROUPS}
        self.lease_seconds = lease_seconds
        self.grace_seconds = grace_seconds
        self.agent_name, self._agent = _new_agent(name_prefix)
        self._reg = _register(self._agent, self._pools)
        self._metadata = self._agent.get_agent_metadata()
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.expired_count = 0

    def describe(self, page_tables: Mapping[str, Sequence[int]], num_tokens: int, *,
                 first_blocks: Mapping[str, int] | None = None) -> KVShard:
        """Where this rank's live pages of a sequence are (no lease: a TP group's leader pins once for
        every rank). `page_tables[group]` lists physical pages in logical order starting at logical page
        `first_blocks[group]` (0 by default); pages outside the live range are not described."""
        groups = []
        for group in GROUPS:
            tensors = self._pools[group]
            if not tensors:
                continue
            table = list(page_tables.get(group, ()))
            start = (first_blocks or {}).get(group, 0)
            live = live_pages(group, num_tokens, self.layout.page_size, self.layout.sliding_window)
            if live.start < start or live.stop > start + len(table):
                raise ValueError(f"group {group!r}: page table covers logical pages [{start}, "
                                 f"{start + len(table)}) but {num_tokens} tokens need [{live.start}, {live.stop})")
            mem, dev = _mem_type(tensors[0])
            groups.append(PageGroupDescriptor(
                group=group, layer_ids=self.layout.group_layers(group),
                base_addrs=tuple(t.data_ptr() for t in tensors), page_bytes=tensors[0][0].nbytes,
                device_id=dev, first_block=live.start,
                page_ids=tuple(table[live.start - start: live.stop - start])))
        mem_type = _mem_type(next(t for g in GROUPS for t in self._pools[g]))[0]
        return KVShard(self.layout.tp_rank, self.agent_name, self._metadata, mem_type, tuple(groups))

    def pin(self, request_id: str, page_tables: Mapping[str, Sequence[int]], num_tokens: int, *,
            first_blocks: Mapping[str, int] | None = None,
            on_release: Callable[[], None] | None = None, peers: Sequence[KVShard] = ()) -> KVHandle:
        """Lease the sequence's pages and describe them (see `describe`). `peers` are the other ranks'
        `describe` of the same sequence when this exporter leads a TP group: the one lease then covers
        every rank, and `on_release` (which frees the pages on all of them) runs exactly once, when the
        lease is released or reclaimed."""
        now = time.time()
        own = self.describe(page_tables, num_tokens, first_blocks=first_blocks)
        shards: tuple[KVShard, ...] = ()
        if self.layout.tp_size > 1:
            shards = tuple(sorted((own, *peers), key=lambda sh: sh.tp_rank))
            if [sh.tp_rank for sh in shards] != list(range(self.layout.tp_size)):
                raise ValueError(f"request {request_id}: TP{self.layout.tp_size} handle needs one shard per "
                                 f"rank, got ranks {[sh.tp_rank for sh in shards]}")
        elif peers:
            raise ValueError("peers given to a TP1 exporter")
        with self._lock:
            lease_id = next(self._ids)
            handle = KVHandle(
                request_id=request_id, lease_id=lease_id, agent_name=self.agent_name,
                agent_metadata=self._metadata, mem_type=own.mem_type, layout=self.layout,
                layout_hash=self.layout.layout_hash, num_tokens=num_tokens, groups=own.groups,
                expires_at=now + self.lease_seconds, reclaim_at=now + self.lease_seconds + self.grace_seconds,
                shards=shards)
            self._leases[lease_id] = _Lease(handle, on_release)
        return handle

    def release(self, lease_id: int) -> bool:
        """Unpin. True if the lease was still valid, False if it had expired or was unknown (then
        a pull that already happened may have raced the expiry and must not be trusted)."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        if lease.on_release:
            lease.on_release()
        return time.time() < lease.handle.expires_at

    def reap(self, now: float | None = None) -> list[str]:
        """Free leases past their reclaim time; returns their request ids. Called periodically."""
        now = time.time() if now is None else now
        with self._lock:
            dead = [lid for lid, lease in self._leases.items() if now >= lease.handle.reclaim_at]
            gone = [self._leases.pop(lid) for lid in dead]
            self.expired_count += len(gone)
        for lease in gone:
            if lease.on_release:
                lease.on_release()
        return [lease.handle.request_id for lease in gone]

    def active_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def release_all(self) -> int:
        """Release every lease (their pages are freed); returns how many there were."""
        with self._lock:
            ids = list(self._leases)
        return sum(self.release(lid) for lid in ids)

    def close(self) -> None:
        """Release every lease and drop the NIXL registration."""
        self.release_all()
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None


class KVImporter:
    """Decode side: pulls leased pages from exporters into the local pool with NIXL READ."""

    def __init__(self, layout: KVLayout, pools: Mapping[str, Sequence[torch.Tensor]], *,
                 name_prefix: str = "decode", poll_interval: float = 0.0002, settle_seconds: float = 10.0):
        _check_pools(layout, pools)
        self.layout = layout
        self._pools = {g: list(pools.get(g, ())) for g in GROUPS}
        self.agent_name, self._agent = _new_agent(name_prefix)
        self._reg = _register(self._agent, self._pools)
        self._remotes: dict[str, str] = {}  # exporter agent name -> name NIXL returned on add
        self._poll = poll_interval
        self._settle_s = settle_seconds
        self._lock = threading.Lock()  # one NIXL request at a time keeps the agent's state simple

    def check(self, handle: KVHandle) -> None:
        """Raise the documented error if this handle cannot be pulled (layout first, then the lease)."""
        if handle.layout_hash != self.layout.layout_hash:
            raise KVLayoutMismatch(
                f"request {handle.request_id}: KV layout hash {handle.layout_hash} from {handle.agent_name} "
                f"!= local {self.layout.layout_hash} ({handle.layout.diff(self.layout)}); prefill and decode "
                f"must serve the same model, dtype, page size and layer types")
        if len(handle.sources()) != handle.layout.tp_size:
            raise KVTransferError(f"request {handle.request_id}: handle lists {len(handle.sources())} "
                                  f"shards for a TP{handle.layout.tp_size} prefill group")
        now = time.time()
        if now >= handle.expires_at:
            raise KVLeaseExpired(f"request {handle.request_id}: lease {handle.lease_id} on "
                                 f"{handle.agent_name} expired {now - handle.expires_at:.3f} s ago; "
                                 f"re-run prefill")

    def plan(self, prefill_tp: int) -> tuple[KVHandoffPlan, tuple[HeadSlice, ...]]:
        """The handoff plan from a TP`prefill_tp` group and this rank's part of it."""
        plan = _plan(self.layout.num_q_heads, self.layout.kv_heads, prefill_tp, self.layout.tp_size)
        return plan, plan.for_decode_rank(self.layout.tp_rank)

    def pull(self, handle: KVHandle, dst_pages: Mapping[str, Sequence[int]]) -> TransferStats:
        """READ this rank's KV heads of the handle's pages into `dst_pages[group]` (same count and
        logical order), from whichever prefill ranks hold them. Raises KVLayoutMismatch,
        KVLeaseExpired or KVTransferError; on return the bytes are in place. Returns or raises only once
        no READ of this call can still write into `dst_pages` (KVReadInFlight when that cannot be
        confirmed), so the caller may free or reuse them then."""
        self.check(handle)
        sources = handle.sources()
        plan, slices = self.plan(len(sources))
        itemsize = torch.empty((), dtype=getattr(torch, self.layout.dtype)).element_size()
        rows: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}  # src rank -> (local, remote)
        for s in slices:
            src = sources[s.src_rank]
            kv0, kv1 = plan.prefill_heads[s.src_rank]
            runs = np.array(page_copy_runs(s, self.layout.page_size, kv1 - kv0, self.layout.local_kv_heads,
                                           self.layout.head_dim, itemsize), dtype=np.uint64)
            local_rows, remote_rows = rows.setdefault(s.src_rank, ([], []))
            for g in src.groups:
                dst = np.array(list(dst_pages.get(g.group, ())), dtype=np.uint64)
                if len(dst) != len(g.page_ids):
                    raise ValueError(f"group {g.group!r}: {len(g.page_ids)} pages to pull, {len(dst)} given")
                if not len(dst):
                    continue
                local = self._pools[g.group]
                dev = _mem_type(local[0])[1]
                # Every (layer, page, run) triple at once: [layers, pages, runs] addresses, flattened.
                lbase = np.array([t.data_ptr() for t in local], dtype=np.uint64)[:, None, None]
                rbase = np.array(g.base_addrs, dtype=np.uint64)[:, None, None]
                src_pages = np.array(g.page_ids, dtype=np.uint64)[None, :, None]
                laddr = lbase + dst[None, :, None] * np.uint64(local[0][0].nbytes) + runs[None, None, :, 1]
                raddr = rbase + src_pages * np.uint64(g.page_bytes) + runs[None, None, :, 0]
                size = np.broadcast_to(runs[None, None, :, 2], laddr.shape)
                local_rows.append(np.stack([laddr, size, np.full_like(laddr, dev)], -1).reshape(-1, 3))
                remote_rows.append(np.stack([raddr, size, np.full_like(raddr, g.device_id)], -1).reshape(-1, 3))
        jobs = [(sources[r], np.concatenate(lr), np.concatenate(rr)) for r, (lr, rr) in sorted(rows.items()) if lr]
        if not jobs:
            return TransferStats(0, 0.0, 0)
        mem = "VRAM" if next(t for g in GROUPS for t in self._pools[g]).is_cuda else "DRAM"
        t0 = time.perf_counter()
        with self._lock:
            xfers = []
            try:
                # One READ per source agent, all in flight together: a TP4 -> TP1 pull waits for the
                # slowest rank, not the sum of four.
                for src, local_rows, remote_rows in jobs:
                    xfer = self._agent.initialize_xfer(
                        "READ", self._agent.get_xfer_descs(local_rows, mem),
                        self._agent.get_xfer_descs(remote_rows, src.mem_type), self._remote(src), b"")
                    xfers.append((src, xfer, self._agent.transfer(xfer)))
                pending = [(src, x) for src, x, state in xfers if self._settled(handle, src, state) == "PROC"]
                while pending:
                    if time.time() >= handle.reclaim_at:
                        raise KVLeaseExpired(
                            f"request {handle.request_id}: pull from {pending[0][0].agent_name} did not "
                            f"finish before the lease's pages were reclaimed")
                    time.sleep(self._poll)
                    pending = [(src, x) for src, x in pending
                               if self._settled(handle, src, self._agent.check_xfer_state(x)) == "PROC"]
            except KVTransferError:
                raise
            except Exception as e:  # NIXL's own errors (e.g. the exporting worker died: its agent
                # disconnected): a failed pull, which the client fixes by prefilling again
                raise KVTransferError(f"request {handle.request_id}: NIXL READ failed "
                                      f"({type(e).__name__}: {e})") from e
            finally:
                self._retire(handle, [(src, x) for src, x, _ in xfers])
        nbytes = int(sum(int(lr[:, 1].sum()) for _, lr, _ in jobs))
        return TransferStats(nbytes=nbytes, seconds=time.perf_counter() - t0,
                             descriptors=sum(len(lr) for _, lr, _ in jobs))

    def _retire(self, handle: KVHandle, xfers: list) -> None:
        """Release every transfer handle of a pull. NIXL cancels a READ that is still active, or refuses
        while it cannot; such a READ may still be writing into pages the caller is about to free, so the
        release is retried until it ends (bounded)."""
        deadline = time.monotonic() + self._settle_s
        for src, xfer in xfers:
            while True:
                try:
                    self._agent.release_xfer_handle(xfer)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise KVReadInFlight(f"request {handle.request_id}: READ from {src.agent_name} could "
                                             f"not be cancelled and did not end within {self._settle_s:g} s")
                    time.sleep(self._poll)

    @staticmethod
    def _settled(handle: KVHandle, src: KVShard, state: str) -> str:
        if state not in ("PROC", "DONE"):
            raise KVTransferError(f"request {handle.request_id}: NIXL READ from {src.agent_name} failed "
                                  f"(state {state})")
        return state

    def _remote(self, src: KVShard) -> str:
        name = self._remotes.get(src.agent_name)
        if name is None:
            got = self._agent.add_remote_agent(src.agent_metadata)
            name = got.decode() if isinstance(got, bytes) else got
            self._remotes[src.agent_name] = name
        return name

    def forget(self, agent_name: str) -> None:
        """Drop a remote agent (its worker died or restarted) so a stale connection is not reused."""
        with self._lock:
            if self._remotes.pop(agent_name, None) is not None:
                self._agent.remove_remote_agent(agent_name)

    def close(self) -> None:
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None

