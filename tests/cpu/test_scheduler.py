"""Continuous batching on the real tiny model: outputs equal solo runs, budgets are never exceeded."""

from __future__ import annotations

import pytest

from kvrelay.decode_worker.scheduler import Scheduler
from kvrelay.workers.messages import AdmissionRefused
from kvrelay.engine.runner import Runner
from kvrelay.engine.sampling import SamplingParams, TokenOutput

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def new_runner(num_pages: int = 256, page_size: int = 4) -> Runner:
    return Runner.load("tiny", dummy=True, seed=0, page_size=page_size, num_pages=num_pages)


@pytest.fixture(scope="module")
def solo_runner():
    return new_runner()


def solo(runner: Runner, prompt: list[int], params: SamplingParams) -> list[int]:
    """Single-sequence reference: prefill, then one decode step per token."""
    logits = runner.prefill("solo", prompt)
    out = []
    try:
        for step in range(params.max_tokens):
            (tok, _), = runner.sample(logits, [params], [step])
            out.append(tok)
            if tok in params.stop_token_ids:
                break
            logits = runner.decode(["solo"], [tok])[0]
    finally:
        runner.free("solo")
    return out


def admit(sched: Scheduler, rid: str, prompt: list[int], params: SamplingParams, sink: dict) -> None:
    """What the decode actor does after a pull: reserve, have KV in place, join with the first token."""
    sched.reserve(rid, len(prompt), params.max_tokens)
    logits = sched.runner.prefill(rid, prompt)  # stands in for import + NIXL pull
    (tok, _), = sched.runner.sample(logits, [params], [0])
    sink[rid] = [TokenOutput(tok, None, None)]
    sched.join(rid, params, tok, 1, sink[rid].append)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(37 * i + 11 * salt + 5) % 1000 for i in range(n)]


def run_to_end(sched: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not sched.has_work():
            return
        sched.step()
        s = sched.stats()
        for g in ("full", "sliding"):
            assert s.pages_in_use[g] <= s.pages_reserved[g], f"{g}: usage exceeds reservations"
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_requests_joining_mid_batch_match_solo_runs(solo_runner, overlap):
    sched = Scheduler(new_runner(), max_batch=8, overlap=overlap)
    lengths = [1, 7, 8, 9, 30, 3]
    sink: dict[str, list[TokenOutput]] = {}
    for i, n in enumerate(lengths):  # join at different steps: one new request per step
        admit(sched, f"r{i}", prompt_of(n, i), GREEDY, sink)
        sched.step()
    run_to_end(sched)
    for i, n in enumerate(lengths):
        got = [t.token_id for t in sink[f"r{i}"]]
        assert got == solo(solo_runner, prompt_of(n, i), GREEDY), f"request r{i} (prompt {n})"
        assert [t.finish_reason for t in sink[f"r{i}"]] == [None] * 11 + ["length"]
    s = sched.stats()
    assert s.pages_in_use == {"full": 0, "sliding": 0} and s.reserved == 0 and s.running == 0
    # Overlapped: every step after the first was launched while the one before was on the device.
    assert sched.times.overlapped == (sched.times.steps - 1 if overlap else 0)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_stop_token_ends_request_and_frees_pages(solo_runner, overlap):
    sched = Scheduler(new_runner(), max_batch=4, overlap=overlap)
    ref = solo(solo_runner, prompt_of(5), GREEDY)
    stop = ref[4]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,))
    sink: dict[str, list[TokenOutput]] = {}
    admit(sched, "a", prompt_of(5), params, sink)
    run_to_end(sched)
    got = sink["a"]
    first_stop = ref.index(stop)
    assert [t.token_id for t in got] == ref[:first_stop + 1]
    assert got[-1].finish_reason == "stop"
    assert sched.stats().pages_in_use == {"full": 0, "sliding": 0}


def test_admission_refusals_are_explained_and_never_overcommit():
    runner = new_runner(num_pages=20, page_size=4)
    sched = Scheduler(runner, max_batch=3)
    with pytest.raises(AdmissionRefused, match="pool has only 20") as e:
        sched.reserve("huge", 60, 40)  # 100 tokens = 25 full pages > 20
    assert not e.value.retryable
    sched.reserve("a", 30, 10)  # 10 full pages
    sched.reserve("b", 20, 10)  # 8 full pages
    with pytest.raises(AdmissionRefused, match="out of KV pages, needs 3 full pages and 2 of 20") as e:
        sched.reserve("c", 8, 4)
    assert e.value.retryable
    sched.reserve("d", 4, 4)  # 2 pages: fits exactly
    with pytest.raises(AdmissionRefused, match="batch is full") as e:
        sched.reserve("e", 1, 1)
    assert e.value.retryable
    assert sched.stats().pages_reserved["full"] == 20 and sched.stats().free_budget == 0
    sched.release("b")
    sched.reserve("c", 8, 4)
    for rid in ("a", "c", "d"):
        sched.release(rid)
    assert sched.stats().pages_reserved == {"full": 0, "sliding": 0}


