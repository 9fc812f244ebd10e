"""Structured outputs: what a grammar mask costs per token, llguidance against xgrammar.

For each engine and schema: compile time (what a request with a new schema waits for), then a valid
document tokenized with o200k_harmony is fed token by token to B matchers at staggered positions, timing
the mask fill of all B rows per step (llguidance's executor / xgrammar's batch matcher fill rows in
parallel with the GIL released), and every sampled token is checked against its mask. Then the cost of
applying B bitmasks to [B, 201088] logits on --device (the GPU variant: --device cuda), and of
kvrelay's own per-request harmony state machine (engine/structured.py) over the chosen engine.

    python -m kvrelay.bench.structured [--device cpu|cuda] [--batches 1,64] [--engines llguidance,xgrammar]
        [--model gpt-oss-tiny|gpt-oss-20b --quant bf16|fp8-block128]   # decode steps with and without

The JSON goes to bench/results/structured-<device>-<stamp>.json with the commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvrelay.bench.common import DEFAULT_OUT, env_info, parse_ints, run_cli, save_result, stamp

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "age", "tags", "address"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "analytical engines"],
         "address": {"city": "London", "zip": "12345"}}),
    "json_object": ({"type": "object"},
                    {"answer": "The capital of France is Paris, on the Seine.", "confidence": 0.93,
                     "sources": [{"title": "Atlas", "page": 12}], "final": True}),
}


def _doc_tokens(doc) -> list[int]:
    from kvrelay.router.harmony import encode_text

    return encode_text(json.dumps(doc, separators=(",", ":")))


def _percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"mean_ms": 1e3 * statistics.fmean(xs), "p50_ms": 1e3 * xs[len(xs) // 2],
            "p99_ms": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


def _bit(row, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def bench_llguidance(schema, tokens: list[int], batch: int, steps: int) -> dict:
    import llguidance
    import torch

    from kvrelay.engine import grammar

    tok = grammar.tokenizer()
    text = json.dumps(schema)
    t0 = time.perf_counter()
    g = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=grammar.JSON_OPTIONS)
    err = llguidance.LLMatcher.validate_grammar(g, tok)
    compile_s = time.perf_counter() - t0
    assert not err, err
    ex = grammar.executor()
    matchers = [llguidance.LLMatcher(tok, g, log_level=0) for _ in range(batch)]
    pos = [0] * batch
    for i, m in enumerate(matchers):  # stagger: row i starts i tokens in
        for t in tokens[: i % len(tokens)]:
            assert m.consume_token(t)
        pos[i] = i % len(tokens)
    mask = torch.full((batch, grammar.MASK_WORDS), -1, dtype=torch.int32)  # (llguidance.torch's layout)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if batch == 1:
            matchers[0].unsafe_compute_mask_ptr(mask.data_ptr(), grammar.MASK_WORDS * 4)
        else:
            ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(),
                                       grammar.MASK_WORDS * 4, batch)
        times.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            if pos[i] == len(tokens):  # the document is complete: the end token must be allowed
                assert _bit(mask[i], grammar.RETURN), "end of document not allowed"
                m.reset()
                pos[i] = 0
                continue
            assert _bit(mask[i], tokens[pos[i]]), f"token {tokens[pos[i]]} masked at {pos[i]}"
            assert m.consume_token(tokens[pos[i]])
            pos[i] += 1
    return {"compile_ms": 1e3 * compile_s, "fill": _percentiles(times),
            "per_token_ms": 1e3 * statistics.fmean(times) / batch}


def bench_xgrammar(schema, tokens: list[int], batch: int, steps: int) -> dict:
    import xgrammar as xgr

    from kvrelay.engine import grammar

    info = _xgr_info()
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(cg) for _ in range(batch)]
    pos = [0] * batch
    for i, m in enumerate(matchers):
        for t in tokens[: i % len(tokens)]:
            assert m.accept_token(t)
        pos[i] = i % len(tokens)
    mask = xgr.allocate_token_bitmask(batch, info.vocab_size)
    bm = xgr.BatchGrammarMatcher(max_threads="auto")
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if batch == 1:
            matchers[0].fill_next_token_bitmask(mask, 0)
        else:
            bm.batch_fill_next_token_bitmask(matchers, mask)
        times.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            if pos[i] == len(tokens):
                assert _bit(mask[i], grammar.RETURN), "end of document not allowed"
                m.reset()
                pos[i] = 0
                continue
            assert _bit(mask[i], tokens[pos[i]]), f"token {tokens[pos[i]]} masked at {pos[i]}"
            assert m.accept_token(tokens[pos[i]])
            pos[i] += 1
    return {"compile_ms": 1e3 * compile_s, "fill": _percentiles(times),
            "per_token_ms": 1e3 * statistics.fmean(times) / batch}


_XGR = None


def _xgr_info():
    global _XGR
    if _XGR is None:
        import xgrammar as xgr

        from kvrelay.engine import grammar

        vocab = [b""] * grammar.N_VOCAB
        for b, i in grammar.mergeable_ranks().items():
            vocab[i] = b
        for name, i in grammar.special_tokens().items():
            vocab[i] = name.encode()
        _XGR = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=grammar.N_VOCAB,
                                 stop_token_ids=[grammar.RETURN])
    return _XGR


def bench_apply(device: str, batch: int, iters: int = 50) -> dict:
    """Unpack B bitmask rows on the device and mask [B, V] logits (kvrelay's apply path; on a GPU from a
    pinned buffer, as the decode step's mask job fills)."""
    import torch

    from kvrelay.engine import grammar
    from kvrelay.engine.structured import apply_bitmask

    logits = torch.randn(batch, grammar.N_VOCAB, device=device)
    mask = torch.randint(-(2 ** 31), 2 ** 31 - 1, (batch, grammar.MASK_WORDS), dtype=torch.int32)
    if device.startswith("cuda"):
        mask = mask.pin_memory()
    rows = list(range(batch))
    times = []
    for i in range(iters + 2):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        apply_bitmask(logits, rows, mask)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return _percentiles(times)


def bench_state_machine(batch: int, steps: int) -> dict:
    """kvrelay's per-request harmony+grammar state (engine/structured.py): the masks of B requests inside
    the final JSON body at staggered positions, per step (what a decode step waits for if its forward is
    shorter: the masks are computed on their own thread while the forward runs)."""
    from kvrelay.engine.structured import compute_masks, open_constraint
    from kvrelay.router import structured
    from kvrelay.router.types import ChatMessage, ChatRequest, ResponseFormat

    schema, doc = SCHEMAS["person"]
    req = ChatRequest(messages=(ChatMessage("user", "hi"),), max_reasoning_tokens=0,
                      response_format=ResponseFormat("json_schema", json.dumps(schema), "person"))
    spec = structured.build(req)
    body = _doc_tokens(doc)
    head = list(spec.bodies[0].header)
    cons = [open_constraint(spec, head + body[: i % len(body)]) for i in range(batch)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        compute_masks(cons)
        times.append(time.perf_counter() - t0)
    return {"fill": _percentiles(times), "per_token_ms": 1e3 * statistics.fmean(times) / batch}


ROWS = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 500, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 8},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}},
    "required": ["rows"], "additionalProperties": False}


