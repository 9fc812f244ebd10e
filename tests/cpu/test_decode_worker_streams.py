"""The decode actor's methods called directly (no Ray) on the real tiny model: the pull window's page
lifetime, one reader per token channel, and fork choices that hear their end (split out of test_scheduler)."""

from __future__ import annotations

import pytest

from kvrelay.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

# ---- the decode actor's pull window (its methods called directly, no Ray) -----------------------
DECODE_TOPOLOGY = """
model: {name: tiny, dummy: true, seed: 0, max_context: 256}
prefill: {workers: 1, max_prompt_tokens: 128}
decode: {workers: 1, max_batch: 2, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
device: cpu
"""


class _Prefill:
    """Stands in for the prefill actor handle: only `release.remote` is called on it."""

    class _Release:
        def __init__(self):
            self.calls: list[int] = []

        def remote(self, lease_id: int):
            self.calls.append(lease_id)

            async def answer():
                return True

            return answer()

    def __init__(self):
        self.release = self._Release()


def _handle(layout, rid: str, num_tokens: int):
    """A handle for `num_tokens` positions whose pages are never read (the test replaces the READ)."""
    import time

    from kvrelay.engine.kv_geometry import live_pages
    from kvrelay.transfer.handle import KVHandle, PageGroupDescriptor

    groups = []
    for g in ("full", "sliding"):
        live = live_pages(g, num_tokens, layout.page_size, layout.sliding_window)
        layers = layout.group_layers(g)
        groups.append(PageGroupDescriptor(g, layers, (0,) * len(layers), 1, 0, live.start, tuple(range(len(live)))))
    return KVHandle(rid, 1, "fake-prefill", b"", "DRAM", layout, layout.layout_hash, num_tokens, tuple(groups),
                    time.time() + 60, time.time() + 65)


@pytest.fixture(scope="module")
def decode_worker():
    import os

    from kvrelay.cluster.specs import decode_spec
    from kvrelay.cluster.topology import parse_topology
    from kvrelay.decode_worker.worker import DecodeWorker

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    worker = DecodeWorker(decode_spec(parse_topology(DECODE_TOPOLOGY, source="test")))
    yield worker
    import asyncio

    asyncio.run(worker.shutdown())


@pytest.mark.parametrize("how", ["abort", "stream closed"])
def test_pages_outlive_an_aborted_pull_until_the_read_ends(decode_worker, how):
    """An abort (or the consumer going away) while NIXL is still READing into the request's pages must
    not free them: another request could be given them and then be overwritten by the late READ."""
    import asyncio
    import threading

    from kvrelay.transfer.handle import TransferStats

    w = decode_worker
    started, gate = threading.Event(), threading.Event()
    real_pull = w.importer.pull

    def slow_pull(handle, pages):
        started.set()
        assert gate.wait(30), "test never opened the gate"
        return TransferStats(0, 0.0, 0)

    def in_use() -> int:
        return sum(w.scheduler.stats().pages_in_use.values())

    async def go():
        rid = f"victim-{how}"
        prefill = _Prefill()
        await w.reserve(rid, 40, 8)
        stream = w.generate(rid, _handle(w.importer.layout, rid, 40), 7, 1, SamplingParams(max_tokens=8), prefill)
        first = asyncio.ensure_future(stream.__anext__())
        while not started.is_set():
            await asyncio.sleep(0.01)
        held = in_use()
        assert held > 0
        if how == "abort":
            assert await w.abort(rid) is True
        else:
            first.cancel()
            await asyncio.sleep(0.05)
            await stream.aclose()
        await asyncio.sleep(0.1)
        # The READ has not ended: the pages are still this request's and counted against the budget.
        assert w.runner.has_sequence(rid) and in_use() == held and w.scheduler.has_reservation(rid)
        gate.set()
        if how == "abort":
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(first, 10)  # ends quietly, no token after an abort
        deadline = asyncio.get_running_loop().time() + 10
        while w.runner.has_sequence(rid) or w.scheduler.has_reservation(rid):
            assert asyncio.get_running_loop().time() < deadline, "pages never freed after the READ ended"
            await asyncio.sleep(0.02)
        assert in_use() == 0

    w.importer.pull = slow_pull
    try:
        asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        gate.set()
        w.importer.pull = real_pull


