"""KV-aware routing (router.policy: kv-aware): send a prompt where its longest prefix is likely cached,
balanced against how much prompt work that worker already has queued.

The router keeps its own approximate index of what each prefill worker holds (SGLang's cache-aware
router, llm-d's prefix-cache scorer do the same): the page-aligned blocks of every prompt it sent there,
as chained hashes, least recently used dropped past a bound. It asks no worker anything on the request
path. The index can be wrong (the worker evicted a block, or another router sent it prompts); a wrong
guess costs a cache miss, never a wrong answer, since the worker's own cache (engine/prefix_cache.py)
decides what is reused.

The choice: the worker with the least estimated prefill work ahead of this request's first token, i.e.
the prompt tokens queued there plus this prompt's tokens not cached there; ties go to the worker used
longest ago. So a long shared prefix pulls requests to the worker that holds it, until its queue costs
more than recomputing the prefix elsewhere.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence

KV_AWARE = "kv-aware"
POLICIES = ("least-loaded", "round-robin", KV_AWARE)


def block_hashes(tokens: Sequence[int], page_size: int) -> list[int]:
    """Chained hashes of the whole page-size blocks of `tokens`: entry j names tokens[: (j + 1) * page_size]."""
    out, h = [], 0
    for j in range(len(tokens) // page_size):
        h = hash((h, tuple(tokens[j * page_size: (j + 1) * page_size])))
        out.append(h)
    return out


class PrefixIndex:
    """Per worker, the block hashes of the prompts sent there (an LRU of at most `max_blocks` each)."""

    def __init__(self, page_size: int, max_blocks: int = 1 << 16):
        if page_size <= 0 or max_blocks <= 0:
            raise ValueError("page_size and max_blocks must be positive")
        self.page_size = page_size
        self.max_blocks = max_blocks
        self._blocks: dict[Hashable, collections.OrderedDict[int, None]] = {}

    def matched_tokens(self, worker: Hashable, hashes: Sequence[int]) -> int:
        """Tokens of the longest prefix whose blocks were all sent to `worker`."""
        held = self._blocks.get(worker)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n * self.page_size

    def record(self, worker: Hashable, hashes: Sequence[int]) -> None:
        held = self._blocks.setdefault(worker, collections.OrderedDict())
        for h in reversed(hashes):  # the prefix's head ends up most recent: it goes last
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def forget(self, worker: Hashable) -> None:
        """The worker's cache is gone (it died; a replacement starts empty)."""
        self._blocks.pop(worker, None)


def rank(candidates: Sequence, prompt_tokens: int, matched: Sequence[int], queued: Sequence[int],
         last_pick: Sequence[float]) -> list:
    """`candidates` best first by estimated prefill work (queued + uncached tokens), then the one used
    longest ago."""
    order = sorted(range(len(candidates)),
                   key=lambda i: (queued[i] + prompt_tokens - matched[i], last_pick[i]))
    return [candidates[i] for i in order]
