"""`kvrelay config check FILE [--dummy] [--cluster RAY_UP_FILE]`: validate a topology, run the checks
`kvrelay serve` runs before it starts anything (cluster/preflight.py: weights, API keys, ports, memory on
this machine) and print what it resolves to; with a `ray up` cluster file, also check that its GPUs fit
the nodes the file lists."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    check = sub.add_parser("check", help="validate a topology YAML; exit 1 with the error otherwise")
    check.add_argument("file", help="a YAML file, or the name of a shipped config (e.g. cpu-tiny.yaml)")
    check.add_argument("--json", action="store_true", help="print the resolved topology as JSON")
    check.add_argument("--dummy", action="store_true",
                       help="as `kvrelay serve --dummy`: random weights of the model's shape (model.dummy: true)")
    check.add_argument("--cluster", default=None,
                       help="a `ray up` cluster file (local provider): the topology must fit its nodes")
    check.add_argument("--gpus-per-node", type=int, default=8, help="GPUs on each node of --cluster (default 8)")
    sub.add_parser("list", help="list the shipped topology files")


def run(args: argparse.Namespace) -> int:
    from kvrelay.cluster.topology import TopologyError, describe, load_topology, shipped_configs, to_json

    if args.action == "list":
        print("\n".join(shipped_configs()))
        return 0
    from kvrelay.cluster.preflight import PreflightError, run_checks, with_dummy
    from kvrelay.router.auth import ApiKeyError, resolve_api_keys

    try:
        topo = with_dummy(load_topology(args.file), args.dummy)
        resolve_api_keys(None, topo.router.api_keys_env, source=str(topo.source))
        checks = run_checks(topo)
    except (TopologyError, PreflightError, ApiKeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.cluster:
        try:
            print(check_fits_cluster(topo, args.cluster, args.gpus_per_node))
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(to_json(topo) if args.json else describe(topo) + "\nchecks (as kvrelay serve runs them)\n  "
          + "\n  ".join(checks))
    return 0


def check_fits_cluster(topo, cluster_file: str, gpus_per_node: int) -> str:
    """Raise ValueError (naming the file and the keys) unless the topology's workers fit the nodes of a
    `ray up` local-provider file: each TP group on one node, all the GPUs it asks for in the cluster."""
    import yaml

    with open(cluster_file) as f:
        raw = yaml.safe_load(f) or {}
    provider = raw.get("provider") or {}
    if provider.get("type") != "local":
        raise ValueError(f"{cluster_file}: provider.type: only the local provider lists its nodes "
                         f"(got {provider.get('type')!r})")
    if not provider.get("head_ip"):
        raise ValueError(f"{cluster_file}: provider.head_ip: missing")
    nodes = 1 + len(provider.get("worker_ips") or [])
    if topo.device != "cuda":
        return f"cluster {cluster_file}: {nodes} node(s); {topo.source} runs on CPU"
    have = nodes * gpus_per_node
    if topo.gpus_needed > have:
        raise ValueError(f"{topo.source}: gpus: the topology needs {topo.gpus_needed} GPUs but {cluster_file} "
                         f"lists {nodes} node(s) x {gpus_per_node} GPUs = {have} (provider.head_ip + "
                         f"provider.worker_ips)")
    for pool in ("prefill", "decode"):
        tp = getattr(topo, pool).tp
        if tp > gpus_per_node:
            raise ValueError(f"{topo.source}: {pool}.tp: {tp} ranks must share one node, which has "
                             f"{gpus_per_node} GPUs")
    return f"cluster {cluster_file}: {nodes} node(s) x {gpus_per_node} GPUs: {topo.gpus_needed} needed, fits"
