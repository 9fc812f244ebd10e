"""The streaming parser agrees with openai-harmony on well-formed output and never raises on garbage."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_harmony import Role

from kvrelay.router import harmony
from kvrelay.router.parser import MAX_HEADER_TOKENS, Detokenizer, HarmonyStreamParser
from kvrelay.router.types import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallStart


@pytest.fixture(scope="module")
def enc():
    return harmony.load_encoding()


def _ids(enc, text: str) -> list[int]:
    return enc.encode(text, allowed_special="all")


def _run(enc, tokens: list[int], **kw):
    ids = iter(f"call_{i}" for i in range(100))
    parser = HarmonyStreamParser(enc, id_factory=lambda: next(ids), **kw)
    deltas = []
    for t in tokens:
        deltas += parser.feed(t)
    deltas += parser.finish()
    return parser, deltas


WELL_FORMED = {
    "analysis_then_final": "<|channel|>analysis<|message|>The user greets; reply politely.<|end|>"
                           "<|start|>assistant<|channel|>final<|message|>Hello! How can I help? 🙂<|return|>",
    "analysis_then_tool_call": "<|channel|>analysis<|message|>Need to call get_weather.<|end|>"
                               "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                               '<|message|>{"location":"San Francisco"}<|call|>',
    "after_tool_result_final": "<|channel|>analysis<|message|>Tool says 20C and sunny.<|end|>"
                               "<|start|>assistant<|channel|>final<|message|>It is 20 °C and sunny in Tokyo.<|return|>",
    "preamble_then_tool_call": "<|channel|>commentary<|message|>Checking both cities.<|end|>"
                               "<|start|>assistant to=functions.lookup<|channel|>commentary <|constrain|>json"
                               '<|message|>{"q": "日本語"}<|call|>',
}


@pytest.mark.parametrize("name", sorted(WELL_FORMED))
def test_matches_harmony_on_well_formed_output(enc, name: str) -> None:
    tokens = _ids(enc, WELL_FORMED[name])
    parser, deltas = _run(enc, tokens)
    # harmony's docs: parse without the final stop token.
    expected = enc.parse_messages_from_completion_tokens(tokens[:-1], Role.ASSISTANT)
    got = [(m.channel, m.recipient, m.content_type, m.text) for m in parser.messages]
    want = [(m.channel, m.recipient, m.content_type, m.content[0].text) for m in expected]
    assert got == want
    assert all(m.complete for m in parser.messages)
    assert parser.warnings == []
    # The deltas reassemble into the same messages.
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    args = "".join(d.text for d in deltas if isinstance(d, ToolCallArgumentsDelta))
    assert reasoning == "".join(m.text for m in parser.messages if m.kind == "reasoning")
    assert content == "".join(m.text for m in parser.messages if m.kind == "content")
    assert args == "".join(m.text for m in parser.messages if m.kind == "tool_call")
    assert parser.stopped


def test_tool_call_deltas_are_incremental(enc) -> None:
    parser, deltas = _run(enc, _ids(enc, WELL_FORMED["analysis_then_tool_call"]))
    starts = [d for d in deltas if isinstance(d, ToolCallStart)]
    assert starts == [ToolCallStart(0, "call_0", "get_weather")]
    arg_deltas = [d for d in deltas if isinstance(d, ToolCallArgumentsDelta)]
    assert len(arg_deltas) > 1 and all(d.index == 0 for d in arg_deltas)
    assert deltas.index(starts[0]) < deltas.index(arg_deltas[0])
    assert parser.called_tool and parser.stop_token == harmony.CALL


def test_final_answer_is_not_a_tool_call(enc) -> None:
    parser, deltas = _run(enc, _ids(enc, WELL_FORMED["analysis_then_final"]))
    assert not parser.called_tool and parser.stop_token == harmony.RETURN
    assert not any(isinstance(d, (ToolCallStart, ToolCallArgumentsDelta)) for d in deltas)


def test_two_tool_calls_get_increasing_indices(enc) -> None:
    text = ('<|channel|>commentary to=functions.a <|constrain|>json<|message|>{}<|end|>'
            '<|start|>assistant<|channel|>commentary to=functions.b <|constrain|>json<|message|>{"x":1}<|call|>')
    _, deltas = _run(enc, _ids(enc, text))
    assert [(d.index, d.name) for d in deltas if isinstance(d, ToolCallStart)] == [(0, "a"), (1, "b")]


def test_nothing_after_a_stop_token(enc) -> None:
    tokens = _ids(enc, "<|channel|>final<|message|>done<|return|>") + _ids(enc, "more text<|end|>")
    parser, deltas = _run(enc, tokens)
    assert "".join(d.text for d in deltas) == "done"
    assert parser.stop_token == harmony.RETURN


def test_garbled_header_becomes_content_with_warning(enc, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvrelay.router.parser"):
        parser, deltas = _run(enc, _ids(enc, "<|channel|>foo bar baz<|message|>hi<|end|>"))
    assert all(isinstance(d, ContentDelta) for d in deltas)
    # The header is passed on verbatim; the message itself still closes normally at <|end|>.
    assert "".join(d.text for d in deltas) == "<|channel|>foo bar baz<|message|>hi"
    assert parser.warnings and "harmony output" in caplog.text


def test_unknown_recipient_is_content_and_parsing_continues(enc) -> None:
    text = ("<|channel|>analysis to=browser.search<|message|>q<|end|>"
            "<|start|>assistant<|channel|>final<|message|>ok<|return|>")
    parser, deltas = _run(enc, _ids(enc, text))
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    assert content == "<|channel|>analysis to=browser.search<|message|>q" + "ok"
    assert parser.messages[-1].channel == "final" and parser.stop_token == harmony.RETURN


def test_text_after_a_message_falls_back_to_content(enc) -> None:
    parser, deltas = _run(enc, _ids(enc, "<|channel|>final<|message|>hi<|end|>stray words"))
    assert [type(d) for d in deltas] == [ContentDelta] * len(deltas)
    assert "".join(d.text for d in deltas) == "hi" + "stray words"


def test_plain_text_output_is_released_after_the_header_cap(enc) -> None:
    tokens = _ids(enc, " word" * (MAX_HEADER_TOKENS + 10))
    parser = HarmonyStreamParser(enc)
    early = []
    for t in tokens:
        early += parser.feed(t)
    # Released while streaming, not held until the end.
    assert "".join(d.text for d in early).startswith(" word word")
    assert "".join(d.text for d in early + parser.finish()) == " word" * (MAX_HEADER_TOKENS + 10)


def test_text_that_cannot_be_a_header_is_released_at_once(enc) -> None:
    """A model that answers without a header: its first token goes out with its own step, not after
    MAX_HEADER_TOKENS tokens (a stream's time to first token was the 64th token's). What can still become
    a header (a recipient, a content type before <|channel|>) is held, a few tokens at most."""
    parser = HarmonyStreamParser(enc)
    first = parser.feed(_ids(enc, "Hello")[0])
    assert [d.text for d in first] == ["Hello"]
    assert "".join(d.text for d in parser.feed(_ids(enc, " there")[0])) == " there"
    parser = HarmonyStreamParser(enc)
    held = [parser.feed(t) for t in _ids(enc, " to=functions.get_weather")]
    assert not any(held)  # a recipient may precede <|channel|>: still a header candidate
    parser, deltas = _run(enc, _ids(enc, " to=functions.get_weather<|channel|>commentary json"
                                         '<|message|>{"city":"Paris"}<|call|>'))
    assert isinstance(deltas[0], ToolCallStart) and parser.called_tool


def test_truncated_header_is_flushed_on_finish(enc) -> None:
    parser, deltas = _run(enc, _ids(enc, "<|channel|>fin"))
    assert "".join(d.text for d in deltas) == "<|channel|>fin"
    assert not parser.stopped


def test_stop_token_inside_fallback(enc) -> None:
    parser, deltas = _run(enc, _ids(enc, "<|channel|>final<|message|>a<|end|>b<|call|>c"))
    assert "".join(d.text for d in deltas) == "ab"
    assert parser.stop_token == harmony.CALL and not parser.called_tool


def test_detokenizer_holds_split_utf8(enc) -> None:
    # A character the o200k tokenizer splits over several byte-level tokens.
    ch = next(c for c in "𝔘𒀀🜲ꙮ𓀀" if len(enc.encode(c)) > 1)
    ids = enc.encode(ch)
    detok = Detokenizer(enc)
    pieces = [detok.feed([t]) for t in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == ch
    assert Detokenizer(enc).feed([10**7]) == "\N{REPLACEMENT CHARACTER}"


# ---- never raises ------------------------------------------------------------------------------

_SPECIAL = [harmony.START, harmony.END, harmony.MESSAGE, harmony.CHANNEL, harmony.CONSTRAIN,
            harmony.RETURN, harmony.CALL, harmony.ENDOFTEXT, 200000, 200013, 201087]
_WORDS = [35644, 17196, 12606, 815, 173781, 316, 28, 44580, 775, 220, 4108, 1428, 17360, 10848]  # header-ish
_token = st.one_of(
    st.sampled_from(_SPECIAL),
    st.sampled_from(_WORDS),
    st.integers(0, harmony.VOCAB_SIZE - 1),
    st.integers(-5, 2**31),  # ids no real model emits must not break the stream either
)


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_token, max_size=40))
def test_random_tokens_never_raise(tokens: list[int]) -> None:
    enc = harmony.load_encoding()
    logging.getLogger("kvrelay.router.parser").disabled = True
    try:
        parser = HarmonyStreamParser(enc, max_header_tokens=8)
        started: set[int] = set()
        stopped_at = None
        for i, t in enumerate(tokens):
            out = parser.feed(t)
            if stopped_at is not None:
                assert out == []
            for d in out:
                if isinstance(d, ToolCallStart):
                    started.add(d.index)
                elif isinstance(d, ToolCallArgumentsDelta):
                    assert d.index in started
                else:
                    assert isinstance(d.text, str)
            if parser.stopped and stopped_at is None:
                stopped_at = i
        tail = parser.finish()
        assert all(isinstance(d, (ContentDelta, ReasoningDelta, ToolCallStart, ToolCallArgumentsDelta)) for d in tail)
        if parser.called_tool:
            assert parser.messages[-1].kind == "tool_call"
    finally:
        logging.getLogger("kvrelay.router.parser").disabled = False