def bench_steps(model: str, device: str, quant: str, batch: int, steps: int) -> dict:
    """Decode steps of the real Scheduler on `model` (dummy weights): B greedy requests inside a long JSON
    body (masks submitted before each forward, applied after; synchronous steps) against B unconstrained
    ones on synchronous steps, the two interleaved step by step on one Runner so that load on the machine
    hits both alike (each step timed alone, synchronized). Then the hot path, what serving runs: the same
    two on overlapped steps, in alternating blocks of consecutive steps with no synchronization between
    them (a block: its step() calls and the drain of its last launch; per step = block time / steps; a
    scheduler's launched step is drained before the other's block, so no two share the Runner). The
    difference per step is what structured outputs cost a decode step; divided by B, per token."""
    import torch

    from kvrelay.decode_worker.scheduler import Scheduler
    from kvrelay.engine.runner import Runner
    from kvrelay.engine.sampling import SamplingParams
    from kvrelay.router import harmony, structured
    from kvrelay.router.types import ChatMessage, ChatRequest, ResponseFormat

    req = ChatRequest(messages=(ChatMessage("user", "hi"),), max_reasoning_tokens=0,
                      response_format=ResponseFormat("json_schema", json.dumps(ROWS), "rows"))
    spec = structured.build(req)
    prompt = harmony.render_chat(req, "2026-12-01")
    head = list(spec.bodies[0].header)
    pages = 5 * batch * ((len(prompt) + 2 * steps + 60) // 16 + 2) + 16
    runner = Runner.load(model, dummy=True, device=device, quant=quant, page_size=16,
                         num_pages={"full": pages, "sliding": pages})
    sync = (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)

    def start(label: str, overlap: bool, constrained: bool) -> Scheduler:
        sched = Scheduler(runner, max_batch=batch, overlap=overlap)
        params = SamplingParams(max_tokens=2 * steps + 40, temperature=0.0, stop_token_ids=harmony.CHAT_STOP_TOKEN_IDS,
                                structured=spec if constrained else None)
        for i in range(batch):
            rid = f"{label}-{i}"
            sched.reserve(rid, len(prompt) + len(head), params.max_tokens)
            runner.prefill(rid, prompt + head[:-1])
            sched.join(rid, params, head[-1], len(head), lambda o: None, head[:-1])
        for _ in range(3):  # warm-up
            sched.step()
        sched.drain()  # (an overlapped one's launch: the next scheduler's prefills must not share the Runner)
        return sched

    def timed(sched: Scheduler) -> float:
        sync()
        t0 = time.perf_counter()
        sched.step()
        sync()
        return time.perf_counter() - t0

    def finish(sched: Scheduler, label: str) -> int:
        sched.drain()
        running = sched.running_ids()
        for rid in running:
            sched.release(rid)
        if len(running) != batch:  # a request ended during the run: the comparison is void
            raise RuntimeError(f"{label}: {batch - len(running)} of {batch} requests ended during the run")
        return len(running)

    out = {}
    overlapped = start("plain_overlapped", True, False)
    out["plain_overlapped"] = _percentiles([timed(overlapped) for _ in range(steps)])
    finish(overlapped, "plain_overlapped")
    out["hot_path"] = _hot_path({"plain": start("hot_plain", True, False),
                                 "json_schema": start("hot_json_schema", True, True)}, steps, batch, sync, finish)
    pair = {"plain_sync": start("plain_sync", False, False), "json_schema": start("json_schema", False, True)}
    times: dict[str, list[float]] = {k: [] for k in pair}
    for n in range(steps):
        for label in (("plain_sync", "json_schema") if n % 2 else ("json_schema", "plain_sync")):
            times[label].append(timed(pair[label]))
    for label, sched in pair.items():
        finish(sched, label)
        out[label] = _percentiles(times[label])
    added = out["json_schema"]["p50_ms"] - out["plain_sync"]["p50_ms"]
    out["added_per_step_ms"] = added
    out["added_per_token_ms"] = added / batch
    return out


def _hot_path(scheds: dict, steps: int, batch: int, sync, finish) -> dict:
    """Per-step time of overlapped steps in blocks (see bench_steps), plain and json_schema alternating."""
    block = max(5, steps // 4)
    times: dict[str, list[float]] = {k: [] for k in scheds}
    overlapped0 = {k: s.times.overlapped for k, s in scheds.items()}
    calls = {k: 0 for k in scheds}
    for n in range(max(2, -(-steps // block)) * 2):
        label = list(scheds)[n % 2 if (n // 2) % 2 == 0 else 1 - n % 2]
        sched = scheds[label]
        sync()
        t0 = time.perf_counter()
        for _ in range(block):
            sched.step()
        sched.drain()
        sync()
        times[label].append((time.perf_counter() - t0) / block)
        calls[label] += block
    out = {}
    for label, sched in scheds.items():
        # a step() call with nothing in flight before it (each block's first) does not count as overlapped
        share = (sched.times.overlapped - overlapped0[label]) / calls[label]
        finish(sched, f"hot_{label}")
        out[label] = {**_percentiles(times[label]), "overlapped_share": share}
    added = out["json_schema"]["p50_ms"] - out["plain"]["p50_ms"]
    out["added_per_step_ms"] = added
    out["added_per_token_ms"] = added / batch
    return out


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--engines", default="llguidance,xgrammar")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--model", default="gpt-oss-tiny", help="decode steps on this model (dummy weights); '' skips")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--step-count", type=int, default=30)
    args = p.parse_args()
    results: dict = {"env": env_info(args.device, "kvrelay.bench.structured", None), "engines": {},
                     "model": args.model or None, "quant": args.quant}
    import importlib.metadata as md

    for eng in args.engines.split(","):
        fn = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}[eng]
        try:
            r = {"version": md.version(eng)}
        except md.PackageNotFoundError:  # xgrammar is not a dependency: `pip install xgrammar` to compare
            print(f"{eng}: not installed, skipped")
            results["engines"][eng] = {"skipped": "not installed"}
            continue
        for name, (schema, doc) in SCHEMAS.items():
            toks = _doc_tokens(doc)
            for b in parse_ints(args.batches):
                r[f"{name}-b{b}"] = fn(schema, toks, b, args.steps)
                print(f"{eng:10s} {name:12s} B={b:3d} compile {r[f'{name}-b{b}']['compile_ms']:8.2f} ms  "
                      f"fill p50 {r[f'{name}-b{b}']['fill']['p50_ms']:7.3f} ms  "
                      f"per token {r[f'{name}-b{b}']['per_token_ms']:7.4f} ms", flush=True)
        results["engines"][eng] = r
    results["apply"] = {f"b{b}": bench_apply(args.device, b, iters=max(3, min(50, args.steps // 4)))
                        for b in parse_ints(args.batches)}
    results["state_machine"] = {f"b{b}": bench_state_machine(b, args.steps) for b in parse_ints(args.batches)}
    for k, v in results["apply"].items():
        print(f"apply on {args.device} {k}: p50 {v['p50_ms']:.3f} ms")
    for k, v in results["state_machine"].items():
        print(f"kvrelay state machine {k}: fill p50 {v['fill']['p50_ms']:.3f} ms, per token {v['per_token_ms']:.4f} ms")
    if args.model:
        results["decode_steps"] = {f"b{b}": bench_steps(args.model, args.device, args.quant, b, args.step_count)
                                   for b in parse_ints(args.batches)}
        for k, v in results["decode_steps"].items():
            print(f"decode step {args.model} {k}: plain overlapped p50 {v['plain_overlapped']['p50_ms']:.2f} ms; "
                  f"interleaved: plain sync {v['plain_sync']['p50_ms']:.2f} ms, json_schema "
                  f"{v['json_schema']['p50_ms']:.2f} ms: added {v['added_per_step_ms']:.2f} ms a step, "
                  f"{v['added_per_token_ms']:.3f} ms a token")
            h = v["hot_path"]
            print(f"  hot path (overlapped, {h['json_schema']['overlapped_share']:.0%} of json_schema steps "
                  f"overlapped): plain {h['plain']['p50_ms']:.2f} ms, json_schema {h['json_schema']['p50_ms']:.2f} "
                  f"ms a step: added {h['added_per_step_ms']:.2f} ms a step, {h['added_per_token_ms']:.3f} ms a token")
    save_result(args.out, f"structured-{args.device.split(':')[0]}-{stamp()}", results)
    return results


if __name__ == "__main__":
    # measured = every engine asked for ran or was skipped as not installed, and the mask costs exist
    raise SystemExit(run_cli(main, ok=lambda r: bool(r["engines"]) and bool(r.get("apply"))))
