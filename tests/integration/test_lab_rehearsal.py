"""Issue 41's CI acceptance: the lab (``cluster lab up``: head, a cpu pod, two engine pods, sim
engines, the generated serveConfigV2 deployed with ``serve deploy``) under a mixed Tab/Chat/Agent
streaming load from the client namespace (tests/integration/lab_load.py), through an in-place
upgrade (``serve deploy`` of the same serveConfigV2 with one engine argument changed: every engine
replica restarts, and the gateway's) and the loss of an engine node (every process SIGKILLed, then
it rejoins).

Asserted: no request failed before its first token; every request during the upgrade completed;
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

import pytest
import yaml

from cluster.config import load_config
from cluster.k8s.lab_plan import LabPlan
from tests.integration.test_lab import _can_make_namespaces, assert_nothing_left, running_lab

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not _can_make_namespaces(), reason="network namespaces: Linux, root, iproute2"),
]
REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/sim-local.yaml"


def _replicas(plan: LabPlan) -> dict[str, dict[str, str]]:
    """Each deployment's RUNNING replicas: replica id → the name of its node."""
    from deployments import lab

    by_ip = {n.ip: n.name for n in plan.nodes}
    out: dict[str, dict[str, str]] = {}
    for app in ((lab.serve_details(plan) or {}).get("applications") or {}).values():
        for name, dep in (app.get("deployments") or {}).items():
            reps = [r for r in dep.get("replicas") or [] if r.get("state") == "RUNNING"]
            out[name] = {r["replica_id"]: by_ip.get(r.get("node_ip"), "?") for r in reps}
    return out


def _app_status(plan: LabPlan) -> str | None:
    from deployments import lab

    apps = (lab.serve_details(plan) or {}).get("applications") or {}
    return (apps.get(plan.apps()[0]) or {}).get("status")


def _wait(ready: Any, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not ready():
        assert time.monotonic() - t0 < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.5)
    return time.monotonic() - t0


def _internal_token(plan: LabPlan, name: str = "cpu-0") -> str:
    """The internal credential as a pod has it (the lab made it up; it is in the pods' env)."""
    from deployments import lab_net

    node = next(n for n in plan.nodes if n.name == name)
    for pid in lab_net.lab_pids([node.netns], tag=None):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"LLMC_INTERNAL_TOKEN="):
                return kv.split(b"=", 1)[1].decode()
    raise AssertionError(f"no process of {name} carries LLMC_INTERNAL_TOKEN")


def _gateway_status(plan: LabPlan, token: str) -> dict[str, Any]:
    import httpx

    from deployments import lab

    node = next(n for n in plan.nodes if n.group == "cpu")
    url = f"http://{node.ip}:{plan.serve_port}/internal/status"

    def call() -> dict[str, Any]:
        r = httpx.get(url, headers={"x-llmc-internal": token}, timeout=10)
        assert r.status_code == 200, (r.status_code, r.text[:300])
        return r.json()

    return lab.from_client(plan, call)


def _upgraded(serve_config: str) -> str:
    """The same serveConfigV2 with one engine argument changed: Serve restarts the app's replicas."""
    doc = yaml.safe_load(serve_config)
    engine = doc["applications"][0]["args"]["config"]["backends"][0]["engine"]
    engine["max_num_batched_tokens"] = 2 * int(engine["max_num_batched_tokens"])
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="module")
def lab_up():
    with running_lab("rehearsal") as (plan, _):
        yield plan
    assert_nothing_left()


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
    """``serve deploy`` of the changed config; back once every engine replica is a new one and the
    app is RUNNING."""
    from deployments import lab

    old = _replicas(plan)
    events["upgrade_start"] = time.time()
    lab.serve_deploy(plan, _upgraded(plan.serve_config))

    def done() -> bool:
        now = _replicas(plan)
        engines = now.get("backend-sim-h100", {})
        fresh = len(engines) == len(old["backend-sim-h100"]) and not set(engines) & set(
            old["backend-sim-h100"]
        )
        return fresh and _app_status(plan) == "RUNNING"

    events["upgrade_s"] = _wait(done, 120, "the upgraded engines")
    events["upgrade_end"] = time.time()
    events["gateway_restarted"] = not set(_replicas(plan)["Gateway"]) & set(old["Gateway"])


def _lose_node(plan: LabPlan, events: dict[str, Any]) -> None:
    """SIGKILL of every process of the engine node with the most replicas (the most streams to
    migrate, the fewest replicas left); Serve restarts its replicas elsewhere; then it rejoins."""
    from deployments import lab

    before = _replicas(plan)["backend-sim-h100"]
    nodes = sorted(before.values())
    lost = events["lost_node"] = max(nodes, key=nodes.count)
    events["lost_replicas"] = sorted(r for r, node in before.items() if node == lost)
    events["kill"] = time.time()
    events["killed_pids"] = len(lab.kill_node(plan, lost))
    time.sleep(8)  # the load goes on with one engine node
    t0 = time.monotonic()
    lab.rejoin(plan, lost)
    events["rejoin_s"] = time.monotonic() - t0
    # the replacement pod has the Secret's credential (else the gateway's requests to replicas
    # that land on it are forbidden)
    assert _internal_token(plan, lost) == _internal_token(plan)
    events["rejoined"] = time.time()

    def full() -> bool:
        return len(_replicas(plan).get("backend-sim-h100", {})) == len(before)

    events["back_to_full_s"] = time.time() - events["kill"] + _wait(full, 60, "every engine replica back")


def _outcome(rec: dict[str, Any]) -> str:
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


def test_upgrade_and_node_loss_under_load(lab_up, tmp_path: Path) -> None:
    from deployments import lab

    plan = lab_up
    assert load_config(CONFIG).policies.migration.enabled  # streams cut mid-answer continue elsewhere
    assert lab.placement(plan)["Gateway"] == ["cpu-0"]
    token = _internal_token(plan)
    events: dict[str, Any] = {}
    load = _start_load(plan, tmp_path)
    try:
        time.sleep(6)  # steady state
        events["books_before"] = _gateway_status(plan, token)["admission"]["balanced"]
        _upgrade(plan, events)
        time.sleep(4)
        _lose_node(plan, events)
        time.sleep(3)
    finally:
        (tmp_path / "stop").touch()
        rc = load.wait(90)
    assert rc == 0
    status = _gateway_status(plan, token)
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
        "admission": status["admission"],
    }
    print(f"[rehearsal] {json.dumps(summary, indent=1, default=str)}", file=sys.stderr)
    assert len(records) > 50 and len(upgrade) > 5 and len(after_kill) > 5, summary
    for rec in records:  # nothing hung; no stream cut without its error event
        assert _outcome(rec) in ("completed", "one_error_event"), rec
    failed = [r for r in upgrade + after_kill if _outcome(r) == "failed_before_first_token"]
    assert not failed, failed
    assert all(_outcome(r) == "completed" for r in upgrade), summary["upgrade"]
    assert on_lost, "no stream was in flight on the lost node: the kill tested nothing"
    assert all(_outcome(r) == "completed" for r in on_lost), [r for r in on_lost if r["errors"]]
    assert events["books_before"] and status["admission"]["balanced"], status["admission"]
    assert status["admission"]["in_flight"] == 0, status["admission"]
