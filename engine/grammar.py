"""The grammar engine behind structured outputs: JSON Schema -> token masks over o200k_harmony.

We use llguidance (Rust, abi3 wheels, no Python dependencies) rather than xgrammar. Both install here
from PyPI with our pins; measured with `python -m kvrelay.bench.structured` on the real 201,088-token
vocabulary, CPU of this 2-core dev box under load (bench/results/structured-cpu-20261201-111519.json):

| per step | llguidance 1.9.1 | xgrammar 0.2.9 |
|---|---|---|
| mask, batch 1 (object schema / any object), p50 | 0.008 / 0.007 ms | 0.003 / 0.017 ms |
| masks, batch 64 (filled in parallel, GIL released), p50 | 0.61 / 2.3 ms | 0.74 / 1.1 ms |
| compiling a schema (a request with a new one waits for it) | 0.2-0.7 ms | 34-54 ms |

Mask costs are a tie (microseconds at batch 1, under a millisecond at 64 for typical schemas, against a
decode step of 10+ ms that they overlap with); compilation is 50-100x cheaper with llguidance, which
matters because tool calls bring their own schemas with every request; and xgrammar's wheel pulls torch,
transformers, triton and apache-tvm-ffi as runtime dependencies where llguidance pulls none.

The vocabulary is always the real one: the grammar is built over o200k_harmony read from the file
openai-harmony loads (engine/vocab.py: shipped with kvrelay, or $TIKTOKEN_ENCODINGS_BASE), 201,088 ids. A model whose logits are narrower
(the tiny 1024-token test model) gets the mask cut to its width; harmony chat is refused on it anyway.
"""

from __future__ import annotations

import base64
import functools
import json

from kvrelay.engine import vocab

N_VOCAB = 201088  # rows of gpt-oss's embedding table
MASK_WORDS = (N_VOCAB + 31) // 32  # int32 words of one bitmask row

# o200k's pre-tokenizer (harmony's public_encodings.rs); llguidance uses it to tokenize forced text.
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# Harmony's named special tokens (as openai-harmony's o200k_harmony encoding defines them); every other id from
# 199998 on is `<|reserved_N|>`.
SPECIALS = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
    200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
}
FIRST_SPECIAL = 199998
RETURN = 200002  # the grammar's end-of-text token: a body that may end lets the sampler pick it

# JSON as a model should write it inside a harmony message: compact separators and no free whitespace,
# so a model (or random weights) cannot spend its budget on spaces between tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class SchemaError(ValueError):
    """The schema cannot be compiled into a grammar (message from the grammar engine)."""


def mergeable_ranks() -> dict[bytes, int]:
    """o200k's BPE tokens as bytes -> id (what tiktoken loads)."""
    ranks = {}
    with open(vocab.vocab_file(), "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def special_tokens() -> dict[str, int]:
    return {SPECIALS.get(i, f"<|reserved_{i}|>"): i for i in range(FIRST_SPECIAL, N_VOCAB)}


@functools.lru_cache(maxsize=1)
def tokenizer():
    """llguidance's view of o200k_harmony (~1 s to build; once per process)."""
    import llguidance

    return llguidance.LLTokenizer.from_tiktoken(
        encoder=mergeable_ranks(), special_tokens=special_tokens(), pattern=O200K_PATTERN,
        eos_token=RETURN, n_vocab=N_VOCAB)


def warm_up() -> None:
    """Build `tokenizer()` on a daemon thread, so the first structured request a worker serves does not
    wait ~1 s for it on the step thread."""
    import threading

    if tokenizer.cache_info().currsize == 0:
        threading.Thread(target=_warm, name="kvrelay-grammar-warmup", daemon=True).start()


def _warm() -> None:
    try:
        tokenizer()
    except Exception as exc:  # noqa: BLE001 - a request that needs it reports the error itself
        import logging

        logging.getLogger(__name__).warning("structured outputs: building the vocabulary failed: %r", exc)


def json_grammar(schema: str) -> str:
    """llguidance's grammar for a JSON Schema text ('{}' or '{"type": "object"}': any object)."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except Exception as exc:  # noqa: BLE001 - whatever the engine objects to, the schema is at fault
        raise SchemaError(str(exc)) from None


def check_schema(schema: str) -> None:
    """Raise SchemaError when the grammar engine cannot compile `schema` (no tokenizer needed: the
    router checks requests with it)."""
    import llguidance

    err = llguidance.LLMatcher.validate_grammar(json_grammar(schema))
    if err:
        raise SchemaError(err)


@functools.lru_cache(maxsize=256)
def compiled(schema: str) -> str:
    """The grammar for `schema`, checked against the vocabulary; cached (a request with a schema seen
    before starts at once)."""
    import llguidance

    grammar = json_grammar(schema)
    err = llguidance.LLMatcher.validate_grammar(grammar, tokenizer())
    if err:
        raise SchemaError(err)
    return grammar


def matcher(schema: str):
    """A fresh llguidance matcher at the start of a JSON body for `schema`."""
    import llguidance

    m = llguidance.LLMatcher(tokenizer(), compiled(schema), log_level=0)
    if m.is_error():
        raise SchemaError(m.get_error())
    return m


@functools.lru_cache(maxsize=1)
def executor():
    """Fills many matchers' masks at once on llguidance's own threads (the GIL released)."""
    import llguidance

    return llguidance.LLExecutor()


def schema_text(schema) -> str:
    """A schema (dict, bool or text) as canonical JSON text: the cache key and what travels to workers."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    return json.dumps(schema, separators=(",", ":"))  # key order kept: properties come out in it
