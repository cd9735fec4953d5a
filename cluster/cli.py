"""The ``cluster`` command: every subcommand, in one table.

Each entry names a module and its ``add_<name>_parser(subparsers)``. The core's own (``check``,
``k8s``, ``plan``, ``status``) live in ``cluster/``; ``serve``
(``deployments/launcher/cli_serve.py``), ``lab`` (``deployments/launcher/cli_lab.py``),
``bench`` (``loadtest/benchmarks/cli_bench.py``) and ``bench-all`` (``loadtest/benchmarks/bench_all.py``)
belong to the layers above, which the core never imports as code: they are names in this table, loaded when
the command line is built. A subcommand whose module fails to import fails the command, naming it,
instead of silently going missing.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from cluster.config import ConfigError, load_config
from cluster.config_checks import config_warnings

SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("cluster.cli", "add_check_parser"),
    ("deployments.launcher.cli_serve", "add_serve_parser"),
    ("deployments.launcher.cli_lab", "add_lab_parser"),
    ("cluster.k8s.cli_k8s", "add_k8s_parser"),
    ("cluster.planner.cli_plan", "add_plan_parser"),
    ("cluster.observability.cli_status", "add_status_parser"),
    ("loadtest.benchmarks.cli_bench", "add_bench_parser"),
    ("loadtest.benchmarks.bench_all", "add_bench_all_parser"),
)


def add_check_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("check", help="validate a config file")
    p.add_argument("--config", required=True)
    p.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    print(
        f"{args.config}: ok — {len(cfg.models)} models, {len(cfg.backends)} backends, "
        f"{len(cfg.surfaces)} surfaces"
    )
    for warning in config_warnings(cfg):  # loads, but probably not as meant
        print(f"{args.config}: warning: {warning}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cluster", description="LLM serving cluster on Ray Serve")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for module, fn in SUBCOMMANDS:
        getattr(importlib.import_module(module), fn)(sub)  # an ImportError names the module: never skipped
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
