"""The typed messages of the KV handoff: the layout both pools must share, the handle a prefill worker
gives out, and the errors a pull can end with. Plain data (no NIXL), so the client, both workers and the
tests can build and check them without a transfer engine; transfer/nixl.py moves the bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from kvrelay.engine.kv_geometry import GROUPS, layout_hash
from kvrelay.engine.partition import head_range

_TP_SHAPE = ("tp_size", "tp_rank")  # KVLayout fields the hash leaves out: they travel as data


def layout_of(cache) -> tuple[KVLayout, dict[str, list[torch.Tensor]]]:
    """The KVLayout and per-layer pool views of an engine `KVCache` (engine/kv_cache.py), whose group
    pool is one tensor [layers_in_group, pages, 2, page_size, kv_heads, head_dim]."""
    cfg = cache.cfg
    # The cache's own TP shape, not kv_heads // local heads: with more ranks than KV heads each rank
    # holds a replica of one head, and that ratio would understate the group size.
    layout = KVLayout(
        model=cfg.name, dtype=str(cache.dtype).removeprefix("torch."), page_size=cache.page_size,
        layer_types=tuple(cache.layer_group(i) for i in range(cfg.num_hidden_layers)),
        kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, sliding_window=cfg.sliding_window,
        tp_size=getattr(cache, "tp_size", 1), tp_rank=getattr(cache, "tp_rank", 0),
        q_heads=cfg.num_attention_heads)
    return layout, {g: list(cache.pools[g].unbind(0)) for g in GROUPS}


class KVTransferError(RuntimeError):
    """A KV transfer failed (NIXL reported an error, or it did not complete in time)."""


class KVLayoutMismatch(KVTransferError):
    """The two pools do not lay out KV identically, so copying bytes would produce garbage."""


class KVLeaseExpired(KVTransferError):
    """The prefill side's lease on the pages ran out (or was released) before the pull finished."""


class KVReadInFlight(KVTransferError):
    """A READ was abandoned but NIXL could neither cancel it nor see it end: it may still write into the
    destination pages, which must therefore never be given to another sequence."""


@dataclass(frozen=True)
class KVLayout:
    """What must be equal on both sides for a byte copy of pages to be a valid KV copy."""

    model: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    page_size: int
    layer_types: tuple[str, ...]  # "full" | "sliding" for every layer, in model order
    kv_heads: int  # the model's total KV heads
    head_dim: int
    sliding_window: int
    # This pool's rank in its TP group (partition.head_range says which KV heads it holds). Not hashed:
    # differently sharded groups exchange KV by heads, see KVImporter.pull.
    tp_size: int = 1
    tp_rank: int = 0
    q_heads: int | None = None  # the model's query heads (None: as many as kv_heads); fixes GQA groups

    def __post_init__(self) -> None:
        bad = [t for t in self.layer_types if t not in GROUPS]
        if bad:
            raise ValueError(f"layer_types must be 'full' or 'sliding', got {bad}")
        self.heads  # raises ParallelConfigError (a ValueError) if the heads cannot be sharded so

    @property
    def num_q_heads(self) -> int:
        return self.kv_heads if self.q_heads is None else self.q_heads

    @property
    def heads(self):
        return head_range(self.num_q_heads, self.kv_heads, self.tp_rank, self.tp_size)

    @property
    def local_kv_heads(self) -> int:
        return self.heads.num_kv

    def group_layers(self, group: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == group)

    @property
    def layout_hash(self) -> str:
        """Equal on both sides iff a page of one head means the same bytes on both; the TP shape is
        excluded because a TP2 prefill and a TP4 decode group can still exchange KV head by head."""
        return layout_hash(**{k: v for k, v in asdict(self).items() if k not in _TP_SHAPE})

    def diff(self, other: KVLayout) -> str:
        parts = [f"{f.name}: {getattr(self, f.name)!r} vs {getattr(other, f.name)!r}"
                 for f in fields(self)
                 if f.name not in _TP_SHAPE and getattr(self, f.name) != getattr(other, f.name)]
        return "; ".join(parts) or "identical fields (hash scheme differs)"


@dataclass(frozen=True)
class PageGroupDescriptor:
    """The exporter's pages of one layer group for one sequence."""

    group: str
    layer_ids: tuple[int, ...]
    base_addrs: tuple[int, ...]  # start of each layer's pool tensor in the exporter's memory
    page_bytes: int
    device_id: int
    first_block: int  # logical page index of page_ids[0] (sliding groups drop the dead prefix)
    page_ids: tuple[int, ...]  # exporter's physical pages, in logical order

    @property
    def nbytes(self) -> int:
        return len(self.layer_ids) * len(self.page_ids) * self.page_bytes


@dataclass(frozen=True)
class KVShard:
    """One prefill rank's copy of a sequence's KV: the agent to READ from and where its pages are."""

    tp_rank: int
    agent_name: str
    agent_metadata: bytes
    mem_type: str
    groups: tuple[PageGroupDescriptor, ...]


@dataclass(frozen=True)
class KVHandle:
    """Everything the decode side needs to READ one sequence's KV (picklable, no live objects). The
    top-level agent and groups are the exporting leader's (rank 0); a TP>1 exporter also lists every
    rank in `shards`, in rank order, all under the one lease."""

    request_id: str
    lease_id: int
    agent_name: str
    agent_metadata: bytes
    mem_type: str  # "DRAM" | "VRAM"
    layout: KVLayout
    layout_hash: str
    num_tokens: int  # positions whose K/V are in the pages
    groups: tuple[PageGroupDescriptor, ...]
    expires_at: float  # wall clock: importer must not start after this
    reclaim_at: float  # wall clock: exporter frees the pages at this point unless released earlier
    shards: tuple[KVShard, ...] = ()  # every prefill rank when layout.tp_size > 1; empty at TP1

    def sources(self) -> tuple[KVShard, ...]:
        """The prefill ranks' pages, indexed by prefill TP rank."""
        if self.shards:
            return self.shards
        return (KVShard(0, self.agent_name, self.agent_metadata, self.mem_type, self.groups),)

    @property
    def nbytes(self) -> int:
        """Bytes held on the prefill side over all its ranks (replicated heads count once per copy)."""
        return sum(g.nbytes for s in self.sources() for g in s.groups)

    def pages_needed(self) -> dict[str, int]:
        return {g.group: len(g.page_ids) for g in self.groups}

    def first_blocks(self) -> dict[str, int]:
        return {g.group: g.first_block for g in self.groups}


@dataclass(frozen=True)
class TransferStats:
    nbytes: int
    seconds: float
    descriptors: int
