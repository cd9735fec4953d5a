"""What happens to a running lab (``deployments/launcher/lab.py``) during a rehearsal, shared by the CI
acceptance test (tests/integration/lab_rehearsal_check.py) and the benchmark
(loadtest/benchmarks/rehearsal.py): reading Serve's replicas by node, an in-place upgrade with
``serve deploy`` of a changed serveConfigV2, the loss and rejoin of a node, a gateway replica's SIGKILL,
and the gateways' own status (admission books) read with the pods' internal credential from the client
namespace.

Each event function fills ``events`` (wall-clock times, ``time.time()``, to set beside the load's
records) and returns once the lab is back to full strength, or raises ``LabError`` on a timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import yaml

from cluster.json_types import JSONObject
from cluster.k8s.lab_plan import LabError, LabPlan
from deployments.launcher import lab, lab_net

GATEWAY = "Gateway"


def replicas(plan: LabPlan) -> dict[str, dict[str, str]]:
    """Each deployment's RUNNING replicas: replica id → the name of its node."""
    by_ip = {n.ip: n.name for n in plan.nodes}
    out: dict[str, dict[str, str]] = {}
    for app in ((lab.serve_details(plan) or {}).get("applications") or {}).values():
        for name, dep in (app.get("deployments") or {}).items():
            reps = [r for r in dep.get("replicas") or [] if r.get("state") == "RUNNING"]
            out[name] = {r["replica_id"]: by_ip.get(r.get("node_ip"), "?") for r in reps}
    return out


def replica_pids(plan: LabPlan, deployment: str) -> dict[str, int]:
    """A deployment's RUNNING replicas: replica id → its process id (Serve's own record)."""
    out: dict[str, int] = {}
    for app in ((lab.serve_details(plan) or {}).get("applications") or {}).values():
        dep = (app.get("deployments") or {}).get(deployment) or {}
        for r in dep.get("replicas") or []:
            if r.get("state") == "RUNNING" and r.get("pid"):
                out[r["replica_id"]] = int(r["pid"])
    return out


def app_status(plan: LabPlan) -> str | None:
    apps = (lab.serve_details(plan) or {}).get("applications") or {}
    return (apps.get(plan.apps()[0]) or {}).get("status")


def wait_for(ready: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``ready()``; ``LabError`` after ``timeout_s``."""
    t0 = time.monotonic()
    while not ready():
        if time.monotonic() - t0 > timeout_s:
            raise LabError(f"timed out waiting for {what}")
        time.sleep(0.5)
    return time.monotonic() - t0


def internal_token(plan: LabPlan, name: str = "cpu-0") -> str:
    """The internal credential as a pod has it (the lab made it up; it is in the pods' env)."""
    node = next(n for n in plan.nodes if n.name == name)
    for pid in lab_net.lab_pids([node.netns], tag=None):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"LLMC_INTERNAL_TOKEN="):
                return kv.split(b"=", 1)[1].decode()
    raise LabError(f"no process of {name} carries LLMC_INTERNAL_TOKEN")


def gateway_status(plan: LabPlan, token: str, node: str | None = None) -> JSONObject:
    """``/internal/status`` of whichever gateway replica the node's Serve proxy picks (the first
    cpu node's by default)."""
    import httpx

    n = next(x for x in plan.nodes if (x.name == node if node else x.group == "cpu"))
    url = f"http://{n.ip}:{plan.serve_port}/internal/status"

    def call() -> JSONObject:
        r = httpx.get(url, headers={"x-llmc-internal": token}, timeout=10)
        if r.status_code != 200:
            raise LabError(f"/internal/status: {r.status_code} {r.text[:300]}")
        status: JSONObject = r.json()
        return status

    return lab.from_client(plan, call)


class FeedCursor(TypedDict):
    """One gateway's KV-event feed of one replica: the last event read, the blocks it indexes there."""

    after: int | None
    blocks: int | None


def every_gateway_status(
    plan: LabPlan, token: str, node: str, want: int, tries: int = 30
) -> dict[str, JSONObject]:
    """Replica id → status, asked until ``want`` distinct gateway replicas answered (HAProxy picks
    one per request) or ``tries`` ran out."""
    seen: dict[str, JSONObject] = {}
    for _ in range(tries):
        with contextlib.suppress(LabError, OSError):
            st = gateway_status(plan, token, node)
            seen[st["replica"]] = st
        if len(seen) >= want:
            break
    return seen


def upgraded(serve_config: str, factor: int = 2) -> str:
    """The same serveConfigV2 with one engine argument changed: Serve restarts the app's replicas."""
    doc = yaml.safe_load(serve_config)
    engine = doc["applications"][0]["args"]["config"]["backends"][0]["engine"]
    engine["max_num_batched_tokens"] = factor * int(engine["max_num_batched_tokens"])
    return yaml.safe_dump(doc, sort_keys=False)


def upgrade(plan: LabPlan, events: JSONObject, engines: str, serve_config: str) -> None:
    """``serve deploy`` of ``serve_config``; back once every replica of ``engines`` is a new one and
    the app is RUNNING."""
    old = replicas(plan)
    events["upgrade_start"] = time.time()
    lab.serve_deploy(plan, serve_config)

    def done() -> bool:
        now = replicas(plan).get(engines, {})
        fresh = len(now) == len(old[engines]) and not set(now) & set(old[engines])
        return fresh and app_status(plan) == "RUNNING"

    events["upgrade_s"] = wait_for(done, 180, "the upgraded engines")
    events["upgrade_end"] = time.time()
    events["gateway_restarted"] = not set(replicas(plan)[GATEWAY]) & set(old[GATEWAY])


def lose_node(
    plan: LabPlan, events: JSONObject, deployment: str, node: str | None = None, down_s: float = 8.0
) -> None:
    """SIGKILL of every process of ``node`` (default: the one with the most replicas of
    ``deployment``: the most streams to migrate, the fewest replicas left), ``down_s`` with the
    node gone, then a replacement pod rejoins with the Secret's credential. ``events["rejoined"]``
    is when Ray has it alive; ``back_to_full_s`` from the kill until ``deployment`` has all its
    replicas running again."""
    before = replicas(plan)[deployment]
    nodes = sorted(before.values())
    lost = events["lost_node"] = node or max(nodes, key=nodes.count)
    events["lost_replicas"] = sorted(r for r, n in before.items() if n == lost)
    events["kill"] = time.time()
    events["killed_pids"] = len(lab.kill_node(plan, lost))
    time.sleep(down_s)
    t0 = time.monotonic()
    lab.rejoin(plan, lost)
    events["rejoin_s"] = time.monotonic() - t0
    # the replacement pod has the Secret's credential (else the gateway's requests to replicas
    # that land on it are forbidden)
    if internal_token(plan, lost) != internal_token(plan, _other(plan, lost)):
        raise LabError(f"the rejoined {lost} has another internal credential than the lab's")
    events["rejoined"] = time.time()

    def full() -> bool:
        return len(replicas(plan).get(deployment, {})) == len(before)

    events["back_to_full_s"] = time.time() - events["kill"] + wait_for(full, 180, f"every {deployment} back")


def _other(plan: LabPlan, name: str) -> str:
    return next(n.name for n in plan.nodes if n.name != name and not n.head)


def kill_replica(plan: LabPlan, events: JSONObject, deployment: str = GATEWAY) -> None:
    """SIGKILL of one replica's process (the first by id); back once Serve has the deployment at
    full strength with a new replica in its place."""
    pids = replica_pids(plan, deployment)
    if not pids:
        raise LabError(f"no running replica of {deployment}")
    victim = sorted(pids)[0]
    events["killed_replica"] = victim
    events["kill"] = time.time()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pids[victim], signal.SIGKILL)

    def full() -> bool:
        now = replica_pids(plan, deployment)
        return len(now) == len(pids) and victim not in now

    events["back_to_full_s"] = wait_for(full, 180, f"{deployment} back to {len(pids)} replicas")
    events["restored"] = time.time()


