"""`kvrelay status`: every rank of every worker of a running cluster, with its role, worker index, TP rank,
pid, node, health and KV pages.

It joins the cluster's Ray namespace and asks each named worker actor directly, so it reports the
workers themselves rather than what the router believes. The expected workers come from the topology:
one that does not answer (or no longer exists) is listed as unhealthy instead of silently missing.
What the router's supervisor published (cluster/supervisor.py) is added to each rank-0 row: `state`
(healthy, restarting while a replacement loads, failed, or down), `restarts`, and the re-prefills the
router counted against that worker by cause (`reprefills`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None,
                        help="the topology the cluster was started with (default: cpu-tiny.yaml)")
    parser.add_argument("--address", default=None,
                        help="Ray address printed by `kvrelay serve` (default: ray.address, else auto)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the Ray cluster to answer, then for each worker")


def collect(topology, timeout_s: float = 10.0) -> list[dict]:
    """One dict per expected rank (rank 0 of each worker first, then its other TP ranks); needs Ray
    initialised in the cluster's namespace."""
    import ray

    from kvrelay.cluster.placement import rank_names, roles, section
    from kvrelay.cluster.supervisor import read_state

    supervised = (read_state(topology.ray.namespace) or {}).get("workers", {})
    rows, refs = [], []
    for role in roles(topology):
        tp = section(topology, role).tp
        for rank in range(section(topology, role).workers):
            sup = supervised.get(f"{role}/{rank}", {})
            for tp_rank, name in enumerate(rank_names(topology, role, rank)):
                row = {"role": role, "rank": rank, "tp_rank": tp_rank, "tp_size": tp, "name": name,
                       "healthy": False, "state": "down", "restarts": sup.get("restarts", 0),
                       "reprefills": sup.get("reprefills", {}) if tp_rank == 0 else {}}
                rows.append(row)
                if _from_supervisor(row, sup):  # its replacement is loading (a status call would wait for it)
                    continue
                try:
                    actor = ray.get_actor(name, namespace=topology.ray.namespace)
                    refs.append((row, actor.status.remote()))
                except ValueError:
                    row["error"] = "not running (no such actor)"
    silent = []
    for row, ref in refs:
        try:
            st = ray.get(ref, timeout=timeout_s)
            row.update(dataclasses.asdict(st))
            row["state"] = "healthy" if row["healthy"] else "unhealthy"
        except ray.exceptions.GetTimeoutError:
            row["error"] = f"no answer within {timeout_s:g} s"
            silent.append(row)
        except ray.exceptions.RayActorError as e:
            row["error"] = f"dead ({type(e).__name__})"
            silent.append(row)
    if silent:
        # A hung worker keeps its status call waiting, often while the supervisor takes it for hung and
        # starts its replacement: report what the supervisor says now, not what it said before the wait.
        now = (read_state(topology.ray.namespace) or {}).get("workers", {})
        for row in silent:
            _from_supervisor(row, now.get(f"{row['role']}/{row['rank']}", {}))
    return rows


def _from_supervisor(row: dict, sup: dict) -> bool:
    """Whether the supervisor's published entry for the row's worker says restarting or failed; if so the
    row takes that state, its restart count and its reason."""
    if sup.get("state") not in ("restarting", "failed"):
        return False
    row["state"], row["restarts"] = sup["state"], sup.get("restarts", row["restarts"])
    row["error"] = f"{sup['state']}: {sup.get('last_error')}"
    return True


def _reachable(address: str, timeout_s: float) -> bool:
    import socket

    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=max(0.1, timeout_s)).close()
        return True
    except (OSError, ValueError):
        return False


def _host_tier(h: dict, queries: int) -> str:
    """The prefix cache's host tier in a status row: its hits (of all lookups), the tokens it saved, its
    pages (full/sliding) of its capacity, and the bytes moved each way."""
    mib = 1 << 20
    return (f"host tier {h['hits']}/{queries} hits, {h['hit_tokens']} tokens saved, {h['pages']['full']}/"
            f"{h['pages']['sliding']} of {h['capacity_pages']} pages, {h['to_host_bytes'] / mib:.1f} MiB to "
            f"host, {h['to_device_bytes'] / mib:.1f} MiB back")


