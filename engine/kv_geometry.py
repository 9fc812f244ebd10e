"""KV page geometry, torch-free: which pages a sequence of a given length holds, per layer group.

gpt-oss alternates full-attention and sliding-window layers; their KV lives in two page groups. Logical
page j of a sequence covers positions [j * page_size, (j + 1) * page_size). A full layer keeps every
page; a sliding layer keeps only the pages its next query can see (positions down to
`length - window + 1`), so its table starts at a later logical page. Every part that reasons about pages
(the cache, the handoff between workers, the scheduler's reservations, pool sizing) asks here, so they
cannot disagree on a count.
"""

from __future__ import annotations

FULL = "full"
SLIDING = "sliding"
GROUPS = (FULL, SLIDING)


def pages_spanned(length: int, page_size: int) -> int:
    """Pages positions [0, length) touch."""
    return -(-length // page_size)


def first_live_page(group: str, length: int, page_size: int, window: int) -> int:
    """Logical index of the first page a sequence of `length` positions still needs: the next query (at
    position `length`) of a sliding layer sees keys down to length - window + 1; full layers need all."""
    if group == FULL:
        return 0
    return max(0, length - window + 1) // page_size


def live_pages(group: str, length: int, page_size: int, window: int) -> range:
    """Logical indices of the pages a sequence of `length` positions holds in `group`."""
    return range(first_live_page(group, length, page_size, window), pages_spanned(length, page_size))


def window_pages(window: int, page_size: int) -> int:
    """Most sliding pages one sequence holds between forwards: `window` positions straddle at most one
    page boundary more than they fill."""
    return (window - 1) // page_size + 2


def worst_case_pages(total_tokens: int, page_size: int, window: int) -> dict[str, int]:
    """Most pages a sequence growing to `total_tokens` positions ever holds at once, per group (what a
    reservation commits up front)."""
    full = pages_spanned(total_tokens, page_size)
    return {FULL: full, SLIDING: min(full, window_pages(window, page_size))}
