"""bench/serve.py: its arithmetic by hand, then the whole benchmark against the real router over the tiny
model, and against a fake SSE server that sends kvrelay_timings (the router does not send them yet)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
from fastapi import Request  # module level: the fake's annotations are resolved in these globals

from kvrelay.bench import serve

from fake_http_server import fake_openai_app, serving_app

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "data" / "gpt-oss-tiny-original"
TINY_ARGS = ["--concurrency", "1,2", "--workloads", "16/8", "--requests", "4", "--warmup", "1", "--timeout-s", "60"]


# ---- helpers, by hand ---------------------------------------------------------------------------------
def test_percentile_by_hand() -> None:
    assert serve.percentile([], 50) is None
    assert serve.percentile([7.0], 99) == 7.0
    assert serve.percentile([4, 1, 3, 2], 50) == 2.5  # mean of the middle two
    # p99 of 0..100 (101 values) is exactly 99; of [1, 2, 3, 4]: position 0.99 x 3 = 2.97 -> 3 + 0.97
    assert serve.percentile(list(range(101)), 99) == 99
    assert serve.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert serve.percentile([1, 2, 3, 4], 0) == 1 and serve.percentile([1, 2, 3, 4], 100) == 4


def test_workload_parsing() -> None:
    assert serve.parse_workloads("1k/1k,8k/1k, 32k/256") == [(1024, 1024), (8192, 1024), (32768, 256)]
    assert serve.parse_workloads("16/8") == [(16, 8)]
    with pytest.raises(Exception, match="IN/OUT"):
        serve.parse_workloads("1k")


def test_chunk_token_counting() -> None:
    assert serve.chunk_tokens({"text": "ab", "token_ids": [5, 6, 7]}) == 3
    assert serve.chunk_tokens({"text": "ab"}) is None  # text only: count unknown
    assert serve.chunk_tokens({"text": "", "finish_reason": "length"}) == 0
    assert serve.chunk_tokens({"text": "", "token_ids": []}) == 0


def test_itl_by_hand() -> None:
    times = [1.0, 1.1, 1.5, 1.6]
    # Known counts 1, 1, 2, 1 (5 tokens): the 0.4 s gap before the 2-token chunk is two gaps of 0.2 s.
    assert serve.itl_samples(times, [1, 1, 2, 1], 5) == pytest.approx([0.1, 0.2, 0.2, 0.1])
    # Unknown counts, 7 tokens in 4 chunks: 6 tokens after the first over 3 gaps = 2 per chunk.
    assert serve.itl_samples(times, [None] * 4, 7) == pytest.approx([0.05, 0.2, 0.05])
    assert serve.itl_samples([1.0], [1], 1) == []


def test_stream_parser_by_hand() -> None:
    p = serve.StreamParser(t_send=10.0)
    p.feed({"choices": [{"text": "", "finish_reason": None}]}, 10.05)  # held-back bytes: no content yet
    for now, text in ((10.2, "a"), (10.3, "b"), (10.5, "c")):
        p.feed({"choices": [{"text": text, "finish_reason": None}]}, now)
    p.feed({"choices": [{"text": "d", "finish_reason": "length"}]}, 10.6)
    timings = {"queue_s": 0.01, "prefill_compute_s": 0.1, "kv_handoff_s": 0.02, "kv_bytes": 4_000_000,
               "ttft_s": 0.2, "delivery_s": 0.001}
    p.feed({"choices": [], "usage": {"completion_tokens": 5}, "kvrelay_timings": timings}, 10.61)
    r = p.result(output_len=5, t_done=10.62)
    assert r.ok and r.output_tokens == 5 and r.finish_reason == "length"
    assert r.ttft_s == pytest.approx(0.2)
    # 5 tokens in 4 content chunks, 3 gaps (0.1, 0.2, 0.1) each standing for 4/3 tokens.
    assert r.itl_s == pytest.approx([0.075, 0.15, 0.075])
    assert r.per_user_tok_s == pytest.approx(4 / 0.4)
    assert r.timings == timings
    short = serve.StreamParser(0.0)
    short.feed({"choices": [{"text": "x", "finish_reason": "stop"}]}, 0.1)
    assert not short.result(output_len=8, t_done=0.2).ok
    assert "short output: 1 of 8" in short.result(8, 0.2).error


def test_summarize_breakdown_and_cost() -> None:
    def req(ttft, timings):
        return serve.RequestResult(ok=True, ttft_s=ttft, output_tokens=10, itl_s=[0.01], per_user_tok_s=100.0,
                                   timings=timings)

    rs = [req(0.1, {"queue_s": 0.0, "kv_handoff_s": 0.5, "kv_bytes": 1e9}),
          req(0.3, {"queue_s": 0.2, "kv_handoff_s": 0.0, "kv_bytes": 1e9}),  # no handoff: skipped for GB/s
          serve.RequestResult(ok=False, error="HTTP 500: boom")]
    pt = serve.summarize(rs, conc=2, input_len=16, output_len=10, wall_s=2.0, cpu_frac=0.1, gpus=4,
                         usd_per_gpu_hour=3.0)
    assert (pt["requests"], pt["failed"], pt["failure_reasons"]) == (3, 1, {"HTTP 500: boom": 1})
    assert pt["out_tok_s_aggregate"] == 10.0  # 20 tokens of the successful requests / 2 s
    assert pt["usd_per_m_output"] == pytest.approx(4 * 3 / 3600 / 10 * 1e6)
    assert pt["ttft_p50_s"] == pytest.approx(0.2)
    assert pt["queue_s"] == pytest.approx(0.1) and pt["kv_handoff_s"] == pytest.approx(0.25)
    assert pt["kv_handoff_gb_s"] == pytest.approx(2.0)
    assert pt["prefill_compute_s"] is None and pt["delivery_s"] is None


def test_steady_rate_counts_only_the_window_with_every_slot_busy() -> None:
    """Two slots, three requests: the window runs from the 2nd request's start (t=1) to the 3rd's (t=3);
    tokens before it (the ramp) and after it (the drain) do not count."""
    def req(t_send, arrivals):
        return serve.RequestResult(ok=True, t_send=t_send, output_tokens=sum(k for _, k in arrivals),
                                   arrivals=arrivals)

    rs = [req(0.0, [(0.5, 1), (1.5, 1), (2.5, 2)]),   # ramp token at 0.5; 3 tokens inside
          req(1.0, [(2.0, 1), (3.5, 5)]),             # 1 inside, 5 in the drain
          req(3.0, [(3.0, 4), (4.0, 1)])]             # 4 at the window's edge, 1 after
    assert serve.steady_rate(rs, conc=2) == pytest.approx((3 + 1 + 4) / 2.0)
    assert serve.steady_rate(rs, conc=3) is None  # no request beyond the first wave: no window
    assert serve.steady_rate(rs[:2] + [req(1.5, [])], conc=2) is None  # window under 1 s


# ---- end to end ---------------------------------------------------------------------------------------------
def _check_result(payload: dict, tmp_path: Path) -> list[dict]:
    files = payload["files"]
    assert Path(files["json"]).parent == tmp_path and Path(files["json"]).name.startswith("serve-")
    assert Path(files["png"]).stat().st_size > 0
    saved = json.loads(Path(files["json"]).read_text())
    for key in ("kind", "env", "model", "base_url", "topology", "label", "gpus", "usd_per_gpu_hour", "settings",
                "points", "skipped", "files"):
        assert key in saved, key
    assert saved["kind"] == "serve" and "-m kvrelay.bench.serve" in saved["env"]["command"]
    points = saved["points"]
    assert [(p["concurrency"], p["input_len"], p["output_len"]) for p in points] == [(1, 16, 8), (2, 16, 8)]
    for p in points:
        assert p["requests"] == 4 and p["failed"] == 0, p["failure_reasons"]
        assert p["out_tok_s_aggregate"] > 0 and p["usd_per_m_output"] > 0
        assert 0 < p["ttft_p50_s"] <= p["ttft_p99_s"]
        assert 0 <= p["itl_p50_s"] <= p["itl_p99_s"]
        assert p["out_tok_s_per_user_p50"] > 0
        assert p["output_tokens"] == 4 * 8
    return points


def test_against_the_real_router(tmp_path, model_single_thread) -> None:
    from kvrelay.engine.llm import LLM
    from kvrelay.router.engine_client import InProcessEngineClient
    from kvrelay.router.auth import ApiKeys
    from kvrelay.router.server import BackgroundRouter

    client = InProcessEngineClient(LLM(str(TINY), device="cpu"))
    try:
        # A router that wants an API key: the benchmark sends it, and never stores it.
        with BackgroundRouter(client, api_keys=ApiKeys(["sk-bench"])) as srv:
            argv = [*TINY_ARGS, "--base-url", f"{srv.http_url}/v1", "--out-dir", str(tmp_path), "--gpus", "2",
                    "--token-id-range", "1,1000", "--topology", "in-process tiny",  # the tiny vocabulary is 1024
                    "--api-key", "sk-bench"]
            payload = asyncio.run(serve.run(serve.build_parser().parse_args(argv), argv))
    finally:
        client.close()
    assert payload["model"] == client.model_name and payload["topology"] == "in-process tiny"
    assert "sk-bench" not in json.dumps(payload) and "--api-key ***" in payload["env"]["command"]
    # What the server said it runs, fetched at the start (GET /version): this checkout's commit, read once.
    from kvrelay.router.version import BuildInfo

    assert payload["schema"] == serve.SCHEMA == 2
    assert payload["server"]["git_commit"] == BuildInfo.detect().git_commit and "git_dirty" in payload["server"]
    assert payload["server"]["topology"] is None  # an in-process router, not started from a topology
    for p in _check_result(payload, tmp_path):
        # Not sent by the router yet: the breakdown is null, never made up.
        assert all(p[k] is None for k in serve.BREAKDOWN)


# A fake OpenAI server: streams `text` one token per chunk with a delay, then the usage chunk with kvrelay_timings.
def _fake_app():
    from fastapi.responses import StreamingResponse

    app = fake_openai_app("fake-model")
    seen: list[dict] = app.state.seen

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        n = body["max_tokens"]

        async def sse():
            await asyncio.sleep(0.02)  # "prefill"
            for i in range(n):
                await asyncio.sleep(0.002)
                chunk = {"id": "x", "object": "text_completion", "model": "fake-model",
                         "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                     "total_tokens": len(body["prompt"]) + n}
            timings = {"queue_s": 0.001, "prefill_compute_s": 0.015, "kv_handoff_s": 0.004, "kv_bytes": 8_000_000,
                       "ttft_s": 0.02, "delivery_s": 0.0005}
            yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage, 'kvrelay_timings': timings})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


@pytest.fixture()
def fake_server():
    app = _fake_app()
    with serving_app(app) as url:
        yield url, app.state.seen


def test_against_a_fake_server_with_timings(tmp_path, fake_server) -> None:
    url, seen = fake_server
    args = serve.build_parser().parse_args([*TINY_ARGS, "--base-url", url, "--out-dir", str(tmp_path),
                                            "--label", "fake run"])
    payload = asyncio.run(serve.run(args, []))
    assert payload["model"] == "fake-model"  # from GET /v1/models
    assert payload["server"] is None  # no /version there: recorded as such (bench/provenance.py will not table it)
    assert Path(payload["files"]["json"]).name.startswith("serve-fake_run-")
    for p in _check_result(payload, tmp_path):
        assert p["queue_s"] == pytest.approx(0.001) and p["prefill_compute_s"] == pytest.approx(0.015)
        assert p["kv_handoff_s"] == pytest.approx(0.004) and p["delivery_s"] == pytest.approx(0.0005)
        assert p["kv_handoff_gb_s"] == pytest.approx(2.0)  # 8 MB in 4 ms
        assert p["ttft_p50_s"] >= 0.02 and p["itl_p50_s"] >= 0.001
    # Every request (warmups included) had its own prompt of exactly input_len ids in the range.
    assert len(seen) == 1 + 2 * 4
    prompts = [tuple(b["prompt"]) for b in seen]
    assert len(set(prompts)) == len(prompts) and all(len(p) == 16 for p in prompts)
    assert all(1000 <= t < 100000 for p in prompts for t in p)
    b = seen[0]
    assert (b["max_tokens"], b["temperature"], b["ignore_eos"], b["stream"], b["stream_options"]) == (
        8, 0, True, True, {"include_usage": True})


def test_unreachable_endpoint_exits_with_one_line(tmp_path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(SystemExit) as err:
        serve.main(["--base-url", f"http://127.0.0.1:{port}", "--out-dir", str(tmp_path)])
    msg = str(err.value.code)
    assert msg.startswith(f"error: cannot reach http://127.0.0.1:{port}") and "\n" not in msg
    assert not list(tmp_path.iterdir())


def test_client_procs_send_the_same_requests(tmp_path, fake_server) -> None:
    """--client-procs 2: the same prompts (by request number) as one process would send, every request
    once, the results merged into one point."""
    url, seen = fake_server
    argv = ["--concurrency", "3", "--workloads", "16/8", "--requests", "6", "--warmup", "1", "--timeout-s", "60",
            "--base-url", url, "--out-dir", str(tmp_path), "--client-procs", "2", "--stagger-s", "0.2"]
    payload = asyncio.run(serve.run(serve.build_parser().parse_args(argv), argv))
    (p,) = payload["points"]
    assert p["client_procs"] == 2 and p["requests"] == 6 and p["failed"] == 0 and p["output_tokens"] == 6 * 8
    # The third stream starts 2/3 of the stagger in, measured from one start time shared by both processes.
    assert p["wall_s"] > 0.2 * 2 / 3 and p["ttft_p50_s"] >= 0.02
    expected = serve.Prompts(0, 1000, 100000)
    sent = {tuple(b["prompt"]) for b in seen[1:]}
    assert sent == {tuple(expected.at(i, 16)) for i in range(1, 7)}  # request 0 was the warmup


def test_a_serve_result_is_tabled_only_with_the_servers_version(tmp_path) -> None:
    """Schema 2 serve results need the server's /version (commit, dirty, topology, GPUs), clean and known;
    a result without a schema (all those stored before it) is judged by its own env as before."""
    import subprocess

    from kvrelay.bench import provenance

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=provenance.C.REPO_ROOT, capture_output=True,
                          text=True).stdout.strip()
    env = {"git_commit": head, "git_dirty": False, "timestamp": "2026-12-07T10:00:00+00:00"}
    server = {"git_commit": head, "git_dirty": False, "topology": {"device": "cuda"}, "gpus": ["NVIDIA H100"]}
    cases = {
        "old": ({"kind": "serve", "env": env}, None),
        "with-server": ({"kind": "serve", "schema": 2, "env": env, "server": server}, None),
        "no-server": ({"kind": "serve", "schema": 2, "env": env, "server": None},
                      "the server's /version not recorded (git_commit, git_dirty, topology, gpus missing)"),
        "no-topology": ({"kind": "serve", "schema": 2, "env": env, "server": {**server, "topology": None}},
                        "the server's /version not recorded (topology missing)"),
        "dirty-server": ({"kind": "serve", "schema": 2, "env": env, "server": {**server, "git_dirty": True}},
                         "server: dirty tree (env.git_dirty is true)"),
        "foreign-server": ({"kind": "serve", "schema": 2, "env": env, "server": {**server, "git_commit": "f" * 40}},
                           f"server: commit {'f' * 40} is not a commit of this repository"),
    }
    for name, (data, _) in cases.items():
        (tmp_path / f"serve-{name}-20261207.json").write_text(json.dumps(data))
    got = {r.name.split("-", 1)[1].rsplit("-", 1)[0]: r.excluded for r in provenance.collect([tmp_path]).results}
    assert got == {name: why for name, (_, why) in cases.items()}