def test_sliding_reservation_is_capped_at_a_window():
    sched = Scheduler(new_runner(page_size=4), max_batch=2)
    window = sched.runner.cfg.sliding_window  # 8 positions = 2 pages, +1 for the straddle
    need = sched.reserve("long", 100, 50)
    assert need == {"full": 38, "sliding": (window - 1) // 4 + 2}
    sched.release("long")


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_long_request_stays_within_its_sliding_budget(solo_runner, overlap):
    sched = Scheduler(new_runner(page_size=4), max_batch=2, overlap=overlap)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    sink: dict[str, list[TokenOutput]] = {}
    admit(sched, "long", prompt_of(23), params, sink)
    run_to_end(sched)  # checks usage <= reservation after every step
    assert [t.token_id for t in sink["long"]] == solo(solo_runner, prompt_of(23), params)


def test_abort_frees_at_the_next_step():
    sched = Scheduler(new_runner(), max_batch=4)
    sink: dict[str, list[TokenOutput]] = {}
    admit(sched, "a", prompt_of(9), GREEDY, sink)
    admit(sched, "b", prompt_of(4), GREEDY, sink)
    sched.step()
    assert sched.abort("a") is True
    sched.step()
    assert len(sink["a"]) == 2 and len(sink["b"]) == 3
    assert sched.running_ids() == ["b"]
    assert sched.abort("nope") is False
    run_to_end(sched)
    assert sched.stats().pages_in_use == {"full": 0, "sliding": 0}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_reaching_max_context_finishes_with_length(solo_runner, overlap):
    runner = new_runner()
    runner.cfg = runner.cfg.replace(max_context=12)  # the plan refuses positions past it
    runner.kv.cfg = runner.cfg
    sched = Scheduler(runner, max_batch=2, overlap=overlap)
    params = SamplingParams(max_tokens=50, temperature=0.0)
    sink: dict[str, list[TokenOutput]] = {}
    admit(sched, "a", prompt_of(8), params, sink)
    run_to_end(sched)
    assert len(sink["a"]) == 4 and sink["a"][-1].finish_reason == "length"  # 8 prompt + 4 = 12


def test_overlapped_release_waits_for_the_launched_step():
    """A request released while a launched step still computes it keeps its pages until that step has
    been read back; its token from that step is dropped; the others' streams equal a sync run's."""
    streams = {}
    for overlap in (False, True):
        sched = Scheduler(new_runner(), max_batch=4, overlap=overlap)
        sink: dict[str, list[TokenOutput]] = {}
        admit(sched, "a", prompt_of(9), GREEDY, sink)
        admit(sched, "b", prompt_of(4), GREEDY, sink)
        sched.step()
        sched.step()
        if overlap:
            assert len(sink["a"]) == 2  # step 1 read back, step 2 on the device
            held = sched.stats().pages_in_use
            sched.release("a")  # e.g. the client went away, between two steps
            assert sched.runner.has_sequence("a") and sched.stats().pages_in_use == held
            sched.step()  # launches step 3 without "a", reads back step 2 (a's token dropped), frees "a"
            assert not sched.runner.has_sequence("a") and not sched.has_reservation("a")
            assert len(sink["a"]) == 2 and sched.running_ids() == ["b"]
        else:
            sched.release("a")
            assert len(sink["a"]) == 3
        run_to_end(sched)
        assert sched.stats().pages_in_use == {"full": 0, "sliding": 0} and sched.stats().reserved == 0
        streams[overlap] = [t.token_id for t in sink["b"]]
    assert streams[True] == streams[False]


def test_overlap_falls_back_to_sync_steps_for_sampled_requests(solo_runner):
    sched = Scheduler(new_runner(), max_batch=4, overlap=True)
    sink: dict[str, list[TokenOutput]] = {}
    sampled = SamplingParams(max_tokens=5, temperature=0.8, seed=7)
    admit(sched, "s", prompt_of(6), sampled, sink)
    sched.step()
    assert len(sink["s"]) == 2 and sched.times.overlapped == 0  # emitted by its own step: not launched ahead
    run_to_end(sched)
    assert sched.stats().pages_in_use == {"full": 0, "sliding": 0}


def test_decode_launch_takes_tokens_from_the_step_before(solo_runner):
    """Runner.decode_launch with rows fed from the previous launch's device tokens equals decode + argmax."""
    runner = new_runner()
    prompts = {"x": prompt_of(7, 1), "y": prompt_of(3, 2)}
    ref = {sid: solo(solo_runner, p, GREEDY)[:4] for sid, p in prompts.items()}
    first = {}
    for sid, p in prompts.items():
        (first[sid], _), = runner.sample(runner.prefill(sid, p), [GREEDY], [0])
    step1 = runner.decode_launch(["x", "y"], [first["x"], first["y"]])
    step2 = runner.decode_launch(["y", "x"], [None, None], step1)  # rows in another order
    assert runner.decode_collect(step1) == [ref["x"][1], ref["y"][1]]
    assert runner.decode_collect(step2) == [ref["y"][2], ref["x"][2]]
    with pytest.raises(ValueError, match="not in the previous step"):
        runner.decode_launch(["x"], [None])


def test_release_during_a_pull_waits_for_its_end():
    sched = Scheduler(new_runner(num_pages=64), max_batch=4)
    sched.reserve("r", 10, 4)
    sched.runner.import_sequence("r", 10)
    sched.begin_pull("r")
    sched.release("r")  # what an abort or a closed stream does while the READ still runs
    assert sched.runner.has_sequence("r") and sched.has_reservation("r") and sched.is_pulling("r")
    with pytest.raises(ValueError, match="pull may still be running"):
        sched.join("r", GREEDY, 1, 1, lambda out: None)
    assert sched.end_pull("r") is True  # released now
    assert not sched.runner.has_sequence("r") and not sched.has_reservation("r")
    assert sched.stats().pages_in_use == {"full": 0, "sliding": 0}
    sched.reserve("s", 10, 4)  # an undisturbed pull ends without releasing anything
    sched.runner.import_sequence("s", 10)
    sched.begin_pull("s")
    assert sched.end_pull("s") is False and sched.runner.has_sequence("s")


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_min_tokens_runs_past_an_early_stop_token(solo_runner, overlap):
    """The token greedy decoding emits second is made a stop token: without min_tokens the request ends
    there; with min_tokens=6 it is masked for six tokens, then the stop applies again."""
    ref = solo(solo_runner, prompt_of(7), GREEDY)
    stop = ref[1]
    sched = Scheduler(new_runner(), max_batch=4, overlap=overlap)
    sink: dict[str, list[TokenOutput]] = {}
    plain = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,))
    held = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,), min_tokens=6)
    admit(sched, "plain", prompt_of(7), plain, sink)
    admit(sched, "held", prompt_of(7), held, sink)
    run_to_end(sched)
    assert [t.token_id for t in sink["plain"]] == ref[:2] and sink["plain"][-1].finish_reason == "stop"
    got = [t.token_id for t in sink["held"]]
    assert len(got) >= 6 and stop not in got[:6]
    assert sink["held"][-1].finish_reason in ("stop", "length")
    assert sched.stats().pages_in_use == {"full": 0, "sliding": 0}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_fork_group_counts_the_shared_prompt_pages_once(solo_runner, overlap):
    """Three choices of a 40-token prompt (10 whole pages of 4) growing to 48 tokens: 12 + 2 + 2 full
    pages reserved, where three separate requests would need 36 of the pool's 20. The holder of the
    shared pages' budget ends first; the budget moves to a choice still running, usage never exceeds the
    reservations, and each choice decodes as a solo run."""
    sched = Scheduler(new_runner(num_pages=20, page_size=4), max_batch=8, overlap=overlap)
    prompt = prompt_of(40, 3)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with pytest.raises(AdmissionRefused, match="7 x 48 tokens need 24 full KV pages but this decode worker's "
                                               "pool has only 20") as e:
        sched.reserve("x", 40, 8, tuple(f"x{i}" for i in range(6)))  # 12 + 6 x 2
    assert not e.value.retryable
    assert sched.stats().pages_reserved == {"full": 0, "sliding": 0}
    sched.reserve("p", 40, 8, ("c1", "c2"))
    assert sched.stats().pages_reserved["full"] == 16
    with pytest.raises(AdmissionRefused, match="out of KV pages"):
        sched.reserve("other", 20, 8)  # 7 full pages: 4 are left
    logits = sched.runner.prefill("p", prompt)
    (tok, _), = sched.runner.sample(logits, [params], [0])
    sink: dict[str, list[TokenOutput]] = {}
    for rid in ("p", "c1", "c2"):
        if rid != "p":
            sched.runner.fork_sequence("p", rid)
        sink[rid] = [TokenOutput(tok, None, None)]
        sched.join(rid, params, tok, 1, sink[rid].append)
    sched.step()
    sched.abort("p")  # the holder ends first
    run_to_end(sched)
    want = solo(solo_runner, prompt, params)
    assert [t.token_id for t in sink["c1"]] == [t.token_id for t in sink["c2"]] == want
    assert len(sink["p"]) <= 2  # aborted after one step (overlapped: its token may still be on the device)
    s = sched.stats()
    assert s.pages_reserved == {"full": 0, "sliding": 0} and s.pages_in_use == {"full": 0, "sliding": 0}


def test_fork_group_budget_follows_whichever_choice_is_left():
    sched = Scheduler(new_runner(num_pages=64, page_size=4), max_batch=4)
    sched.reserve("p", 40, 8, ("c1", "c2"))
    budget = lambda: {rid: b["full"] for rid, b in sched._budget.items()}  # noqa: E731
    assert budget() == {"p": 12, "c1": 2, "c2": 2}
    sched.release("p")
    assert budget() == {"c1": 12, "c2": 2}
    sched.release("c2")
    sched.release("c2")  # idempotent: nothing moves twice
    assert budget() == {"c1": 12}
    sched.release("c1")
    assert budget() == {} and sched._forks == {}
