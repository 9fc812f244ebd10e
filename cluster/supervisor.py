"""Supervision of the worker actors: a dead (or hung) worker is replaced in its own placement group.

The router process runs one `Supervisor` next to its engine client. It learns of a death two ways: the
engine client tells it at once when a call or a token channel fails with Ray's actor death, or when a
worker stopped answering its calls (`on_worker_dead`), and every `check_every_s` it asks each worker's
`health` (a worker that is dead, says it is unhealthy, misses `misses` answers in a row of
`health_timeout_s` each, or has answered none for `hung_after_s` (router.worker_timeout_s) is replaced
too: a hung worker, e.g. a stopped process, is killed first). So is a worker that answers but whose step
loop has had work and made no progress for `stalled_after_s` (router.worker_step_timeout_s: a step stuck
in a kernel or a collective; each worker reports it with `step_stall_s`). A
replacement is a new actor with the same name, options and topology in the dead one's placement group
(cluster/serve.py `Cluster.start_worker`): its constructor reloads the weights, sizes the pool, starts its
NIXL agent (and, at TP > 1, its follower ranks, which died with their owner). Once it answers `health`,
it is swapped into the engine client's pool (`replace_worker`), where requests waiting for a live pair
(router.resume_timeout_s) resume on it. A replacement that fails to start is retried with backoff.

Why not Ray's own `max_restarts`: Ray would restart the process silently behind the same handle, and
calls made meanwhile either queue without a bound or fail in ways the client cannot tell from a death;
here the client sees the death at once (and re-routes or waits, bounded), and the restart is visible.

State is published in Ray's internal KV (`STATE_KEY`), where `kvrelay status` (another process) reads
it: each worker's state (healthy / restarting / failed), its restart count, its last failure, and the
re-prefills the router counted against it, by cause. Restarts are also counted in /metrics
(kvrelay_worker_restarts{role}).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field

from prometheus_client import Counter

log = logging.getLogger("kvrelay.supervisor")

RESTARTS = Counter("kvrelay_worker_restarts", "Worker actors replaced after a death or failed health checks",
                   ["role"])


def state_key(namespace: str) -> str:
    """The internal-KV key of a cluster's supervision state (one per Ray namespace)."""
    return f"kvrelay-supervision:{namespace}"


@dataclass
class WorkerState:
    role: str  # prefill, decode or colocated
    rank: int
    state: str = "healthy"  # healthy, restarting, failed (a replacement did not start; retried)
    restarts: int = 0  # replacements that came up healthy
    last_error: str | None = None  # why it was last replaced, or why a replacement failed
    since: float = field(default_factory=time.time)  # when it entered `state`
    misses: int = 0  # health checks in a row without an answer


