"""Tensor-parallel workers through the whole cluster: real Ray actors (one per rank), gloo between the ranks
of a worker, NIXL over UCX loopback between the workers' ranks.

The tiny model has 8 query / 2 KV heads, so TP4 keeps one replicated KV head per rank: TP2 -> TP4 has
every decode rank pull half of one prefill rank's heads (the strided case), TP4 -> TP1 gathers both heads
from two of the four prefill ranks. Greedy streams must equal one process running the same weights, up to
bf16 rounding judged in float32 (greedy_judge.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from greedy_judge import assert_same_greedy
from kvrelay.engine.sampling import SamplingParams

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

TOPOLOGY = """
model: {name: tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 1, max_prompt_tokens: 256}
decode: {workers: 1, max_batch: 8, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
kv_transfer: {lease_seconds: 30}
device: cpu
"""
PROMPTS = {1: 10, 9: 8, 40: 12}  # prompt length -> max tokens; window 8: 9 = window + 1
# test_cluster.prompt_of(29, 303) + [735] * 3: one-process bf16 takes 115 at token 2 by 0.043 (11 bf16
# steps of its top logit); float32 takes 735 by 0.049, and bf16 moves that position's logits by 0.080.
REPORTED = [(31 * i + 17 * 303 + 3) % 1000 + 1 for i in range(29)] + [735] * 3


def prompt_of(n: int) -> list[int]:
    return [(37 * i + 11) % 1000 + 1 for i in range(n)]


def topology(prefill_tp: int, decode_tp: int, decode_ep: int):
    from kvrelay.cluster.topology import parse_topology

    topo = parse_topology(TOPOLOGY, source="e2e-tp")
    # Set after parsing: the topology check asks tp to divide the KV heads, stricter than the head
    # mapping, which replicates a KV head over the ranks of its query group (2 KV heads on TP4).
    return dataclasses.replace(topo, prefill=dataclasses.replace(topo.prefill, tp=prefill_tp),
                               decode=dataclasses.replace(topo.decode, tp=decode_tp, ep=decode_ep))


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single-process greedy tokens (bf16) of each prompt, and of the reported one."""
    from kvrelay.engine.llm import LLM

    llm = LLM("tiny", dummy=True, seed=0, page_size=16, kv_tokens=4096)
    jobs = [(n, prompt_of(n), k) for n, k in PROMPTS.items()] + [("report", REPORTED, 8)]
    return {n: [o.token_id for o in llm.generate(prompt, SamplingParams(max_tokens=k, temperature=0))]
            for n, prompt, k in jobs}


@pytest.fixture(scope="module", params=[(2, 4, 4), (4, 1, 1), (2, 2, 1)], ids=["tp2-to-tp4", "tp4-to-tp1", "tp2-to-tp2"])
def cluster(request):
    from kvrelay.cluster.serve import Cluster

    t0 = time.monotonic()
    c = Cluster.start(topology(*request.param), startup_timeout_s=240)
    print(f"cluster TP{request.param[0]} -> TP{request.param[1]} up in {time.monotonic() - t0:.1f} s")
    try:
        yield c
    finally:
        c.shutdown()


def generate_all(cluster) -> dict[int, list]:
    client = cluster.engine_client(stall_check_s=30.0)

    async def one(n: int):
        params = SamplingParams(max_tokens=PROMPTS[n], temperature=0)
        return [o async for o in client.generate(f"tp-{n}", prompt_of(n), params)]

    async def go():  # together, so the decode ranks step a batch of several sequences
        outs = await asyncio.gather(*(one(n) for n in PROMPTS))
        return dict(zip(PROMPTS, outs))

    return asyncio.run(go())


def wait_no_pages(cluster, timeout_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = cluster.statuses()
        busy = [r for r in rows if any(r.get("pages_in_use", {}).values()) or r.get("leases")
                or r.get("admitted") or r.get("running")]
        if not busy:
            return rows
        if time.monotonic() > deadline:
            raise AssertionError(f"KV pages still held: {busy}")
        time.sleep(0.2)


def test_greedy_tokens_equal_single_process(cluster, reference):
    t0 = time.monotonic()
    outs = generate_all(cluster)
    print(f"3 requests in {time.monotonic() - t0:.2f} s")
    for n, out in outs.items():
        assert_same_greedy([o.token_id for o in out], reference[n], prompt_of(n), f"prompt of {n} tokens")
        assert out[-1].finish_reason == "length"
    topo = cluster.topology
    # 40 tokens: 3 pages of the one full layer + 1 live page of each of the 2 sliding layers; a page holds
    # 2 (K, V) x 16 positions x 32 dims x bf16 per head, and every decode rank pulls its own heads.
    heads_pulled = 2 if topo.decode.tp <= 2 else topo.decode.tp  # TP4: one replicated head per rank
    assert outs[40][-1].metrics.kv_bytes == 5 * 2 * 16 * 32 * 2 * heads_pulled


def test_n_choices_fork_on_every_decode_rank(cluster, reference):
    """n=3 greedy choices of one prompt: one prefill, its KV pulled once and forked on every decode rank
    in lockstep (GroupRunner.fork_sequence); each choice is the single-process greedy run."""
    client = cluster.engine_client(stall_check_s=30.0)
    params = SamplingParams(max_tokens=PROMPTS[40], temperature=0)

    async def one(stream):
        return [o for outs in [x async for x in stream] for o in outs]

    async def go():
        return await asyncio.gather(*(one(s) for s in client.fork_batches(["tpn-0", "tpn-1", "tpn-2"],
                                                                           prompt_of(40), [params] * 3)))

    from prometheus_client import REGISTRY

    before = REGISTRY.get_sample_value("kvrelay_prefills_total") or 0.0
    outs = asyncio.run(go())
    assert REGISTRY.get_sample_value("kvrelay_prefills_total") - before == 1
    for j, out in enumerate(outs):
        assert_same_greedy([o.token_id for o in out], reference[40], prompt_of(40), f"choice {j}")
        assert out[-1].finish_reason == "length"
    wait_no_pages(cluster)


def test_no_kv_page_left_and_status_lists_every_rank(cluster):
    from kvrelay.cluster.status import _table

    generate_all(cluster)  # after a second round too
    rows = wait_no_pages(cluster)
    topo = cluster.topology
    want = [("prefill", 0, r) for r in range(topo.prefill.tp)] + [("decode", 0, r) for r in range(topo.decode.tp)]
    assert [(r["role"], r["rank"], r["tp_rank"]) for r in rows] == want
    assert all(r["healthy"] and r["pid"] > 0 and r["pages_total"]["full"] > 0 for r in rows), rows
    assert len({r["pid"] for r in rows}) == len(rows)  # one process per rank
    assert len({r["agent"] for r in rows}) == len(rows)  # and one NIXL agent each
    table = _table(rows)
    assert f"{topo.decode.tp - 1}/{topo.decode.tp}" in table and "DOWN" not in table


def test_prompt_logprobs_and_repetition_penalty_on_tp_groups(cluster):
    """The TP prefill group computes every position's logits on all its ranks alike (the vocabulary gather
    is a collective): the prompt logprobs equal a float64 single-process reference up to sharded bf16
    sums; the TP decode group applies the repetition penalty from the prompt's token set."""
    import torch

    from kvrelay.engine.llm import LLM

    llm = LLM("tiny", dummy=True, seed=0, page_size=16, kv_tokens=4096)
    prompt = prompt_of(40)
    params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=2, repetition_penalty=1.5)
    client = cluster.engine_client(stall_check_s=30.0)

    async def go():
        return [o async for o in client.generate("tp-plp", prompt, params)]

    outs = asyncio.run(go())
    assert len(outs) == 6 and outs[-1].finish_reason == "length"
    plp = outs[0].prompt_logprobs
    lp = torch.log_softmax(llm.runner.score(prompt).double(), dim=-1)
    want = [float(lp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert list(plp.token_logprobs) == pytest.approx(want, abs=2e-2)
    assert len(plp.top) == len(prompt) - 1 and all(len(t) == 2 for t in plp.top)
    ref = [o.token_id for o in llm.generate(prompt, params)]
    assert ref != [o.token_id for o in llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0))]
    assert_same_greedy([o.token_id for o in outs], ref, prompt, "repetition_penalty", params)
    wait_no_pages(cluster)


def test_bf16_near_tie_is_judged_in_float32(cluster, reference):
    """The reported prompt: whichever of 115 or 735 a group takes at token 2, float32 must allow it; the
    tokens before it must be the single process's (the judge refusing a wrong token: test_greedy_judge.py)."""
    client = cluster.engine_client(stall_check_s=30.0)

    async def go():
        return [o async for o in client.generate("tp-report", REPORTED, SamplingParams(max_tokens=8, temperature=0))]

    got = [o.token_id for o in asyncio.run(go())]
    print(f"TP{cluster.topology.prefill.tp} -> TP{cluster.topology.decode.tp}: {got}, "
          f"single process bf16 {reference['report']}")
    assert_same_greedy(got, reference["report"], REPORTED, "reported prompt")
    wait_no_pages(cluster)


def test_killed_rank_takes_its_worker_down_without_hanging_the_stream(cluster):
    """Runs last (it breaks the module's cluster): a TP group cannot step without one of its ranks, so
    the worker goes down as a whole and the client ends the request instead of waiting forever."""
    import ray

    from kvrelay.cluster.engine_client import EngineUnavailable

    topo = cluster.topology
    role = "decode" if topo.decode.tp > 1 else "prefill"
    victim = ray.get_actor(f"kvrelay-{role}-0-tp{getattr(topo, role).tp - 1}", namespace=topo.ray.namespace)
    client = cluster.engine_client(stall_check_s=5.0)
    got: list[int] = []

    async def go():
        params = SamplingParams(max_tokens=400, temperature=0)
        if role == "prefill":
            ray.kill(victim, no_restart=True)
        async for out in client.generate("victim", prompt_of(20), params):
            got.append(out.token_id)
            if role == "decode" and len(got) == 5:
                ray.kill(victim, no_restart=True)

    t0 = time.monotonic()
    with pytest.raises(EngineUnavailable, match=f"no live {role} worker"):
        asyncio.run(go())
    assert time.monotonic() - t0 < 60 and len(got) < 400
    assert client.dead_workers() == [(role, 0)]
    rows = {(r["role"], r["tp_rank"]): r for r in cluster.statuses(timeout_s=5)}
    assert "error" in rows[(role, 0)] and "error" in rows[(role, getattr(topo, role).tp - 1)]
