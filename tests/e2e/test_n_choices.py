"""`n` > 1 on a real cluster: the prompt is prefilled once and its KV forked into n decodes, in both served
topologies: configs/cpu-tiny.yaml (prefill worker -> NIXL -> decode worker, which pulls once and forks)
and the same preset colocated (one actor prefills once and forks in place).

Each choice must be what a request of its own gives (greedy: the n=1 output; seeded: the n=1 output with
the seed vLLM gives choice j, seed + j), /metrics must count one prefill for the request, and no page may
be left after it ends, whether it finishes or the client goes away mid-stream.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

from greedy_judge import assert_same_greedy
from test_cluster import assert_no_pages_left, prompt_of

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PRESET = Path(__file__).resolve().parents[2] / "configs" / "cpu-tiny.yaml"


def preset(colocate: bool) -> str:
    """configs/cpu-tiny.yaml on free 127.0.0.1 ports (colocated: the same with `colocate: true`)."""
    doc = yaml.safe_load(PRESET.read_text())
    doc["router"].update(grpc_port=0, http_port=0)
    if colocate:
        doc["colocate"] = True
    return yaml.safe_dump(doc)


@pytest.fixture(scope="module", params=["split", "colocated"])
def running(request):
    from conftest import serving

    with serving(preset(request.param == "colocated")) as (run, server):
        yield run, server


def prefills(server) -> float:
    text = httpx.get(f"{server.http_url}/metrics", timeout=30).text
    m = re.search(r"^kvrelay_prefills_total (\S+)$", text, re.M)
    assert m, "kvrelay_prefills_total missing from /metrics"
    return float(m.group(1))


def complete(server, model: str, **body) -> dict:
    r = httpx.post(f"{server.http_url}/v1/completions", json={"model": model, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_choices_equal_the_single_output_from_one_prefill(running):
    run, server = running
    model = run.client.model_name
    prompt = prompt_of(37, 1)  # 37 positions: two whole pages shared, a partial third one copied
    body = dict(prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True, return_token_ids=True)
    one = complete(server, model, **body)["choices"][0]
    before = prefills(server)
    out = complete(server, model, n=3, **body)
    assert prefills(server) - before == 1
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for c in out["choices"]:
        assert (c["token_ids"], c["text"], c["finish_reason"]) == (one["token_ids"], one["text"], "length")
    assert out["usage"] == {**out["usage"], "prompt_tokens": 37, "completion_tokens": 72}
    assert_no_pages_left(run)


def test_a_big_batch_body_serves_what_each_prompt_gives_alone(running):
    """A body over 256 KiB (padded with JSON whitespace) is decoded in the helper process and its token ids
    stay array('i') through the engine client, the fork group and Ray into the workers
    (router/engine_client.engine_prompt): every choice equals the prompt's own small-body request."""
    from kvrelay.router.body import SMALL_BODY_BYTES

    run, server = running
    model = run.client.model_name
    prompts = [prompt_of(300 + 7 * i, 40 + i) for i in range(4)]
    opts = dict(max_tokens=6, temperature=0, ignore_eos=True, return_token_ids=True)
    want = [complete(server, model, prompt=p, **opts)["choices"][0]["token_ids"] for p in prompts]
    ids = ", ".join("[" + ("," + " " * 240).join(map(str, p)) + "]" for p in prompts)
    body = ('{"model": %s, "n": 2, "prompt": [%s], %s}' % (json.dumps(model), ids, json.dumps(opts)[1:-1])).encode()
    assert len(body) > SMALL_BODY_BYTES
    r = httpx.post(f"{server.http_url}/v1/completions", content=body, timeout=120,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text[:300]
    out = r.json()["choices"]
    assert [c["index"] for c in out] == list(range(8))
    for j, c in enumerate(out):  # 8 choices decoded together: bf16 of other shapes than each one alone
        assert_same_greedy(c["token_ids"], want[j // 2], prompts[j // 2], f"choice {j}")
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, prompts)), r.json()["usage"]
    assert_no_pages_left(run)


def test_seeded_choices_equal_separate_requests_with_consecutive_seeds(running):
    """vLLM gives choice j of a seeded request the seed + j; so did our per-choice path before the fork."""
    run, server = running
    model = run.client.model_name
    prompt = prompt_of(21, 2)
    body = dict(prompt=prompt, max_tokens=16, temperature=0.9, ignore_eos=True, return_token_ids=True, logprobs=1)
    want = [complete(server, model, seed=11 + j, **body)["choices"][0] for j in range(4)]
    before = prefills(server)
    got = complete(server, model, n=4, seed=11, **body)["choices"]
    assert prefills(server) - before == 1
    assert [c["token_ids"] for c in got] == [w["token_ids"] for w in want]
    assert len({tuple(w["token_ids"]) for w in want}) > 1  # the seeds do draw different choices
    for c, w in zip(got, want):
        assert c["logprobs"]["token_logprobs"] == pytest.approx(w["logprobs"]["token_logprobs"], abs=1e-4)
    assert_no_pages_left(run)


def test_chat_choices_share_one_prefill(running):
    run, server = running
    model = run.client.model_name
    body = {"model": model, "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 12,
            "temperature": 0.8, "seed": 5}
    want = [httpx.post(f"{server.http_url}/v1/chat/completions", json={**body, "seed": 5 + j}, timeout=120).json()
            for j in range(3)]
    before = prefills(server)
    r = httpx.post(f"{server.http_url}/v1/chat/completions", json={**body, "n": 3}, timeout=120)
    assert r.status_code == 200, r.text
    assert prefills(server) - before == 1
    got = r.json()["choices"]
    assert [c["message"] for c in got] == [w["choices"][0]["message"] for w in want]
    assert [c["finish_reason"] for c in got] == [w["choices"][0]["finish_reason"] for w in want]
    assert_no_pages_left(run)


def test_streamed_choices_each_have_their_index_and_finish(running):
    run, server = running
    model = run.client.model_name
    body = {"model": model, "prompt": prompt_of(19, 3), "max_tokens": 10, "temperature": 0, "n": 3,
            "ignore_eos": True, "stream": True}
    texts, finishes = {}, {}
    with httpx.stream("POST", f"{server.http_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"]:
                    finishes[c["index"]] = c["finish_reason"]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert texts[0] == texts[1] == texts[2] != ""
    assert_no_pages_left(run)


def test_echo_with_prompt_logprobs_on_every_choice(running):
    """lm-eval's scoring request with n=2: the prompt's logprobs, computed once, come with each choice."""
    run, server = running
    body = dict(prompt=prompt_of(12, 7), max_tokens=1, temperature=0, echo=True, logprobs=1)
    one = complete(server, run.client.model_name, **body)["choices"][0]
    two = complete(server, run.client.model_name, n=2, **body)["choices"]
    for c in two:
        assert c["text"] == one["text"]
        assert c["logprobs"]["tokens"] == one["logprobs"]["tokens"]
        assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(one["logprobs"]["token_logprobs"][1:], abs=1e-4)
    assert_no_pages_left(run)


def test_choices_that_end_on_their_first_token_leave_nothing(running):
    """max_tokens 1: every choice ends at the prefill, nothing is forked or pulled."""
    run, server = running
    out = complete(server, run.client.model_name, prompt=prompt_of(9, 4), max_tokens=1, n=3, temperature=1.0,
                   seed=3, return_token_ids=True)
    assert [len(c["token_ids"]) for c in out["choices"]] == [1, 1, 1]
    assert_no_pages_left(run)


def decode_row(run) -> dict:
    return next(r for r in run.cluster.statuses() if r["role"] in ("decode", "colocated") and r["tp_rank"] == 0)


def test_a_disconnect_mid_stream_frees_every_choice_and_the_prompt_pages_are_shared(running):
    """Four choices of a 400-token prompt (25 pages per group) decoding together hold the prompt's
    pages once: far fewer than the 100 four copies would take. Hanging up frees all of them."""
    run, server = running
    body = {"model": run.client.model_name, "prompt": prompt_of(400, 5), "max_tokens": 1000, "temperature": 0.7,
            "seed": 1, "n": 4, "ignore_eos": True, "stream": True, "return_token_ids": True}
    seen = {j: 0 for j in range(4)}
    with httpx.stream("POST", f"{server.http_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    seen[c["index"]] += len(c["token_ids"])
            if min(seen.values()) >= 3:  # past the prefill's first token: every choice is decoding
                row = decode_row(run)
                break  # hang up
    assert row["running"] == 4
    # 25 shared + per choice its copied partial page and what it generated so far (a few pages each).
    assert row["pages_in_use"]["full"] < 60, row["pages_in_use"]
    assert_no_pages_left(run, timeout_s=30)


def retries(*causes: str) -> float:
    from prometheus_client import REGISTRY

    return sum(REGISTRY.get_sample_value("kvrelay_request_retries_total", {"cause": c}) or 0.0
               for c in causes or ("decode_died", "decode_unresponsive"))


SUPERVISED = """
model: {name: tiny, dummy: true, seed: 0, max_context: 2048}
prefill: {workers: 1, max_prompt_tokens: 1024}
decode: {workers: 1, max_batch: 32, page_size: 16}
router: {host: 127.0.0.1, grpc_port: 0, http_port: 0, resume_timeout_s: 60}
device: cpu
"""


def test_each_choice_resumes_on_its_own_after_a_worker_dies(monkeypatch):
    """n=3 seeded choices decoding from one fork; the decode worker is SIGKILLed. Each choice is
    re-prefilled alone (prompt + its own tokens) on the replacement and ends as its undisturbed run.
    Then the prefill worker dies as the group's one prefill is sent to it: each choice is prefilled on
    its own on the replacement, again ending as its undisturbed run."""
    import os
    import signal
    import threading
    import time

    from conftest import serving

    with serving(SUPERVISED, supervise=True, check_every_s=0.5, health_timeout_s=5.0) as (run, server):
        body = {"model": "tiny", "prompt": prompt_of(30, 6), "max_tokens": 120, "temperature": 0.9, "seed": 4,
                "n": 3, "ignore_eos": True, "return_token_ids": True}
        want = [c["token_ids"] for c in complete(server, "tiny", **{k: v for k, v in body.items() if k != "model"})["choices"]]
        got = {j: [] for j in range(3)}
        errors = []

        def stream() -> None:
            with httpx.stream("POST", f"{server.http_url}/v1/completions", json={**body, "stream": True},
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        data = json.loads(line[6:])
                        if "error" in data:
                            errors.append(data["error"])
                        for c in data.get("choices", []):
                            got[c["index"]] += c["token_ids"]

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 60
        while min(len(v) for v in got.values()) < 5:
            assert time.monotonic() < deadline and t.is_alive(), got
            time.sleep(0.01)
        assert min(len(v) for v in got.values()) < 120, "the choices finished before the kill: make them longer"
        before = retries()
        os.kill(decode_row(run)["pid"], signal.SIGKILL)
        t.join(timeout=120)
        assert not t.is_alive() and errors == []
        assert [got[j] for j in range(3)] == want
        assert retries() - before == 3  # each choice re-prefilled once, on its own
        assert_no_pages_left(run, timeout_s=30)

        client = run.client
        real_pick = client._pick_prefill
        killed = []

        def pick_and_kill(*args, **kwargs):
            w = real_pick(*args, **kwargs)
            if not killed:
                pid = next(r for r in run.cluster.statuses() if r["role"] == "prefill")["pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            return w

        monkeypatch.setattr(client, "_pick_prefill", pick_and_kill)
        before = retries("prefill_died")
        out = complete(server, "tiny", **{k: v for k, v in body.items() if k != "model"})
        assert [c["token_ids"] for c in out["choices"]] == want
        assert killed and retries("prefill_died") - before == 3
        assert_no_pages_left(run, timeout_s=30)
