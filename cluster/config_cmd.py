"""`kvrelay config check FILE`: validate a topology and print what it resolves to."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    check = sub.add_parser("check", help="validate a topology YAML; exit 1 with the error otherwise")
    check.add_argument("file", help="a YAML file, or the name of a shipped config (e.g. cpu-tiny.yaml)")
    check.add_argument("--json", action="store_true", help="print the resolved topology as JSON")
    sub.add_parser("list", help="list the shipped topology files")


def run(args: argparse.Namespace) -> int:
    from kvrelay.cluster.topology import TopologyError, describe, load_topology, shipped_configs, to_json

    if args.action == "list":
        print("\n".join(shipped_configs()))
        return 0
    try:
        topo = load_topology(args.file)
    except TopologyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(to_json(topo) if args.json else describe(topo))
    return 0
