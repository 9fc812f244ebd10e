"""The engine client's side of a decode worker's token channel, over stand-in actors (no Ray): channel ids
never repeat, and a request whose stream the worker has ended without its end arriving is retried, not
awaited for good (the worker is alive and idle then, so the hung-worker checks alone never fire)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc

import pytest

from kvrelay.cluster.engine_client import DisaggregatedEngineClient
from kvrelay.cluster.worker_pool import _Retry

pytestmark = pytest.mark.timeout(60)


class _Ref:
    """An ObjectRef's two faces the client uses: awaitable, and `.future()`."""

    def __init__(self, value):
        self.value = value

    def future(self) -> concurrent.futures.Future:
        f = concurrent.futures.Future()
        f.set_result(self.value)
        return f

    def __await__(self):
        async def get():
            return self.value

        return get().__await__()


class _Method:
    def __init__(self, fn):
        self.fn = fn
        self.calls: list[tuple] = []

    def remote(self, *args):
        self.calls.append(args)
        return _Ref(self.fn(*args))


class _Stream:
    """A channel stream that never yields (the test only needs its id)."""

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()


class _Channel:
    def __init__(self):
        self.ids: list[str] = []

    def options(self, **_):
        return self

    def remote(self, channel_id: str):
        self.ids.append(channel_id)
        return _Stream()


class _Decode:
    """A live, idle decode worker: answers its pings, no step stalled; `streams` says which requests it
    still has events for."""

    def __init__(self, streams=()):
        self.streams = set(streams)
        self.health = _Method(lambda: True)
        self.step_stall_s = _Method(lambda: 0.0)
        self.streaming = _Method(lambda rid: rid in self.streams)
        self.channel = _Channel()


def client_of(decode: _Decode, stall_check_s: float = 0.05) -> DisaggregatedEngineClient:
    return DisaggregatedEngineClient([object()], [decode], model_name="tiny", max_context=256,
                                     stall_check_s=stall_check_s, worker_timeout_s=2.0)


def test_channel_ids_never_repeat_across_clients():
    """Each client used to name its channel after id(self): a client collected by the GC left its address
    to the next one, whose channel then had the same id as the dropped one still open on the worker."""
    decode = _Decode()

    async def open_one():
        c = client_of(decode)
        ch = c._channel(c.decode[0])
        await asyncio.sleep(0)  # the pump has asked the worker for the stream
        ch.task.cancel()

    for _ in range(30):
        asyncio.run(open_one())
        gc.collect(1)  # the client (in a cycle with its pump task) is freed here; its address can come back
    ids = decode.channel.ids
    assert len(ids) == 30 and len(set(ids)) == 30, ids


def test_a_stream_whose_end_never_arrives_is_retried():
    """The worker answers and has no more events for the request: after its last event has had a whole
    stall check to arrive, the wait ends in a retry (re-prefill) instead of lasting for good."""
    decode = _Decode()
    c = client_of(decode)

    async def go():
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(_Retry, match="end never arrived") as e:
            await c._next(asyncio.Queue(), c.decode[0], "r-lost")
        assert e.value.cause == "decode_stream_lost"
        assert asyncio.get_running_loop().time() - t0 >= 2 * c.stall_check_s
        assert decode.streaming.calls == [("r-lost",), ("r-lost",)]

    asyncio.run(go())


def test_a_quiet_stream_the_worker_still_holds_waits_and_a_late_end_is_taken():
    """No token for several stall checks while the worker still streams the request (a long prefill of
    others, a slow step): it keeps waiting. An end that arrives within the grace after the worker let go
    of the request is taken as it is."""
    decode = _Decode(streams={"r-slow"})
    c = client_of(decode)

    async def go():
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, q.put_nowait, (5, None, None, None, None))
        outs = await c._next(q, c.decode[0], "r-slow")
        assert [o.token_id for o in outs] == [5] and len(decode.streaming.calls) >= 3
        decode.streams.clear()  # its last event has left the worker and arrives after one stall check
        loop.call_later(1.5 * c.stall_check_s, q.put_nowait, (6, None, "length", None, None))
        outs = await c._next(q, c.decode[0], "r-slow")
        assert [(o.token_id, o.finish_reason) for o in outs] == [(6, "length")]

    asyncio.run(go())
