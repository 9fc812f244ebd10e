"""Incremental harmony parser: model output tokens -> reasoning / content / tool-call deltas.

openai-harmony's `StreamableParser` does the real work for well-formed output. Model output is not
always well-formed (random weights, truncation, a confused model), and a chat stream must never die
because of it, so around the library parser we:

* hold header tokens back until the header closes, then route the message by channel/recipient;
* turn a header we do not understand (unknown channel, a recipient outside `functions.`) into plain
  content, header text included, and keep parsing the next message;
* on any exception from the library, or a header that never closes, switch to a fallback mode that
  decodes every remaining token as content;
* stop at `<|return|>` / `<|call|>` and ignore anything after them.
"""

from __future__ import annotations

import codecs
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

from openai_harmony import HarmonyEncoding, Role, StreamableParser, StreamState

from kvrelay.router.harmony import CALL, CHANNEL, CONSTRAIN, RETURN, START, TOOL_NAMESPACE, VOCAB_SIZE
from kvrelay.router.types import (
    CHANNELS,
    ContentDelta,
    Delta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
)

log = logging.getLogger(__name__)

# A real header is a handful of tokens (`<|start|>assistant<|channel|>commentary to=functions.x
# <|constrain|>json`); a long function name adds a few. Past this we stop waiting for `<|message|>`,
# otherwise garbage would be held back from the client until the stream ends.
MAX_HEADER_TOKENS = 64

_FUNCTION_RECIPIENT = re.compile(rf"^{TOOL_NAMESPACE}\.([A-Za-z0-9_\-.]+)$")
_HEADER_SPECIALS = frozenset({START, CHANNEL, CONSTRAIN})
_HEADER_TEXT = None  # compiled on first use (parser._could_be_header)
_REPLACEMENT = "\N{REPLACEMENT CHARACTER}".encode()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedMessage:
    """One assistant message as the client sees it. `kind` is how we routed it."""

    kind: str  # "reasoning" | "content" | "tool_call"
    channel: str | None
    recipient: str | None
    content_type: str | None
    text: str = ""
    complete: bool = False


@dataclass
class Detokenizer:
    """Incremental tokens -> text that holds back split UTF-8 sequences until they complete (a
    character can span tokens) and never raises. Also the parser's fallback for unparseable output."""

    encoding: HarmonyEncoding
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    def token_bytes(self, token: int) -> bytes:
        if not 0 <= token < VOCAB_SIZE:
            return _REPLACEMENT
        try:
            # surrogateescape keeps invalid bytes as lone surrogates, which encode back losslessly.
            text = self.encoding.decode([token], errors="surrogateescape")
            return text.encode("utf-8", errors="surrogateescape")
        except Exception:  # the encoding rejects the id; never let that end the stream
            return _REPLACEMENT

    def feed(self, tokens: list[int]) -> str:
        return self.decoder.decode(b"".join(self.token_bytes(t) for t in tokens))

    def flush(self) -> str:
        return self.decoder.decode(b"", final=True)