class Supervisor:
    def __init__(self, cluster, client, *, check_every_s: float = 2.0, health_timeout_s: float = 10.0,
                 misses: int = 3, startup_timeout_s: float = 600.0, max_backoff_s: float = 60.0,
                 hung_after_s: float = 30.0, stalled_after_s: float = 120.0):
        from kvrelay.cluster import placement

        self.cluster = cluster
        self.client = client
        self.check_every_s = check_every_s
        self.health_timeout_s = health_timeout_s
        self.misses = misses
        self.hung_after_s = hung_after_s
        self.stalled_after_s = stalled_after_s
        self.startup_timeout_s = startup_timeout_s
        self.max_backoff_s = max_backoff_s
        self._colocated = cluster.topology.colocate
        self._slots = {(s.role, s.rank): s for s in cluster.slots}
        self.states = {k: WorkerState(*k) for k in self._slots}
        if getattr(cluster, "attached", False):  # a restarted router: the workers' restart counts go on
            prev = (read_state(cluster.topology.ray.namespace) or {}).get("workers", {})
            for (role, rank), st in self.states.items():
                st.restarts = prev.get(f"{role}/{rank}", {}).get("restarts", 0)
        self._lock = threading.Lock()  # guards states and _restarting
        self._restarting: dict[tuple[str, int], threading.Thread] = {}
        self._starting: dict[tuple[str, int], object] = {}  # replacements still loading (killed on stop)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._suspects: set[tuple[str, int]] = set()
        self._answered = {k: time.monotonic() for k in self._slots}  # each worker's last health answer
        self._thread: threading.Thread | None = None
        self._published: str | None = None
        self._key = state_key(cluster.topology.ray.namespace)
        self._placement = placement
        client.on_worker_dead = self.notify

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="kvrelay-supervisor", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop checking; a replacement still loading is killed (the cluster is going down)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            threads = list(self._restarting.values())
            loading = list(self._starting.values())
        for actor in loading:  # its health call then fails at once and the restart thread ends
            _kill_quietly(actor)
        for t in threads:
            t.join(timeout_s)

    def notify(self, role: str, rank: int) -> None:
        """The engine client found worker (role, rank) dead: check it now (any thread)."""
        key = (self._placement.COLOCATED, rank) if self._colocated else (role, rank)
        with self._lock:
            self._suspects.add(key)
        self._wake.set()

    def snapshot(self) -> dict:
        """What `kvrelay status` shows: per worker (\"role/rank\") its state, restarts, last error and
        the re-prefills counted against it by cause."""
        reprefills: dict[tuple[str, int], dict[str, int]] = {}
        for (role, rank, cause), n in dict(self.client.reprefills).items():  # a copy: the loop counts on
            key = (self._placement.COLOCATED, rank) if self._colocated else (role, rank)
            per = reprefills.setdefault(key, {})
            per[cause] = per.get(cause, 0) + n
        with self._lock:
            workers = {f"{k[0]}/{k[1]}": {**{n: v for n, v in asdict(st).items() if n != "misses"},
                                           "reprefills": reprefills.get(k, {})}
                       for k, st in self.states.items()}
        return {"router_pid": os.getpid(), "workers": workers}

    # ---- the check loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._check()
                self._publish()
            except Exception as e:  # the supervisor must outlive a bad check (e.g. GCS hiccup)
                log.warning("supervision check failed: %r", e)
            self._wake.wait(self.check_every_s)
            self._wake.clear()

    def _actor(self, key: tuple[str, int]):
        role, rank = key
        return (self.cluster.decode if role in ("decode", self._placement.COLOCATED) else self.cluster.prefill)[rank]

    def _check(self) -> None:
        import ray

        with self._lock:
            suspects, self._suspects = self._suspects, set()
            keys = [k for k in self._slots if k not in self._restarting]
        refs = {k: self._actor(k).health.remote() for k in keys}
        if not refs:
            return
        stalls = {k: self._actor(k).step_stall_s.remote() for k in keys}
        ready, _ = ray.wait(list(refs.values()) + list(stalls.values()), num_returns=2 * len(refs),
                            timeout=min(self.health_timeout_s, self.hung_after_s))
        ready = set(ready)
        for key, ref in refs.items():
            reason = None
            if ref in ready:
                self._answered[key] = time.monotonic()
                try:
                    if not ray.get(ref):
                        reason = "its health check answered unhealthy"
                    elif stalls[key] in ready and (stalled := ray.get(stalls[key])) >= self.stalled_after_s:
                        reason = (f"hung: its step loop has had work and made no progress for {stalled:.0f} s "
                                  f"(router.worker_step_timeout_s {self.stalled_after_s:g})")
                except ray.exceptions.RayActorError as e:
                    reason = f"died ({type(e).__name__})"
                except Exception as e:
                    reason = f"health check failed: {e!r}"
            else:
                st = self.states[key]
                st.misses += 1
                silent = time.monotonic() - self._answered[key]
                if st.misses >= self.misses:
                    reason = f"no health answer in {st.misses} checks of {self.health_timeout_s:g} s"
                elif silent >= self.hung_after_s:
                    reason = (f"hung: no health answer for {silent:.0f} s "
                              f"(router.worker_timeout_s {self.hung_after_s:g})")
                elif key in suspects:  # the client gave up on it: do not wait for more misses
                    reason = "the engine client found it unresponsive"
            if reason is None:
                if ref in ready:
                    self.states[key].misses = 0
                continue
            self._begin_restart(key, reason)

    # ---- replacement -------------------------------------------------------------------------
    def _begin_restart(self, key: tuple[str, int], reason: str) -> None:
        with self._lock:
            if key in self._restarting or self._stop.is_set():
                return
            st = self.states[key]
            st.state, st.last_error, st.since, st.misses = "restarting", reason, time.time(), 0
            t = threading.Thread(target=self._restart, args=(key,), name=f"kvrelay-restart-{key[0]}-{key[1]}",
                                 daemon=True)
            self._restarting[key] = t
        log.warning("%s worker %d %s; starting a replacement in its placement group", key[0], key[1], reason)
        self._mark_dead(key)
        self._publish()
        t.start()

    def _mark_dead(self, key: tuple[str, int]) -> None:
        """No request is routed to it meanwhile (the client may not have seen the death itself)."""
        role, rank = key
        for r in ("prefill", "decode") if role == self._placement.COLOCATED else (role,):
            pool = self.client.prefill if r == "prefill" else self.client.decode
            pool[rank].dead = True

    def _restart(self, key: tuple[str, int]) -> None:
        import ray

        slot = self._slots[key]
        name = self._placement.actor_name(*key)
        namespace = self.cluster.topology.ray.namespace
        backoff = 2.0
        try:
            try:
                ray.kill(self._actor(key), no_restart=True)  # a hung one too; a dead one: no-op
            except Exception as e:
                log.info("killing %s: %r", name, e)
            while not self._stop.is_set():
                new = None
                try:
                    _wait_name_free(name, namespace, timeout_s=60.0)
                    t0 = time.monotonic()
                    new = self.cluster.start_worker(slot)
                    with self._lock:
                        self._starting[key] = new
                    if self._stop.is_set():
                        raise RuntimeError("the supervisor is stopping")
                    if not ray.get(new.health.remote(), timeout=self.startup_timeout_s):
                        raise RuntimeError("the replacement answered unhealthy")
                except Exception as e:
                    with self._lock:
                        st = self.states[key]
                        st.state, st.last_error, st.since = "failed", f"replacement failed: {e}", time.time()
                    log.warning("replacement of %s failed (%r); retrying in %g s", name, e, backoff)
                    self._publish()
                    if new is not None:
                        _kill_quietly(new)
                    self._stop.wait(backoff)
                    backoff = min(self.max_backoff_s, backoff * 2)
                    continue
                if self._stop.is_set():
                    _kill_quietly(new)
                    return
                self.cluster.set_worker(slot, new)
                self.client.replace_worker(key[0], key[1], new)
                with self._lock:
                    st = self.states[key]
                    st.state, st.since, st.restarts, st.misses = "healthy", time.time(), st.restarts + 1, 0
                    self._answered[key] = time.monotonic()
                RESTARTS.labels(key[0]).inc()
                log.warning("%s is back: a replacement started in %.1f s (restart %d)", name,
                            time.monotonic() - t0, st.restarts)
                self._publish()
                return
        finally:
            with self._lock:
                self._restarting.pop(key, None)
                self._starting.pop(key, None)

    # ---- publishing --------------------------------------------------------------------------
    def _publish(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_initialized, _internal_kv_put

        text = json.dumps(self.snapshot(), sort_keys=True)
        if text == self._published or not _internal_kv_initialized():
            return
        try:
            _internal_kv_put(self._key, text, overwrite=True)
            self._published = text
        except Exception as e:  # status then shows the last state it saw
            log.info("publishing supervision state failed: %r", e)


def read_state(namespace: str) -> dict | None:
    """The supervision state a running router published (None without one); needs Ray initialised."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    if not _internal_kv_initialized():
        return None
    raw = _internal_kv_get(state_key(namespace))
    return json.loads(raw) if raw else None


def _wait_name_free(name: str, namespace: str, timeout_s: float) -> None:
    """Ray frees a dead actor's name once the GCS has processed the death (a moment after ray.kill)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the name {name} is still held by the dead actor after {timeout_s:g} s")
        time.sleep(0.1)


def _kill_quietly(actor) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:
        pass
