"""Everything that crosses an actor boundary between the engine client (cluster/engine_client.py) and the
workers, or between a worker's ranks, besides the KV handoff's own messages (transfer/handle.py) and the
engine's token (`engine.sampling.TokenOutput`): what a prefill returns, what a decode stream yields,
why admission refused, and the one status row every rank of every role answers `kvrelay status` with.

Plain frozen dataclasses (and one exception), picklable by Ray; none holds a live object.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.engine.sampling_params import TokenOutput
from kvrelay.transfer.handle import KVHandle


@dataclass(frozen=True)
class InPlaceKV:
    """The handoff between the two roles of one colocated worker: the prompt's pages are already in the
    pool the decode steps read, so nothing moves; decode adopts the sequence by id."""

    request_id: str
    lease_id: int
    num_tokens: int
    nbytes: int = 0  # nothing is copied


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill (worker or colocated role) returns to the router's client."""

    request_id: str
    first: TokenOutput  # the sampled token; finish_reason set if the request ends with it
    handle: KVHandle | InPlaceKV | None  # None when the request already finished (nothing to decode)
    prompt_tokens: int
    queue_s: float  # waiting for the worker (other prompts ahead)
    prefill_s: float  # forward(s) + sampling + pinning
    cached_tokens: int = 0  # prompt positions reused from the prefix cache (not computed)
    cache_queried: int = 0  # prompt positions looked up in the prefix cache (0: no cache, or no lookup)
    # The first tokens of choices 1..n-1 of an n > 1 request (workers/forks.py), sampled from the same
    # forward; `handle` is set while any choice (this one or a fork) goes on decoding.
    forks: tuple[TokenOutput, ...] = ()
    cached_host_tokens: int = 0  # of cached_tokens, those only the host tier held (copied back, not computed)
    # The worker's host tier so far (cumulative, since the worker started): bytes moved device -> host
    # (evictions) and host -> device (hits). /metrics counts the increase (cluster/cache_metrics.py).
    host_bytes: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class PullMetrics:
    kv_bytes: int
    kv_transfer_s: float  # the NIXL READ
    admit_s: float  # from the call's arrival to joining the batch (allocation + pull + release)


@dataclass(frozen=True)
class DecodeChunk:
    """One piece of a request's own decode stream (`DecodeWorker.generate`)."""

    tokens: tuple[TokenOutput, ...]
    pull: PullMetrics | None = None  # on the first chunk only


class AdmissionRefused(RuntimeError):
    """The decode worker cannot take the request. `retryable`: it may fit later (pages or batch slots
    are busy) as opposed to never (it is bigger than the whole pool)."""

    def __init__(self, reason: str, retryable: bool):
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable

    def __reduce__(self):  # keep both fields when Ray ships the exception to the caller
        return AdmissionRefused, (self.reason, self.retryable)


@dataclass(frozen=True)
class WorkerStatus:
    """`kvrelay status` row of one rank of one worker, whatever its role. The fields after `tp_size`
    belong to one role's leader (rank 0) and keep their zero value elsewhere."""

    role: str  # "prefill" | "decode" | "colocated"
    rank: int  # the worker's index in its pool
    tp_rank: int
    tp_size: int
    pid: int
    node: str  # host name / Ray node id prefix
    healthy: bool
    pages_in_use: dict[str, int]  # allocated in the pool now
    pages_total: dict[str, int]
    agent: str  # this rank's NIXL agent ("-" when it has none: colocated)
    completed: int = 0  # requests finished here
    # prefill leader
    queued_tokens: int = 0  # prompt tokens waiting or running
    leases: int = 0  # pinned sequences awaiting a pull
    expired_leases: int = 0
    # decode / colocated leader
    pages_reserved: dict[str, int] | None = None  # committed to admitted requests (their worst case)
    free_budget: int = 0  # pages a new request could still reserve
    admitted: int = 0
    running: int = 0
    steps: int = 0
    last_step_error: str | None = None
    decode_tokens: int = 0  # computed by decode steps
    prompt_tokens: int = 0  # prompt tokens computed here (0 unless colocated: pulled KV is not recomputed)
    # Step loop seconds per phase, summed: launch (host planning), wait (blocked on the device), emit
    # (token bookkeeping), ops (admission and other queued calls between steps), plus step counts.
    step_phases: dict[str, float] | None = None
    # prefill / colocated leader with prefill.prefix_cache: engine.prefix_cache.PrefixCache.summary()
    prefix_cache: dict | None = None
