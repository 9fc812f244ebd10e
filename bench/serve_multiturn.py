"""Multi-turn serving benchmark (issue 16): C concurrent conversations over one shared system prompt, each
turn's prompt the previous turn's prompt + its answer + a new user message, streamed to /v1/completions of
any OpenAI-compatible server (kvrelay, vLLM, SGLang). A prefix cache shows as turn 2+'s TTFT and as the
answers' usage.prompt_tokens_details.cached_tokens; tables per turn index, JSON + PNG in bench/results.

    python -m kvrelay.bench.serve_multiturn --base-url http://127.0.0.1:8000 --prefix-cache on \\
        --conversations 8 --turns 7 --system-len 6k --first-user-len 2k --user-len 3840 --answer-len 256

Turn t's prompt is system + first user message + (t - 1) x (answer + user message) tokens long: the
example grows from 8k to 32k. Prompts are token-id lists (--prompt-format ids) and each answer comes back
as its exact ids (vLLM's `return_token_ids`, which kvrelay's router implements), so every prompt starts with
the previous turn's prompt and answer token for token: nothing but the server decides what is reused.
A server without return_token_ids or token-id prompts gets text (--prompt-format text; `auto`, the
default, asks one short probe request for ids and falls back to text when none come back): random common
English words, one o200k token each, and the answer's text. The server re-tokenizes that history, so
tokens at the seams may merge differently from the ones generated (a cache still hits the previous prompt
up to the seam), and the lengths are the server's counts (usage.prompt_tokens), near the planned ones.

`--prefix-cache off|on|on+host` only labels the run (what the server was started with): bench/RESULTS.md
sets turn 2+'s TTFT with the cache against the cache-off run of the same workload (bench/serve_h200.sh
MULTITURN=1 runs all three against fresh servers).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvrelay.bench import common as C
from kvrelay.bench.serve import DEFAULT_TOKEN_RANGE, _gpu_name, parse_length, percentile, probe
from kvrelay.bench.serve_client import RequestResult, one_request, request_body

CACHE_MODES = ("off", "on", "on+small", "on+host", "unknown")  # on+small: the cache on a KV pool too small for every conversation
# Common English words that are each one o200k token after a space (tests/cpu/test_bench_multiturn.py
# checks): text prompts of n words are n tokens long.
WORDS = tuple("""the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there been one all we their has would when if so no will more can who time
about out up them some into only other new than then also its could two first any these may like now my over
such our man me even most made after what many before must years back through much where your way down
should because long each just state those people how too little very good world make well great see work
under between life own being day same another know while last might us three old year off come since go
against came right used take""".split())


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    system_len: int      # the shared system prompt, the same for every conversation
    first_user_len: int  # turn 1's user message
    user_len: int        # each later turn's new user message
    answer_len: int      # tokens generated per turn (ignore_eos: exactly this many)

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "answer_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("system_len", "first_user_len", "user_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")
        if self.system_len + self.first_user_len < 1:
            raise ValueError("turn 1's prompt is empty: give --system-len or --first-user-len")

    def prompt_len(self, turn: int) -> int:
        """Turn `turn`'s (1-based) prompt length in tokens (in ids mode exactly what is sent)."""
        return self.system_len + self.first_user_len + (turn - 1) * (self.answer_len + self.user_len)

    def key(self) -> tuple[int, ...]:
        return (self.conversations, self.turns, self.system_len, self.first_user_len, self.user_len,
                self.answer_len)


class IdPieces:
    """Token-id prompt pieces, reproducible from the seed: the system prompt, a user message per
    (conversation, turn), distinct from each other and from the warmup prompts."""

    fmt = "ids"

    def __init__(self, seed: int, lo: int, hi: int):
        import numpy as np

        self._np, self.seed, self.lo, self.hi = np, seed, lo, hi

    def _draw(self, key: tuple[int, ...], n: int) -> list[int]:
        return self._np.random.default_rng((self.seed, *key)).integers(self.lo, self.hi, size=n).tolist()

    def system(self, n: int) -> list[int]:
        return self._draw((0,), n)

    def user(self, conv: int, turn: int, n: int) -> list[int]:
        return self._draw((1, conv, turn), n)

    def warmup(self, i: int, n: int) -> list[int]:
        return self._draw((2, i), n)

    @staticmethod
    def answer(r: RequestResult) -> list[int] | None:
        return r.answer_ids


