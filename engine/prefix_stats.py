"""What the prefix cache (engine/prefix_cache.py) reports: its counters (`PrefixStats`, for /metrics and
`kvrelay status`) and a lookup's answer (`PrefixHit`, what KVCache.begin_prefix shares). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.engine.kv_geometry import FULL, SLIDING


@dataclass
class PrefixStats:
    """Counters for /metrics and `kvrelay status`."""

    queries: int = 0  # sequences that looked up a prefix
    hits: int = 0  # ... and reused at least one block
    query_tokens: int = 0  # tokens those sequences asked about
    hit_tokens: int = 0  # tokens whose prefill a hit skipped
    inserted_blocks: int = 0
    evicted_pages: dict[str, int] = field(default_factory=lambda: {FULL: 0, SLIDING: 0})  # from the device
    # The host tier: hits that restored pages from it, the tokens those hits reach beyond what the
    # device alone held (of hit_tokens), pages and bytes moved each way, slots it dropped.
    host_hits: int = 0
    host_hit_tokens: int = 0
    to_host_pages: int = 0
    to_device_pages: int = 0
    to_host_bytes: int = 0
    to_device_bytes: int = 0
    host_evicted_pages: dict[str, int] = field(default_factory=lambda: {FULL: 0, SLIDING: 0})

    def as_dict(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "query_tokens": self.query_tokens,
                "hit_tokens": self.hit_tokens, "inserted_blocks": self.inserted_blocks,
                "evicted_pages": dict(self.evicted_pages)}

    @property
    def host_bytes(self) -> tuple[int, int]:
        """(device -> host, host -> device) bytes so far."""
        return self.to_host_bytes, self.to_device_bytes

    def host_dict(self) -> dict:
        return {"hits": self.host_hits, "hit_tokens": self.host_hit_tokens, "to_host_pages": self.to_host_pages,
                "to_device_pages": self.to_device_pages, "to_host_bytes": self.to_host_bytes,
                "to_device_bytes": self.to_device_bytes, "evicted_pages": dict(self.host_evicted_pages)}


@dataclass(frozen=True)
class PrefixHit:
    """A reusable prefix: `tokens` positions, the full pages of blocks 0 .. tokens/page_size - 1 and the
    sliding pages from logical page `sliding_first` on."""

    tokens: int
    full: tuple[int, ...]
    sliding: tuple[int, ...]
    sliding_first: int
    tail: object = None  # the last block (where an insert of the sequence's later blocks continues)
    host_tokens: int = 0  # of `tokens`, those past the longest prefix the device tier alone could resume
