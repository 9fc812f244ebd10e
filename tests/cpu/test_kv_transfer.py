"""Real NIXL transfers between two processes over UCX loopback, on raw pool-shaped tensors.

The exporter lives in a spawned process (its own NIXL agent and address space), the importer in the
test process, so every byte checked here crossed a process boundary through UCX.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from kvrelay.engine.kv_geometry import live_pages
from kvrelay.transfer.handle import KVLayout, KVLayoutMismatch, KVLeaseExpired
from kvrelay.transfer.nixl import KVExporter, KVImporter
from kvrelay.transfer.ucx import UcxSettings

pytestmark = pytest.mark.timeout(120)

LAYOUT = KVLayout(model="tiny-test", dtype="bfloat16", page_size=4, layer_types=("sliding", "full") * 2,
                  kv_heads=2, head_dim=8, sliding_window=8)
EXPORT_PAGES = 24


def make_pools(layout: KVLayout, num_pages: int, seed: int | None) -> dict[str, list[torch.Tensor]]:
    """Per-layer pools; seeded random contents so the test process can rebuild the exporter's bytes."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (num_pages, 2, layout.page_size, layout.local_kv_heads, layout.head_dim)
    pools: dict[str, list[torch.Tensor]] = {"full": [], "sliding": []}
    for kind in layout.layer_types:
        t = (torch.randn(shape, generator=gen) if gen is not None else torch.zeros(shape))
        pools[kind].append(t.to(getattr(torch, layout.dtype)).contiguous())
    return pools


def _peer(conn, lease_seconds: float, grace_seconds: float) -> None:
    """Exporter process: serves pin/release/reap commands over a pipe."""
    UcxSettings("tcp,cma,self", "lo").apply()
    pools = make_pools(LAYOUT, EXPORT_PAGES, seed=1234)
    exp = KVExporter(LAYOUT, pools, lease_seconds=lease_seconds, grace_seconds=grace_seconds)
    released: list[str] = []
    while True:
        cmd, *args = conn.recv()
        try:
            if _serve(conn, exp, released, cmd, args):
                return
        except Exception as e:  # sent back so the test sees the exporter's own error
            conn.send(e)


def _serve(conn, exp: KVExporter, released: list[str], cmd: str, args: list) -> bool:
    if cmd == "pin":
        rid, tables, n, first = args
        conn.send(exp.pin(rid, tables, n, first_blocks=first,
                          on_release=lambda rid=rid: released.append(rid)))
    elif cmd == "release":
        conn.send(exp.release(args[0]))
    elif cmd == "reap":
        conn.send(exp.reap())
    elif cmd == "state":
        conn.send((exp.active_leases(), list(released)))
    elif cmd == "stop":
        exp.close()
        conn.send(True)
        return True
    return False


class Peer:
    def __init__(self, lease_seconds: float = 30.0, grace_seconds: float = 2.0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer, args=(child, lease_seconds, grace_seconds), daemon=True)
        self.proc.start()

    def call(self, *msg):
        self.conn.send(msg)
        if not self.conn.poll(60):
            raise TimeoutError(f"exporter process did not answer {msg[0]}")
        got = self.conn.recv()
        if isinstance(got, Exception):
            raise got
        return got

    def stop(self):
        self.call("stop")
        self.proc.join(10)


@pytest.fixture(scope="module")
def peer():
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    p = Peer()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def importer():
    UcxSettings("tcp,cma,self", "lo").apply()
    pools = make_pools(LAYOUT, 40, seed=None)
    imp = KVImporter(LAYOUT, pools)
    imp.test_pools = pools  # the test reads the destination bytes directly
    yield imp
    imp.close()


def test_live_pages():
    assert list(live_pages("full", 0, 4, 8)) == []
    assert list(live_pages("full", 1, 4, 8)) == [0]
    assert list(live_pages("full", 9, 4, 8)) == [0, 1, 2]
    assert list(live_pages("sliding", 8, 4, 8)) == [0, 1]
    assert list(live_pages("sliding", 9, 4, 8)) == [0, 1, 2]  # next query (pos 9) sees keys 2..9
    assert list(live_pages("sliding", 11, 4, 8)) == [1, 2]  # pos 11 sees keys 4..11
    assert list(live_pages("sliding", 12, 4, 8)) == [1, 2]
    assert list(live_pages("sliding", 16, 4, 8)) == [2, 3]