def test_a_token_channel_has_one_reader_and_every_event_reaches_it(decode_worker):
    """A caller that dropped its channel stream leaves the worker's side waiting at its queue (Ray does not
    cancel it). A second stream under that id used to take turns with it at the queue, so a request's
    finish could go to the dead reader and its caller wait for good; it is refused now, the open reader
    gets every event, and `streaming` says when a request's last event has left."""
    import asyncio

    from kvrelay.transfer.handle import TransferStats

    w = decode_worker
    real_pull = w.importer.pull

    async def go():
        dropped = w.channel("ch-1")
        waiting = asyncio.ensure_future(dropped.__anext__())  # the dropped caller's reader, at the queue
        await asyncio.sleep(0.01)
        second = w.channel("ch-1")
        with pytest.raises(ValueError, match="already open"):
            await asyncio.wait_for(second.__anext__(), 5)
        rid = "chan-1"
        await w.reserve(rid, 40, 6)
        pull = await w.start(rid, _handle(w.importer.layout, rid, 40), 7, 1,
                             SamplingParams(max_tokens=6, temperature=0.0), _Prefill(), "ch-1")
        assert pull is not None
        events = list(await asyncio.wait_for(waiting, 10))
        while events[-1][3] is None:
            events += await asyncio.wait_for(dropped.__anext__(), 10)
        assert [e[0] for e in events] == [rid] * 5 and events[-1][3] == "length"
        assert not await w.streaming(rid) and not w.scheduler.has_reservation(rid)
        await dropped.aclose()
        assert "ch-1" not in w._channels and "ch-1" not in w._readers
        # A re-attaching router's reset ends the streams its predecessor left open.
        left = w.channel("ch-2")
        pending = asyncio.ensure_future(left.__anext__())
        await asyncio.sleep(0.01)
        await w.reset()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(pending, 5)
        assert "ch-2" not in w._readers

    w.importer.pull = lambda handle, pages: TransferStats(0, 0.0, 0)  # the pages' bytes are not judged here
    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        w.importer.pull = real_pull


def test_a_choice_aborted_during_the_group_pull_hears_aborted(decode_worker):
    """n=2 from one pull: choice 1 is aborted while choice 0's KV is still being READ. It is not forked,
    and its caller's channel says "aborted" (its route was set with the group's), instead of never
    hearing of it again; choice 0 decodes to its end."""
    import asyncio
    import threading

    from kvrelay.transfer.handle import TransferStats

    w = decode_worker
    real_pull = w.importer.pull
    started, gate = threading.Event(), threading.Event()

    def slow_pull(handle, pages):
        started.set()
        assert gate.wait(30), "test never opened the gate"
        return TransferStats(0, 0.0, 0)

    async def go():
        params = SamplingParams(max_tokens=6, temperature=0.0)
        await w.reserve("g0", 40, 6, ("g1",))
        channel = w.channel("ch-g")
        events: list[tuple] = []

        async def read():
            async for batch in channel:
                events.extend(batch)
                if {e[0] for e in events if e[3] is not None or e[4] is not None} == {"g0", "g1"}:
                    return

        reader = asyncio.ensure_future(read())
        start = asyncio.ensure_future(w.start_group("g0", _handle(w.importer.layout, "g0", 40), 1, params,
                                                    _Prefill(), "ch-g", (("g0", 7, params), ("g1", 9, params))))
        while not started.is_set():
            await asyncio.sleep(0.01)
        await w.abort("g1")
        gate.set()
        assert await asyncio.wait_for(start, 10) is not None
        await asyncio.wait_for(reader, 10)
        await channel.aclose()
        assert [e[4] for e in events if e[0] == "g1"] == ["aborted"]
        g0 = [e for e in events if e[0] == "g0"]
        assert len(g0) == 5 and g0[-1][3] == "length"
        assert not await w.streaming("g1") and not await w.streaming("g0")
        assert w.scheduler.request_ids() == [] and not w.runner.has_sequence("g1")

    w.importer.pull = slow_pull
    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        gate.set()
        w.importer.pull = real_pull
