"""bench/serve_multiturn.py: the prompt building by hand (token-exact growth, the shared system prompt, text
prompts of one o200k token a word), the per-turn rows, the whole run against a fake server that keeps a
prefix cache of what it was sent (ids answered with return_token_ids; a server without them gets text), and
the RESULTS.md section (the cache-on / cache-off ratio at the same length). The run against the real CPU
tiny cluster with the prefix cache on is tests/e2e/test_bench_multiturn_cluster.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import git_revs
import pytest
from fastapi import Request  # module level: the fake's annotations are resolved in these globals

from kvrelay.bench import provenance, results_md
from kvrelay.bench import serve_multiturn as mt
from kvrelay.bench.serve_client import RequestResult, StreamParser

from fake_http_server import fake_openai_app, serving_app



# ---- prompt building ----------------------------------------------------------------------------------
def test_workload_lengths_and_bad_settings() -> None:
    wl = mt.Workload(8, 7, 6144, 2048, 3840, 256)
    assert [wl.prompt_len(t) for t in range(1, 8)] == [8192 + 4096 * i for i in range(7)]  # 8k .. 32k
    with pytest.raises(ValueError, match="--turns must be at least 1"):
        mt.Workload(1, 0, 10, 10, 10, 1)
    with pytest.raises(ValueError, match="--user-len must not be negative"):
        mt.Workload(1, 1, 10, 10, -1, 1)
    with pytest.raises(ValueError, match="turn 1's prompt is empty"):
        mt.Workload(1, 1, 0, 0, 10, 1)


def test_id_prompts_grow_token_exactly() -> None:
    wl = mt.Workload(3, 4, 40, 10, 12, 5)
    pieces = mt.IdPieces(7, 1000, 100000)
    system = pieces.system(40)
    convs = [mt.Conversation(c, pieces, wl, system) for c in range(3)]
    seen_users = set()
    for conv in convs:
        prompts = [list(conv.prompt)]
        assert conv.prompt[:40] == system  # the same system prompt in every conversation
        for turn in range(2, 5):
            answer = [(conv.index * 100 + turn * 10 + k) % 997 for k in range(5)]  # what the server generated
            before = list(conv.prompt)
            conv.advance(answer)
            user = pieces.user(conv.index, turn, 12)
            # exactly the previous prompt, then the answer's ids, then the new user message
            assert conv.prompt == before + answer + user and conv.turn == turn
            prompts.append(list(conv.prompt))
            seen_users.add(tuple(user))
        assert [len(p) for p in prompts] == [wl.prompt_len(t) for t in range(1, 5)]
        assert all(prompts[i + 1][:len(prompts[i])] == prompts[i] for i in range(3))
        assert all(1000 <= t < 100000 for t in prompts[0])
    # Every user message is its own (conversations diverge right after the system prompt) ...
    assert len(seen_users) == 3 * 3 and len({tuple(c.prompt[40:50]) for c in convs}) == 3
    # ... and the whole workload is reproducible from the seed (cache off and on runs send the same prompts).
    again = mt.Conversation(1, mt.IdPieces(7, 1000, 100000), wl)
    assert again.prompt == convs[1].prompt[:50]
    assert mt.IdPieces(8, 1000, 100000).system(40) != system
    assert pieces.warmup(0, 40)[:8] != system[:8]


def test_text_prompts_are_one_o200k_token_a_word() -> None:
    from kvrelay.router import harmony

    enc = harmony.load_encoding()
    assert all(len(enc.encode(" " + w)) == 1 for w in mt.WORDS) and len(set(mt.WORDS)) == len(mt.WORDS)
    pieces = mt.TextPieces(0, 0, 0)
    wl = mt.Workload(2, 3, 300, 100, 50, 4)
    conv = mt.Conversation(0, pieces, wl)
    assert len(enc.encode(conv.prompt)) == 400
    before = conv.prompt
    conv.advance(" and then")
    assert conv.prompt.startswith(before + " and then") and conv.prompt == before + " and then" + pieces.user(0, 2, 50)
    assert conv.prompt.startswith(pieces.system(300))


def test_stream_parser_keeps_the_answer_and_cached_tokens() -> None:
    p = StreamParser(0.0, keep_answer=True)
    p.feed({"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6], "prompt_token_ids": [1, 2, 3]}]}, 0.1)
    p.feed({"choices": [{"index": 0, "text": "c", "token_ids": [7], "finish_reason": "length"}]}, 0.2)
    p.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                     "prompt_tokens_details": {"cached_tokens": 2}}}, 0.3)
    r = p.result(3, 0.3)
    assert r.ok and r.answer_ids == [5, 6, 7] and r.answer_text == "abc"
    assert (r.prompt_tokens, r.cached_tokens) == (3, 2)
    # Text without ids: the exact answer is unknown (None), the text is still kept.
    p = StreamParser(0.0, keep_answer=True)
    p.feed({"choices": [{"index": 0, "text": "x"}]}, 0.1)
    p.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}, 0.2)
    r = p.result(1, 0.2)
    assert r.answer_ids is None and r.answer_text == "x" and r.cached_tokens is None
    # Without keep_answer nothing is collected (the plain benchmark's hot path).
    p = StreamParser(0.0)
    p.feed({"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6]}]}, 0.1)
    assert p.result(2, 0.1).answer_ids is None


def test_turn_rows_by_hand() -> None:
    def res(send, ttft, done, prompt, cached, ok=True) -> RequestResult:
        return RequestResult(ok=ok, error=None if ok else "boom", ttft_s=ttft, output_tokens=4, itl_s=[0.01] * 3,
                             t_send=send, t_done=done, prompt_tokens=prompt, cached_tokens=cached)

    wl = mt.Workload(2, 2, 8, 2, 2, 4)
    turns = [mt.Turn(0, 1, 10, res(0.0, 1.0, 2.0, 10, 0)), mt.Turn(1, 1, 10, res(0.5, 1.5, 3.0, 10, 8)),
             mt.Turn(0, 2, 16, res(2.0, 0.25, 4.0, 16, 8)), mt.Turn(1, 2, 16, res(3.0, 0.5, 4.0, 16, 16, ok=False))]
    rows = {r["turn"]: r for r in mt.turn_rows(turns, wl)}
    assert list(rows) == ["1", "2", "2+", "all"]
    one, two = rows["1"], rows["2"]
    assert (one["requests"], one["failed"], one["planned_prompt_len"], one["prompt_tokens_p50"]) == (2, 0, 10, 10)
    assert one["ttft_p50_s"] == 1.25 and one["cached_tokens_p50"] == 4 and one["cached_frac"] == 8 / 20
    assert one["span_s"] == 3.0 and one["in_tok_s"] == 20 / 3 and one["out_tok_s"] == 8 / 3
    # a failed request counts as sent, never as measured
    assert (two["requests"], two["failed"], two["ttft_p50_s"], two["cached_tokens_sum"]) == (2, 1, 0.25, 8)
    assert two["failure_reasons"] == {"boom": 1} and two["span_s"] == 2.0 and two["in_tok_s"] == 16 / 2
    assert rows["all"]["span_s"] == 4.0 and rows["all"]["prompt_tokens_sum"] == 36 and rows["2+"] == {
        **two, "turn": "2+", "planned_prompt_len": None}


# ---- against a fake server ----------------------------------------------------------------------------
def _fake_app(with_ids: bool):
    """Streams 4 chunks per answer; keeps every prompt it was sent and reports as cached the longest
    prefix (in whole 16-token blocks) shared with an earlier one, as a prefix cache would."""
    from fastapi.responses import JSONResponse, StreamingResponse

    app = fake_openai_app("fake")
    seen: list[dict] = app.state.seen

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if not with_ids and ("return_token_ids" in body or not isinstance(body["prompt"], str)):
            return JSONResponse({"error": {"message": "prompt must be a string"}}, status_code=400)
        tokens = body["prompt"] if with_ids else body["prompt"].split()
        earlier = [b["_tokens"] for b in seen]
        shared = max((next((i for i, (a, b) in enumerate(zip(tokens, e)) if a != b), min(len(tokens), len(e)))
                      for e in earlier), default=0)
        seen.append({**body, "_tokens": tokens})
        n = body["max_tokens"]
        answer = [(len(seen) * 31 + k) % 1000 + 5 for k in range(n)]

        async def sse():
            await asyncio.sleep(0.01)
            for i in range(0, n, max(1, n // 4)):
                ids = answer[i:i + max(1, n // 4)]
                choice = {"index": 0, "text": "".join(f" w{t}" for t in ids),
                          "finish_reason": "length" if i + len(ids) >= n else None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = ids
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                await asyncio.sleep(0.002)
            usage = {"prompt_tokens": len(tokens), "completion_tokens": n, "total_tokens": len(tokens) + n,
                     "prompt_tokens_details": {"cached_tokens": shared // 16 * 16}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


@pytest.fixture(params=[True, False], ids=["ids", "text"])
def fake(request):
    app = _fake_app(request.param)
    with serving_app(app) as url:
        yield request.param, url, app.state.seen


ARGS = ["--conversations", "3", "--turns", "3", "--system-len", "48", "--first-user-len", "16", "--user-len", "20",
        "--answer-len", "8", "--warmup", "1", "--stagger-s", "0.05", "--prefix-cache", "on", "--timeout-s", "30"]


def test_against_a_fake_server(tmp_path, fake) -> None:
    with_ids, url, seen = fake
    argv = [*ARGS, "--base-url", f"{url}/v1", "--out-dir", str(tmp_path), "--label", "fake mt"]
    payload = asyncio.run(mt.run(mt.build_parser().parse_args(argv), argv))
    assert payload["prompt_format"] == ("ids" if with_ids else "text") and payload["prefix_cache"] == "on"
    saved = json.loads(Path(payload["files"]["json"]).read_text())
    assert saved["kind"] == "serve-multiturn" and Path(payload["files"]["png"]).is_file()
    assert Path(payload["files"]["json"]).name.startswith("serve-multiturn-fake_mt-")
    assert saved["settings"]["prompt_lens"] == [64, 92, 120] and not saved["stopped_early"]
    rows = {r["turn"]: r for r in saved["points"]}
    assert list(rows) == ["1", "2", "3", "2+", "all"]
    assert all(rows[t]["requests"] == 3 and rows[t]["failed"] == 0 for t in "123")
    assert [rows[t]["prompt_tokens_p50"] for t in "123"] == [64, 92, 120]
    # Turns 2+ start with the previous turn's prompt and answer: the fake's cache hits whole blocks of it.
    assert rows["2"]["cached_tokens_p50"] >= 64 and rows["3"]["cached_tokens_p50"] >= 92 // 16 * 16
    assert saved["prompt_len_mismatches"] == 0 and len(saved["requests"]) == 9
    # What the server got: 1 format probe (auto) + 3 warmups (the longest length, then two turns of a
    # conversation of its own, the second starting with the first's prompt + answer) + 9 turns; each
    # conversation's prompt is the previous one + the answer the server sent + a new user message (ids:
    # token for token).
    warm = seen[1:4] if with_ids else seen[0:3]  # the text server refused the probe, which it did not keep
    turns = seen[4:] if with_ids else seen[3:]
    assert [len(b["_tokens"]) for b in warm] == [120, 64, 92]
    assert warm[2]["_tokens"][:64] == warm[1]["_tokens"] and warm[1]["_tokens"][:48] != turns[0]["_tokens"][:48]
    assert len(turns) == 9
    by_conv: dict = {}
    for b in turns:
        by_conv.setdefault(tuple(b["_tokens"][48:64]), []).append(b)
    assert len(by_conv) == 3
    for convo in by_conv.values():
        assert [len(b["_tokens"]) for b in convo] == [64, 92, 120]
        for prev, nxt in zip(convo, convo[1:]):
            answer = [(((seen.index(prev) + 1) * 31 + k) % 1000) + 5 for k in range(8)]
            head = prev["_tokens"] + (answer if with_ids else [f"w{t}" for t in answer])
            assert nxt["_tokens"][:len(head)] == head and len(nxt["_tokens"]) == len(head) + 20
            if with_ids:
                assert nxt["return_token_ids"] is True and nxt["ignore_eos"] is True
    assert len({tuple(b["_tokens"][:48]) for b in turns}) == 1  # one system prompt for all


def test_prompts_longer_than_the_server_allows_exit_with_one_line(tmp_path, fake) -> None:
    _, url, seen = fake
    argv = ["--base-url", url, "--out-dir", str(tmp_path), "--turns", "3", "--system-len", "4k"]
    with pytest.raises(SystemExit, match="error: turn 3 needs 14592 tokens .* over the server's max_model_len 4096"):
        mt.main(argv)
    assert not seen and not list(tmp_path.iterdir())


# ---- RESULTS.md ---------------------------------------------------------------------------------------
def _mt_result(mode: str, ts: str, ttft: list[float], cached: list[int], head: str) -> dict:
    lens = [8192 + 4096 * i for i in range(7)]
    pts = [{"turn": str(i + 1), "requests": 8, "failed": 0, "prompt_tokens_p50": n, "cached_tokens_p50": c,
            "cached_frac": c / n, "ttft_p50_s": t, "ttft_p99_s": t * 2, "itl_p50_s": 0.004, "in_tok_s": 1e5,
            "out_tok_s": 900.0} for i, (n, t, c) in enumerate(zip(lens, ttft, cached))]
    pts.append({**pts[-1], "turn": "2+", "requests": 48, "prompt_tokens_p50": 20480, "ttft_p50_s": ttft[3]})
    return {"kind": "serve-multiturn", "model": "gpt-oss-20b", "gpus": 1, "prefix_cache": mode, "label": f"mt-{mode}",
            "prompt_format": "ids", "points": pts,
            "settings": {"conversations": 8, "turns": 7, "system_len": 6144, "first_user_len": 2048, "user_len": 3840,
                         "answer_len": 256},
            "env": {"gpu": "NVIDIA H200", "git_commit": head, "git_dirty": False, "timestamp": ts,
                    "command": f"python -m kvrelay.bench.serve_multiturn --prefix-cache {mode}"}}


def test_results_md_sets_cache_on_against_off(tmp_path) -> None:
    head = git_revs.rev("HEAD")
    off = [0.2 + 0.1 * i for i in range(7)]  # 0.8 s at 32k
    files = {"mt-off.json": _mt_result("off", "2026-12-01T14:00:00+00:00", off, [0] * 7, head),
             "mt-on.json": _mt_result("on", "2026-12-01T14:03:00+00:00", [0.2] + [0.16] * 6, [6144] + [8000] * 6, head),
             "mt-host-old.json": _mt_result("on+host", "2026-12-01T13:00:00+00:00", [9.0] * 7, [0] * 7, head),
             "mt-host.json": _mt_result("on+host", "2026-12-01T14:06:00+00:00", [0.2] + [0.4] * 6, [0] * 7, head)}
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    col = provenance.collect([tmp_path])
    text = "\n".join(results_md.multiturn_section(col))
    assert ("### gpt-oss-20b (1 GPU): 8 conversations x 7 turns, system 6k + user 2k, then +256 answer +3840 user"
            in text)
    assert "| cache on | 7 (longest) | 32,768 | 8 (0) | 8,000 | 24% | 0.160 | 0.320 | 4.00 |" in text
    # the ratio table: turn 7 at 32k, off 0.8 s; on 0.16 s = 20%; the host-tier run (the newer of two) 50%
    assert "| 7 | 32,768 | 0.800 | 0.160 | 20% | 0.400 | 50% |" in text
    assert "| 2+ | 20,480 | 0.500 | 0.160 | 32% | 0.400 | 80% |" in text
    assert "Longest turn (32,768 tokens), cache on: TTFT p50 20% of cache off; target <= 25% at 32k: met." in text
    assert "cache on + host tier, small KV pool: TTFT p50 50% of cache off; target <= 25% at 32k: not met." in text
    assert "9.000" not in text  # the older host-tier run is superseded
    used = results_md._used(col)
    assert used["mt-on.json"] == 8 and "mt-host-old.json" not in used
    # Only one mode: its table, no ratio.
    for name in ("mt-off.json", "mt-host-old.json", "mt-host.json"):
        (tmp_path / name).unlink()
    text = "\n".join(results_md.multiturn_section(provenance.collect([tmp_path])))
    assert "| cache on | 1 |" in text and "no ratio" in text
