"""Stored responses for the Responses API's `previous_response_id` (and `GET`/`DELETE /v1/responses/{id}`).

In memory, in the router process, bounded three ways so that a busy or long-running router cannot grow
without limit: at most `max_entries` responses, at most `max_chars` characters of conversation text over
all of them, and each one for `ttl_s` seconds after it was created. The oldest go first. A response is
stored with its whole conversation (the chat messages of every earlier turn, its input and its output, but
not its instructions, which OpenAI does not carry over): a continuation needs nothing but this entry, so
evicting an older turn never breaks a newer one. The messages are immutable and shared between the turns
of one conversation, so a chain of turns holds each text once; `max_chars` counts them as if they were
not shared, and twice (the response object and the listed input items hold copies), an upper bound.

Only the router's event loop touches the store (the HTTP handlers are coroutines), so it needs no lock.
A router restart loses it, as vLLM's in-memory store does.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from kvrelay.router.types import ChatMessage

MAX_ENTRIES = 4096
MAX_CHARS = 64 * 1024 * 1024
TTL_S = 6 * 3600.0


def conversation_chars(history: tuple[ChatMessage, ...]) -> int:
    return sum(len(m.content) + len(m.reasoning) + sum(len(c.arguments) + len(c.name) for c in m.tool_calls)
               for m in history)


@dataclass(frozen=True)
class StoredResponse:
    id: str
    history: tuple[ChatMessage, ...]  # the conversation so far, this response's output included
    body: dict[str, Any]  # the response object, as `GET /v1/responses/{id}` returns it
    chars: int
    input_items: tuple[dict[str, Any], ...]  # this response's own input, as `GET .../input_items` lists it
    expires_at: float


class ResponseStore:
    def __init__(self, *, max_entries: int = MAX_ENTRIES, max_chars: int = MAX_CHARS, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1 or max_chars < 1 or ttl_s <= 0:
            raise ValueError(f"store bounds must be positive, got {max_entries=} {max_chars=} {ttl_s=}")
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._chars = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, history: tuple[ChatMessage, ...], body: dict[str, Any],
            input_items: tuple[dict[str, Any], ...] = ()) -> None:
        chars = 2 * conversation_chars(history)  # the response object and its input items repeat its texts
        if chars > self.max_chars:
            return  # bigger than the whole store: keeping it would evict everything else
        self.delete(response_id)
        self._entries[response_id] = StoredResponse(response_id, history, body, chars, input_items=input_items,
                                                    expires_at=self._clock() + self.ttl_s)
        self._chars += chars
        self._expire()
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            self._pop_oldest()

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._chars -= entry.chars
        return True

    def _expire(self) -> None:
        # Every entry lives ttl_s from its creation, so the oldest expire first.
        now = self._clock()
        while self._entries and next(iter(self._entries.values())).expires_at <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._chars -= entry.chars