class TextPieces(IdPieces):
    """The same pieces as text: n random words of WORDS (n o200k tokens)."""

    fmt = "text"

    def _draw(self, key: tuple[int, ...], n: int) -> str:  # type: ignore[override]
        rng = random.Random(repr((self.seed, *key)))
        return "".join(" " + rng.choice(WORDS) for _ in range(n))

    @staticmethod
    def answer(r: RequestResult) -> str:  # type: ignore[override]
        return r.answer_text


class Conversation:
    """One conversation's prompt: turn 1 = system + first user message; each next turn = the previous
    turn's prompt + its answer + a new user message (lists of ids or strings: both concatenate)."""

    def __init__(self, index: int, pieces: IdPieces, wl: Workload, system=None):
        self.index, self.pieces, self.wl, self.turn = index, pieces, wl, 1
        system = pieces.system(wl.system_len) if system is None else system
        self.prompt = system + pieces.user(index, 1, wl.first_user_len)

    def advance(self, answer) -> None:
        self.turn += 1
        self.prompt = self.prompt + answer + self.pieces.user(self.index, self.turn, self.wl.user_len)


@dataclass
class Turn:
    conversation: int
    turn: int
    sent_len: int | None  # ids mode: len(prompt) as sent (text: None, the server counts)
    result: RequestResult


# ---- the run ----------------------------------------------------------------------------------------------
def body_for(model: str, prompt, answer_len: int, fmt: str) -> dict:
    body = request_body(model, prompt, answer_len)
    if fmt == "ids":
        body["return_token_ids"] = True  # vLLM's field: the answer's exact ids, for the next turn's history
    return body


async def detect_format(client, url: str, model: str, pieces: IdPieces, timeout_s: float) -> tuple[str, str]:
    """`auto`: a 16-token id prompt asking for ids. Ids back -> "ids"; a 4xx or text only -> "text";
    anything else (no server, 5xx, timeout) is not a question of format: exit with it."""
    r = await one_request(client, url, body_for(model, pieces.warmup(10**6, 16), 4, "ids"), 4, timeout_s,
                          keep_answer=True)
    if r.ok and r.answer_ids is not None and len(r.answer_ids) == r.output_tokens:
        return "ids", "the server returned the answer's token ids (return_token_ids)"
    if r.ok:
        return "text", "the server sent no token ids for the answer (no return_token_ids)"
    if r.error and re.match(r"HTTP 4\d\d", r.error):
        return "text", f"token-id prompt or return_token_ids refused: {r.error[:200]}"
    raise SystemExit(f"error: the probe request failed: {r.error}")


async def run_conversation(client, url: str, model: str, conv: Conversation, wl: Workload, *, t_start: float,
                           stagger_s: float, think_s: float, deadline: float, timeout_s: float,
                           on_done) -> tuple[list[Turn], str | None]:
    """The conversation's turns in order; (turns, why it stopped early or None). A failed turn ends it:
    its history would no longer be what the server saw."""
    await asyncio.sleep(max(0.0, t_start + stagger_s * conv.index / wl.conversations - time.perf_counter()))
    fmt = conv.pieces.fmt
    turns: list[Turn] = []
    while True:
        if time.perf_counter() > deadline:
            return turns, f"--duration-s reached before turn {conv.turn}"
        sent = len(conv.prompt) if fmt == "ids" else None
        r = await one_request(client, url, body_for(model, conv.prompt, wl.answer_len, fmt), wl.answer_len,
                              timeout_s, keep_answer=True)
        on_done()
        turns.append(Turn(conv.index, conv.turn, sent, r))
        if not r.ok:
            return turns, f"turn {conv.turn} failed: {r.error}"
        if conv.turn == wl.turns:
            return turns, None
        answer = conv.pieces.answer(r)
        if fmt == "ids" and (answer is None or len(answer) != r.output_tokens):
            return turns, f"turn {conv.turn}: the answer's token ids did not come back whole"
        conv.advance(answer)
        if think_s > 0:
            await asyncio.sleep(think_s)


