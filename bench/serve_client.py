"""The client side of one streamed request of bench.serve: the request body, the prompt numbering, the SSE
parsing and what one stream measured. Shared by the one-process run (serve.py) and the load split over
client processes (serve_procs.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def chunk_tokens(choice: dict) -> int | None:
    """Output tokens one streamed completion choice carries: len(token_ids) when the server sends ids,
    None for text whose token count is unknown, 0 when it carries no output (a finish-only chunk, or a
    token whose text the server holds back until its UTF-8 completes)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and ids:
        return len(ids)
    return None if choice.get("text") else 0


def itl_samples(times: Sequence[float], tokens: Sequence[int | None], total: int) -> list[float]:
    """Inter-token latencies from the arrival times of the content chunks. A chunk of k tokens stands
    for k gaps of (its gap / k). When the per-chunk counts are unknown (text only) or disagree with the
    server's total, the tokens after the first chunk are spread evenly over the later chunks."""
    if len(times) < 2:
        return []
    gaps = [b - a for a, b in itertools.pairwise(times)]
    if all(k is not None for k in tokens) and sum(tokens) == total:  # type: ignore[arg-type]
        return [g / k for g, k in zip(gaps, tokens[1:], strict=True) for _ in range(k)]  # type: ignore[misc]
    first = tokens[0] or 1
    per_chunk = max(1.0, (total - first) / len(gaps))
    return [g / per_chunk for g in gaps]


# ---- one request -------------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    itl_s: list[float] = field(default_factory=list)
    per_user_tok_s: float | None = None
    timings: dict[str, Any] | None = None
    t_done: float = 0.0
    t_send: float = 0.0
    # (arrival time, tokens) of each content chunk, on the clock of t_send / t_done (perf_counter: one
    # clock for every client process of a run), for throughput over a window (bench.serve.steady_rate)
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    # From the usage chunk: the server's prompt token count, and how many of them its prefix cache
    # supplied (usage.prompt_tokens_details.cached_tokens; None when the server does not say).
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # keep_answer only (bench.serve_multiturn feeds the answer back as the next turn's history): the
    # generated ids (return_token_ids; None when a content chunk came without them) and the text.
    answer_ids: list[int] | None = None
    answer_text: str = ""


class StreamParser:
    """Folds the SSE payloads of one streamed completion into a RequestResult."""

    def __init__(self, t_send: float, keep_answer: bool = False):
        self.t_send = t_send
        self.keep_answer = keep_answer
        self.answer_ids: list[int] | None = []
        self.answer_text: list[str] = []
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.times: list[float] = []
        self.tokens: list[int | None] = []
        self.usage_tokens: int | None = None
        self.finish: str | None = None
        self.timings: dict | None = None
        self.error: str | None = None

    def feed(self, obj: dict, now: float) -> None:
        if "error" in obj and not obj.get("choices"):
            err = obj["error"]
            self.error = "in-stream error: " + str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                self.prompt_tokens = int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                self.cached_tokens = int(details["cached_tokens"])
        if isinstance(obj.get("kvrelay_timings"), dict):
            self.timings = obj["kvrelay_timings"]
        for choice in obj.get("choices") or ():
            self.finish = choice.get("finish_reason") or self.finish
            k = chunk_tokens(choice)
            if k != 0:
                self.times.append(now - self.t_send)
                self.tokens.append(k)
            if self.keep_answer:
                self._keep(choice)

    def _keep(self, choice: dict) -> None:
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            if self.answer_ids is not None:
                self.answer_ids += ids
        elif choice.get("text"):
            self.answer_ids = None  # text without ids: the answer's exact tokens are not known
        if choice.get("text"):
            self.answer_text.append(choice["text"])

    def result(self, output_len: int, t_done: float) -> RequestResult:
        known = sum(k or 1 for k in self.tokens)
        n = self.usage_tokens if self.usage_tokens is not None else known
        r = RequestResult(output_tokens=n, finish_reason=self.finish, timings=self.timings, t_done=t_done,
                          t_send=self.t_send,
                          arrivals=[(self.t_send + t, k or 1) for t, k in zip(self.times, self.tokens)],
                          prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens)
        if self.keep_answer:
            r.answer_ids = self.answer_ids if self.answer_ids else None
            r.answer_text = "".join(self.answer_text)
        if self.times:
            r.ttft_s = self.times[0]
            r.itl_s = itl_samples(self.times, self.tokens, n)
            span = self.times[-1] - self.times[0]
            r.per_user_tok_s = (n - 1) / span if n > 1 and span > 0 else None
        if self.error:
            r.error = self.error
        elif n < output_len:
            r.error = f"short output: {n} of {output_len} tokens (finish_reason={self.finish})"
        elif not self.times:
            r.error = "no content chunk in the stream"
        r.ok = r.error is None
        return r


