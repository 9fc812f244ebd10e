"""The pinned staging ring of a forward's index arrays (engine/staging.py) on CUDA: back-to-back layouts
equal fresh ones, the ring reuses its buffers, a slot is not rewritten while a copy out of it is still
queued, and a Runner's back-to-back forwards through it give the same logits, bit for bit, as without it.
tests/cpu/test_staging.py checks the same logic on the CPU with events completed by hand."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import attn64_cfg, dummy_weights

from kvrelay.engine import batch_plan
from kvrelay.engine.config import PRESETS
from kvrelay.engine.kv_cache import KVCache
from kvrelay.engine.staging import StagingRing, pack

pytestmark = pytest.mark.gpu

CPU = torch.device("cpu")
SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s of GPU time, so copies queued behind it are in flight


def _tensors(b) -> dict:
    out = {"qo_indptr": b.qo_indptr, "positions": b.positions, "logit_rows": b.logit_rows}
    for g in ("full", "sliding"):
        out |= {f"ip/{g}": b.kv[g].kv_indptr, f"ix/{g}": b.kv[g].kv_indices, f"ll/{g}": b.kv[g].kv_last_page_len,
                f"wp/{g}": b.write_pages[g], f"wo/{g}": b.write_offsets[g]}
    return out


def _host(b) -> dict:
    return {f"{k}/{g}": t for k, v in b.host.items() for g, t in (v.items() if isinstance(v, dict) else [(None, v)])}


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].cpu(), want[k]), k


def test_back_to_back_layouts_equal_fresh_ones_and_reuse_the_buffers():
    cfg = PRESETS["tiny"]
    kv = KVCache(cfg, num_pages=4096, page_size=4, device="cuda")
    ring = StagingRing("cuda")
    assert ring.pin
    rng = random.Random(0)
    done, ptrs = [], []
    for i in range(6):  # no sync between the forwards: their copies are queued back to back
        batch = [((i, 0), 300), ((i, 1), 1), ((i, 2), 17)]  # the same sizes: no slot outgrows its buffer
        kv.import_sequence((i, 1), rng.randint(1, 200))
        for sid, n in batch:
            kv.reserve(sid, n)
        want = batch_plan.layout(kv.plan_lists(batch), CPU)
        ring.next()
        got = kv.plan(batch, ring)
        fresh = kv.plan(batch)  # fresh pinned memory: the path without a ring
        _assert_same(_host(got), _host(want))  # read now: the slot is rewritten two forwards on
        assert all(t.is_pinned() for t in _host(got).values())
        ptrs.append(ring.buffers[ring.slot].data_ptr())
        done.append((got, fresh, want))
        for sid, _ in batch:
            kv.free(sid)
    torch.cuda.synchronize()
    for got, fresh, want in done:
        _assert_same(_tensors(got), _tensors(want))
        _assert_same(_tensors(fresh), _tensors(want))
    assert ptrs[0::2] == [ptrs[0]] * 3 and ptrs[1::2] == [ptrs[1]] * 3 and ptrs[0] != ptrs[1]


def _in_flight_case(ring: StagingRing):
    """Forward 1 stages `a` behind a long GPU sleep (its copy and a later FlashInfer-like copy from its host
    view stay queued), forward 2 stages `b`, forward 3 comes round to forward 1's slot and stages `c`."""
    a, b, c = list(range(100, 164)), list(range(200, 264)), list(range(300, 364))
    torch.cuda._sleep(SLEEP_CYCLES)
    ring.next()
    dev1, host1 = pack([("x", a, torch.int64)], torch.device("cuda"), ring)
    late = host1["x"].to("cuda", non_blocking=True)  # as FlashInfer's plan copies qo/kv indptr from the views
    ring.next()
    pack([("x", b, torch.int64)], torch.device("cuda"), ring)
    ring.next()
    _, host3 = pack([("x", c, torch.int64)], torch.device("cuda"), ring)
    torch.cuda.synchronize()
    return a, c, dev1["x"].tolist(), late.tolist(), host1["x"], host3["x"]


def test_a_slot_is_not_rewritten_while_a_copy_out_of_it_is_queued():
    ring = StagingRing("cuda")
    a, c, dev1, late, host1, host3 = _in_flight_case(ring)
    assert ring.waits == 1  # forward 3 found forward 1's copies queued behind the sleep and waited
    assert dev1 == a and late == a  # both copies read forward 1's bytes
    assert host3.data_ptr() == host1.data_ptr() and host1.tolist() == c  # the same buffer, rewritten after

    class Done:  # a guard that never waits: the race the event closes
        def record(self, stream=None):
            pass

        def query(self):
            return True

        def synchronize(self):
            pass

    a, c, dev1, late, _, _ = _in_flight_case(StagingRing("cuda", event=Done))
    assert dev1 == c and late == c  # the queued copies read forward 3's bytes: the test can tell


def test_runner_back_to_back_forwards_through_the_ring_equal_forwards_without_it():
    """Prefill, chunk, mixed and decode forwards queued without a sync in between (sliding layers on the
    Triton prefill, whose tile lists take the attention's own ring; full layers planned by FlashInfer,
    which copies from the layout's host views): each forward's layout equals the CPU one, the ring's two
    buffers are reused, and the logits equal a Runner's without a ring, bit for bit."""
    from kvrelay.engine.runner import Runner

    cfg = attn64_cfg(layers=2)
    w = dummy_weights(cfg, seed=11)
    staged = Runner(cfg, w, device="cuda", page_size=16, kv_tokens=8192, cuda_graphs=False)
    plain = Runner(cfg, w, device="cuda", page_size=16, kv_tokens=8192, cuda_graphs=False)
    plain._staging = None  # ids and layouts made without a ring (fresh pinned memory per layout)
    assert staged._staging is not None and staged._staging.pin
    seen = []
    plan = staged.kv.plan

    def spy(batch, staging=None):
        want = batch_plan.layout(staged.kv.plan_lists(batch), CPU)
        got = plan(batch, staging)
        seen.append((got, want, staging.slot, staging.buffers[staging.slot].data_ptr()))
        return got

    staged.kv.plan = spy
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    p, q, r = prompt(700), prompt(33), prompt(300)
    steps = [lambda x: x.prefill_batch([("a", p[:600]), ("b", q)]),
             lambda x: x.extend("a", p[600:]),
             lambda x: x.forward_mixed([("a", [1]), ("b", [2]), ("c", r)]),
             lambda x: x.decode(["a", "b", "c"], [3, 4, 5]),
             lambda x: x.decode(["a", "b", "c"], [6, 7, 8])]
    outs = {}
    for runner in (staged, plain):
        outs[runner] = [step(runner) for step in steps]  # queued back to back
    torch.cuda.synchronize()
    for a, b in zip(outs[staged], outs[plain]):
        assert torch.equal(a, b)
    assert [s for _, _, s, _ in seen] == [0, 1, 0, 1, 0]
    assert seen[0][3] == seen[2][3] == seen[4][3] and seen[1][3] == seen[3][3] != seen[0][3]
    for got, want, _, _ in seen:
        _assert_same(_tensors(got), _tensors(want))
