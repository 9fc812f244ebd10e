"""Stop strings: end generation when the visible text contains one, and never stream any part of one.

The engine stops on token ids only. A stop string is text: it can start in the middle of one token
and end several tokens later, so the router matches it on the decoded text it is about to send (chat:
`content`, i.e. the final channel and preambles; completions/Generate: the completion text).

Streaming holds back the longest suffix of the text that is still a prefix of some stop string (it may
yet turn into one) and releases it as soon as later text rules that out, or when the stream ends
without a match. So a client never receives characters that a later token reveals to be part of a
stop string, and the text it does receive is exactly the non-streamed text.

When several stop strings occur, the one completed first in the text wins (on a tie, the one that
starts first). That is what a character-by-character scan finds, so the result does not depend on how
the text happened to be split into tokens.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from kvrelay.router.types import ContentDelta, Delta

# OpenAI takes 4; vLLM and SGLang take any number, and evaluation harnesses send more (lm-eval tasks
# list 5-10). Bounded so the per-token matching cost stays small: at most this many, each this long.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


class StopStrings:
    """Incremental matcher over one request's output text. Feed text in order; send what it returns."""

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or any(not s for s in stops):
            raise ValueError(f"stop strings must be a non-empty list of non-empty strings, got {list(stops)!r}")
        self.stops = tuple(dict.fromkeys(stops))
        self._longest = max(len(s) for s in self.stops)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text, once one has

    @property
    def held(self) -> str:
        """Text received but not yet released (a prefix of some stop string)."""
        return self._held

    def feed(self, text: str) -> str:
        """The text that is now safe to send. After a match: the text before the stop string, then nothing."""
        if self.matched is not None:
            return ""
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stops:
            start = buf.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            self.matched, self._held = best[2], ""
            return buf[: best[1]]
        keep = self._partial_len(buf)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """End of the text: whatever was held back was not a stop string after all."""
        text, self._held = self._held, ""
        return "" if self.matched is not None else text

    def filter(self, deltas: Iterable[Delta]) -> list[Delta]:
        """Run the content deltas through `feed`; everything after a match is dropped.

        Reasoning and tool-call deltas pass unchanged: stop strings apply to the user-visible content,
        and the chain of thought routinely mentions words a caller may use as a stop string.
        """
        out: list[Delta] = []
        for d in deltas:
            if self.matched is not None:
                break
            if isinstance(d, ContentDelta):
                text = self.feed(d.text)
                if text:
                    out.append(ContentDelta(text))
            else:
                out.append(d)
        return out

    def _partial_len(self, buf: str) -> int:
        # A complete stop string is never in `buf` here, so only proper prefixes (< longest) can match.
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