def kv_fault(plan: LabPlan, token: str, url: str, cut_s: float) -> JSONObject:
    """``POST /kv_events/fault`` of one engine replica (its data-plane address, with the internal
    credential, from the client namespace): its event endpoint stalls every poll for ``cut_s``
    (0: the cut ends). Returns the replica's log head."""
    import httpx

    def call() -> JSONObject:
        headers = {"x-llmc-internal": token}
        r = httpx.post(url + "/kv_events/fault", json={"cut_s": cut_s}, headers=headers, timeout=10)
        if r.status_code != 200:
            raise LabError(f"/kv_events/fault: {r.status_code} {r.text[:300]}")
        answer: JSONObject = r.json()
        return answer

    return lab.from_client(plan, call)


def feed_cursors(
    plan: LabPlan, token: str, backend: str, replica: str, gateways: int
) -> dict[str, FeedCursor]:
    """Per gateway replica: how far its KV-event feed has read ``replica``'s log, and the blocks
    its index holds there."""
    out: dict[str, FeedCursor] = {}
    for rid, st in every_gateway_status(plan, token, plan.head.name, gateways).items():
        routing = st["routing"][backend]["kv_index"]
        cursor = ((routing.get("feed") or {}).get("replicas") or {}).get(replica) or {}
        blocks = (routing.get("replicas") or {}).get(replica, {}).get("blocks")
        out[rid] = {"after": cursor.get("after"), "blocks": blocks}
    return out


def cut_kv_feed(
    plan: LabPlan, events: JSONObject, token: str, backend: str, cut_s: float = 30.0, gateways: int = 2
) -> None:
    """One engine replica's KV-event endpoint unreachable for ``cut_s`` while it serves (its fault
    hook), the gateways' feed of it sampled during the cut; back once every gateway's feed has read
    the replica's log up to its head at the cut's end (``catch_up_s``, from the end)."""
    routing = gateway_status(plan, token)["routing"][backend]
    urls, feed = routing["replicas"], (routing["kv_index"].get("feed") or {}).get("replicas") or {}
    if not urls:
        raise LabError(f"no replica of {backend} in the gateway's view")
    # the replica with the most events so far (where sessions live): events to miss during the cut
    replica = events["cut_replica"] = max(sorted(urls), key=lambda r: (feed.get(r) or {}).get("events", 0))
    events["start"] = time.time()
    events["head_at_start"] = kv_fault(plan, token, urls[replica], cut_s)["last_seq"]
    samples = events["cursors_during"] = []
    while (left := events["start"] + cut_s - time.time()) > 0:
        time.sleep(min(left, 10.0))
        with contextlib.suppress(LabError, OSError):
            samples.append([time.time(), feed_cursors(plan, token, backend, replica, gateways)])
    head = events["head_at_end"] = kv_fault(plan, token, urls[replica], 0.0)["last_seq"]
    events["end"] = time.time()

    def caught_up() -> bool:
        now = feed_cursors(plan, token, backend, replica, gateways)
        events["cursors_after"] = now
        return len(now) >= gateways and all((c["after"] or 0) >= head for c in now.values())

    events["catch_up_s"] = wait_for(caught_up, 60, f"the gateways' feeds of {replica} to catch up")