def _group_row(label: str, turns: list[Turn], planned: int | None) -> dict:
    ok = [t for t in turns if t.result.ok]
    res = [t.result for t in ok]
    prompt = [r.prompt_tokens if r.prompt_tokens is not None else t.sent_len for t, r in zip(ok, res)]
    prompt = [p for p in prompt if p is not None]
    cached = [r.cached_tokens for r in res if r.cached_tokens is not None]
    span = (max(t.result.t_done for t in turns) - min(t.result.t_send for t in turns)) if turns else 0.0

    def timing(key: str) -> float | None:
        vals = [r.timings[key] for r in res if r.timings and isinstance(r.timings.get(key), (int, float))]
        return percentile(vals, 50)

    return {
        "turn": label, "requests": len(turns), "failed": len(turns) - len(ok), "planned_prompt_len": planned,
        "prompt_tokens_p50": percentile(prompt, 50), "prompt_tokens_sum": sum(prompt),
        "cached_tokens_p50": percentile(cached, 50), "cached_tokens_sum": sum(cached) if cached else None,
        "cached_frac": sum(cached) / sum(prompt) if cached and sum(prompt) else None,
        "ttft_p50_s": percentile([r.ttft_s for r in res if r.ttft_s is not None], 50),
        "ttft_p99_s": percentile([r.ttft_s for r in res if r.ttft_s is not None], 99),
        "itl_p50_s": percentile([x for r in res for x in r.itl_s], 50),
        "output_tokens": sum(r.output_tokens for r in res), "span_s": span,
        # Over the span from the turn index's first send to its last answer (turns of different
        # conversations overlap, so the rows' spans do too; the "all" row's is the run's wall time).
        "in_tok_s": sum(prompt) / span if span > 0 else None,
        "out_tok_s": sum(r.output_tokens for r in res) / span if span > 0 else None,
        "queue_s_p50": timing("queue_s"), "prefill_compute_s_p50": timing("prefill_compute_s"),
        "failure_reasons": dict(Counter(t.result.error for t in turns if not t.result.ok).most_common(3)),
    }


def turn_rows(turns: list[Turn], wl: Workload) -> list[dict]:
    """A row per turn index 1..T, then "2+" (every later turn) and "all"."""
    rows = [_group_row(str(i), [t for t in turns if t.turn == i], wl.prompt_len(i)) for i in range(1, wl.turns + 1)]
    rows.append(_group_row("2+", [t for t in turns if t.turn >= 2], None))
    rows.append(_group_row("all", turns, None))
    return [r for r in rows if r["requests"]]


