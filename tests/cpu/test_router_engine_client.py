"""InProcessEngineClient: a blocking LLM iterator bridged into asyncio, with abort; and the whole
router over the real tiny model when `kvrelay.engine.llm` is available."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvrelay.engine.sampling import SamplingParams, TokenOutput
from kvrelay.router.engine_client import EngineClient, InProcessEngineClient
from waiting import wait_for


REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "data" / "gpt-oss-tiny-original"


@dataclass
class SteppingLLM:
    """Stands in for `LLM`'s engine loop: every step emits one token (prompt[0] + n) per running
    request, sleeping like a forward pass; records which requests ran together and which were freed."""

    token_delay_s: float = 0.005
    fail_on_step: int | None = None
    max_pages_tokens: int = 10_000
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(name="stepping", vocab_size=1024))
    max_context: int = 256
    running: dict = field(default_factory=dict)  # rid -> [prompt, produced, params]
    freed: list = field(default_factory=list)
    max_batch: int = 0
    steps: int = 0
    thread_names: set = field(default_factory=set)

    def add_request(self, rid, prompt_ids, params: SamplingParams) -> None:
        if params.max_tokens > self.max_pages_tokens:
            raise ValueError(f"request needs more KV pages than the pool has ({params.max_tokens} tokens)")
        self.running[rid] = [list(prompt_ids), 0, params]

    def abort(self, rid) -> bool:
        if self.running.pop(rid, None) is None:
            return False
        self.freed.append(rid)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self):
        self.thread_names.add(threading.current_thread().name)
        self.steps += 1
        if self.fail_on_step is not None and self.steps == self.fail_on_step:
            raise RuntimeError("kernel exploded")
        time.sleep(self.token_delay_s)
        self.max_batch = max(self.max_batch, len(self.running))
        outs = []
        for rid, entry in list(self.running.items()):
            prompt, n, params = entry
            entry[1] = n + 1
            last = n + 1 == params.max_tokens
            outs.append((rid, TokenOutput(prompt[0] + n, None, "length" if last else None)))
            if last:
                del self.running[rid]
                self.freed.append(rid)
        return outs


async def _collect(client: InProcessEngineClient, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    return [o.token_id async for o in client.generate(rid, prompt, SamplingParams(max_tokens=max_tokens))]


def test_streams_from_the_engine_thread() -> None:
    llm = SteppingLLM()
    client = InProcessEngineClient(llm)
    try:
        assert isinstance(client, EngineClient)
        assert (client.model_name, client.max_context, client.vocab_size) == ("stepping", 256, 1024)
        assert asyncio.run(_collect(client, "a", [10], 4)) == [10, 11, 12, 13]
        assert llm.freed == ["a"] and llm.thread_names == {"kvrelay-llm"}
    finally:
        client.close()


def test_concurrent_requests_share_engine_steps() -> None:
    llm = SteppingLLM()
    client = InProcessEngineClient(llm)

    async def both():
        return await asyncio.gather(_collect(client, "a", [100], 5), _collect(client, "b", [200], 5))

    try:
        assert asyncio.run(both()) == [list(range(100, 105)), list(range(200, 205))]
        assert llm.max_batch == 2  # continuous batching, not one request after another
    finally:
        client.close()


def test_abort_frees_the_sequence() -> None:
    llm = SteppingLLM(token_delay_s=0.01)
    client = InProcessEngineClient(llm)

    async def run():
        got = []
        async for out in client.generate("x", [1], SamplingParams(max_tokens=10_000)):
            got.append(out.token_id)
            if len(got) == 3:
                await client.abort("x")
        return got

    try:
        got = asyncio.run(run())
        assert 3 <= len(got) < 10 and got[:3] == [1, 2, 3]
        assert wait_for(lambda: llm.freed == ["x"]) and not llm.running
    finally:
        client.close()


def test_consumer_leaving_early_frees_the_sequence() -> None:
    llm = SteppingLLM(token_delay_s=0.01)
    client = InProcessEngineClient(llm)

    async def run():
        stream = client.generate("y", [1], SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        await stream.aclose()

    try:
        asyncio.run(run())
        assert wait_for(lambda: llm.freed == ["y"]) and not llm.running
    finally:
        client.close()


def test_engine_errors_reach_the_request() -> None:
    llm = SteppingLLM(fail_on_step=3, max_pages_tokens=100)
    client = InProcessEngineClient(llm)
    try:
        with pytest.raises(ValueError, match="more KV pages"):
            asyncio.run(_collect(client, "big", [1], 500))
        with pytest.raises(RuntimeError, match="kernel exploded"):
            asyncio.run(_collect(client, "z", [1], 10))
        assert llm.freed == ["z"] and not llm.running
        assert asyncio.run(_collect(client, "after", [5], 2)) == [5, 6]  # the engine thread survived
        asyncio.run(client.abort("never-started"))  # unknown ids are fine
    finally:
        client.close()


# ---- the real model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm():
    from kvrelay.engine.llm import LLM

    return LLM(str(TINY), device="cpu")


def test_router_over_real_tiny_llm(tiny_llm) -> None:
    from kvrelay.router.client import RouterClient
    from kvrelay.router.server import BackgroundRouter
    from kvrelay.router.types import SamplingOptions

    reference = json.loads((TINY / "reference.json").read_text())["runs"][0]
    prompt = reference["prompt"]
    n = 8
    direct = [o.token_id for o in tiny_llm.generate(list(prompt), SamplingParams(max_tokens=n, temperature=0))]
    client = InProcessEngineClient(tiny_llm)
    with BackgroundRouter(client) as srv, RouterClient(srv.grpc_target, timeout_s=120) as rc:
        out = list(rc.generate(prompt, SamplingOptions(max_tokens=n, temperature=0)))
        ids = [t for r in out for t in r.token_ids]
        assert ids == direct
        assert out[-1].finish_reason != 0 and out[-1].usage.completion_tokens == n
        # Streaming a long request and cancelling it frees the engine for the next one.
        stream = rc.generate(prompt, SamplingOptions(max_tokens=200, temperature=0))
        next(stream)
        stream.cancel()
        assert wait_for(lambda: not tiny_llm.has_unfinished(), timeout=30)  # its KV was released
        again = list(rc.generate(prompt, SamplingOptions(max_tokens=n, temperature=0)))
        assert [t for r in again for t in r.token_ids] == direct
        import httpx

        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True}
        resp = httpx.post(f"{srv.http_url}/v1/completions", json=body, timeout=120).json()
        assert resp["choices"][0]["token_ids"] == direct
    client.close()
