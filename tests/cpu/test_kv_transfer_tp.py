"""Real NIXL READs between differently sharded pools: a TPp prefill group exports, a TPd decode rank pulls
exactly its KV heads (8 query / 2 KV heads, so TP4 holds replicated heads).

The prefill ranks' exporters (one NIXL agent each, as in separate rank processes) live in a spawned
process; every decode rank's importer lives in the test process. Pool contents are built from one
seeded "global" tensor holding all KV heads, so the test knows which bytes every rank must end up with.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os

import pytest
import torch

from kvrelay.engine.kv_geometry import live_pages
from kvrelay.transfer.handle import KVLayout
from kvrelay.transfer.nixl import KVExporter, KVImporter
from kvrelay.transfer.ucx import UcxSettings

pytestmark = pytest.mark.timeout(120)

BASE = KVLayout(model="tiny-tp-test", dtype="bfloat16", page_size=4, layer_types=("sliding", "full") * 2,
                kv_heads=2, head_dim=8, sliding_window=8, q_heads=8)
PAGES = 16


def global_pools(num_pages: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Every KV head of every layer: [pages, 2, page_size, kv_heads, head_dim] per layer."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {"full": [], "sliding": []}
    for kind in BASE.layer_types:
        shape = (num_pages, 2, BASE.page_size, BASE.kv_heads, BASE.head_dim)
        out[kind].append(torch.randn(shape, generator=gen).to(torch.bfloat16))
    return out


def rank_layout(tp: int, rank: int) -> KVLayout:
    return dataclasses.replace(BASE, tp_size=tp, tp_rank=rank)


def rank_pools(pools: dict[str, list[torch.Tensor]], layout: KVLayout) -> dict[str, list[torch.Tensor]]:
    h = layout.heads
    return {g: [t[..., h.kv0:h.kv1, :].contiguous() for t in ts] for g, ts in pools.items()}


def _prefill_group(conn, tp: int) -> None:
    UcxSettings("tcp,cma,self", "lo").apply()
    full = global_pools(PAGES, seed=99)
    exporters = [KVExporter(rank_layout(tp, r), rank_pools(full, rank_layout(tp, r)), lease_seconds=30,
                            name_prefix=f"p{r}") for r in range(tp)]
    released: list[str] = []
    while True:
        cmd, *args = conn.recv()
        if cmd == "pin":
            rid, table, n = args
            peers = [e.describe({"full": table, "sliding": table}, n) for e in exporters[1:]]
            conn.send(exporters[0].pin(rid, {"full": table, "sliding": table}, n, peers=peers,
                                       on_release=lambda rid=rid: released.append(rid)))
        elif cmd == "release":
            conn.send((exporters[0].release(args[0]), list(released)))
        elif cmd == "stop":
            for e in exporters:
                e.close()
            conn.send(True)
            return


class PrefillGroup:
    def __init__(self, tp: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_group, args=(child, tp), daemon=True)
        self.proc.start()

    def call(self, *msg):
        self.conn.send(msg)
        assert self.conn.poll(60), f"prefill group did not answer {msg[0]}"
        return self.conn.recv()

    def stop(self):
        self.call("stop")
        self.proc.join(10)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 4), (4, 1), (2, 2)])
def test_each_decode_rank_pulls_exactly_its_heads(prefill_tp, decode_tp):
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    UcxSettings("tcp,cma,self", "lo").apply()
    group = PrefillGroup(prefill_tp)
    importers = [KVImporter(rank_layout(decode_tp, r),
                            rank_pools(global_pools(PAGES, seed=0), rank_layout(decode_tp, r)))
                 for r in range(decode_tp)]
    try:
        for num_tokens in (1, 9, 30):  # one page; past the window; the sliding group drops pages
            for imp in importers:
                for t in imp._pools["full"] + imp._pools["sliding"]:
                    t.zero_()
            n_pages = -(-num_tokens // BASE.page_size)
            src_table = [(5 * i + 3) % PAGES for i in range(n_pages)]  # scrambled on both sides
            handle = group.call("pin", f"r{num_tokens}", src_table, num_tokens)
            assert len(handle.sources()) == prefill_tp
            want = global_pools(PAGES, seed=99)
            for imp in importers:
                need = handle.pages_needed()
                dst = {g: [PAGES - 1 - 2 * i for i in range(k)] for g, k in need.items()}
                stats = imp.pull(handle, dst)
                h = imp.layout.heads
                assert stats.nbytes == sum(len(p) for p in dst.values()) * 2 * (h.kv1 - h.kv0) * BASE.page_size \
                    * BASE.head_dim * 2 * 2  # layers per group (2) x bf16 (2 bytes)
                for g in ("full", "sliding"):
                    first = live_pages(g, num_tokens, BASE.page_size, BASE.sliding_window).start
                    for li, (src, got) in enumerate(zip(want[g], imp._pools[g])):
                        for k, d in enumerate(dst[g]):
                            expect = src[src_table[first + k]][..., h.kv0:h.kv1, :]
                            assert torch.equal(got[d], expect), (g, li, k, imp.layout.tp_rank)
                        untouched = [p for p in range(PAGES) if p not in dst[g]]
                        assert not got[untouched].any()
            ok, released = group.call("release", handle.lease_id)
            assert ok and released[-1] == f"r{num_tokens}"
    finally:
        for imp in importers:
            imp.close()
        group.stop()


def test_decode_plan_reads_only_the_ranks_it_needs():
    imp_layout = rank_layout(4, 3)  # holds KV head 1
    imp = KVImporter(imp_layout, rank_pools(global_pools(2, seed=0), imp_layout))
    try:
        plan, slices = imp.plan(2)
        assert plan.source_ranks(3) == (1,) and [s.num_heads for s in slices] == [1]
        plan, slices = imp.plan(1)
        assert plan.source_ranks(3) == (0,) and (slices[0].src0, slices[0].dst0) == (1, 0)
    finally:
        imp.close()