async def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    import httpx
    from tqdm import tqdm

    args.base_url = re.sub(r"/v1/?$", "", args.base_url.rstrip("/"))
    try:
        wl = Workload(args.conversations, args.turns, parse_length(args.system_len), parse_length(args.first_user_len),
                      parse_length(args.user_len), parse_length(args.answer_len))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    lo, hi = C.parse_ints(args.token_id_range)
    url = f"{args.base_url}/v1/completions"
    console = C.console()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    limits = httpx.Limits(max_connections=wl.conversations + 8, max_keepalive_connections=wl.conversations + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.timeout_s, connect=30.0),
                                 headers=headers) as client:
        card = await probe(client, args)
        longest = wl.prompt_len(wl.turns) + wl.answer_len
        max_len = card.get("max_model_len")
        if isinstance(max_len, int) and longest > max_len:
            raise SystemExit(f"error: turn {wl.turns} needs {longest} tokens (prompt + answer), over the server's "
                             f"max_model_len {max_len}: fewer --turns or shorter messages")
        fmt, why = args.prompt_format, "as asked (--prompt-format)"
        if fmt == "auto":
            fmt, why = await detect_format(client, url, args.model, IdPieces(args.seed, lo, hi), args.timeout_s)
        pieces = (IdPieces if fmt == "ids" else TextPieces)(args.seed, lo, hi)
        console.print(f"[bold]multi-turn[/] {args.model} at {args.base_url}: {wl.conversations} conversations x "
                      f"{wl.turns} turns, prompts {wl.prompt_len(1)}..{wl.prompt_len(wl.turns)} tokens, "
                      f"{fmt} prompts ({why}), prefix cache {args.prefix_cache}")
        # Unmeasured, sharing nothing with the conversations: the longest prompt length, then two turns of a
        # conversation of its own, whose second is a prefix-cache hit when the cache is on. A server compiles
        # (and times) kernels for shapes it has not seen yet on first use; on the H200 the first server of a
        # MULTITURN run paid for that in its early turns (turn 2: 2.4 s TTFT, 0.14 s on the next server).
        for i in range(args.warmup):
            n = wl.prompt_len(wl.turns)
            w = await one_request(client, url, body_for(args.model, pieces.warmup(3 * i, n), wl.answer_len, fmt),
                                  wl.answer_len, args.timeout_s)
            if not w.ok:
                console.print(f"[yellow]warmup at {n} tokens failed: {w.error}[/]")
            conv = Conversation(10**6 + i, pieces, wl, system=pieces.warmup(3 * i + 1, wl.system_len))
            for _ in range(2):
                w = await one_request(client, url, body_for(args.model, conv.prompt, wl.answer_len, fmt),
                                      wl.answer_len, args.timeout_s, keep_answer=True)
                answer = pieces.answer(w) if w.ok else None
                if answer is None:
                    console.print(f"[yellow]warmup turn {conv.turn} failed: {w.error or 'no answer'}[/]")
                    break
                conv.advance(answer)
        system = pieces.system(wl.system_len)
        convs = [Conversation(c, pieces, wl, system) for c in range(wl.conversations)]
        bar = tqdm(total=wl.conversations * wl.turns, desc="turns", unit="req", leave=False)
        t0, cpu0 = time.perf_counter(), time.process_time()
        deadline = math.inf if args.duration_s is None else t0 + args.duration_s
        outs = await asyncio.gather(*(run_conversation(
            client, url, args.model, c, wl, t_start=t0, stagger_s=args.stagger_s, think_s=args.think_s,
            deadline=deadline, timeout_s=args.timeout_s, on_done=lambda: bar.update(1)) for c in convs))
        bar.close()
        wall = max(time.perf_counter() - t0, 1e-9)
    turns = [t for ts, _ in outs for t in ts]
    env = C.env_info("cpu", "kvrelay.bench.serve_multiturn", argv)
    if args.api_key:
        env["command"] = env["command"].replace(args.api_key, "***")
    env.update(gpu=_gpu_name(), device="client host (the server may run elsewhere)")
    mismatch = [t for t in turns if t.sent_len is not None and t.result.prompt_tokens is not None
                and t.result.prompt_tokens != t.sent_len]
    payload: dict[str, Any] = {
        "kind": "serve-multiturn", "env": env, "model": args.model, "base_url": args.base_url,
        "topology": args.topology, "label": args.label, "gpus": args.gpus, "prefix_cache": args.prefix_cache,
        "prompt_format": fmt, "prompt_format_reason": why, "server_model_card": card,
        "settings": {"conversations": wl.conversations, "turns": wl.turns, "system_len": wl.system_len,
                     "first_user_len": wl.first_user_len, "user_len": wl.user_len, "answer_len": wl.answer_len,
                     "prompt_lens": [wl.prompt_len(i) for i in range(1, wl.turns + 1)],
                     "stagger_s": args.stagger_s, "think_s": args.think_s, "warmup": args.warmup,
                     "duration_s": args.duration_s, "timeout_s": args.timeout_s, "token_id_range": [lo, hi],
                     "seed": args.seed, "endpoint": "/v1/completions (streamed, ignore_eos, temperature 0)"},
        "wall_s": wall, "client_cpu_frac": (time.process_time() - cpu0) / wall,
        # ids mode: the server counted a different prompt length than was sent (should never happen)
        "prompt_len_mismatches": len(mismatch),
        "stopped_early": [f"conversation {i}: {why}" for i, (_, why) in enumerate(outs) if why],
        "points": turn_rows(turns, wl),
        "requests": [{"conversation": t.conversation, "turn": t.turn, "sent_len": t.sent_len, "ok": t.result.ok,
                      "error": t.result.error, "prompt_tokens": t.result.prompt_tokens,
                      "cached_tokens": t.result.cached_tokens, "ttft_s": t.result.ttft_s,
                      "output_tokens": t.result.output_tokens,
                      "t_send_s": t.result.t_send - t0, "t_done_s": t.result.t_done - t0} for t in turns],
    }
    _print(console, payload)
    name = C.slug(args.label or args.model)
    payload["files"] = C.save_result(args.out_dir, f"serve-multiturn-{name}-{C.stamp()}", payload, _plot(payload))
    console.print(f"saved {payload['files']}")
    return payload


