"""`kvrelay serve CONFIG`: Ray, the worker actors, and the router in front of them.

`Cluster` is the reusable part (the e2e tests start one per module); `run` adds the router, signal
handling and a clean drain: on Ctrl-C/SIGTERM new requests are refused, in-flight streams get
`--drain-timeout` seconds to finish, then the router, the actors and Ray (if we started it) go down.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvrelay.serve")
READY = "kvrelay-ready "  # the line serve prints once it serves: READY + a JSON object (ready_info)


def ready_info(line: str) -> dict | None:
    """The JSON object of a `kvrelay-ready {...}` line, wherever on the line the marker starts; None for any
    other line. Only the object is read: whatever another process appended to the line is not (the router's
    stdout and its workers' forwarded logs may share one pipe; seen once in CI, 2026-12-05)."""
    at = line.find(READY)
    if at < 0:
        return None
    return json.JSONDecoder().raw_decode(line, at + len(READY))[0]


def _say(text: str) -> None:
    """`text` and its newline to stdout in one write: print() writes the newline separately, and a worker's
    log line forwarded to the same pipe in between ran into the ready line (the e2e tests parse it)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@dataclass
class Cluster:
    topology: Any
    prefill: list = field(default_factory=list)  # rank-0 actor handles, by worker index
    decode: list = field(default_factory=list)
    slots: list = field(default_factory=list)
    started_ray: bool = False
    ray_gone: bool = False  # the Ray cluster went away while serving: nothing left to shut down
    # On a joined Ray cluster the workers outlive this process (a restarted router re-attaches to them,
    # cluster/reattach.py); a private Ray ends with us anyway.
    detached: bool = False
    attached: bool = False  # the workers were left by an earlier router, not started by this one

    @classmethod
    def start(cls, topology, *, address: str | None = None, startup_timeout_s: float = 300.0) -> "Cluster":
        from kvrelay.cluster import placement, signals

        placement.prepare_ray_env(topology, address)  # before the first `import ray`
        import ray

        placement.check_supported(topology)
        cluster = cls(topology)
        cluster.started_ray = placement.init_ray(topology, address=address)
        cluster.detached = not cluster.started_ray
        try:
            signals.check()  # each step: `kvrelay serve` interrupted (cluster/signals.py), else nothing
            if cluster.detached:
                from kvrelay.cluster import reattach

                if reattach.attach(cluster, timeout_s=min(60.0, startup_timeout_s)):
                    cluster.attached = True
                    return cluster
            cluster.slots = placement.place(topology, timeout_s=startup_timeout_s, detached=cluster.detached)
            signals.check()
            for slot in cluster.slots:
                actor = cluster.start_worker(slot)
                if slot.role == placement.COLOCATED:  # one actor, both roles
                    cluster.prefill.append(actor)
                    cluster.decode.append(actor)
                else:
                    getattr(cluster, slot.role).append(actor)
            # The first call on each actor waits for its constructor (model load, pool sizing, graph
            # capture, NIXL agent; a TP worker's rank 0 returns only once its other ranks are ready).
            ray.get([a.health.remote() for a in cluster.actors()], timeout=startup_timeout_s)
            signals.check()
            if cluster.detached:
                reattach.record(topology)
        except BaseException:
            # Interrupted: the workers still loading would make a graceful stop wait for their constructors.
            cluster.shutdown(graceful=signals.received() is None)
            raise
        return cluster

    def start_worker(self, slot):
        """A new worker actor for `slot` (its placement group, name and options): at start-up, and for
        the supervisor's replacement of a dead one. Returns at once; its first call waits for the
        constructor (weights, pool, NIXL agent)."""
        import ray

        from kvrelay.cluster import placement
        from kvrelay.cluster.specs import worker_spec
        from kvrelay.decode_worker.colocated import ColocatedWorker
        from kvrelay.decode_worker.worker import DecodeWorker
        from kvrelay.prefill_worker.worker import PrefillWorker

        cls = {"prefill": PrefillWorker, "decode": DecodeWorker, placement.COLOCATED: ColocatedWorker}[slot.role]
        return ray.remote(cls).options(**placement.actor_options(self.topology, slot, detached=self.detached)).remote(
            worker_spec(self.topology, slot.role), slot.rank)

    def set_worker(self, slot, actor) -> None:
        """Record `actor` as the worker of `slot` (a replacement)."""
        from kvrelay.cluster import placement

        if slot.role in ("prefill", placement.COLOCATED):
            self.prefill[slot.rank] = actor
        if slot.role in ("decode", placement.COLOCATED):
            self.decode[slot.rank] = actor

    def supervise(self, client, **kwargs):
        """Start a Supervisor (cluster/supervisor.py) that replaces dead workers of this cluster and swaps
        them into `client`'s pool; returns it (stop it before `shutdown`)."""
        from kvrelay.cluster.supervisor import Supervisor

        router = self.topology.router
        sup = Supervisor(self, client, **{"hung_after_s": router.worker_timeout_s,
                                          "stalled_after_s": router.worker_step_timeout_s, **kwargs})
        sup.start()
        return sup

    def actors(self) -> list:
        """Every worker actor once (a colocated one is in both role lists)."""
        out = []
        for a in self.prefill + self.decode:
            if not any(a is b for b in out):
                out.append(a)
        return out

    def engine_client(self, **kwargs):
        from kvrelay.cluster.engine_client import DisaggregatedEngineClient
        from kvrelay.engine.config import load_model_config

        cfg = load_model_config(self.topology.model.name)
        return DisaggregatedEngineClient(
            self.prefill, self.decode, model_name=cfg.name,
            max_context=min(self.topology.model.max_context, cfg.max_context),
            vocab_size=cfg.vocab_size, colocated=self.topology.colocate, policy=self.topology.router.policy,
            max_waiting=self.topology.router.max_waiting_requests, page_size=self.topology.decode.page_size,
            **{"resume_timeout_s": self.topology.router.resume_timeout_s,
               "worker_timeout_s": self.topology.router.worker_timeout_s,
               "worker_step_timeout_s": self.topology.router.worker_step_timeout_s, **kwargs})

    def statuses(self, timeout_s: float = 10.0) -> list[dict]:
        from kvrelay.cluster.status import collect

        return collect(self.topology, timeout_s=timeout_s)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (each its own `shutdown` first when `graceful`), their placement groups, and
        Ray if we started it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized() or self.ray_gone:
            return
        actors = self.actors()
        try:
            if graceful:
                ray.get([a.shutdown.remote() for a in actors], timeout=10)
        except Exception as e:  # dead or hung workers are killed below anyway
            log.info("worker shutdown: %r", e)
        for a in actors:
            ray.kill(a, no_restart=True)
        for slot in self.slots:
            remove_placement_group(slot.placement_group)
        self.prefill, self.decode, self.slots = [], [], []
        if self.started_ray:
            ray.shutdown()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None, metavar="CONFIG_OR_MODEL",
                        help="topology YAML or shipped config name (default: cpu-tiny.yaml); or, as `vllm serve "
                             "MODEL`, a checkpoint directory or preset name, served with the shipped one-machine "
                             "topology for --device")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="with a MODEL: where it runs (default: cuda when a GPU is visible, else cpu)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="with a MODEL: model.max_context, prompt + generated tokens per request")
    parser.add_argument("--grpc-port", type=int, default=None, help="override router.grpc_port (0 = any)")
    parser.add_argument("--http-port", type=int, default=None, help="override router.http_port (0 = any)")
    parser.add_argument("--address", default=None, help="join this Ray cluster (overrides ray.address)")
    parser.add_argument("--dummy", action="store_true",
                        help="random full-size weights of the model's shape (model.dummy: true): benchmarks")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish on shutdown")
    parser.add_argument("--log-requests", action="store_true",
                        help="log each request: its metrics on the router, its prefill and finish on the workers")
    parser.add_argument("--log-format", choices=("text", "json"), default=None,
                        help="router and worker log lines as text or one JSON object per line, with the request "
                             "id the response carries (overrides log_format; default: text)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model's name(s) in the API: the first is the id responses carry, requests may "
                             "use any (default: the model's own name). Given before CONFIG_OR_MODEL, a last "
                             "NAME that is a .yaml or an existing path is taken as CONFIG_OR_MODEL (or end the "
                             "names with --)")
    parser.add_argument("--ssl-certfile", default=None, metavar="PEM",
                        help="serve HTTPS and gRPC over TLS with this certificate (with --ssl-keyfile; overrides "
                             "router.tls_cert_file)")
    parser.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key")
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1 routes and gRPC calls (repeatable; "
                             "router.api_keys_env names an environment variable with more)")


