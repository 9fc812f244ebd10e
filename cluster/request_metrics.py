"""What the disaggregated engine client measures per request: its Prometheus series (vLLM's names where vLLM
has one), a request's running totals across its attempts (`_Acc`), and the `RequestMetrics` its final
token carries (`ClusterTokenOutput`) and the log line that reports them."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field

from prometheus_client import Counter, Histogram

from kvrelay.engine.sampling_params import TokenOutput
from kvrelay.workers.logs import request_extra

log = logging.getLogger("kvrelay.requests")

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# vLLM's request_queue_time_seconds and request_prefill_time_seconds; time to first token and inter-token
# latency are the router's (router/metrics.py), measured for every engine client alike.
QUEUE_S = Histogram("kvrelay_request_queue_time_seconds", "Admission wait + prefill queue per request",
                    buckets=_BUCKETS)
PREFILL_S = Histogram("kvrelay_request_prefill_time_seconds", "Prefill forward + first token per request",
                      buckets=_BUCKETS)
KV_TRANSFER_S = Histogram("kvrelay_kv_transfer_seconds", "NIXL READ of a request's KV", buckets=_BUCKETS)
KV_BYTES = Counter("kvrelay_kv_transfer_bytes", "KV bytes moved prefill -> decode")
REQUESTS = Counter("kvrelay_requests", "Finished requests", ["outcome"])
# vLLM's prefix_cache_queries / prefix_cache_hits, both in tokens: hits / queries is the hit rate.
PREFIX_QUERIES = Counter("kvrelay_prefix_cache_queries", "Prompt tokens looked up in a prefill worker's prefix cache")
PREFIX_HITS = Counter("kvrelay_prefix_cache_hits", "Prompt tokens a prefix cache supplied instead of a prefill")
# One per prefill run (a request's first attempt, each re-prefill): a request with n choices counts one.
PREFILLS = Counter("kvrelay_prefills", "Prompt prefills run (n choices of one prompt share one)")
RETRIES = Counter("kvrelay_request_retries", "Requests re-prefilled on another worker pair, by cause", ["cause"])


@dataclass(frozen=True)
class RequestMetrics:
    request_id: str
    prompt_tokens: int
    output_tokens: int
    queue_s: float  # waiting for decode admission and for the prefill worker
    prefill_s: float
    kv_bytes: int
    kv_transfer_s: float
    ttft_s: float  # from the request reaching the engine client to its first token here
    tpot_s: float  # mean gap between output tokens after the first
    decode_tokens_per_s: float
    retries: int
    prefill_worker: int
    decode_worker: int
    cached_tokens: int = 0  # prompt tokens the prefill worker's prefix cache supplied (first attempt)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def timings(self) -> dict[str, float | int]:
        """The TTFT breakdown clients see (HTTP `kvrelay_timings`): queue + prefill compute + delivery =
        TTFT; the KV handoff happens after the first token and delays only the second."""
        return {"queue_s": self.queue_s, "prefill_compute_s": self.prefill_s, "kv_handoff_s": self.kv_transfer_s,
                "kv_bytes": self.kv_bytes, "ttft_s": self.ttft_s,
                "delivery_s": max(0.0, self.ttft_s - self.queue_s - self.prefill_s), "tpot_s": self.tpot_s}


@dataclass(frozen=True)
class ClusterTokenOutput(TokenOutput):
    """A TokenOutput; the final one of a stream also carries the request's metrics."""

    metrics: RequestMetrics | None = None


@dataclass
class _Acc:
    """Running totals for one request across attempts."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_bytes: int = 0
    kv_transfer_s: float = 0.0
    retries: int = 0
    prefill_worker: int = -1
    decode_worker: int = -1
    cached_tokens: int = 0
    times: list[float] = field(default_factory=list)  # perf_counter of each streamed token


def request_metrics(request_id: str, prompt_tokens: int, t0: float, acc: _Acc) -> RequestMetrics:
    """The finished request's metrics (`t0`: when it reached the client), observed and logged."""
    n = len(acc.times)
    ttft = acc.times[0] - t0
    span = acc.times[-1] - acc.times[0]
    tpot = span / (n - 1) if n > 1 else 0.0
    m = RequestMetrics(
        request_id=request_id, prompt_tokens=prompt_tokens, output_tokens=n, queue_s=acc.queue_s,
        prefill_s=acc.prefill_s, kv_bytes=acc.kv_bytes, kv_transfer_s=acc.kv_transfer_s, ttft_s=ttft,
        tpot_s=tpot, decode_tokens_per_s=(n - 1) / span if span > 0 else 0.0, retries=acc.retries,
        prefill_worker=acc.prefill_worker, decode_worker=acc.decode_worker, cached_tokens=acc.cached_tokens)
    QUEUE_S.observe(m.queue_s)
    log.info("request %s metrics %s", request_id, m.to_json(), extra=request_extra(request_id))
    return m