def test_live_pages_agree_with_engine_cache():
    from kvrelay.engine.config import PRESETS
    from kvrelay.engine.kv_cache import KVCache
    from kvrelay.transfer.handle import layout_of
    cfg = PRESETS["tiny"]
    cache = KVCache(cfg, num_pages=64, page_size=4)
    for n in [1, 3, 4, 5, cfg.sliding_window - 1, cfg.sliding_window, cfg.sliding_window + 1, 40, 41]:
        kv = cache.import_sequence(("s", n), n)
        for g in ("full", "sliding"):
            live = live_pages(g, n, 4, cfg.sliding_window)
            assert (kv.first_page[g], len(kv.pages[g])) == (live.start, len(live)), (g, n)
        cache.free(("s", n))
    layout, pools = layout_of(cache)
    assert layout.layer_types == tuple("sliding" if i % 2 == 0 else "full" for i in range(cfg.num_hidden_layers))
    assert pools["full"][0].shape == (64, 2, 4, cfg.num_key_value_heads, cfg.head_dim)
    assert pools["sliding"][1].data_ptr() == cache.pools["sliding"][1].data_ptr()


def test_layout_hash_covers_every_field_but_the_tp_shape():
    import dataclasses
    variants = [dataclasses.replace(LAYOUT, model="x"), dataclasses.replace(LAYOUT, dtype="float32"),
                dataclasses.replace(LAYOUT, page_size=8), dataclasses.replace(LAYOUT, sliding_window=16),
                dataclasses.replace(LAYOUT, layer_types=("full", "sliding") * 2),
                dataclasses.replace(LAYOUT, kv_heads=1), dataclasses.replace(LAYOUT, q_heads=8),
                dataclasses.replace(LAYOUT, head_dim=16)]
    hashes = {v.layout_hash for v in variants} | {LAYOUT.layout_hash}
    assert len(hashes) == len(variants) + 1
    # Differently sharded groups still exchange KV (head by head): the TP shape travels as data.
    for tp, rank in [(2, 0), (2, 1)]:
        sharded = dataclasses.replace(LAYOUT, tp_size=tp, tp_rank=rank)
        assert sharded.layout_hash == LAYOUT.layout_hash and sharded.local_kv_heads == 1


def test_layout_of_uses_the_caches_tp_size_when_kv_heads_are_replicated():
    from kvrelay.engine.config import PRESETS
    from kvrelay.engine.kv_cache import KVCache
    from kvrelay.transfer.handle import layout_of
    from kvrelay.engine.parallel import ParallelContext

    cfg = PRESETS["tiny"]  # 8 query / 2 KV heads: TP4 keeps one replicated KV head per rank
    layout, pools = layout_of(KVCache(cfg, num_pages=4, page_size=4, shard=ParallelContext(3, 4)))
    assert (layout.tp_size, layout.tp_rank, layout.local_kv_heads, layout.q_heads) == (4, 3, 1, 8)
    assert (layout.heads.kv0, layout.heads.kv1) == (1, 2)
    assert pools["full"][0].shape[-2] == 1


@pytest.mark.parametrize("num_tokens", [1, 7, 8, 9, 13, 30])
def test_pull_copies_exactly_the_live_pages(peer, importer, num_tokens):
    ps = LAYOUT.page_size
    n_pages = (num_tokens + ps - 1) // ps
    # Scrambled physical pages on both sides: a bug that copies page i to page i would show.
    src_table = [(7 * i + 3) % EXPORT_PAGES for i in range(n_pages)]
    handle = peer.call("pin", f"r{num_tokens}", {"full": src_table, "sliding": src_table}, num_tokens, None)
    need = handle.pages_needed()
    assert need["full"] == n_pages
    live = live_pages("sliding", num_tokens, ps, LAYOUT.sliding_window)
    assert need["sliding"] == len(live) and handle.first_blocks()["sliding"] == live.start

    for t in importer.test_pools["full"] + importer.test_pools["sliding"]:
        t.zero_()
    dst = {g: [39 - 2 * i for i in range(k)] for g, k in need.items()}
    stats = importer.pull(handle, dst)
    assert stats.nbytes == handle.nbytes > 0

    expected = make_pools(LAYOUT, EXPORT_PAGES, seed=1234)
    for group in ("full", "sliding"):
        first = handle.first_blocks()[group]
        for li, (want, got) in enumerate(zip(expected[group], importer.test_pools[group])):
            for k, d in enumerate(dst[group]):
                src = src_table[first + k]
                assert torch.equal(got[d], want[src]), f"{group} layer {li} block {first + k}"
            untouched = [p for p in range(got.shape[0]) if p not in dst[group]]
            assert not got[untouched].any(), f"{group}: a page outside the pulled set was written"
    assert peer.call("release", handle.lease_id) is True
    active, released = peer.call("state")
    assert active == 0 and f"r{num_tokens}" in released


