"""The piecewise-graph forward (engine/cuda_graph.PiecewiseGraphs) split around the attention kernels,
run eagerly on the CPU in float32: it must equal the monolithic forward, padding rows and all, over
prefill chunks, mixed steps (prompt chunks riding with decode rows) and decode steps - to float32
rounding (a GEMM over 16 padded rows may block its sums differently from one over 15) and in every
greedy token. On the GPU the
same pieces are replayed as CUDA graphs (tests/gpu/test_cuda_graph.py)."""

from __future__ import annotations

import os

import pytest
import torch

from kvrelay.engine.cuda_graph import PiecewiseGraphs
from kvrelay.engine.kv_geometry import GROUPS
from kvrelay.engine.runner import Runner

pytestmark = pytest.mark.usefixtures("model_single_thread")


def _runner(pieces: bool, dtype: torch.dtype = torch.float32) -> Runner:
    r = Runner.load("tiny", dummy=True, seed=3, page_size=4, num_pages=256, dtype=dtype)
    if pieces:
        # What Runner.warmup does on a GPU, minus the capture: a scratch page per group for the padding
        # rows, and pieces that the forward runs eagerly (graph_replay False).
        r._scratch = {g: r.kv.allocators[g].allocate(1)[0] for g in GROUPS}
        r._pieces = PiecewiseGraphs(r.model, r.kv, r._scratch, buckets=(8, 16, 40))
        r.graph_replay = False
    return r


def test_pieces_equal_the_monolithic_forward_over_mixed_steps():
    eager, split = _runner(False), _runner(True)
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(0, eager.cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    a, b, c = prompt(13), prompt(6), prompt(21)
    steps = [
        [("a", a[:9]), ("b", b)],                       # two new prompts, one chunked (15 tokens: bucket 16)
        [("a", a[9:]), ("b", [5])],                     # a's last chunk + b's first decode token
        [("a", [7]), ("b", [9]), ("c", c)],             # decode rows + a 21-token prompt (23: 40)
        [("a", [1]), ("b", [2]), ("c", [3])],           # a decode step (3: 8)
        [("a", prompt(30)), ("c", [4])],                # over the middle bucket
        [("b", prompt(41))],                            # past the largest bucket: the eager path
    ]
    used, calls = [], []
    run = split._pieces.forward
    split._pieces.forward = lambda *a, **k: calls.append(len(a[0])) or run(*a, **k)
    for items in steps:
        want = eager.forward_mixed(items)
        got = split.forward_mixed(items)
        used.append(split._pieces.padded_size(sum(len(t) for _, t in items)))
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), items
    assert used == [16, 8, 40, 8, 40, None]
    assert calls == [15, 5, 23, 3, 31]  # every forward that fits a bucket went through the pieces
    for r in (eager, split):
        for sid in ("a", "b", "c"):
            r.free(sid)
    assert split.kv.free_pages() == {g: split.kv.allocators[g].num_pages - 1 for g in GROUPS}


