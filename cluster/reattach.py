"""A restarted router re-attaches to the workers its predecessor left on a joined Ray cluster.

On a Ray cluster that `kvrelay serve` joins (`--address` / `ray.address`: a long-lived cluster, e.g. from
`ray up`), the worker actors and their placement groups are detached: they outlive the router process.
When the router dies (a crash, an OOM kill, a node drain of its pod) and `kvrelay serve` is started again
against the same cluster and namespace with the same topology, it finds the named workers, checks they
were started for this topology (a fingerprint kept in Ray's internal KV), ends every request the dead
router left on them (`reset`: decode requests aborted and their pages and reservations freed, prefill
leases released; nothing is left to expire) and serves on them without reloading any weights.

Why re-attach rather than stop and restart them: loading gpt-oss-120b and capturing its CUDA graphs takes
minutes, the router is a stateless front door in front of them (what vLLM's and SGLang's routers are in
front of their engines: restarting the router does not restart the engines), and the workers' state that
mattered to the dead router (its requests) is ended explicitly, so nothing it held survives. Workers that
do not match (another topology, or some of them missing) are stopped and started fresh instead, since a
mixed pool could not be trusted to hand KV over. A clean stop (SIGTERM / Ctrl-C) still stops the workers
it serves, as before; with a private Ray (no address) Ray itself ends with the router, so there is
nothing to re-attach to.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger("kvrelay.serve")


def topology_key(namespace: str) -> str:
    return f"kvrelay-topology:{namespace}"


def fingerprint(topology) -> str:
    """What the workers were built from: everything but the router's own settings and Ray's address."""
    d = topology.to_dict()
    d.pop("router", None)
    d.pop("ray", None)
    return json.dumps(d, sort_keys=True, default=str)


def record(topology) -> None:
    """Remember which topology the (detached) workers of this namespace run."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(topology_key(topology.ray.namespace), fingerprint(topology), overwrite=True)


def _expected(topology) -> list[tuple[str, int]]:
    from kvrelay.cluster.placement import roles, section

    return [(role, rank) for role in roles(topology) for rank in range(section(topology, role).workers)]


def attach(cluster, timeout_s: float = 60.0) -> bool:
    """Take over the workers a dead router left in this namespace; True if the cluster now holds them.
    False when there were none, or they did not match (then they are stopped, and their placement
    groups removed, so that fresh ones can take their names)."""
    import ray
    from ray.experimental.internal_kv import _internal_kv_get

    from kvrelay.cluster import placement
    from kvrelay.cluster.supervisor import _wait_name_free

    topo = cluster.topology
    ns = topo.ray.namespace
    expected = _expected(topo)
    found = {}
    for key in expected:
        try:
            found[key] = ray.get_actor(placement.actor_name(*key), namespace=ns)
        except ValueError:
            pass
    stored = _internal_kv_get(topology_key(ns))
    same = stored is not None and stored.decode() == fingerprint(topo)
    if found and same and len(found) == len(expected):
        for key in expected:
            pg = ray.util.get_placement_group(placement.pg_name(*key))
            slot = placement.WorkerSlot(key[0], key[1], pg, len(placement.bundles(topo, key[0])))
            cluster.slots.append(slot)
            if key[0] in ("prefill", placement.COLOCATED):
                cluster.prefill.append(found[key])
            if key[0] in ("decode", placement.COLOCATED):
                cluster.decode.append(found[key])
        ended = 0
        for actor in cluster.actors():
            try:
                ended += ray.get(actor.reset.remote(), timeout=timeout_s)
            except Exception as e:  # a dead one: the supervisor replaces it
                log.warning("a re-attached worker did not answer reset: %r", e)
        print(f"kvrelay: re-attached to {len(found)} running worker(s) an earlier router left in namespace {ns} "
              f"(no weights reloaded; ended {ended} request(s) and lease(s) it had left on them)", flush=True)
        return True
    if found:
        why = ("they run another topology" if not same
               else f"only {len(found)} of the {len(expected)} workers are running")
        print(f"kvrelay: stopping {len(found)} worker(s) an earlier router left in namespace {ns} ({why})",
              flush=True)
        for actor in found.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        for key in found:
            _wait_name_free(placement.actor_name(*key), ns, timeout_s=timeout_s)
    for key in expected:  # placement groups left without their workers: free the resources and names
        try:
            ray.util.remove_placement_group(ray.util.get_placement_group(placement.pg_name(*key)))
        except ValueError:
            pass
    return False
