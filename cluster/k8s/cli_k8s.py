"""``cluster k8s …``: render the KubeRay manifests from the configs, and check them for drift.

    cluster k8s render --config configs/gpu.yaml --settings k8s/settings/gpu.yaml \\
        --out k8s/base/rayservice.yaml
    cluster k8s render --config configs/cpu-dev.yaml --settings k8s/settings/cpu-dev.yaml \\
        --patch-of k8s/base/rayservice.yaml --out k8s/overlays/cpu-dev/rayservice-patch.yaml
    cluster k8s serve-config --config configs/gpu.yaml --settings k8s/settings/gpu.yaml
    cluster k8s sync            # re-render every target in k8s/render.yaml
    cluster k8s sync --check    # exit 1 when a committed manifest differs from its config

``add_k8s_parser(subparsers)`` plugs this into ``cluster.cli``; each subcommand sets ``func``,
which takes the parsed arguments and returns an exit code.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yaml

from cluster.config import ConfigError, load_config
from cluster.k8s.patch import rayservice_patch, to_yaml
from cluster.k8s.rayservice import GENERATED_HEADER, render_rayservice, serve_config
from cluster.k8s.settings import load_settings

DEFAULT_TARGETS = Path("k8s/render.yaml")


@dataclass(frozen=True)
class Target:
    out: str
    config: str
    settings: str
    patch_of: str | None = None


def render_text(config: str, settings: str, patch_of: str | None = None, root: Path = Path()) -> str:
    """The manifest text for one target; paths are relative to ``root`` and appear as given."""
    obj = render_rayservice(load_config(root / config), load_settings(root / settings))
    if patch_of is not None:
        base = yaml.safe_load((root / patch_of).read_text())
        obj = rayservice_patch(base, obj)
    header = GENERATED_HEADER.format(config=config, settings=settings)
    if patch_of is not None:
        header += f"# A kustomize patch (JSON merge semantics) over {patch_of}.\n"
    return to_yaml(obj, header)


def load_targets(path: Path) -> list[Target]:
    raw = yaml.safe_load(path.read_text()) or {}
    try:
        return [Target(**t) for t in raw["targets"]]
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: expected 'targets: [{{out, config, settings, patch_of?}}]'") from exc


def sync(targets_file: Path, check: bool, out: TextIO | None = None) -> int:
    """Render each target (in order: a patch reads its base) and write it, or, with ``check``,
    report each that differs. Paths in the targets file are relative to the repository root,
    the parent of the folder holding that file."""
    out = out or sys.stdout
    root = targets_file.resolve().parent.parent
    drift = 0
    for t in load_targets(targets_file):
        want = render_text(t.config, t.settings, t.patch_of, root)
        path = root / t.out
        have = path.read_text() if path.exists() else ""
        if have == want:
            print(f"ok        {t.out}", file=out)
            continue
        if check:
            drift += 1
            print(f"drift     {t.out} (run `cluster k8s sync`)", file=out)
            diff = difflib.unified_diff(have.splitlines(), want.splitlines(), t.out, "rendered", lineterm="")
            print("\n".join(list(diff)[:80]), file=out)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(want)
            print(f"rendered  {t.out}", file=out)
    return 1 if drift else 0


def _render(args: argparse.Namespace) -> int:
    text = render_text(args.config, args.settings, args.patch_of)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"rendered {args.out}", file=sys.stderr)
    return 0


def _serve_config(args: argparse.Namespace) -> int:
    cfg, settings = load_config(args.config), load_settings(args.settings)
    sys.stdout.write(yaml.safe_dump(serve_config(cfg, settings), sort_keys=False, width=100))
    return 0


def _sync(args: argparse.Namespace) -> int:
    return sync(Path(args.targets), args.check)


def add_k8s_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    k8s = subparsers.add_parser("k8s", help="KubeRay manifests: render, check for drift")
    sub = k8s.add_subparsers(dest="k8s_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", required=True, help="cluster config (configs/*.yaml)")
        p.add_argument("--settings", required=True, help="deploy settings (k8s/settings/*.yaml)")

    r = sub.add_parser("render", help="render a RayService (or an overlay patch) from a config")
    common(r)
    r.add_argument("--patch-of", help="write a kustomize patch over this base RayService instead")
    r.add_argument("--out", default="-", help="output file ('-': stdout)")
    r.set_defaults(func=_render)

    sc = sub.add_parser("serve-config", help="print only serveConfigV2 (for `serve deploy`)")
    common(sc)
    sc.set_defaults(func=_serve_config)

    s = sub.add_parser("sync", help="re-render every target listed in k8s/render.yaml")
    s.add_argument("--targets", default=str(DEFAULT_TARGETS), help="the targets file")
    s.add_argument("--check", action="store_true", help="write nothing; exit 1 on drift")
    s.set_defaults(func=_sync)
    return k8s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster")
    add_k8s_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
