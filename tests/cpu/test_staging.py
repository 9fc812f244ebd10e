"""The reused host staging of a forward's index arrays (engine/staging.py): layouts staged through a ring
equal the ones made tensor by tensor, a slot is not rewritten while the event guarding it is pending,
and a Runner staging its forwards gives the same logits, bit for bit. The same ring, pinned on CUDA,
runs in tests/gpu/test_staging_gpu.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvrelay.engine import batch_plan
from kvrelay.engine.config import PRESETS
from kvrelay.engine.kv_cache import KVCache, PageAllocator
from kvrelay.engine.staging import ALIGN, StagingRing, pack

CFG = PRESETS["tiny"]
CPU = torch.device("cpu")


class FakeEvent:
    """torch.cuda.Event's record/query/synchronize, completed by hand; `on_wait` runs inside synchronize
    (before the ring may touch the slot it guards)."""

    log: list = []

    def __init__(self, on_wait=None):
        self.recorded, self.done, self.on_wait = 0, True, on_wait

    def record(self, stream=None):
        self.recorded += 1
        self.done = False
        FakeEvent.log.append(("record", self))

    def query(self):
        return self.done

    def synchronize(self):
        if self.on_wait is not None:
            self.on_wait(self)
        self.done = True
        FakeEvent.log.append(("sync", self))


def _tensors(b) -> dict:
    out = {"qo_indptr": b.qo_indptr, "positions": b.positions, "logit_rows": b.logit_rows}
    for g in ("full", "sliding"):
        out |= {f"ip/{g}": b.kv[g].kv_indptr, f"ix/{g}": b.kv[g].kv_indices, f"ll/{g}": b.kv[g].kv_last_page_len,
                f"wp/{g}": b.write_pages[g], f"wo/{g}": b.write_offsets[g]}
    for k, v in b.host.items():
        for g, t in (v.items() if isinstance(v, dict) else [(None, v)]):
            out[f"host/{k}/{g}"] = t
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
        assert a[k].is_contiguous() and b[k].is_contiguous(), k


def _random_batches(rng: random.Random, kv: KVCache, n: int):
    """n batches of new prompts, chunks after a prefix (some past the sliding window) and one-token rows,
    short (planned as lists) and long (as arrays); each reserved, then committed after the caller's use."""
    for i in range(n):
        batch = []
        for j in range(rng.randint(1, 4)):
            sid = (i, j)
            if rng.random() < 0.5:
                kv.import_sequence(sid, rng.choice([1, 7, 40, 333]))
            batch.append((sid, rng.choice([1, 1, 3, 17, 64, 300])))
        for sid, m in batch:
            kv.reserve(sid, m)
        yield batch
        for sid, m in batch:
            kv.free(sid)


def test_ring_layouts_equal_tensor_by_tensor_layouts_on_random_batches():
    """Forward after forward through one ring (slot after slot, growing when a batch outgrows its slot):
    each layout equals the CPU path's and the fresh-buffer path's; a layout's host views stay intact
    while the next forward is staged, and its device tensors (copies) for good."""
    rng = random.Random(0)
    kv = KVCache(CFG, num_pages=4096, page_size=4, device="cpu")
    ring = StagingRing(CPU, min_bytes=256)  # small: several batches outgrow their slot
    kept = []
    for batch in _random_batches(rng, kv, 40):
        n_new = sum(m for _, m in batch)
        lists = (batch_plan.plan_arrays([(s, kv.seqs[s], m) for s, m in batch], page_size=4,
                                        max_context=CFG.max_context)
                 if n_new >= batch_plan.ARRAYS_MIN_TOKENS else kv.plan_lists(batch))
        want = _tensors(batch_plan.layout(lists, CPU))
        ring.next()
        got = batch_plan.layout(lists, CPU, ring)
        _assert_same(_tensors(got), want)
        _assert_same(_tensors(kv.plan(batch, ring)), want)  # KVCache.plan hands the ring on (same slot)
        _assert_same(_tensors(batch_plan.layout(lists, CPU, None)), want)
        if kept:  # the forward before: its slot is not this forward's
            before, before_want = kept[-1]
            _assert_same(_tensors(before), before_want)
        kept.append((got, want))
    for got, want in kept:  # device tensors are copies: no later forward reaches them
        for k, t in _tensors(got).items():
            if not k.startswith("host/"):
                assert torch.equal(t, want[k]), k
    assert ring.waits == 0  # no event on a CPU device: nothing to wait for