def _table(rows: list[dict]) -> str:
    head = (f"{'role':9} {'rank':>4} {'tp':>5} {'pid':>8} {'state':10} {'restarts':>8} "
            f"{'KV pages used (full/sliding of total)':38} node")
    lines = [head]
    reprefills: dict[str, int] = {}
    for r in rows:
        for cause, n in r.get("reprefills", {}).items():
            reprefills[cause] = reprefills.get(cause, 0) + n
        tp = f"{r['tp_rank']}/{r['tp_size']}"
        label = r.get("state", "healthy" if r["healthy"] else "down")
        state = f"{label if label == 'healthy' else label.upper():10} {r.get('restarts', 0):>8}"  # trouble stands out
        if "pid" in r:
            used = r["pages_in_use"]
            total = r["pages_total"]
            pages = f"{used['full']}/{used['sliding']} of {total['full']}/{total['sliding']}"
            if r["tp_rank"] > 0:
                extra = f"follower of rank 0, agent {r['agent']}"
            elif r["role"] == "prefill":
                extra = f"leases {r['leases']}, queued tokens {r['queued_tokens']}"
            else:
                extra = f"running {r['running']}, admitted {r['admitted']}"
            if r["tp_rank"] == 0 and r.get("prefix_cache"):
                pc = r["prefix_cache"]
                extra += (f", prefix cache {pc['hits']}/{pc['queries']} hits, {pc['hit_tokens']} tokens saved, "
                          f"{pc['cached_pages']['full']}/{pc['cached_pages']['sliding']} pages")
                if pc.get("host"):
                    extra += ", " + _host_tier(pc["host"], pc["queries"])
            lines.append(f"{r['role']:9} {r['rank']:>4} {tp:>5} {r['pid']:>8} {state} {pages:38} {r['node']}  ({extra})")
        else:
            lines.append(f"{r['role']:9} {r['rank']:>4} {tp:>5} {'-':>8} {state} {'-':38} {r.get('error', '')}")
    if reprefills:
        lines.append("re-prefills (requests resumed on another or a replacement worker): "
                     + ", ".join(f"{c} {n}" for c, n in sorted(reprefills.items())))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvrelay.cluster.placement import init_ray, loopback_env
    from kvrelay.cluster.topology import TopologyError, load_topology

    try:
        topo = load_topology(args.config)
    except TopologyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    loopback_env(topo)  # before the first `import ray`, or Ray looks for the GCS on the routable address
    # A local cluster started by `kvrelay serve` (plain ray.init) uses Ray's default token auth; a driver
    # that joins it only presents Ray's token when told the mode. RAY_AUTH_MODE=disabled opts out.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    address = args.address or topo.ray.address or "auto"
    if ":" in address and not _reachable(address, args.timeout):
        # Ray itself would retry a dead GCS address for minutes before giving up.
        print(f"error: no running kvrelay cluster at {address}: nothing accepts connections there "
              f"(within {args.timeout:g} s)", file=sys.stderr)
        return 1
    joined: dict = {}

    def join() -> None:
        try:
            init_ray(topo, address=address)
            joined["ok"] = True
        except Exception as e:  # reported below, in one line
            joined["error"] = e

    # Ray's join cannot be cancelled and waits without bound on an address that accepts connections but
    # is no GCS (measured: 10+ minutes), so it runs on a thread and the process leaves at the timeout.
    thread = threading.Thread(target=join, name="kvrelay-status-join", daemon=True)
    thread.start()
    thread.join(args.timeout)
    if thread.is_alive():
        print(f"error: no running kvrelay cluster at {address}: something accepts connections there but no Ray "
              f"cluster answered within {args.timeout:g} s", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    if "error" in joined:
        e = joined["error"]
        print(f"error: no running kvrelay cluster at {address}: {' '.join(str(e).split()) or type(e).__name__}",
              file=sys.stderr)
        return 1
    try:
        rows = collect(topo, timeout_s=args.timeout)
    finally:
        ray.shutdown()
    print(json.dumps(rows, indent=2) if args.json else _table(rows))
    return 0 if rows and all(r["healthy"] for r in rows) else 3
