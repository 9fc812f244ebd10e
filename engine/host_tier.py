"""The host-memory tier under the prefix cache: page slots in (page-locked, on CUDA) CPU memory that hold the
KV of cached blocks the device pool evicted, and the copies between them and the device pages.

engine/prefix_cache.py decides which block lives where (a block's page is in one tier at a time) and
evicts least recently used slots; this module only stores bytes. Each page group has its own slots, as
many per group as the byte budget holds pairs of one full and one sliding page (a cached block keeps
both). A slot is one page of every layer of its group, contiguous ([slots, layers, 2, page_size,
kv_heads, head_dim], slot-major), so a run of consecutive slots is one cudaMemcpyAsync either way.

Copies go on the current (compute) stream, non_blocking: a device page an eviction saves is freed for
reuse at once, and the forward that next writes it is queued behind the device->host copy; a restored
page is read by the forward queued behind its host->device copy. So stream order alone makes both
correct, with no event and no host wait; the host never touches a slot's bytes itself. (A side stream
could only hide a copy behind the step already in flight, at the price of an event per copy; the copy
of a 32k-token prefix of 20b is ~0.8 GB, ~20 ms at PCIe 5 speeds against seconds of prefill.)
"""

from __future__ import annotations

import torch

from kvrelay.engine.kv_geometry import GROUPS

# Pages gathered into one device staging buffer per copy: bounds the scratch memory (20b: 64 x 384 KiB).
_BATCH = 64


class HostKVStore:
    def __init__(self, pools: dict[str, torch.Tensor], budget_bytes: int, *, pin: bool | None = None):
        """`pools`: the device KV pools (group -> [layers, pages, 2, page_size, kv_heads, head_dim])."""
        self.pools = pools
        first = next(iter(pools.values()))
        self.device = first.device
        self.page_bytes = {g: pools[g][:, 0].numel() * pools[g].element_size() for g in GROUPS}
        pair = sum(self.page_bytes.values())
        self.capacity = int(budget_bytes) // pair
        if self.capacity < 1:
            raise ValueError(f"a host tier of {budget_bytes} bytes holds no page (one full + one sliding page "
                             f"take {pair} bytes)")
        pin = self.device.type == "cuda" if pin is None else pin
        self.host = {g: torch.empty((self.capacity, *pools[g][:, 0].shape), dtype=pools[g].dtype) for g in GROUPS}
        self.pinned = pin
        if pin:
            _pin(self, list(self.host.values()))
        self._free = {g: list(range(self.capacity - 1, -1, -1)) for g in GROUPS}  # lowest slot out first

    @property
    def bytes_total(self) -> int:
        return self.capacity * sum(self.page_bytes.values())

    def num_free(self, group: str) -> int:
        return len(self._free[group])

    def used_bytes(self) -> int:
        return sum((self.capacity - len(self._free[g])) * self.page_bytes[g] for g in GROUPS)

    def take(self, group: str) -> int | None:
        """A free slot of `group`, or None."""
        return self._free[group].pop() if self._free[group] else None

    def give(self, group: str, slot: int) -> None:
        self._free[group].append(slot)

    # ---- copies ----------------------------------------------------------------------------------
    def _index(self, pages: list[int]) -> torch.Tensor:
        t = torch.tensor(pages, dtype=torch.long)
        if self.device.type == "cuda":  # from pageable memory the copy would wait for the stream
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def save(self, group: str, pages: list[int], slots: list[int]) -> None:
        """Device pages -> host slots (queued on the current stream)."""
        pool, host = self.pools[group], self.host[group]
        slots, pages = map(list, zip(*sorted(zip(slots, pages)))) if slots else ([], [])
        for i in range(0, len(pages), _BATCH):
            p, s = pages[i: i + _BATCH], slots[i: i + _BATCH]
            staged = pool.index_select(1, self._index(p)).transpose(0, 1).contiguous()  # slot-major, on device
            for at, slot, n in _runs(s):
                host[slot: slot + n].copy_(staged[at: at + n], non_blocking=True)

    def load(self, group: str, slots: list[int], pages: list[int]) -> None:
        """Host slots -> device pages (queued on the current stream)."""
        pool, host = self.pools[group], self.host[group]
        # In slot order: a chain went to host tail first, so its slots run backwards from its head.
        slots, pages = map(list, zip(*sorted(zip(slots, pages)))) if slots else ([], [])
        for i in range(0, len(pages), _BATCH):
            p, s = pages[i: i + _BATCH], slots[i: i + _BATCH]
            staged = torch.empty((len(p), *pool[:, 0].shape), dtype=pool.dtype, device=self.device)
            for at, slot, n in _runs(s):
                staged[at: at + n].copy_(host[slot: slot + n], non_blocking=True)
            pool.index_copy_(1, self._index(p), staged.transpose(0, 1))


def _pin(owner: object, tensors: list[torch.Tensor]) -> None:
    """Page-lock `tensors` where they are (cudaHostRegister) for as long as `owner` lives. Not
    `pin_memory=True`: torch's pinned allocator rounds every allocation up to a power of two (a 40 GiB
    tier would lock 64), and keeps freed blocks for reuse."""
    import weakref

    cudart = torch.cuda.cudart()
    ptrs = []
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        code = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 1))  # 1: cudaHostRegisterPortable (as torch's own)
        if code != 0:
            _unpin(ptrs)
            raise RuntimeError(f"cannot pin {nbytes / 2**30:.2f} GiB of host memory for the prefix cache's host "
                               f"tier (cudaHostRegister: cudaError {code}); make the tier smaller")
        ptrs.append(t.data_ptr())
    # Unregistered before the tensors' memory goes back (the finalizer holds no reference to them).
    weakref.finalize(owner, _unpin, ptrs)


def _unpin(ptrs: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for p in ptrs:
        cudart.cudaHostUnregister(p)


def _runs(slots: list[int]):
    """(offset in `slots`, first slot, length) of each run of consecutive slots."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield start, slots[start], i - start
            start = i
