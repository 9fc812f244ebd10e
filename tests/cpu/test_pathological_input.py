"""Text the tokenizer would spend minutes on gets a 400 at once, and tokenizing a big valid prompt happens
off the event loop: /health keeps answering within 100 ms meanwhile (real HTTP server on 127.0.0.1)."""

from __future__ import annotations

import time

import httpx
import pytest

from kvrelay.router import harmony
from kvrelay.router.validation import MAX_MESSAGES, MAX_TEXT_RUN, ValidationError, check_text

from health_probe import post_watching_health
from scripted_router import scripted_router_fixtures

MODEL = "m"


REPLY = harmony.load_encoding().encode("<|channel|>final<|message|>ok<|return|>", allowed_special="all")
engine, server = scripted_router_fixtures([REPLY], model_name=MODEL, max_context=1 << 20)


@pytest.mark.parametrize("text,kind", [("a" * 300_000, "letters"), ("x" + " " * 60_000 + "y", "whitespace"),
                                       ("!" * 50_000, "symbols"), ("漢" * 20_000, "letters"),
                                       ("😀" * 20_000, "symbols"), ("hi " * 1000 + "_" * 9000, "symbols")])
def test_runs_the_tokenizer_chokes_on_are_refused_fast(server, text, kind) -> None:
    t0 = time.perf_counter()
    r = httpx.post(f"{server.http_url}/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1},
                   timeout=60)
    took = time.perf_counter() - t0
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "prompt" and f"more than {MAX_TEXT_RUN} {kind}" in err["message"]
    assert took < 2.0, took
    r = httpx.post(f"{server.http_url}/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": text}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"


def test_text_that_only_looks_long_passes() -> None:
    import base64
    import os

    for ok in ("hello world " * 50_000, base64.b64encode(os.urandom(100_000)).decode(), "b" * MAX_TEXT_RUN,
               "x" * MAX_TEXT_RUN + " " + "y" * MAX_TEXT_RUN, "12345" * 20_000):
        check_text(ok, "prompt")
    with pytest.raises(ValidationError, match="at character 13"):
        check_text("twelve chars " + "z" * (MAX_TEXT_RUN + 1), "prompt")


def test_health_answers_while_a_big_prompt_is_tokenized(server) -> None:
    big = "The quick brown fox jumps over the lazy dog. " * 60_000  # 2.7 MB of ordinary text
    r, gaps = post_watching_health(server, "/v1/completions", json={"model": MODEL, "prompt": big, "max_tokens": 1})
    result = {"status": r.status_code, "count": r.json().get("usage", {}).get("prompt_tokens")}
    assert result["status"] == 200 and result["count"] > 500_000
    assert len(gaps) >= 3 and max(gaps) < 0.1, (len(gaps), max(gaps))


def test_long_text_encodes_in_pieces_to_the_same_ids() -> None:
    """harmony.encode_text cuts long text where no token spans; openai-harmony's one-call encode of the
    whole text is the reference."""
    import random

    enc = harmony.load_encoding()
    rng = random.Random(0)
    alphabet = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"-\n\t()[]{}/\\_")
                + ["é", "ß", "漢", "字", "😀", "ñ", "Ж", "  ", "\n\n", "'s", "'re", "123", "http://x.y/z", "\u0301"])
    for trial in range(4):
        words, n = [], 0
        while n < 200_000:
            w = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
            words.append(w)
            n += len(w) + 1
        text = " ".join(words)
        assert harmony.encode_text(text) == enc.encode(text, allowed_special=set()), trial


@pytest.mark.parametrize("shape", ["many messages", "one huge message"])
def test_health_answers_while_a_big_conversation_is_rendered(server, shape) -> None:
    """openai-harmony holds the GIL while it renders (2048 messages: ~0.6 s here, 11k: 3 s): big
    conversations render in a helper process (router/render_pool.py), to exactly the ids harmony gives
    in-process."""
    from kvrelay.router.service import utc_today
    from kvrelay.router.types import ChatMessage, ChatRequest

    if shape == "many messages":
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: hi there " * 8}
                    for i in range(MAX_MESSAGES)]
    else:
        messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 25_000}]
    want = len(harmony.render_chat(ChatRequest(tuple(ChatMessage(m["role"], m["content"]) for m in messages)),
                                   utc_today()))  # the date the server renders with
    r, gaps = post_watching_health(server, "/v1/chat/completions",
                                   json={"model": MODEL, "messages": messages, "max_tokens": 1})
    result = {"status": r.status_code, "body": r.json()}
    assert result["status"] == 200, result["body"]
    assert result["body"]["usage"]["prompt_tokens"] == want
    assert len(gaps) >= 3 and max(gaps) < 0.1, (len(gaps), max(gaps))


def test_more_messages_than_the_limit_are_refused_by_name(server) -> None:
    messages = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    r = httpx.post(f"{server.http_url}/v1/chat/completions", json={"model": MODEL, "messages": messages}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]
    assert str(MAX_MESSAGES) in r.json()["error"]["message"]
