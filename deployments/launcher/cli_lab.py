"""``cluster lab up|down|status``: the RayService's cluster on this machine, a Ray node per pod in a
network namespace of its own (``deployments/launcher/lab.py``), to try a config and its deploy settings
before shipping them. Linux, as root.

    cluster lab up --config configs/sim-local.yaml      # head, a cpu pod, two engine pods
    cluster lab status
    cluster lab down                                     # also after a crashed `up`
"""

from __future__ import annotations

import argparse
import sys
import time

from cluster.k8s.lab_plan import LabError

DEFAULT_SETTINGS = "k8s/settings/lab.yaml"


def add_lab_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("lab", help="the RayService's multi-node cluster on this machine (root)")
    sub = p.add_subparsers(dest="lab_command", required=True)
    u = sub.add_parser("up", help="bring the lab up and deploy the manifest's serveConfigV2")
    u.add_argument("--config", default="configs/sim-local.yaml", help="cluster config (configs/*.yaml)")
    u.add_argument("--settings", default=DEFAULT_SETTINGS, help="deploy settings (k8s/settings/*.yaml)")
    u.add_argument("--timeout", type=float, default=300.0, help="seconds until every node serves")
    u.set_defaults(func=_up)
    sub.add_parser("down", help="remove every process, namespace, link and file of the lab").set_defaults(
        func=_down
    )
    sub.add_parser("status", help="the lab's nodes, their Serve ports and replicas").set_defaults(
        func=_status
    )


def _up(args: argparse.Namespace) -> int:
    from deployments.launcher import lab

    t0 = time.monotonic()
    try:
        plan = lab.up(args.config, args.settings, timeout_s=args.timeout)
    except LabError as exc:
        print(f"[lab] {exc}", file=sys.stderr)
        if lab.read_state() is not None:
            print("[lab] what it made is left for a look: `cluster lab down` removes it", file=sys.stderr)
        return 1
    print(f"[lab] up in {time.monotonic() - t0:.0f} s")
    for line in lab.addresses(plan):
        print(f"[lab] {line}")
    for dep, nodes in lab.placement(plan).items():
        print(f"[lab] {dep}: {', '.join(nodes)}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from deployments.launcher import lab

    return 1 if any(lab.down().values()) else 0


def _status(args: argparse.Namespace) -> int:
    from deployments.launcher import lab

    try:
        return lab.status()
    except LabError as exc:
        print(f"[lab] {exc}", file=sys.stderr)
        return 1