def test_pieces_take_decode_tokens_left_on_the_device():
    """A decode step past the largest decode graph (decode_launch's eager path) whose tokens are still on
    the device: the pieces' metadata copy takes them from there (`fill`)."""
    eager, split = _runner(False), _runner(True)
    for r in (eager, split):
        r.prefill_batch([("a", [1, 2, 3]), ("b", [4, 5, 6, 7])])
    prev_tokens = torch.tensor([11, 12])
    fill = (torch.tensor([0, 1]), torch.tensor([1, 0]), prev_tokens)
    got = split._run([("a", [0]), ("b", [0])], fill=fill)
    want = eager.forward_mixed([("a", [12]), ("b", [11])])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_graph_buffers_step_equals_eager_decode():
    """The CUDA-graph decode step's fixed buffers (engine/cuda_graph.DecodeGraphBuffers): refilled on the
    host, padded with scratch-page rows and run uncaptured on the CPU, a step equals the eager decode of
    the same rows, through padded sizes that shrink and grow."""
    from kvrelay.engine.cuda_graph import DecodeGraphBuffers, DecodeGraphs

    eager, r = _runner(False), _runner(False)
    r.cuda_graph_batch_sizes = (1, 2, 4, 8)
    r._scratch = {g: r.kv.allocators[g].allocate(1)[0] for g in GROUPS}
    cap = {g: r.kv.allocators[g].num_pages + 8 for g in GROUPS}
    r._gbuf = DecodeGraphBuffers.allocate(r.cuda_graph_batch_sizes, cap, r.device,
                                          lambda bs: r.model.make_attention(r.kv.page_size))
    # Nothing captured: DecodeGraphs.run prepares the buffers and runs the step eagerly.
    r._graphs = DecodeGraphs(r._graph_step, r._graph_prepare, r.cuda_graph_batch_sizes)
    prompts = {"a": [3, 1, 4, 1, 5, 9, 2, 6, 5], "b": [2, 7, 1, 8], "c": list(range(40, 63))}
    toks = {}
    for x in (eager, r):
        lg = x.prefill_batch(list(prompts.items()))
        toks = dict(zip(prompts, lg.argmax(-1).tolist()))
    steps = [["a", "b", "c"], ["a", "b", "c"], ["c"], ["a", "c"], ["a", "b", "c"]]
    for ids in steps:
        want = eager.decode(ids, [toks[i] for i in ids])
        got = r.decode(ids, [toks[i] for i in ids])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        toks.update(zip(ids, want.argmax(-1).tolist()))
    assert r._gbuf.items is None  # cleared after every step
    for i in prompts:
        r.free(i)
    assert r.kv.free_pages() == {g: r.kv.allocators[g].num_pages - 1 for g in GROUPS}


def test_decode_graph_step_in_the_heads_dtype_selects_the_same_tokens():
    """KVRELAY_GRAPH_HEAD_LOGITS=1: the decode graph step (its fixed buffers, run uncaptured on the CPU) returns the
    bf16 model's head output unwidened; `decode` still returns fp32 (the same values), and the pipelined greedy
    path (decode_launch / decode_collect) picks the same tokens as with fp32 logits."""
    from kvrelay.engine.cuda_graph import DecodeGraphBuffers, DecodeGraphs

    def graph_runner():
        r = _runner(False, dtype=torch.bfloat16)
        r.cuda_graph_batch_sizes = (1, 2, 4)
        r._scratch = {g: r.kv.allocators[g].allocate(1)[0] for g in GROUPS}
        cap = {g: r.kv.allocators[g].num_pages + 8 for g in GROUPS}
        r._gbuf = DecodeGraphBuffers.allocate(r.cuda_graph_batch_sizes, cap, r.device,
                                              lambda bs: r.model.make_attention(r.kv.page_size))
        r._graphs = DecodeGraphs(r._graph_step, r._graph_prepare, r.cuda_graph_batch_sizes)
        return r

    prompts = {"a": [3, 1, 4, 1, 5, 9, 2, 6, 5], "b": [2, 7, 1, 8]}
    out = {}
    for flag in ("0", "1"):
        os.environ["KVRELAY_GRAPH_HEAD_LOGITS"] = flag
        try:
            r = graph_runner()
            first = r.prefill_batch(list(prompts.items())).argmax(-1).tolist()
            logits = r.decode(["a", "b"], first)
            assert logits.dtype == torch.float32
            step = r.decode_launch(["a", "b"], logits.argmax(-1).tolist(), select_later=True)
            assert step.logits.dtype == (torch.bfloat16 if flag == "1" else torch.float32)  # the graph's output
            step = r.decode_select(step)
            tokens = []
            for _ in range(3):
                step = r.decode_launch(["a", "b"], [None, None], prev=step)
                tokens.append(step.tokens.tolist())
            out[flag] = (logits, tokens)
        finally:
            os.environ.pop("KVRELAY_GRAPH_HEAD_LOGITS", None)
    assert torch.equal(out["0"][0], out["1"][0])
    assert out["0"][1] == out["1"][1]
