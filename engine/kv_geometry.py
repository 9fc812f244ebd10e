"""KV page geometry, torch-free: the page groups and which layer is in which, which pages a sequence of a
given length holds, the most it can ever hold, how many bytes a page or a token takes, and the hash that
says two pools lay pages out alike.

gpt-oss alternates full-attention and sliding-window layers; their KV lives in two page groups, spelled
FULL and SLIDING here and nowhere else (a model config names the layers' attention as config.json does,
"full_attention"/"sliding_attention": `layer_groups` translates). Logical page j of a sequence covers
positions [j * page_size, (j + 1) * page_size). A full layer keeps every page; a sliding layer keeps only
the pages its next query can see (positions down to `length - window + 1`), so its table starts at a
later logical page. Every part that reasons about pages (the cache, the handoff between workers, the
scheduler's reservations, pool sizing, the single-process LLM, the benchmarks) asks here, so they cannot
disagree on a count.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from kvrelay.engine.config import FULL_ATTENTION, SLIDING_ATTENTION

FULL = "full"
SLIDING = "sliding"
GROUPS = (FULL, SLIDING)
GROUP_OF_LAYER_TYPE = {FULL_ATTENTION: FULL, SLIDING_ATTENTION: SLIDING}


def layer_groups(layer_types: Sequence[str]) -> tuple[str, ...]:
    """The page group of every layer, in model order, from the config's layer types."""
    try:
        return tuple(GROUP_OF_LAYER_TYPE[t] for t in layer_types)
    except KeyError as e:
        raise ValueError(f"layer type {e.args[0]!r} has no KV page group (known: "
                         f"{', '.join(GROUP_OF_LAYER_TYPE)})") from None


def group_layers(groups: Sequence[str], group: str) -> tuple[int, ...]:
    """The layers (model order) whose KV lives in `group`, given every layer's group."""
    return tuple(i for i, g in enumerate(groups) if g == group)


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


def page_bytes(page_size: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one page of one layer: K and V of `page_size` positions over `kv_heads` heads (the pool
    layout [pages, 2, page_size, kv_heads, head_dim])."""
    return 2 * page_size * kv_heads * head_dim * itemsize


def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """KV bytes one position takes over `num_layers` layers (K and V of every head)."""
    return num_layers * page_bytes(1, kv_heads, head_dim, itemsize)


def layout_hash(*, model: str, dtype: str, page_size: int, layer_types: Sequence[str], kv_heads: int,
                head_dim: int, sliding_window: int, q_heads: int | None) -> str:
    """Equal for two pools iff a page of one KV head means the same bytes in both: the model, dtype, page
    size, every layer's group, the model's head counts and window. The TP shape is not in it: differently
    sharded groups exchange KV head by head (transfer/sharding.py). Keyword-only, so a field added to
    KVLayout (transfer/handle.py) without a place here fails at once rather than hash differently."""
    d = dict(model=model, dtype=dtype, page_size=page_size, layer_types=list(layer_types), kv_heads=kv_heads,
             head_dim=head_dim, sliding_window=sliding_window, q_heads=q_heads)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:32]
