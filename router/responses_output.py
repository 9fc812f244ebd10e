"""Responses API output: the router core's token steps -> output items and the documented stream events.

One `OutputBuilder` serves both the plain and the streamed response, so `responses.stream(...)`'s final
response is by construction the one `responses.create(...)` returns. Each harmony message of the output
becomes one item: analysis -> `reasoning` (its text as `reasoning_text` content, and as the summary when
`reasoning.summary` is set: gpt-oss writes no separate summary), a final or preamble (commentary without
recipient) message -> `message` with one `output_text` part (`phase` final_answer / commentary), a call to
`functions.X` -> `function_call`.

The parsed deltas say what a token is (reasoning, content, a call's arguments) but not where one harmony
message ends and the next begins, so the builder also follows the header tokens itself: `<|end|>`,
`<|return|>`, `<|call|>` close the current item, and the header's channel tells a preamble from a final
answer. It also counts the tokens of analysis messages (headers and ends included) as reasoning tokens.

Event shapes are the official `openai` SDK's (`openai.types.responses`, checked against the installed
version): each item opens with `response.output_item.added` (+ `response.content_part.added`), streams
`response.reasoning_text.delta` / `response.output_text.delta` / `response.function_call_arguments.delta`,
and closes with the matching `.done` events and `response.output_item.done`. Deltas of one item that the
engine handed over together go out as one delta event.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from kvrelay.router import harmony
from kvrelay.router.harmony import CALL, END, MESSAGE, RETURN
from kvrelay.router.responses_models import seal
from kvrelay.router.types import (
    ChatMessage,
    ContentDelta,
    ReasoningDelta,
    TokenStep,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallStart,
)

_MAX_HEADER = 64  # header tokens kept for finding the channel (a real header is ~10)
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z]+)")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _header(tokens: list[int]) -> tuple[str | None, bool]:
    """(channel, has a recipient) of a message header."""
    text = harmony.decode_tokens(tokens)
    m = _CHANNEL.search(text)
    return (m.group(1) if m else None), "to=" in text


def _logprob(step: TokenStep) -> dict[str, Any]:
    text = harmony.decode_tokens([step.token_id])  # type: ignore[list-item]  # a step with a delta has a token
    top = []
    for token, logprob in step.top_logprobs or ():
        t = harmony.decode_tokens([token])
        top.append({"token": t, "logprob": logprob, "bytes": list(t.encode())})
    return {"token": text, "logprob": step.logprob, "bytes": list(text.encode()), "top_logprobs": top}


class OutputBuilder:
    def __init__(self, *, summary: bool, encrypted: bool, logprobs: bool = False) -> None:
        self.summary = summary
        self.encrypted = encrypted
        self.logprobs = logprobs  # per token of output_text (not of reasoning or arguments, as OpenAI's)
        self.output: list[dict[str, Any]] = []  # the items, finished ones in their final shape
        self.reasoning_tokens = 0
        self._events: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._text = ""  # the open item's text so far
        self._pending = ""  # text received but not yet sent as a delta event
        self._lps: list[dict[str, Any]] = []  # the open message's token logprobs
        self._pending_lps: list[dict[str, Any]] = []
        self._in_header = True  # the prompt ended with <|start|>assistant
        self._header_tokens: list[int] = []
        self._header_len = 0
        self._channel: str | None = None
        self._recipient = False

    # ---- input ----------------------------------------------------------------------------------

    def feed(self, step: TokenStep) -> None:
        closes = self._track(step.token_id)
        for d in step.deltas:
            if isinstance(d, ReasoningDelta):
                self._write("reasoning", d.text)
            elif isinstance(d, ContentDelta):
                self._write("message", d.text)
            elif isinstance(d, ToolCallStart):
                self._close("completed")
                self._start({"id": _new_id("fc"), "type": "function_call", "call_id": d.id, "name": d.name,
                             "arguments": "", "status": "in_progress"})
            elif isinstance(d, ToolCallArgumentsDelta) and self._kind() == "function_call":
                self._append(d.text)
        if (self.logprobs and step.logprob is not None and self._kind() == "message"
                and any(isinstance(d, ContentDelta) for d in step.deltas)):
            entry = _logprob(step)
            self._lps.append(entry)
            self._pending_lps.append(entry)
        if closes:
            self._close("completed")

    def flush(self) -> None:
        """Send the text received so far (called once per engine hand-over)."""
        if not self._pending or self._open is None:
            return
        item, delta, lps = self._open, self._pending, self._pending_lps
        self._pending, self._pending_lps = "", []
        where = {"item_id": item["id"], "output_index": len(self.output)}
        kind = item["type"]
        if kind == "reasoning":
            self._emit("response.reasoning_text.delta", **where, content_index=0, delta=delta)
            if self.summary:
                self._emit("response.reasoning_summary_text.delta", **where, summary_index=0, delta=delta)
        elif kind == "message":
            self._emit("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=lps)
        else:
            self._emit("response.function_call_arguments.delta", **where, delta=delta)

    def finish(self, status: str) -> None:
        """End of output: the open item closes with `status` (incomplete when cut at max_output_tokens)."""
        self._close(status)

    def take_events(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def conversation(self) -> list[ChatMessage]:
        """The output as chat messages, for the next turn (empty items render nothing and are left out)."""
        out = []
        for item in self.output:
            if item["type"] == "reasoning" and item["content"][0]["text"]:
                out.append(ChatMessage("assistant", reasoning=item["content"][0]["text"]))
            elif item["type"] == "message" and item["content"][0]["text"]:
                channel = "commentary" if item["phase"] == "commentary" else "final"
                out.append(ChatMessage("assistant", item["content"][0]["text"], channel=channel))
            elif item["type"] == "function_call":
                call = ToolCall(item["call_id"], item["name"], item["arguments"])
                out.append(ChatMessage("assistant", tool_calls=(call,)))
        return out

    # ---- harmony message boundaries ---------------------------------------------------------------

    def _track(self, token: int | None) -> bool:
        """Follow headers and ends; True when this token ends the current message."""
        if token is None:
            return False
        if self._in_header:
            self._header_len += 1
            if len(self._header_tokens) < _MAX_HEADER:
                self._header_tokens.append(token)
            if token == MESSAGE:
                self._channel, self._recipient = _header(self._header_tokens)
                self._in_header = False
                if self._channel == "analysis":
                    self.reasoning_tokens += self._header_len
            return False
        if self._channel == "analysis":
            self.reasoning_tokens += 1
        if token in (END, RETURN, CALL):
            self._in_header, self._header_tokens, self._header_len = True, [], 0
            return True
        return False

    # ---- items ----------------------------------------------------------------------------------

    def _kind(self) -> str | None:
        return None if self._open is None else self._open["type"]

    def _write(self, kind: str, text: str) -> None:
        if not text:
            return
        phase = "commentary" if self._channel == "commentary" and not self._recipient else "final_answer"
        if self._kind() != kind or (kind == "message" and self._open["phase"] != phase):
            self._close("completed")
            if kind == "reasoning":
                self._start({"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                             "encrypted_content": None, "status": "in_progress"})
            else:
                self._start({"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                             "content": [], "phase": phase})
        self._append(text)

    def _start(self, item: dict[str, Any]) -> None:
        self._open, self._text, self._pending = item, "", ""
        self._lps, self._pending_lps = [], []
        where = {"item_id": item["id"], "output_index": len(self.output)}
        self._emit("response.output_item.added", output_index=len(self.output), item=dict(item))
        if item["type"] == "reasoning":
            self._emit("response.content_part.added", **where, content_index=0,
                       part={"type": "reasoning_text", "text": ""})
            if self.summary:
                self._emit("response.reasoning_summary_part.added", **where, summary_index=0,
                           part={"type": "summary_text", "text": ""})
        elif item["type"] == "message":
            self._emit("response.content_part.added", **where, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def _append(self, text: str) -> None:
        self._text += text
        self._pending += text

    def _close(self, status: str) -> None:
        if self._open is None:
            return
        self.flush()
        item, text = self._open, self._text
        self._open = None
        where = {"item_id": item["id"], "output_index": len(self.output)}
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            self._emit("response.reasoning_text.done", **where, content_index=0, text=text)
            self._emit("response.content_part.done", **where, content_index=0, part=part)
            item["content"] = [part]
            if self.summary:
                summary = {"type": "summary_text", "text": text}
                self._emit("response.reasoning_summary_text.done", **where, summary_index=0, text=text)
                self._emit("response.reasoning_summary_part.done", **where, summary_index=0, part=summary)
                item["summary"] = [summary]
            if self.encrypted:
                item["encrypted_content"] = seal(text)
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self._lps}
            self._emit("response.output_text.done", **where, content_index=0, text=text, logprobs=self._lps)
            self._emit("response.content_part.done", **where, content_index=0, part=part)
            item["content"] = [part]
        else:
            self._emit("response.function_call_arguments.done", **where, arguments=text)
            item["arguments"] = text
        item["status"] = status
        self._emit("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)

    def _emit(self, kind: str, **fields: Any) -> None:
        self._events.append({"type": kind, **fields})