def config_after_names(args: argparse.Namespace) -> str | None:
    """`kvrelay serve --served-model-name foo CONFIG`: argparse gives the flag (nargs="+", as vLLM's) every
    word up to the next option, CONFIG included, and no CONFIG_OR_MODEL. With none given, a last name that
    is a YAML file name or an existing path (a topology, a checkpoint directory) is the positional: a
    served name is neither. Fixes `args` in place; returns an error when nothing would be left as a name."""
    names = args.served_model_name
    if args.config is not None or not names:
        return None
    last = names[-1]
    if not (last.endswith((".yaml", ".yml")) or os.path.exists(last)):
        return None
    if len(names) == 1:
        return (f"--served-model-name {last}: a topology or checkpoint, not a name; give the names after it "
                f"(kvrelay serve {last} --served-model-name NAME) or end them with --")
    args.config = names.pop()
    return None


def run(args: argparse.Namespace) -> int:
    error = config_after_names(args)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    from kvrelay.cluster import signals

    signals.guard()  # until the router serves, SIGTERM/SIGINT end start-up (cluster/signals.py)
    try:
        return _run(args)
    except BaseException:
        signum = signals.received()
        if signum is None:
            raise
        signals.quiet()
        _stop_ray()
        # One line, whatever the signal became on its way out (Ray re-raises it as its own exceptions).
        print(f"kvrelay: {signal.Signals(signum).name} during start-up; stopped", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Not a normal exit: Ray's core worker, interrupted inside one of its blocking calls, crashed in
        # the interpreter's teardown (SIGSEGV after the line above, seen at every start-up step after
        # ray.init). Everything it started is stopped by now.
        os._exit(128 + signum)


def _stop_ray() -> None:
    """After an interrupted start-up: disconnect, and stop the private Ray's processes if ray.init got as
    far as starting them (ray.shutdown stops a node it started even when the connection never came up).
    A node interrupted half-way through its own start is left to Ray's fate-sharing: its processes die
    with this one."""
    if "ray" not in sys.modules:
        return
    import ray

    try:
        ray.shutdown()
    except Exception as e:  # the exit status and line above are what matter now
        log.info("ray.shutdown after an interrupted start: %r", e)


def _run(args: argparse.Namespace) -> int:
    import dataclasses

    from kvrelay.cluster.serve_model import is_model_ref, topology_for_model
    from kvrelay.cluster.topology import TopologyError, load_topology

    try:
        if args.config is not None and is_model_ref(args.config):
            from kvrelay.cluster.preflight import gpu_memory

            device = args.device or _default_device()
            gpus = gpu_memory() if device == "cuda" else None
            topo = topology_for_model(args.config, device=device, max_context=args.max_model_len,
                                      gpu_memory_bytes=min(gpus) if gpus else None)
        else:
            if args.device or args.max_model_len:
                raise TopologyError(f"{args.config or 'cpu-tiny.yaml'}: --device and --max-model-len go with a "
                                    "MODEL (a checkpoint directory or preset); a topology YAML sets device and "
                                    "model.max_context itself")
            topo = load_topology(args.config)
    except TopologyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    router = dataclasses.replace(
        topo.router,
        grpc_port=topo.router.grpc_port if args.grpc_port is None else args.grpc_port,
        http_port=topo.router.http_port if args.http_port is None else args.http_port)
    if args.ssl_certfile or args.ssl_keyfile:
        if not (args.ssl_certfile and args.ssl_keyfile):
            print("error: --ssl-certfile and --ssl-keyfile go together", file=sys.stderr)
            return 1
        for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
            if not os.path.isfile(path):
                print(f"error: {flag}: {path!r} is not a file", file=sys.stderr)
                return 1
        router = dataclasses.replace(router, tls_cert_file=os.path.abspath(args.ssl_certfile),
                                     tls_key_file=os.path.abspath(args.ssl_keyfile))
    topo = dataclasses.replace(topo, router=router, log_format=args.log_format or topo.log_format)
    from kvrelay.workers import logs

    logs.configure_router(topo.log_format, log_requests=args.log_requests)  # before Ray: workers follow it
    if args.dummy:
        topo = dataclasses.replace(topo, model=dataclasses.replace(topo.model, dummy=True))
    from kvrelay.router.auth import ApiKeyError, resolve_api_keys

    try:
        api_keys = resolve_api_keys(args.api_key, topo.router.api_keys_env, source=str(topo.source))
    except ApiKeyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from kvrelay.cluster.preflight import PreflightError, run_checks

    try:  # weights, ports, memory: found now, not after Ray and every worker started (cluster/preflight.py)
        run_checks(topo)
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    print(f"kvrelay: starting {topo.prefill.workers} prefill (TP{topo.prefill.tp}) + {topo.decode.workers} "
          f"decode (EP{topo.decode.ep} TP{topo.decode.tp}) worker(s) for {topo.model.name} on {topo.device}",
          flush=True)
    from kvrelay.cluster import placement
    from kvrelay.engine.partition import ParallelConfigError

    try:
        cluster = Cluster.start(topo, address=args.address)
    except (NotImplementedError, ParallelConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except placement.NotEnoughResources as e:
        print(f"error: {topo.source}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a worker's constructor failed: say why in one line when it is ours to say
        reason = _startup_reason(e)
        if reason is None:
            return _fatal(topo, e)
        print(f"error: {topo.source}: {reason}", file=sys.stderr)
        return 2
    from kvrelay.cluster import signals

    try:
        return asyncio.run(_serve(cluster, args.drain_timeout, t0, api_keys, args.served_model_name))
    except Exception as e:  # e.g. the router could not bind: after its traceback, one line to read
        return _fatal(topo, e)
    finally:
        interrupted = signals.received() is not None  # before ready: run() says so, in one line
        cluster.shutdown(graceful=not interrupted)
        if not interrupted:
            print("kvrelay: stopped", flush=True)


def _default_device() -> str:
    """cuda when the NVIDIA driver shows a device (checked without importing torch), else cpu."""
    import glob

    return "cuda" if glob.glob("/dev/nvidia[0-9]*") else "cpu"


def _fatal(topo, e: BaseException) -> int:
    """An unexpected failure: its traceback (for a bug report), then one `error:` line with the innermost
    cause (a worker's own exception, not Ray's wrapper around it), the line an operator reads. Exit 2."""
    import traceback

    traceback.print_exception(e, file=sys.stderr)
    causes = re.findall(r"^(\w[\w.]*(?:Error|Exception|Exit|Interrupt|NotFit)\b.*)$", str(e), re.M)
    cause = causes[-1].strip() if causes else f"{type(e).__name__}: {' '.join(str(e).split())}"
    print(f"error: {topo.source}: {cause}", file=sys.stderr, flush=True)
    return 2


def _startup_reason(e: BaseException) -> str | None:
    """The message of a known start-up failure (a KV pool that cannot fit) inside Ray's actor error."""
    m = re.search(r"KVDoesNotFit: (.*)", str(e))
    return m.group(1).strip() if m else None


async def _watch_ray(gcs_address: str, cluster: Cluster, stop: asyncio.Event, every_s: float = 1.0,
                    misses: int = 3) -> None:
    """Set `stop` once the GCS has refused connections `misses` times in a row. A TCP connect is the
    check because Ray's own calls retry for a minute against a dead GCS."""
    import socket

    host, port = gcs_address.rsplit(":", 1)
    failed = 0
    while not stop.is_set():
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(lambda: socket.create_connection((host, int(port)), timeout=2).close())
            failed = 0
        except OSError:
            failed += 1
            if failed >= misses:
                cluster.ray_gone = True
                stop.set()
                return


async def _stop_quietly(server, supervisor) -> None:
    """Stop a router that was interrupted while starting, part-started as it may be."""
    try:
        await server.stop()
    except Exception as e:
        log.info("router stop after an interrupted start: %r", e)
    await asyncio.to_thread(supervisor.stop)


async def _serve(cluster: Cluster, drain_timeout_s: float, t0: float, api_keys=None,
                 served_names: list[str] | None = None) -> int:
    import ray

    from kvrelay.router.auth import ApiKeys
    from kvrelay.router.limits import RateLimiter, TlsFiles
    from kvrelay.router.server import RouterServer
    from kvrelay.cluster.version import server_info

    topo = cluster.topology
    client = cluster.engine_client()
    supervisor = cluster.supervise(client)
    r = topo.router
    server = RouterServer(client, served_names or client.model_name, r.host, r.grpc_port, r.http_port,
                          api_keys=api_keys or ApiKeys(),
                          tls=TlsFiles(r.tls_cert_file, r.tls_key_file) if r.tls_cert_file else None,
                          rate_limit=RateLimiter(r.rate_limit_rpm, r.rate_limit_burst) if r.rate_limit_rpm else None,
                          server_info=server_info(topo))
    from kvrelay.cluster import signals

    try:
        await server.start()
        signals.check()
    except BaseException:
        if signals.received() is not None:  # interrupted before ready: the router goes down with the rest
            await _stop_quietly(server, supervisor)
        raise
    # Everything allocated so far (Ray, torch, the tokenizer) lives as long as the process: move it out of
    # the collector's reach, so a full collection never pauses the event loop for a walk over all of it.
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    signals.serving()
    ready = {"model": server.core.model_name, "grpc": server.grpc_target, "http": server.http_url,
             "ray": ray.get_runtime_context().gcs_address, "namespace": topo.ray.namespace,
             "startup_s": round(time.perf_counter() - t0, 2)}
    names = server.core.model_names
    alias = "" if names == (client.model_name,) else f" as {', '.join(names)}"
    _say(f"kvrelay: serving {client.model_name}{alias}\n  gRPC  {server.grpc_target}\n  HTTP  {server.http_url}"
          f"  (OpenAI-compatible: {server.http_url}/v1/chat/completions)\n  Ray   {ready['ray']} "
          f"namespace {topo.ray.namespace}  (kvrelay status --address {ready['ray']})\n"
          f"  Auth  {f'{len(server.api_keys)} API key(s) required on /v1 and gRPC' if server.api_keys else 'none'}"
          f"{'; TLS on HTTP and gRPC' if server.tls else ''}"
          f"{f'; {r.rate_limit_rpm} requests/min per client' if server.rate_limit else ''}\n"
          f"{READY}{json.dumps(ready)}")
    # A signal ends serving, or the Ray cluster going away under us (`ray down`, `ray stop`): a router
    # whose workers are gone must not outlive them. (RouterServer.wait() is not used: cancelling its
    # pending wait_for_termination() cancels gRPC's own shutdown future, and the later stop() fails.)
    watch = asyncio.ensure_future(_watch_ray(ready["ray"], cluster, stop))
    await stop.wait()
    watch.cancel()
    if cluster.ray_gone:
        print(f"kvrelay: the Ray cluster at {ready['ray']} went away; stopping", flush=True)
        drain_timeout_s = 0.0
    print("kvrelay: shutting down, draining in-flight requests", flush=True)
    drained = await client.drain(drain_timeout_s)
    if not drained:
        print(f"kvrelay: {client._in_flight} request(s) still running after {drain_timeout_s:g} s; "
              f"stopping anyway", flush=True)
    await server.stop()
    await asyncio.to_thread(supervisor.stop)
    return 0 if drained else 1