async def one_request(client, url: str, body: dict, output_len: int, timeout_s: float, *,
                      keep_answer: bool = False) -> RequestResult:
    t_send = time.perf_counter()
    parser = StreamParser(t_send, keep_answer)

    async def drive() -> None:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace").replace("\n", " ")
                parser.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            # Splitting raw bytes ourselves: at hundreds of concurrent streams the client parses tens
            # of thousands of chunks a second, and aiter_lines' text decoding costs measurably more.
            buf = b""
            async for raw in resp.aiter_raw():
                now = time.perf_counter()
                buf += raw
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    parser.feed(json.loads(data), now)

    try:
        await asyncio.wait_for(drive(), timeout_s)
    except asyncio.TimeoutError:
        parser.error = f"timeout after {timeout_s:g} s"
    except Exception as e:  # noqa: BLE001 - any transport or protocol failure is a failed request
        parser.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return parser.result(output_len, time.perf_counter())


# ---- one point ------------------------------------------------------------------------------------------------
class Prompts:
    """Distinct random prompts, reproducible from (seed, request number); numbered across the whole run so
    no prefix is ever shared, not even with an earlier point (prefix caching must not help)."""

    def __init__(self, seed: int, lo: int, hi: int):
        import numpy as np

        self._np, self.seed, self.lo, self.hi, self.issued = np, seed, lo, hi, 0

    def next(self, length: int) -> list[int]:
        self.issued += 1
        return self.at(self.issued - 1, length)

    def at(self, index: int, length: int) -> list[int]:
        """Prompt number `index` (what the index-th `next` returns)."""
        rng = self._np.random.default_rng((self.seed, index))
        return rng.integers(self.lo, self.hi, size=length).tolist()


def request_body(model: str, prompt: list[int], output_len: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def send_requests(client, url: str, model: str, prompts: "Prompts", base: int, indices: Sequence[int], *,
                        slots: int, conc: int, input_len: int, output_len: int, t_start: float, stagger_s: float,
                        deadline: float, timeout_s: float, on_done: Callable[[], None]) -> list[RequestResult]:
    """The point's requests `indices` (request i sends prompt number base + i), at most `slots` in flight.
    The first wave (i < conc) starts spread over `stagger_s` from `t_start`: streams then start and end at
    different steps, as in steady serving, instead of all prefilling at once and finishing together. No
    request starts after `deadline`."""
    sem = asyncio.Semaphore(max(slots, 1))

    async def guarded(i: int) -> RequestResult | None:
        if i < conc and stagger_s > 0:
            await asyncio.sleep(max(0.0, t_start + stagger_s * i / conc - time.perf_counter()))
        async with sem:
            if time.perf_counter() > deadline:
                return None
            r = await one_request(client, url, request_body(model, prompts.at(base + i, input_len), output_len),
                                  output_len, timeout_s)
            on_done()
            return r

    done = await asyncio.gather(*(guarded(i) for i in indices))
    return [r for r in done if r is not None]
