"""The ``cluster`` command's table of subcommands: all of them there, a broken one fails loudly, and
the core's CLI module imports nothing above the core."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster import cli

ROOT = Path(__file__).resolve().parents[2]


def test_every_subcommand_is_registered() -> None:
    sub = next(a for a in cli.build_parser()._actions if a.dest == "cmd")
    assert set(sub.choices) == {"check", "serve", "lab", "k8s", "plan", "status", "bench", "bench-all"}  # type: ignore[arg-type]


def test_a_subcommand_that_fails_to_import_fails_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "SUBCOMMANDS", (*cli.SUBCOMMANDS, ("loadtest.no_such_plugin", "add_x_parser")))
    with pytest.raises(ModuleNotFoundError, match=r"loadtest\.no_such_plugin"):
        cli.main(["check", "--config", str(ROOT / "configs/local.yaml")])


def test_the_core_cli_does_not_import_the_layers_above() -> None:
    code = (
        "import sys, cluster.cli\n"
        "up = sorted(m for m in sys.modules if m.split('.')[0] in ('deployments', 'loadtest'))\n"
        "print(' '.join(up))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == []
