"""Issue 41's CI acceptance, run by tests/integration/test_lab.py on its lab (one ``up`` for both
saves CI half a minute): the lab (``cluster lab up``: head, a cpu pod, two engine pods, sim
engines, the generated serveConfigV2 deployed with ``serve deploy``) under a mixed Tab/Chat/Agent
streaming load from the client namespace (tests/integration/lab_load.py), through an in-place
upgrade (``serve deploy`` of the same serveConfigV2 with one engine argument changed: every engine
replica restarts, and the gateway's) and the loss of an engine node (every process SIGKILLed, then
it rejoins).

Asserted: no request failed before its first token; every request during the upgrade completed
(the SLO guard's deferrals aside, each inside a capped period the gateway recorded);
every stream in flight on the lost node completed on another replica (all are self-hosted and
can migrate: a stream that cannot would end with one error event, which any other request may
too); nothing hung; the gateway's admission books balance; and after ``cluster lab down`` nothing
is left. Linux, as root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cluster.config import load_config
from cluster.k8s.lab_plan import LabPlan
from deployments.launcher import lab_events

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/sim-local.yaml"
ENGINES = "backend-sim-h100"


def _start_load(plan: LabPlan, folder: Path) -> subprocess.Popen[bytes]:
    """The load, in the client namespace, to the nodes that stay up (the head and the cpu pod):
    a Service drops a lost pod from its endpoints, so no client is sent to the lost node's port."""
    urls = [f"http://{n.ip}:{plan.serve_port}/v1/chat/completions" for n in plan.nodes if n.group != "engine"]
    cmd = [
        "ip",
        "netns",
        "exec",
        plan.client.netns,
        sys.executable,
        str(REPO / "tests/integration/lab_load.py"),
    ]
    cmd += [f"--url={u}" for u in urls]
    cmd += ["--per-surface=2", f"--stop={folder / 'stop'}", "--max-s=240", f"--out={folder / 'load.json'}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "LLMC_"))}
    return subprocess.Popen(cmd, cwd=REPO, env=env | {"PYTHONPATH": str(REPO)})


def _upgrade(plan: LabPlan, events: dict[str, Any]) -> None:
    """``serve deploy`` of the same serveConfigV2 with one engine argument changed; back once every
    engine replica is a new one and the app is RUNNING."""
    lab_events.upgrade(plan, events, ENGINES, lab_events.upgraded(plan.serve_config))


def _lose_node(plan: LabPlan, events: dict[str, Any]) -> None:
    """SIGKILL of every process of the engine node with the most replicas (the most streams to
    migrate, the fewest replicas left); Serve restarts its replicas elsewhere; then it rejoins
    (with the Secret's credential, checked)."""
    lab_events.lose_node(plan, events, ENGINES)


def _deferred(rec: dict[str, Any]) -> bool:
    """The SLO guard's deliberate answer: a 429 before any token that says the surface is deferred
    (Tab near its objective on every backend this request could use)."""
    said = " ".join(str(e) for e in rec["errors"])
    return rec["status"] == 429 and rec["t_first"] is None and "is deferred" in said


def _capped(changes: list[dict[str, Any]], read_at: float) -> list[tuple[float, float]]:
    """When the guard capped deferrable work (wall clock): from each pressure decision until the
    cap went, from the gateway's record of its latest cap changes (ages at ``read_at``)."""
    periods, start = [], None
    for c in changes:
        at = read_at - c["age_s"]
        if c["reason"] == "pressure" and start is None:
            start = at
        elif c["cap"] is None and start is not None:
            periods.append((start, at))
            start = None
    return periods + ([(start, read_at)] if start is not None else [])


def _outcome(rec: dict[str, Any]) -> str:
    if _deferred(rec):
        return "deferred"
    if rec["t_first"] is None:
        return "hung" if "Timeout" in rec.get("exception", "") else "failed_before_first_token"
    if "Timeout" in rec.get("exception", ""):
        return "hung"
    if not rec["errors"] and rec["done"] and rec["finish"]:
        return "completed"
    return "one_error_event" if len(rec["errors"]) == 1 else "cut"  # cut: no end, or two errors


def _tally(records: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for rec in records:
        out[_outcome(rec)] = out.get(_outcome(rec), 0) + 1
    return out


def _during(records: list[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    return [r for r in records if r["t0"] <= t1 and r["t_end"] >= t0]


def check_upgrade_and_node_loss_under_load(plan: LabPlan, tmp_path: Path) -> None:
    from deployments.launcher import lab

    assert load_config(CONFIG).policies.migration.enabled  # streams cut mid-answer continue elsewhere
    assert lab.placement(plan)["Gateway"] == ["cpu-0"]
    token = lab_events.internal_token(plan)
    events: dict[str, Any] = {}
    load = _start_load(plan, tmp_path)
    try:
        time.sleep(6)  # steady state
        events["books_before"] = lab_events.gateway_status(plan, token)["admission"]["balanced"]
        _upgrade(plan, events)
        time.sleep(4)
        _lose_node(plan, events)
        time.sleep(3)
    finally:
        (tmp_path / "stop").touch()
        rc = load.wait(90)
    assert rc == 0
    status = lab_events.gateway_status(plan, token)
    read_at = time.time()
    records = json.loads((tmp_path / "load.json").read_text())
    upgrade = _during(records, events["upgrade_start"], events["upgrade_end"])
    after_kill = _during(records, events["kill"], events["rejoined"])
    lost = set(events["lost_replicas"])
    on_lost = [r for r in records if r["t0"] < events["kill"] < r["t_end"] and r["replica"] in lost]
    summary = {
        "events": events,
        "all": _tally(records),
        "upgrade": _tally(upgrade),
        "node_loss": _tally(after_kill),
        "node_loss_streams_in_flight": _tally(on_lost),
        "migrations": status["policy"].get("migrations"),
        "slo_guard": status.get("slo_guard"),  # why a deferrable request got a 429, if one did
        "slo_guard_changes": status.get("slo_guard_changes"),  # and when the caps changed
        "admission": status["admission"],
    }
    print(f"[rehearsal] {json.dumps(summary, indent=1, default=str)}", file=sys.stderr)
    assert len(records) > 50 and len(upgrade) > 5 and len(after_kill) > 5, summary
    for rec in records:  # nothing hung; no stream cut without its error event
        assert _outcome(rec) in ("completed", "one_error_event", "deferred"), rec
    # The SLO guard's deferrals are the product's deliberate answer to Tab near its objective, which
    # this 2-core box reaches while an upgrade restarts every replica (CI at bc14b25: Tab's p90 at
    # 0.83 of 100 ms over 26 samples, Chat capped for 0.5 s, 7 Chat 429s). Accepted only inside a
    # capped period the gateway recorded (0.5 s either side: its revisions' cadence); anything else
    # that failed before its first token fails the test. The full rehearsal counts them as failed.
    periods = _capped(status.get("slo_guard_changes") or [], read_at)
    unexplained = [
        r for r in records if _deferred(r) and not any(a - 0.5 <= r["t0"] <= b + 0.5 for a, b in periods)
    ]
    assert not unexplained, (unexplained[:3], periods)
    failed = [r for r in upgrade + after_kill if _outcome(r) == "failed_before_first_token"]
    assert not failed, failed
    assert all(_outcome(r) in ("completed", "deferred") for r in upgrade), summary["upgrade"]
    assert on_lost, "no stream was in flight on the lost node: the kill tested nothing"
    assert all(_outcome(r) == "completed" for r in on_lost), [r for r in on_lost if r["errors"]]
    assert events["books_before"] and status["admission"]["balanced"], status["admission"]
    assert status["admission"]["in_flight"] == 0, status["admission"]