def test_a_slot_is_not_rewritten_while_its_event_is_pending():
    FakeEvent.log.clear()
    seen = []

    def on_wait(ev):  # the ring waits before touching the slot: forward 1's bytes are still there
        seen.append(host1.tolist())

    ring = StagingRing(CPU, event=lambda: FakeEvent(on_wait), min_bytes=64)
    a, b, c = list(range(10, 20)), list(range(20, 30)), list(range(30, 40))
    ring.next()
    dev1, h1 = pack([("x", a, torch.int64)], CPU, ring)
    host1 = h1["x"]
    assert FakeEvent.log == []  # nothing recorded while the forward is being staged
    ring.next()  # forward 2: seals forward 1's slot (its event records after every copy out of it)
    ev1 = ring.events[0]
    assert ev1 is not None and ev1.recorded == 1 and not ev1.query() and ring.slot == 1
    _, h2 = pack([("x", b, torch.int64)], CPU, ring)
    assert h2["x"].data_ptr() != host1.data_ptr() and host1.tolist() == a  # two slots: no reuse yet
    ring.next()  # forward 3 comes round to slot 0 while its copies are still pending: it waits first
    assert seen == [a] and ring.waits == 1 and ev1.query()
    assert [k for k, _ in FakeEvent.log] == ["record", "record", "sync"]
    _, h3 = pack([("x", c, torch.int64)], CPU, ring)
    assert h3["x"].data_ptr() == host1.data_ptr()  # the same buffer, reused
    assert host1.tolist() == c and dev1["x"].tolist() == a  # rewritten only now; the device copy untouched
    # a slot whose copies are done is handed out without a wait
    ring.events[1].done = True
    ring.next()
    assert ring.waits == 1 and ring.slot == 1
    # a forward that staged nothing leaves its slot's event as it was (nothing new to guard)
    ring.next()
    assert ring.events[1].recorded == 1


def test_packs_of_one_forward_share_its_slot_aligned_and_a_slot_grows():
    ring = StagingRing(CPU, min_bytes=128)
    ring.next()
    d1, h1 = pack([("a", [1, 2, 3], torch.int32), ("b", np.arange(5), torch.int64)], CPU, ring)
    d2, h2 = pack([("c", [7] * 3, torch.int64)], CPU, ring)
    base = ring.buffers[0].data_ptr()
    for h in (h1["a"], h1["b"], h2["c"]):
        assert (h.data_ptr() - base) % ALIGN == 0 and h.untyped_storage().data_ptr() == base
    assert h1["a"].tolist() == [1, 2, 3] and h1["b"].tolist() == list(range(5)) and h2["c"].tolist() == [7] * 3
    assert d1["a"].dtype == torch.int32 and d1["b"].dtype == torch.int64
    big = np.arange(1020)  # 8160 bytes: with the 96 before it, past 8192
    d3, h3 = pack([("big", big, torch.int64)], CPU, ring)  # a larger buffer for this slot
    assert ring.buffers[0].numel() >= 96 + 8160 and ring.buffers[0].data_ptr() != base
    assert h3["big"].tolist() == big.tolist() and h1["a"].tolist() == [1, 2, 3]  # the old buffer lives on
    grown = ring.buffers[0].data_ptr()
    ring.next()
    ring.next()  # slot 0 again: the same packs fit the grown buffer, which is kept
    pack([("a", [1, 2, 3], torch.int32), ("b", np.arange(5), torch.int64)], CPU, ring)
    pack([("c", [7] * 3, torch.int64)], CPU, ring)
    _, h4 = pack([("big", big, torch.int64)], CPU, ring)
    assert ring.buffers[0].data_ptr() == grown and h4["big"].tolist() == big.tolist()
    # the int64 -> int32 cast wraps, as the `.to(torch.int32)` this replaced
    d, h = pack([("w", [2**33 + 5, -1], torch.int32)], CPU, ring)
    assert h["w"].tolist() == d["w"].tolist() == torch.tensor([2**33 + 5, -1]).to(torch.int32).tolist()
    assert pack([], CPU, ring) == ({}, {})