def _fmt(x: float | None, spec: str = ".3f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def _print(console, payload: dict) -> None:
    from rich.table import Table

    s = payload["settings"]
    t = Table(title=f"{payload['model']} multi-turn at {payload['base_url']}: {s['conversations']} conversations x "
                    f"{s['turns']} turns, {payload['prompt_format']} prompts, prefix cache {payload['prefix_cache']}")
    for col in ("turn", "prompt tok p50", "reqs", "failed", "cached tok p50", "cached %", "TTFT p50 s",
                "TTFT p99 s", "ITL p50 ms", "in tok/s", "out tok/s", "queue s", "prefill s"):
        t.add_column(col, justify="right")
    for p in payload["points"]:
        t.add_row(p["turn"], _fmt(p["prompt_tokens_p50"], ",.0f"), str(p["requests"]), str(p["failed"]),
                  _fmt(p["cached_tokens_p50"], ",.0f"), _fmt(p["cached_frac"], ".0%"), _fmt(p["ttft_p50_s"]),
                  _fmt(p["ttft_p99_s"]), _fmt(p["itl_p50_s"], ".2f", 1e3), _fmt(p["in_tok_s"], ",.0f"),
                  _fmt(p["out_tok_s"], ",.0f"), _fmt(p["queue_s_p50"]), _fmt(p["prefill_compute_s_p50"]))
    console.print(t)
    for line in payload["stopped_early"]:
        console.print(f"[yellow]{line}[/]")
    if payload["prompt_len_mismatches"]:
        console.print(f"[red]{payload['prompt_len_mismatches']} requests: the server counted another prompt length "
                      "than was sent[/]")


def _tokens(n: float | None) -> str:
    return "-" if n is None else f"{n / 1024:.1f}k" if n >= 1024 else f"{n:.0f}"


def _plot(payload: dict):
    rows = [p for p in payload["points"] if p["turn"].isdigit()]
    if not rows:
        return None
    try:
        fig, (ax_t, ax_c) = C.new_figure(ncols=2, figsize=(11, 4.5))
    except ImportError:  # matplotlib is a test extra; the JSON alone is the result
        return None
    xs = [int(p["turn"]) for p in rows]
    nan = math.nan
    ax_t.plot(xs, [nan if p["ttft_p50_s"] is None else p["ttft_p50_s"] for p in rows], "o-", label="TTFT p50")
    ax_t.plot(xs, [nan if p["ttft_p99_s"] is None else p["ttft_p99_s"] for p in rows], "s--", label="TTFT p99")
    ax_t.set_ylabel("seconds")
    ax_c.bar(xs, [p["prompt_tokens_p50"] or 0 for p in rows], color="0.8", label="prompt tokens p50")
    ax_c.bar(xs, [p["cached_tokens_p50"] or 0 for p in rows], color="C2", label="cached tokens p50")
    ax_c.set_ylabel("tokens")
    labels = [f"{x}\n{_tokens(p['prompt_tokens_p50'])}" for x, p in zip(xs, rows)]
    for ax in (ax_t, ax_c):
        ax.set_xticks(xs, labels)
        ax.set_xlabel("turn (prompt tokens p50)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{payload['model']} multi-turn, {payload['settings']['conversations']} conversations, prefix cache "
                 f"{payload['prefix_cache']} ({payload['label'] or payload['base_url']})", fontsize=10)
    return fig


# ---- CLI --------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvrelay.bench.serve_multiturn", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is dropped)")
    p.add_argument("--model", default=None, help="model name to request (default: first id of GET /v1/models)")
    p.add_argument("--conversations", type=int, default=8, help="conversations in flight at once (C)")
    p.add_argument("--turns", type=int, default=7, help="turns per conversation")
    p.add_argument("--system-len", default="6k", help="shared system prompt tokens (k = 1024)")
    p.add_argument("--first-user-len", default="2k", help="turn 1's user message tokens")
    p.add_argument("--user-len", default="3840", help="each later turn's new user message tokens")
    p.add_argument("--answer-len", default="256", help="tokens generated per turn (ignore_eos)")
    p.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                   help="token-id prompts with return_token_ids answers, or text (auto: ids when the server "
                        "returns them)")
    p.add_argument("--prefix-cache", choices=CACHE_MODES, default="unknown",
                   help="what the server runs with (recorded; RESULTS.md compares on against off)")
    p.add_argument("--stagger-s", type=float, default=0.0, help="spread the conversations' starts over this")
    p.add_argument("--think-s", type=float, default=0.0, help="pause between an answer and the next turn")
    p.add_argument("--warmup", type=int, default=1,
                   help="unmeasured rounds of two requests (turn 1's and the last turn's length) before the run")
    p.add_argument("--duration-s", type=float, default=None, help="start no turn after this many seconds")
    p.add_argument("--timeout-s", type=float, default=600.0, help="wall-clock limit of one request")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the server uses (recorded)")
    p.add_argument("--topology", default=None, help="free text recorded in the JSON (e.g. the topology YAML)")
    p.add_argument("--label", default=None, help="names the result files (default: the model)")
    p.add_argument("--token-id-range", default=DEFAULT_TOKEN_RANGE,
                   help="LO,HI: prompt ids are drawn from [LO, HI) (small test models need a small HI)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(C.DEFAULT_OUT), help="directory for the JSON and PNG")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY; never stored in results)")
    return p


def main(argv: list[str] | None = None) -> dict:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise SystemExit("error: kvrelay.bench.serve_multiturn needs httpx (pip install httpx)") from None
    return asyncio.run(run(build_parser().parse_args(argv), argv))


def _any_success(payload: dict) -> bool:
    return any(p["requests"] > p["failed"] for p in payload["points"])


if __name__ == "__main__":
    sys.exit(C.run_cli(main, ok=_any_success))