def test_layout_mismatch_is_refused_before_any_transfer(peer):
    import dataclasses
    other = dataclasses.replace(LAYOUT, page_size=8)
    imp = KVImporter(other, make_pools(other, 4, seed=None))
    handle = peer.call("pin", "mm", {"full": [0, 1], "sliding": [0, 1]}, 6, None)
    with pytest.raises(KVLayoutMismatch, match=r"page_size: 4 vs 8"):
        imp.pull(handle, {"full": [0, 1], "sliding": [0, 1]})
    assert peer.call("release", handle.lease_id) is True
    imp.close()


def test_expired_lease_is_reported_and_reclaimed(importer):
    short = Peer(lease_seconds=0.3, grace_seconds=0.3)
    try:
        handle = short.call("pin", "late", {"full": [0, 1], "sliding": [0, 1]}, 6, None)
        time.sleep(0.35)
        with pytest.raises(KVLeaseExpired, match=r"lease .* expired"):
            importer.pull(handle, {"full": [0, 1], "sliding": [0, 1]})
        assert short.call("reap") == []  # past expiry but within the grace: not yet reclaimed
        time.sleep(0.3)
        assert short.call("reap") == ["late"]
        active, released = short.call("state")
        assert active == 0 and released == ["late"]
        assert short.call("release", handle.lease_id) is False  # already gone
    finally:
        short.stop()


def test_release_after_expiry_reports_false():
    short = Peer(lease_seconds=0.2, grace_seconds=5.0)
    try:
        handle = short.call("pin", "x", {"full": [2], "sliding": [2]}, 3, None)
        time.sleep(0.25)
        assert short.call("release", handle.lease_id) is False  # freed, but caller must not trust data
        assert short.call("state") == (0, ["x"])
    finally:
        short.stop()


def test_pin_rejects_short_page_table(peer):
    with pytest.raises(ValueError, match="need"):
        peer.call("pin", "bad", {"full": [0], "sliding": [0]}, 9, None)


def test_an_abandoned_read_is_waited_out_before_the_pages_are_given_back():
    """NIXL refuses to release a READ it cannot cancel; the importer must not return (and let the caller
    free the destination pages) until that READ has ended, and must say so when it never does."""
    from kvrelay.transfer.handle import KVHandle, KVReadInFlight, KVShard

    class Agent:
        def __init__(self, refusals: int):
            self.refusals = refusals

        def release_xfer_handle(self, xfer):
            if self.refusals:
                self.refusals -= 1
                raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")  # still writing, not cancellable

    imp = object.__new__(KVImporter)  # only the retirement logic; no NIXL agent needed
    imp._poll, imp._settle_s = 0.001, 5.0
    handle = KVHandle("r", 1, "p", b"", "DRAM", LAYOUT, LAYOUT.layout_hash, 4, (), 0.0, 0.0)
    src = KVShard(0, "p", b"", "DRAM", ())
    imp._agent = Agent(refusals=3)
    imp._retire(handle, [(src, object())])
    assert imp._agent.refusals == 0  # retried until the READ ended and the handle went
    imp._agent, imp._settle_s = Agent(refusals=10**9), 0.05
    with pytest.raises(KVReadInFlight, match="could not be cancelled"):
        imp._retire(handle, [(src, object())])


def test_an_idle_agent_uses_under_two_percent_of_a_core():
    """NIXL's progress thread spun without pause (98% of a core per idle worker); it now pauses
    between polls. Measured in a fresh process: an agent with registered memory, idle for 3 s."""
    import subprocess
    import sys

    code = (
        "import time, torch\n"
        "from kvrelay.transfer.nixl import _new_agent\n"
        "name, agent = _new_agent('idle')\n"
        "reg = agent.register_memory([torch.zeros(1 << 20)])\n"
        "time.sleep(0.5)\n"
        "c0, t0 = time.process_time(), time.perf_counter()\n"
        "time.sleep(3)\n"
        "print((time.process_time() - c0) / (time.perf_counter() - t0))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    share = float(out.stdout.strip().splitlines()[-1])
    assert share < 0.02, f"an idle NIXL agent used {share:.1%} of a core"