class HarmonyStreamParser:
    """Feed generated tokens one at a time; collect the deltas each returns. Never raises."""

    def __init__(
        self,
        encoding: HarmonyEncoding,
        *,
        id_factory: Callable[[], str] = new_call_id,
        max_header_tokens: int = MAX_HEADER_TOKENS,
    ) -> None:
        self._enc = encoding
        self._parser: StreamableParser | None = StreamableParser(encoding, Role.ASSISTANT)
        self._state = StreamState.HEADER  # the prompt ended with `<|start|>assistant`
        self._header: list[int] = []
        self._fallback: Detokenizer | None = None
        self._new_id = id_factory
        self._max_header = max_header_tokens
        self._current: ParsedMessage | None = None
        self._tool_index = -1
        self.messages: list[ParsedMessage] = []
        self.stop_token: int | None = None  # <|return|> or <|call|> once seen
        self.warnings: list[str] = []

    # ---- public -------------------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return self.stop_token is not None

    @property
    def called_tool(self) -> bool:
        """True when the output ended on `<|call|>` right after a parsed tool call."""
        last = self.messages[-1] if self.messages else None
        return self.stop_token == CALL and last is not None and last.kind == "tool_call" and last.complete

    def feed(self, token: int) -> list[Delta]:
        if self.stopped:
            return []
        try:
            if self._fallback is not None:
                return self._feed_fallback(token)
            return self._feed_harmony(token)
        except Exception as exc:  # our own bug must not end a client's stream either
            return self._enter_fallback(f"internal parser error: {exc!r}", [token])

    def finish(self) -> list[Delta]:
        """End of generation: release whatever is held back, close the open message."""
        out: list[Delta] = []
        if self._fallback is None and self._header:
            self._warn(f"output ended inside a message header ({len(self._header)} tokens)")
            out += self._emit_content(self._fallback_for_text().feed(self._header))
            self._header = []
        if self._fallback is not None:
            out += self._emit_content(self._fallback.flush())
        self._close_current(complete=False)
        return [d for d in out if not _empty(d)]

    # ---- harmony mode -------------------------------------------------------------------------

    def _feed_harmony(self, token: int) -> list[Delta]:
        assert self._parser is not None
        prev = self._state
        try:
            self._parser.process(token)
            state = self._parser.state
        except Exception as exc:
            return self._enter_fallback(f"harmony parser rejected token {token}: {exc}", self._header + [token])
        self._state = state
        if state == StreamState.CONTENT and prev == StreamState.CONTENT:
            return self._route_delta(self._parser.last_content_delta or "")
        if state == StreamState.CONTENT:
            self._header.append(token)
            return self._open_message()
        if prev == StreamState.CONTENT and state == StreamState.EXPECT_START:
            # <|end|>, <|return|> or <|call|> closed the message
            self._close_current(complete=True)
            if token in (RETURN, CALL):
                self.stop_token = token
            return []
        self._header.append(token)
        if state != StreamState.HEADER:  # a header that ended without <|message|>: not harmony any more
            return self._enter_fallback("header ended without <|message|>", self._header)
        if len(self._header) > self._max_header:
            return self._enter_fallback(f"no <|message|> within {self._max_header} header tokens", self._header)
        if not self._could_be_header():
            return self._enter_fallback("output does not start with a message header", self._header)
        return []

    def _could_be_header(self) -> bool:
        """Whether the held tokens can still grow into a header. Plain text that cannot (a model that
        answers without one) is released at once instead of after MAX_HEADER_TOKENS tokens, which made a
        streamed reply's first token wait for the 64th. Once a header token (<|start|>, <|channel|>,
        <|constrain|>) is there, harmony decides, as before."""
        if any(t in _HEADER_SPECIALS for t in self._header):
            return True
        global _HEADER_TEXT
        if _HEADER_TEXT is None:
            import regex

            # What may precede the header's special tokens: the role, a recipient, a content type.
            _HEADER_TEXT = regex.compile(r"(?:assistant)?(?:\s*to=[^\s<]+)?(?:\s+[^\s<]+)?\s*<\|channel\|>")
        text = Detokenizer(self._enc).feed(self._header)
        return _HEADER_TEXT.fullmatch(text, partial=True) is not None

    def _open_message(self) -> list[Delta]:
        assert self._parser is not None
        channel = self._parser.current_channel
        recipient = self._parser.current_recipient
        content_type = self._parser.current_content_type
        header, self._header = self._header, []
        self._close_current(complete=True)  # defensive: a message is always closed before the next opens
        match = _FUNCTION_RECIPIENT.match(recipient or "")
        if channel in CHANNELS and match is not None:
            self._tool_index += 1
            self._current = ParsedMessage("tool_call", channel, recipient, content_type)
            return [ToolCallStart(self._tool_index, self._new_id(), match.group(1))]
        if channel in CHANNELS and recipient is None:
            kind = "reasoning" if channel == "analysis" else "content"
            self._current = ParsedMessage(kind, channel, recipient, content_type)
            return []
        self._warn(f"unrecognised header (channel={channel!r}, recipient={recipient!r}); passing it on as content")
        self._current = ParsedMessage("content", channel, recipient, content_type)
        return self._emit_content(Detokenizer(self._enc).feed(header))

    def _route_delta(self, text: str) -> list[Delta]:
        msg = self._current
        if not text or msg is None:
            return []
        msg.text += text
        if msg.kind == "tool_call":
            return [ToolCallArgumentsDelta(self._tool_index, text)]
        if msg.kind == "reasoning":
            return [ReasoningDelta(text)]
        return [ContentDelta(text)]

    def _close_current(self, *, complete: bool) -> None:
        if self._current is not None:
            self._current.complete = complete
            self.messages.append(self._current)
            self._current = None

    # ---- fallback mode ------------------------------------------------------------------------

    def _fallback_for_text(self) -> Detokenizer:
        if self._fallback is None:
            self._fallback = Detokenizer(self._enc)
        return self._fallback

    def _enter_fallback(self, reason: str, pending: list[int]) -> list[Delta]:
        self._warn(f"{reason}; treating the rest of the output as content")
        self._parser = None  # its state after an error is unspecified; never touch it again
        self._header = []
        fb = self._fallback_for_text()
        if self._current is None or self._current.kind != "content":
            self._close_current(complete=False)
            self._current = ParsedMessage("content", None, None, None)
        stop = next((i for i, t in enumerate(pending) if t in (RETURN, CALL)), None)
        if stop is not None:
            self.stop_token = pending[stop]
            pending = pending[:stop]
        out = self._emit_content(fb.feed(pending))
        if self.stopped:
            out += self._emit_content(fb.flush())
            self._close_current(complete=True)
        return out

    def _feed_fallback(self, token: int) -> list[Delta]:
        assert self._fallback is not None
        if token in (RETURN, CALL):
            self.stop_token = token
            out = self._emit_content(self._fallback.flush())
            self._close_current(complete=True)
            return out
        return self._emit_content(self._fallback.feed([token]))

    def _emit_content(self, text: str) -> list[Delta]:
        if not text:
            return []
        if self._current is None:
            self._current = ParsedMessage("content", None, None, None)
        self._current.text += text
        return [ContentDelta(text)]

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        log.warning("harmony output: %s", message)


def _empty(delta: Delta) -> bool:
    return isinstance(delta, (ContentDelta, ReasoningDelta)) and not delta.text