def test_prefill_tiles_equal_the_loop_they_replaced():
    from kvrelay.kernels.triton_attention import plan_prefill_tiles, prefill_tiles

    rng = random.Random(1)
    for _ in range(200):
        lens = [rng.choice([0, 1, 2, 15, 16, 17, 300, 8192]) for _ in range(rng.randint(0, 6))]
        qo = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        bq = rng.choice([1, 8, 16, 64])
        seq, q0 = [], []
        for b in range(len(qo) - 1):
            starts = range(0, int(qo[b + 1] - qo[b]), bq)
            seq += [b] * len(starts)
            q0 += list(starts)
        s, q = prefill_tiles(qo, bq)
        assert s.tolist() == seq and q.tolist() == q0
        ts, tq = plan_prefill_tiles(torch.tensor(qo, dtype=torch.int32), bq)
        assert ts.dtype == tq.dtype == torch.int32 and ts.tolist() == seq and tq.tolist() == q0


def test_allocator_hands_out_what_popping_one_by_one_did():
    rng = random.Random(2)
    a, held = PageAllocator(300), []
    free_ref, refs = list(range(299, -1, -1)), {}
    for _ in range(300):
        if held and rng.random() < 0.4:
            pages = held.pop(rng.randrange(len(held)))
            a.release(pages)
            for p in pages:
                del refs[p]
                free_ref.append(p)
        else:
            n = rng.randint(0, min(40, len(free_ref)))
            want = [free_ref.pop() for _ in range(n)]
            refs.update({p: 1 for p in want})
            got = a.allocate(n)
            assert got == want
            held.append(got)
        assert a._free == free_ref and a._refs == refs


@pytest.mark.usefixtures("model_single_thread")
def test_runner_staging_its_forwards_gives_the_same_logits():
    """A Runner on the CPU with a staging ring put in (what it makes on CUDA, with events that complete
    by hand): prefills long and short, chunks, prompt logprob rows, decode steps and launched decode steps
    with tokens left on the device give the same logits, bit for bit, as the Runner without one."""
    from kvrelay.engine.runner import Runner

    def runner(staged: bool) -> Runner:
        r = Runner.load("tiny", dummy=True, seed=5, page_size=4, num_pages=512, dtype=torch.float32)
        if staged:
            r._staging = StagingRing(CPU, event=FakeEvent, min_bytes=64)
        return r

    plain, staged = runner(False), runner(True)
    starts = []  # one slot per forward: _run starts it, or decode_launch for its fill rows and forward
    advance = staged._staging.next
    staged._staging.next = lambda: starts.append(1) or advance()
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(0, plain.cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    a, b, c = prompt(300), prompt(5), prompt(40)
    steps = [
        lambda r: r.prefill_batch([("a", a[:260]), ("b", b)]),
        lambda r: r.extend("a", a[260:]),
        lambda r: r.forward_mixed([("a", [3]), ("c", c)], all_positions={1}),
        lambda r: r.decode(["a", "b", "c"], [1, 2, 3]),
        lambda r: r.prefill("d", prompt(7), all_logits=True),
    ]
    for step in steps:
        state = g.get_state()
        want = step(plain)
        g.set_state(state)
        got = step(staged)
        assert torch.equal(got, want)
    for bad in ([0, plain.cfg.vocab_size], [-1], [2**70]):  # range-checked on the staged copy, as before
        for r in (plain, staged):
            with pytest.raises(ValueError, match="outside"):
                r.prefill("bad", bad)
            assert not r.has_sequence("bad")
    prev = {}
    for r in (plain, staged):
        s1 = r.decode_launch(["a", "b"], [4, 5])
        s2 = r.decode_launch(["a", "b"], [None, 6], prev=s1, select_later=True)  # a's token from s1
        prev[r] = (r.decode_collect(s1), s2.logits.clone(), r.decode_collect(r.decode_select(s2)))
    assert prev[plain][0] == prev[staged][0] and prev[plain][2] == prev[staged][2]
    assert torch.equal(prev[plain][1], prev[staged][1])
    assert len(starts) == len(steps) + 3 + 2  # + the three refused prefills
    assert all(ev is not None and ev.recorded for ev in staged._staging.events)
