"""The prefix cache's host tier on CUDA (engine/host_tier.py): its slots are pinned memory and its copies
are asynchronous on the compute stream, so a device page overwritten right after its save, or read right
after its load, sees the bytes in stream order (checked byte for byte on random KV, with no host sync in
between); through the Runner (CUDA graphs and piecewise graphs on), a prefix pushed out to host and hit
again reuses exactly the KV an uncached prefill computed, and decodes as the uncached runner does (up
to near-ties, as in test_prefix_cache_gpu.py). Prints what a host hit costs against recomputing it, and
the copy bandwidth for gpt-oss-20b's page geometry."""

from __future__ import annotations

import time

import pytest
import torch

from test_model_gpu import GRAPH_SIZES, _cuda, _model, rel_err
from test_prefix_cache_gpu import TIE, greedy

pytestmark = pytest.mark.gpu


def test_pinned_async_copies_keep_the_bytes_in_stream_order():
    from kvrelay.engine.host_tier import HostKVStore
    from kvrelay.engine.kv_geometry import GROUPS

    dev = _cuda()
    # gpt-oss-20b's geometry: 12 layers per group, 8 KV heads of 64, pages of 16 (384 KiB a page).
    pools = {g: torch.randn(12, 600, 2, 16, 8, 64, device=dev).to(torch.bfloat16) for g in GROUPS}
    pair = sum(p[:, 0].numel() * p.element_size() for p in pools.values())
    store = HostKVStore(pools, 520 * pair)
    assert store.pinned and all(h.is_pinned() for h in store.host.values())
    # 400 of the pool's pages into 400 slots: half in one run of consecutive slots, half scattered.
    pages = torch.randperm(600, generator=torch.Generator().manual_seed(0))[:400].tolist()
    scattered = torch.randperm(320, generator=torch.Generator().manual_seed(1))[:200]
    slots = list(range(200)) + (200 + scattered).tolist()
    want = {g: pools[g][:, pages].clone() for g in GROUPS}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for g in GROUPS:
        store.save(g, pages, slots)
    torch.cuda.synchronize()
    t_save = time.perf_counter() - t0
    for g in GROUPS:  # queued right behind the saves: stream order must keep the old bytes for them
        store.save(g, pages, slots)
        pools[g].normal_()
    dest = list(reversed(pages))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for g in GROUPS:
        store.load(g, slots, dest)
    torch.cuda.synchronize()
    t_load = time.perf_counter() - t0
    for g in GROUPS:
        assert torch.equal(pools[g][:, dest], want[g]), g
    moved = len(pages) * pair
    print(f"\nhost tier, 20b pages: {len(pages)} pages x 2 groups ({moved / 2**20:.0f} MiB): device->host "
          f"{moved / t_save / 1e9:.1f} GB/s, host->device {moved / t_load / 1e9:.1f} GB/s "
          f"(a 32k-token prefix of 20b is {2048 * pair / 2**20:.0f} MiB)")


@pytest.mark.parametrize("kind", ["fixture", "attn64"])
def test_a_prefix_pushed_to_host_comes_back_on_the_gpu_kernels(kind):
    from kvrelay.engine.kv_geometry import FULL, GROUPS
    from kvrelay.engine.runner import Runner

    dev = _cuda()
    cfg, w = _model(kind)
    g = torch.Generator().manual_seed(9)
    rnd = lambda n: torch.randint(0, min(cfg.vocab_size, 200000), (n,), generator=g).tolist()  # noqa: E731
    a, other = rnd(330), rnd(400)
    plain = Runner(cfg, w, device=dev, page_size=16, kv_tokens=8192, cuda_graph_batch_sizes=GRAPH_SIZES)
    # 38 pages: a's 21 pages, then other's 26 push most of a's blocks out to the host tier.
    cached = Runner(cfg, w, device=dev, page_size=16, num_pages=38, cuda_graph_batch_sizes=GRAPH_SIZES)
    for r in (plain, cached):
        r.warmup()
    pair = sum(p[:, 0].numel() * p.element_size() for p in cached.kv.pools.values())
    cached.kv.enable_prefix_cache(host_bytes=64 * pair)
    pc = cached.kv.prefix
    assert pc.host.pinned
    hit = (len(a) - 1) // 16 * 16
    want, want_logits, _, want_kv = greedy(plain, "p", a, kv_upto=hit)
    t0 = time.perf_counter()
    greedy(cached, "first", a)  # cold: computed, cached
    torch.cuda.synchronize()
    t_cold = time.perf_counter() - t0
    greedy(cached, "other", other)
    assert pc.host_pages()[FULL] > 0 and pc.stats.to_host_bytes > 0
    t0 = time.perf_counter()
    got, got_logits, start, got_kv = greedy(cached, "again", a, kv_upto=hit)
    torch.cuda.synchronize()
    t_hit = time.perf_counter() - t0
    assert start == hit and pc.stats.host_hits == 1 and pc.stats.host_hit_tokens > 0
    for grp in want_kv:  # the bytes restored from host are the ones an uncached prefill computes
        assert torch.equal(got_kv[grp], want_kv[grp]), (kind, grp)
    _, noise_logits, _, _ = greedy(plain, "n", a, cut=hit)
    for step, (x, y, lx, ly) in enumerate(zip(got, want, got_logits, want_logits)):
        tol = max(2e-2, 2 * rel_err(noise_logits[step], ly))
        assert rel_err(lx, ly) < tol, (kind, step, tol)
        if x != y:
            top = torch.topk(ly, 2).values
            assert float(top[0] - top[1]) < TIE, (kind, step, x, y)
            break
    print(f"\n{kind}: {len(a)}-token prompt + {len(got)} decode steps: cold {1000 * t_cold:.1f} ms, after a host "
          f"hit of {pc.stats.host_hit_tokens} tokens {1000 * t_hit:.1f} ms "
          f"({pc.stats.to_device_bytes / 2**20:.2f} MiB back)")
    pc.clear()
    free = cached.kv.free_pages()
    assert all(free[g] == cached.kv.allocators[g].num_pages - cached.internal_pages()[g] for g in GROUPS)
