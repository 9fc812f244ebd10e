"""The prefix cache's host tier in /metrics (prefill.prefix_cache_host_gib): tokens its hits supplied,
and bytes moved each way. The hits come with each request's PrefillResult, as the device tier's
(kvrelay_prefix_cache_hits_total) do; the bytes are the worker's running totals, which every
PrefillResult carries, so the counters need no call of their own to the workers (a prefill worker's
status waits for its forward in progress). Bytes an eviction moved after a worker's last prefill show
at its next one; a replaced worker starts again from zero, which counts as a fresh start here.
"""

from __future__ import annotations

from prometheus_client import Counter

# vLLM counts the hits of its KV-connector tier (e.g. CPU offloading) apart, in tokens:
# vllm:external_prefix_cache_hits; here they are a part of kvrelay_prefix_cache_hits_total too.
HOST_HITS = Counter("kvrelay_prefix_cache_host_hits",
                    "Prompt tokens of prefix-cache hits that only the host tier held (copied back, not computed)")
HOST_BYTES = Counter("kvrelay_prefix_cache_host_bytes", "KV bytes moved between device pages and the prefix "
                     "cache's host tier", ["direction"])

_seen: dict[object, tuple[int, int]] = {}  # worker -> its totals as last counted


def observe(worker: object, cached_host_tokens: int, host_bytes: tuple[int, int]) -> None:
    """Count one PrefillResult of `worker` (any hashable name of it)."""
    if cached_host_tokens:
        HOST_HITS.inc(cached_host_tokens)
    if host_bytes == (0, 0) and worker not in _seen:
        return
    last = _seen.get(worker, (0, 0))
    if any(now < before for now, before in zip(host_bytes, last)):
        last = (0, 0)  # a new process under the same name
    for direction, now, before in zip(("device_to_host", "host_to_device"), host_bytes, last):
        if now > before:
            HOST_BYTES.labels(direction).inc(now - before)
    _seen[worker] = tuple(host_bytes)
