"""The prefix cache on the GPU kernels (engine/prefix_cache.py through Runner on device="cuda", CUDA
graphs and piecewise graphs on): prompts that share a prefix, diverge inside the sliding window before
a cached page boundary, or repeat, decode the same greedy tokens as a runner without the cache, except
where the uncached run's top-2 margin is a near-tie (a hit computes the suffix in a forward of another
shape, so bits may differ); the logits stay close, the hits are where the cache says, and every page
comes back. Two shapes: the MXFP4 fixture (Triton attention, window 8 < page 16) and gpt-oss's
attention shape (FlashInfer, window 128 > page 16)."""

from __future__ import annotations

import pytest
import torch

from test_model_gpu import GRAPH_SIZES, _cuda, _model, rel_err

pytestmark = pytest.mark.gpu

N_DECODE = 16
CHUNK = 64
TIE = 0.25  # top-2 logit margin under which two runs may pick differently


def kv_rows(kv, sid, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """The sequence's K and V of positions [lo, hi) per page group, gathered from the pools by its page
    table ([layers, positions, 2, heads, dim]); positions a sliding group no longer holds are skipped."""
    seq, ps, out = kv.seqs[sid], kv.page_size, {}
    for g, pool in kv.pools.items():
        start = max(lo, seq.first_page[g] * ps)
        rows = [pool[:, seq.pages[g][p // ps - seq.first_page[g]], :, p % ps] for p in range(start, hi)]
        if rows:
            out[g] = torch.stack(rows, 1).clone()
    return out


def greedy(r, sid, prompt: list[int], cut: int = 0, kv_upto: int = 0, *, chunk: int = CHUNK, n_decode: int = N_DECODE):
    """Chunked prefill (after a cache hit, if any; chunks restart at `cut` as they do at a hit), then
    greedy decode: tokens, logits, positions hit, and the KV of positions [0, kv_upto) after the prefill.
    (test_serve_prefix_cache_gpu runs it with the served chunk size as its reference.)"""
    start = r.kv.begin_prefix(sid, prompt) if r.kv.prefix is not None else 0
    at, out = start, None
    while at < len(prompt):
        end = min(at + chunk, cut) if at < cut else at + chunk
        out = r.extend(sid, prompt[at: end])
        at = end
    kv = kv_rows(r.kv, sid, 0, kv_upto) if kv_upto else None
    logits = [out.float()]
    toks = [int(out.argmax())]
    for _ in range(n_decode - 1):
        logits.append(r.decode([sid], [toks[-1]])[0].float())
        toks.append(int(logits[-1].argmax()))
    r.free(sid)
    return toks, logits, start, kv


def prompts_for(cfg) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(5)
    rnd = lambda n: torch.randint(0, min(cfg.vocab_size, 200000), (n,), generator=g).tolist()  # noqa: E731
    base = rnd(300)  # 18 whole pages of 16, and a window (128) spans 8 of them
    a, b = base + rnd(20), base[:290] + rnd(30)  # b diverges 2 tokens past the boundary at 288
    prompts = [a, b, a, base[:200] + rnd(5)]
    return prompts, [0, 288, (len(a) - 1) // 16 * 16, 192]


def check(kind: str, device, graphs: bool = True) -> None:
    from kvrelay.engine.runner import Runner

    cfg, w = _model(kind)
    prompts, hits = prompts_for(cfg)
    kw = dict(cuda_graph_batch_sizes=GRAPH_SIZES) if graphs else {}
    plain, cached = (Runner(cfg, w, device=device, page_size=16, kv_tokens=8192, **kw) for _ in range(2))
    for r in (plain, cached):
        if graphs:
            r.warmup()
    cached.kv.enable_prefix_cache()
    for i, p in enumerate(prompts):
        want, want_logits, _, want_kv = greedy(plain, f"p{i}", p, kv_upto=hits[i])
        got, got_logits, start, got_kv = greedy(cached, f"c{i}", p, kv_upto=hits[i])
        assert start == hits[i], (kind, i)
        if hits[i]:
            # What a hit reuses is the KV an uncached prefill of the same chunks computes, bit for bit
            # (each row of every kernel is computed alone, so another prompt's later tokens change none).
            assert want_kv.keys() == got_kv.keys(), (kind, i)
            for g in want_kv:
                assert torch.equal(got_kv[g], want_kv[g]), (kind, i, g)
        # The suffix after a hit runs in forwards of other shapes, so its bits differ: the logits must be
        # as close as an uncached run whose chunks restart at the same position (the same noise).
        _, noise_logits, _, _ = greedy(plain, f"n{i}", p, cut=hits[i])
        for step, (x, y, lx, ly) in enumerate(zip(got, want, got_logits, want_logits)):
            tol = max(2e-2, 2 * rel_err(noise_logits[step], ly))
            assert rel_err(lx, ly) < tol, (kind, i, step, tol)
            if x != y:
                top = torch.topk(ly, 2).values
                assert float(top[0] - top[1]) < TIE, (kind, i, step, x, y)
                break
    assert cached.kv.prefix.stats.hit_tokens == sum(hits)
    cached.kv.prefix.clear()
    for r in (plain, cached):
        free = r.kv.free_pages()
        assert all(free[g] == r.kv.allocators[g].num_pages - r.internal_pages()[g] for g in free)


@pytest.mark.parametrize("kind", ["fixture", "attn64"])
def test_prefix_cache_on_the_gpu_kernels(kind):
    check(kind, _cuda())
