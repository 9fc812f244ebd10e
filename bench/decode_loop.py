"""The two ways bench.decode times greedy decode steps, and which of them a result's headline figures are.

- sync: `Runner.decode` then `Runner.sample`, the tokens brought back to the host (`.tolist()`) before the
  next step is planned: the host work of every step (planning, page tables, graph input copies) adds to
  its GPU time. This is how the scheduler runs sampled (non-greedy) rows.
- pipelined: what the decode worker runs for greedy rows (decode_worker/scheduler.py `_step_overlapped`):
  `Runner.decode_launch` of step N+1 takes each row's last token from step N still on the device
  (last token None, prev = step N), and step N is read back (`Runner.decode_collect`) only after N+1 is
  launched, so the host work of N+1 overlaps the GPU work of N. A step's time is the interval between two
  consecutive read-backs in the chain; their sum is the wall time over the chained steps, so the mean of
  the intervals is wall time / steps.

Old results hold only the sync figures; `headline` picks the pipelined one when a point has it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

MODES = ("pipelined", "sync")
SYNC_NOTE = "sync: Runner.decode + Runner.sample (greedy), tokens read back to the host before the next step"
PIPELINED_NOTE = ("pipelined (the decode worker's greedy path): Runner.decode_launch of step N+1 chained on "
                  "step N's tokens on the device, step N read back (decode_collect) after N+1 is launched")


@dataclass(frozen=True)
class Timed:
    """One mode's run of a point: per-step seconds of the timed (post-warmup) steps and every step's
    greedy tokens (row order), the warmup's included."""

    step_s: list[float]
    tokens: list[list[int]]
    forward_s: list[float] | None = None  # sync only: decode until its logits are ready


def extra_positions(mode: str) -> int:
    """Positions a run appends beyond warmup + iters steps: the pipelined chain launches one step more
    than it times (the last read-back has no launch to overlap, so it is not timed) plus the first,
    whose interval has no read-back before it."""
    return 2 if mode in ("pipelined", "both") else 0


def run_sync(runner, sids: list, tokens: list[int], *, warmup: int, iters: int, greedy, sw, budget) -> Timed:
    """warmup + iters synchronous steps; `sw` is bench.common.StopWatch (CUDA events on a GPU)."""
    step_t, fwd_t, out = [], [], []
    b = len(sids)
    for i in range(warmup + iters):
        a = sw.mark()
        logits = runner.decode(sids, tokens)
        m = sw.mark()
        tokens = [t for t, _ in runner.sample(logits, greedy, [i + 1] * b)]
        z = sw.mark()
        out.append(tokens)
        if i >= warmup:
            step_t.append(sw.elapsed(a, z))
            fwd_t.append(sw.elapsed(a, m))
            if budget.left() < 0:
                break  # over budget: keep the steps timed so far (at least one)
    return Timed(step_t, out, fwd_t)


def run_pipelined(runner, sids: list, tokens: list[int], *, warmup: int, iters: int, budget) -> Timed:
    """warmup + iters + 2 chained greedy steps, as the decode worker runs them; times the read-back
    intervals 1 .. warmup + iters (interval k: launch step k+1, then wait for step k) past the warmup.
    The host clock after `decode_collect` (which waits for the step's event) is the device's progress."""
    none = [None] * len(sids)
    pending = runner.decode_launch(sids, tokens)  # step 0: the host's tokens, as for a newly admitted row
    out, step_t = [], []
    last = None  # when the previous read-back returned
    k = 0
    while True:
        nxt = runner.decode_launch(sids, none, pending)  # step k+1, fed from step k on the device
        out.append(runner.decode_collect(pending))  # step k (waits for it)
        now = time.perf_counter()
        if last is not None and k > warmup:
            step_t.append(now - last)
        last, pending, k = now, nxt, k + 1
        if k > warmup + iters or (step_t and budget.left() < 0):
            break
    out.append(runner.decode_collect(pending))  # the drain: no launch overlaps it, not timed
    return Timed(step_t, out)


def headline(p: dict) -> dict:
    """The figures a decode point is reported by: the pipelined step (how the worker serves greedy rows)
    when the point has it, the sync step otherwise (results from before both were measured)."""
    if p.get("pipelined_step_median_s") is not None:
        return {"timing": "pipelined", "step_s": p["pipelined_step_median_s"],
                "tokens_per_s_per_user": p["pipelined_tokens_per_s_per_user"],
                "tokens_per_s_aggregate": p["pipelined_tokens_per_s_aggregate"],
                "usd_per_m_output": p["pipelined_usd_per_m_output"]}
    return {"timing": "sync", "step_s": p["step_median_s"], "tokens_per_s_per_user": p["tokens_per_s_per_user"],
            "tokens_per_s_aggregate": p["tokens_per_s_aggregate"], "usd_per_m_output": p["usd_per_m_output"]}
