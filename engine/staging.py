"""Host staging of a forward's index arrays: one host buffer, one asynchronous copy to the device.

`pack` lays int arrays (Python lists or numpy arrays) out in one host byte buffer, each as its own dtype,
copies the buffer to the device in one non-blocking copy and returns device and host views of every
array. A copy from pageable memory would wait for the stream, so on CUDA the buffer is page-locked.

Page-locking fresh memory per forward (`tensor.pin_memory()`) was ~4 ms of host time for an 8192-token
prefill's index arrays on the H200 while the GPU sat idle before its first kernel
(bench/results/host-profile-prefill-gpt-oss-20b-8192-63f643f.txt). A `StagingRing` keeps a few pinned
buffers instead, one per forward in turn (`next`), each grown when too small.

A slot's bytes are read asynchronously after its forward's host code has moved on: by the device copy
`pack` queues, and by FlashInfer's plan, which copies qo/kv indptr from the host views of the layout
(non_blocking, so from that pinned memory, later on the stream). So a slot is guarded by an event
recorded when its forward is sealed, i.e. at the next forward's `next`: by then every copy out of it is
queued, on the device's current stream (the forward's). A slot comes round again after `slots` forwards,
and `next` waits on its event (query first: no wait when the copies are done, the usual case with two
slots and one forward in flight). Host views of a slot are valid until the slot comes round again: the
layout of a forward is read on the host only while that forward is set up (Runner._run).
"""

from __future__ import annotations

import numpy as np
import torch

# Each array starts on a 16-byte boundary: Triton specialises pointer arguments divisible by 16.
ALIGN = 16
_ITEMSIZE = {torch.int64: 8, torch.int32: 4}
_NP = {torch.int64: np.int64, torch.int32: np.int32}


class StagingRing:
    """`slots` reused host byte buffers (page-locked when `pin`: default on a CUDA device), one per forward.

    `event` makes the guard of a slot (default torch.cuda.Event on CUDA; None: no guard, for a CPU
    device, whose copies are done when `pack` returns); anything with record(stream) / query() /
    synchronize() will do (tests). One ring serves one Runner (not thread-safe)."""

    def __init__(self, device, *, slots: int = 2, pin: bool | None = None, event=None, min_bytes: int = 1 << 16):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.pin = cuda if pin is None else pin
        self._new_event = (torch.cuda.Event if cuda else None) if event is None else event
        self.min_bytes = min_bytes
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.events: list[object | None] = [None] * slots
        self.slot = -1  # the slot of the forward being staged (-1: none yet)
        self._used = 0  # bytes of it handed out to that forward
        self.waits = 0  # times `next` found a slot's copies unfinished and waited

    def next(self) -> None:
        """Start a forward: seal the slot of the forward before (record its event after every copy out of
        it queued so far), move to the next slot, and wait until the copies out of that one have finished."""
        if self.slot >= 0 and self._used and self._new_event is not None:
            ev = self.events[self.slot]
            if ev is None:
                ev = self.events[self.slot] = self._new_event()
            ev.record(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
        self.slot = (self.slot + 1) % len(self.buffers)
        self._used = 0
        ev = self.events[self.slot]
        if ev is not None and not ev.query():
            self.waits += 1
            ev.synchronize()

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of the current slot not handed out yet in this forward (uint8, ALIGN-aligned start)."""
        if self.slot < 0:
            self.next()
        buf, start = self.buffers[self.slot], self._used
        if buf is None or start + nbytes > buf.numel():
            # A fresh, larger buffer for this slot, used from its start, big enough for all this forward
            # has taken (the next forward of the slot likely takes as much). Views of the old one handed
            # out in this forward keep it alive, and torch's pinned allocator does not reuse it before the
            # copies out of it have finished.
            cap = max(self.min_bytes, 1 << max(0, start + nbytes - 1).bit_length())
            buf = self.buffers[self.slot] = torch.empty(cap, dtype=torch.uint8, pin_memory=self.pin)
            start = 0
        self._used = -(-(start + nbytes) // ALIGN) * ALIGN
        return buf[start: start + nbytes]


def pack(parts: list[tuple], device: torch.device, ring: StagingRing | None = None) -> tuple[dict, dict]:
    """[(key, int values, dtype int64|int32)] -> ({key: device tensor}, {key: host tensor}): the arrays in
    one host buffer (from `ring`, or a fresh one, pinned on CUDA), one non-blocking copy to `device`."""
    spans, at = [], 0
    for key, values, dtype in parts:
        at = -(-at // ALIGN) * ALIGN
        n = len(values)
        spans.append((key, at, n, dtype))
        at += n * _ITEMSIZE[dtype]
    if ring is not None:
        host = ring.take(at)
    else:
        host = torch.empty(at, dtype=torch.uint8, pin_memory=torch.device(device).type == "cuda")
    mem = host.numpy()
    for (key, o, n, dtype), (_, values, _) in zip(spans, parts):
        # through int64, then numpy's cast, as the int64 tensor + `.to(int32)` this replaced: values wrap,
        # never raise (page ids and positions are far inside int32 anyway)
        src = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=np.int64)
        mem[o: o + n * _ITEMSIZE[dtype]].view(_NP[dtype])[:] = src
    # copy=True: a CPU device gets its own tensor too, which the slot's next forward cannot overwrite
    dev = host.to(device, non_blocking=True, copy=True)

    def views(t: torch.Tensor) -> dict:
        return {key: t[o: o + n * _ITEMSIZE[dtype]].view(dtype) for key, o, n, dtype in spans}

    return views(dev), views(host)
