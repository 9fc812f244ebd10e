"""Admission back-pressure: the waiting line (first come, first served, bounded), and the router's answer
when it is full (HTTP 429 with Retry-After through the official openai client, gRPC RESOURCE_EXHAUSTED),
and reservations made from another thread while the step thread decodes."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import openai
import pytest

from kvrelay.cluster.admission import AdmissionQueue, AdmissionTimeout
from kvrelay.router import harmony
from kvrelay.router.client import RouterClient
from kvrelay.router.engine_client import EngineOverloaded
from kvrelay.router.scripted_engine import ScriptedEngineClient
from kvrelay.router.server import BackgroundRouter


def test_line_keeps_arrival_order_and_is_bounded() -> None:
    async def main():
        q = AdmissionQueue(max_waiting=3, poll_s=0.001)
        room = {"free": 0}
        admitted: list[str] = []
        calls: list[str] = []

        def trier(name):
            async def try_once():
                calls.append(name)
                if room["free"] > 0:
                    room["free"] -= 1
                    admitted.append(name)
                    return name
                return None
            return try_once

        tasks = []
        for name in "abc":
            tasks.append(asyncio.create_task(q.admit(trier(name), timeout_s=10)))
            await asyncio.sleep(0.01)
        assert q.waiting == 3 and q.full()
        with pytest.raises(EngineOverloaded, match="3 requests are already waiting") as e:
            await q.admit(trier("d"), timeout_s=10)
        assert e.value.retry_after_s >= 1
        with pytest.raises(EngineOverloaded):
            q.check()
        # Only the oldest waiter asks while there is no room.
        asked_while_full = set(calls[3:])
        assert asked_while_full <= {"a"}, asked_while_full
        for _ in range(3):
            room["free"] += 1
            await asyncio.sleep(0.02)
        assert await asyncio.gather(*tasks) == ["a", "b", "c"] and admitted == ["a", "b", "c"]
        assert q.waiting == 0
        # With nobody waiting, a request with room goes straight through.
        room["free"] = 1
        assert await q.admit(trier("e"), timeout_s=1) == "e"

    asyncio.run(main())


def test_a_cancelled_or_timed_out_waiter_passes_its_turn() -> None:
    async def main():
        q = AdmissionQueue(max_waiting=4, poll_s=0.001)
        room = {"free": 0}

        async def try_once():
            if room["free"]:
                room["free"] -= 1
                return True
            return None

        first = asyncio.create_task(q.admit(try_once, timeout_s=10))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(q.admit(try_once, timeout_s=10))
        await asyncio.sleep(0.01)
        first.cancel()  # e.g. the client went away while waiting
        await asyncio.sleep(0.01)
        room["free"] = 1
        assert await asyncio.wait_for(second, 2) is True
        with pytest.raises(AdmissionTimeout):
            await q.admit(try_once, timeout_s=0.05)
        assert q.waiting == 0

    asyncio.run(main())


class _Busy(ScriptedEngineClient):
    """A scripted engine whose admission line is full while `busy` is set."""

    busy = False

    def check_admission(self) -> None:
        if self.busy:
            raise EngineOverloaded("1024 requests are already waiting for a decode worker", retry_after_s=2)


def test_router_answers_429_and_resource_exhausted_when_the_line_is_full() -> None:
    reply = harmony.load_encoding().encode("<|channel|>final<|message|>Hi.<|return|>", allowed_special="all")
    engine = _Busy([reply], model_name="m", max_context=4096)
    with BackgroundRouter(engine) as srv:
        with openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="x", max_retries=0, timeout=30) as c:
            engine.busy = True
            for stream in (False, True):
                with pytest.raises(openai.RateLimitError) as e:
                    c.completions.create(model="m", prompt=[1, 2, 3], max_tokens=4, stream=stream)
                assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "2"
                assert "already waiting" in e.value.message
            with pytest.raises(openai.RateLimitError):
                c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            # A bad request is still a 400, not a 429.
            with pytest.raises(openai.BadRequestError):
                c.completions.create(model="m", prompt=[1, 2, 3], max_tokens=0)
            with RouterClient(srv.grpc_target, timeout_s=30) as g:
                with pytest.raises(grpc.RpcError) as ge:
                    list(g.generate([1, 2, 3]))
                assert ge.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after 2 s" in ge.value.details()
            engine.busy = False
            assert c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]
                                             ).choices[0].message.content == "Hi."


def test_reservations_from_another_thread_while_steps_run() -> None:
    """The decode actor answers `reserve` on its event loop while the step thread decodes and releases:
    the reservations stay consistent (no lost or doubled budget, no dict mutated mid-iteration)."""
    from kvrelay.decode_worker.scheduler import Scheduler
    from kvrelay.workers.messages import AdmissionRefused
    from kvrelay.engine.runner import Runner
    from kvrelay.engine.sampling import SamplingParams, TokenOutput

    sched = Scheduler(Runner.load("tiny", dummy=True, seed=0, page_size=4, num_pages=512), max_batch=64)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    sink: list[TokenOutput] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def admitter():
        i = 0
        try:
            while not stop.is_set():
                rid = f"t{i}"
                try:
                    sched.reserve(rid, 8, 8)
                except AdmissionRefused:
                    continue
                sched.admission_load()
                time.sleep(0.0002)  # like a stream of arriving requests, not a spin holding the GIL
                sched.release(rid)
                i += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=admitter)
    t.start()
    try:
        for j in range(8):
            rid = f"r{j}"
            sched.reserve(rid, 5, params.max_tokens)
            logits = sched.runner.prefill(rid, [3 + j, 4, 5, 6, 7])
            (tok, _), = sched.runner.sample(logits, [params], [0])
            sched.join(rid, params, tok, 1, sink.append)
            sched.step()
        while sched.has_work():
            sched.step()
    finally:
        stop.set()
        t.join(timeout=30)
    assert not errors, errors
    st = sched.stats()
    assert st.reserved == 0 and st.pages_reserved == {"full": 0, "sliding": 0} and st.pages_in_use == {"full": 0, "sliding": 0}
    assert sum(o.finish_reason == "length" for o in sink) == 8
