"""``cluster lab``: the RayService's cluster on this machine, a Ray node per pod, each in a network
namespace of its own (``deployments/launcher/lab_net.py``), laid out by the manifest that
``cluster k8s render`` writes for the same config (``cluster/k8s/lab_plan.py`` reads it as KubeRay
does), and the app deployed with Serve's own ``serve deploy`` of its ``serveConfigV2``, as is.

``up`` refuses while anything of a lab is there, writes its state (``/tmp/llmc-lab/state.json``)
before it creates anything, and leaves what it made when it fails (the nodes' logs are under
``/tmp/llmc-lab/<node>/``); ``down`` removes every process, namespace, veth and the bridge of the
lab, those the state names and those it finds by their names or their tag, and the folder.
Requests come from the client namespace (``ip netns exec llmc-lab0-client …``), to each node's
address as a Kubernetes Service would spread them; the host has no address on the lab's subnet.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sized
from pathlib import Path
from typing import TypeVar

from cluster.config import load_config
from cluster.dataplane import INTERNAL_TOKEN_ENV
from cluster.json_types import JSON, JSONObject
from cluster.k8s.lab_plan import (
    LAB,
    PEER_PREFIX,
    ROOT,
    SUBNET,
    LabError,
    LabNode,
    LabPlan,
    gpus_needed,
    make_plan,
    pinned,
    start_args,
    state_of,
    unplaceable,
)
from cluster.k8s.rayservice import render_rayservice
from cluster.k8s.settings import load_settings
from deployments.launcher import lab_net

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STATE = ROOT / "state.json"
LOCK = Path("/tmp/llmc-lab.lock")  # beside the root, which `down` removes whole
INTERNAL_TOKEN_FILE = "internal_token"  # under the root, beside Ray's token
Say = Callable[[str], None]
T = TypeVar("T")


# State -----------------------------------------------------------------------------------------
def read_state() -> JSONObject | None:
    with contextlib.suppress(OSError, ValueError):
        state: JSONObject = json.loads(STATE.read_text())
        return state
    return None


def _write_state(state: Mapping[str, object]) -> None:
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(STATE)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One ``up`` or ``down`` at a time on this machine."""
    with open(LOCK, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield


def leftovers() -> dict[str, list[str] | list[int]]:
    """What of a lab is on this machine now: namespaces, links, processes (all empty: none)."""
    namespaces = lab_net.lab_namespaces()
    return {
        "namespaces": namespaces,
        "links": lab_net.lab_links(),
        "routes": lab_net.guarded(SUBNET),
        "processes": lab_net.lab_pids(namespaces, LAB),
    }


# Up --------------------------------------------------------------------------------------------
def plan_of(
    config: str,
    settings: str,
    internal_token: str = "",
    root: Path = ROOT,
    pins: Mapping[str, str] | None = None,
) -> LabPlan:
    """The lab of a config and deploy settings: the RayService they render, read as KubeRay does,
    its Secret filled from this environment and the lab's own internal credential; ``pins``
    (deployment -> node) hold deployments to nodes (:func:`cluster.k8s.lab_plan.pinned`)."""
    manifest = render_rayservice(load_config(config), load_settings(settings))
    filled = dict(os.environ)
    for e in manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0].get(
        "env", []
    ):
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if e["name"] == INTERNAL_TOKEN_ENV and ref:
            filled[ref["key"]] = internal_token or secrets.token_hex(32)
    plan = make_plan(manifest, filled, REPO, root)
    if pins:
        plan = pinned(plan, pins)
    if bad := unplaceable(plan):
        raise LabError("the manifest's replicas cannot run on the lab's nodes: " + "; ".join(bad))
    need, have = gpus_needed(plan), len(glob.glob("/dev/nvidia[0-9]*"))
    if sum(need.values()) > have:
        raise LabError(
            f"the manifest's GPU pods need {sum(need.values())} GPUs ({need}) and this machine has "
            f"{have}: try a config whose engines are simulated or vLLM-CPU (configs/sim-local.yaml, "
            "configs/local.yaml)"
        )
    return plan


def up(
    config: str,
    settings: str,
    timeout_s: float = 300.0,
    say: Say = print,
    pins: Mapping[str, str] | None = None,
) -> LabPlan:
    """Bring the lab up: network, head, workers, ``serve deploy``; returns once every node's Serve
    port answers. Refuses while anything of a lab is there."""
    with _locked():
        found = leftovers()
        if read_state() is not None or any(found.values()):
            raise LabError(f"a lab is up or left over ({_describe(found)}): run `cluster lab down` first")
        token = secrets.token_hex(32)
        plan = plan_of(config, settings, token, pins=pins)
        lab_net.check_subnet_free(plan.subnet)
        _prepare_root(Path(plan.root), token)
        state = state_of(plan, {"config": config, "settings": settings})
        _write_state(state)
        deadline = time.monotonic() + timeout_s
        t0 = time.monotonic()
        _create_net(plan)
        say(f"[lab] network: bridge {plan.bridge}, {len(plan.nodes) + 1} namespaces on {plan.subnet}")
        state["pids"] = _start_nodes(plan, deadline, say)
        _write_state(state)
        say(f"[lab] {len(plan.nodes)} Ray nodes up in {time.monotonic() - t0:.0f} s")
        t1 = time.monotonic()
        serve_deploy(plan)
        wait_serving(plan, deadline)
        say(f"[lab] serving on every node {time.monotonic() - t1:.0f} s after `serve deploy`")
    return plan


def _describe(found: Mapping[str, Sized]) -> str:
    return ", ".join(f"{len(v)} {k}" for k, v in found.items() if v) or "a state file"


def _prepare_root(root: Path, internal_token: str) -> None:
    """The lab's folder, Ray's token, and the internal credential (the Secret's: a node that
    rejoins gets the same one, or the gateway's requests to its replicas would be forbidden)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    root.chmod(0o700)
    for name, value in (("ray_auth_token", secrets.token_hex(32)), (INTERNAL_TOKEN_FILE, internal_token)):
        (root / name).touch(mode=0o600)
        (root / name).chmod(0o600)
        (root / name).write_text(value)


def _create_net(plan: LabPlan) -> None:
    prefixlen = plan.subnet.split("/")[1]
    lab_net.guard_subnet(plan.subnet)
    lab_net.create_bridge(plan.bridge)
    for i, node in enumerate((plan.client, *plan.nodes)):
        lab_net.create_node_net(node, plan.bridge, int(prefixlen), f"{PEER_PREFIX}{i}")


def _base_env() -> dict[str, str]:
    """The image's environment, here: this one without Ray's and ours (they would point a node at
    another cluster), the venv's binaries first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "LLMC_")) or k == "LLMC_CACHE"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _start_node(node: LabNode, plan: LabPlan) -> subprocess.Popen[bytes]:
    """``ray start --block`` in the node's namespace, as the pod's main process (a session of its
    own: the command that started it may end)."""
    folder = Path(plan.root) / node.name
    folder.mkdir(parents=True, exist_ok=True)
    cmd = ["ip", "netns", "exec", node.netns, str(BIN / "ray"), "start", *start_args(node, plan)]
    with open(folder / "ray-start.log", "ab") as log:
        return subprocess.Popen(
            cmd,
            env=_base_env() | node.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=folder,
            start_new_session=True,
        )


def _start_nodes(plan: LabPlan, deadline: float, say: Say) -> dict[str, int]:
    """The head, once its dashboard answers the workers together, then until every node is alive."""
    procs = {plan.head.name: _start_node(plan.head, plan)}
    _wait(lambda: _dashboard(plan, "/api/version") is not None, deadline, "the head's dashboard", procs, plan)
    say(f"[lab] head {plan.head.ip}: GCS {plan.gcs_address}, dashboard {plan.dashboard_url}")
    for node in plan.nodes:
        if not node.head:
            procs[node.name] = _start_node(node, plan)
    want = {n.ip for n in plan.nodes}
    _wait(lambda: want <= set(alive_nodes(plan).values()), deadline, "every node to join", procs, plan)
    return {name: p.pid for name, p in procs.items()}


def _wait(
    ready: Callable[[], bool],
    deadline: float,
    what: str,
    procs: Mapping[str, subprocess.Popen[bytes]],
    plan: LabPlan,
) -> None:
    while not ready():
        for name, p in procs.items():
            if p.poll() is not None:
                log = Path(plan.root) / name / "ray-start.log"
                raise LabError(
                    f"`ray start` of {name} exited ({p.returncode}) waiting for {what}: {_tail(log)}"
                )
        if time.monotonic() > deadline:
            raise LabError(f"timed out waiting for {what} (logs under {plan.root})")
        time.sleep(0.5)


def _tail(path: Path, n: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n" + "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    return f"(no {path})"


# Serve -----------------------------------------------------------------------------------------
def serve_deploy(plan: LabPlan, serve_config: str | None = None) -> None:
    """Serve's own CLI, from the client namespace, with the manifest's serveConfigV2 as is (or
    another, for an in-place upgrade)."""
    path = Path(plan.root) / "serve-config.yaml"
    path.write_text(plan.serve_config if serve_config is None else serve_config)
    env = _base_env() | {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(Path(plan.root) / "ray_auth_token"),
    }
    cmd = ["ip", "netns", "exec", plan.client.netns, str(BIN / "serve"), "deploy", "-a", plan.dashboard_url]
    out = subprocess.run([*cmd, str(path)], env=env, capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        raise LabError(f"serve deploy failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-2000:]}")


def wait_serving(plan: LabPlan, deadline: float) -> None:
    """Every app RUNNING (a failed deploy says why), then every node that should have a Serve proxy
    (the head, and each node with a replica: Serve's ``EveryNode``) answering on its Serve port."""
    while True:
        apps = (serve_details(plan) or {}).get("applications") or {}
        status = {name: (apps.get(name) or {}).get("status") for name in plan.apps()}
        failed = [n for n, s in status.items() if s == "DEPLOY_FAILED"]
        if failed:
            raise LabError(f"{failed[0]} failed to deploy: {apps[failed[0]].get('message')}")
        if all(s == "RUNNING" for s in status.values()):
            break
        if time.monotonic() > deadline:
            raise LabError(f"apps not running before the deadline: {status}")
        time.sleep(1)
    hosting = {name for nodes in placement(plan).values() for name in nodes}
    waiting = [n for n in plan.nodes if n.head or n.name in hosting]
    while waiting:
        waiting = [n for n in waiting if node_health(plan, n) != 200]
        if waiting and time.monotonic() > deadline:
            raise LabError(f"Serve port of {[n.name for n in waiting]} not answering before the deadline")
        time.sleep(0.5 if waiting else 0)


def proxied(plan: LabPlan) -> list[LabNode]:
    """The nodes with a healthy Serve proxy (HAProxy on the Serve port): Serve runs one on the head
    and on each node that holds a replica, and KubeRay's Serve Service selects those pods."""
    proxies = ((serve_details(plan) or {}).get("proxies") or {}).values()
    ips = {p.get("node_ip") for p in proxies if p.get("status") == "HEALTHY"}
    return [n for n in plan.nodes if n.ip in ips]


# Losing a node ---------------------------------------------------------------------------------
def _node(plan: LabPlan, name: str) -> LabNode:
    for n in plan.nodes:
        if n.name == name:
            return n
    raise LabError(f"no node {name} in the lab: {[n.name for n in plan.nodes]}")


def kill_node(plan: LabPlan, name: str) -> list[int]:
    """SIGKILL every process of one node (its raylet, its replicas, its HAProxy) at once, the way
    a preempted pod dies; its namespace and address stay, for a replacement to rejoin."""
    node = _node(plan, name)
    pids = lab_net.lab_pids([node.netns], tag=None)
    lab_net.kill_all(pids, grace_s=0.0, first=signal.SIGKILL)
    return pids


def rejoin(plan: LabPlan, name: str, timeout_s: float = 120.0) -> int:
    """A replacement pod for a lost node: the same address, a fresh folder (the lost one's is
    kept beside it, logs and all); returns once Ray has the new node alive. Serve moves no replica
    back to it by itself (nor starts its proxy until one lands there)."""
    node = _node(plan, name)
    if lab_net.lab_pids([node.netns], tag=None):
        raise LabError(f"{name} still has processes: kill_node first")
    folder = Path(plan.root) / name
    if folder.exists():
        folder.rename(folder.with_name(f"{name}.lost-{time.time_ns()}"))
    lost = set(alive_nodes(plan))  # Ray may not have noticed the loss yet
    proc = _start_node(node, plan)
    deadline = time.monotonic() + timeout_s

    def joined() -> bool:
        return any(ip == node.ip and nid not in lost for nid, ip in alive_nodes(plan).items())

    _wait(joined, deadline, f"{name} to rejoin", {name: proc}, plan)
    return proc.pid


# Reading the lab -------------------------------------------------------------------------------
def _get(url: str, headers: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # the lab's own subnet
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def from_client(plan: LabPlan, fn: Callable[[], T]) -> T:
    """``fn()`` run in the client namespace (where the lab's requests come from)."""
    return lab_net.in_netns(plan.client.netns, fn)


def _dashboard(plan: LabPlan, path: str) -> JSON:
    """A GET of the head's dashboard API with the lab's Ray token (None: no answer yet)."""
    token = (Path(plan.root) / "ray_auth_token").read_text().strip()
    url = plan.dashboard_url + path

    def call() -> JSON:
        with contextlib.suppress(OSError):
            code, body = _get(url, {"Authorization": f"Bearer {token}"})
            if code == 200:
                return json.loads(body)
        return None

    return from_client(plan, call)


def alive_nodes(plan: LabPlan) -> dict[str, str]:
    """Node id → node IP, for the nodes Ray has alive."""
    got = _dashboard(plan, "/api/v0/nodes?limit=1000") or {}
    rows = ((got.get("data") or {}).get("result") or {}).get("result") or []
    return {r["node_id"]: r["node_ip"] for r in rows if r.get("state") == "ALIVE"}


def serve_details(plan: LabPlan) -> JSONObject | None:
    """Serve's own account of the apps (``/api/serve/applications/``, what ``serve status`` reads)."""
    details: JSONObject | None = _dashboard(plan, "/api/serve/applications/")
    return details


def node_health(plan: LabPlan, node: LabNode) -> int | None:
    """The HTTP status of ``/healthz`` through the node's Serve port (None: no answer)."""
    url = f"http://{node.ip}:{plan.serve_port}/healthz"

    def call() -> int | None:
        with contextlib.suppress(OSError):
            return _get(url, timeout_s=3)[0]
        return None

    return from_client(plan, call)


def ready_pods(plan: LabPlan, timeout_s: float = 2.0) -> list[LabNode]:
    """The nodes a KubeRay Serve Service would send to now: those whose Serve port answers 200 on
    ``/-/healthz``, the readiness probe KubeRay gives a RayService's worker pods (and the proxy
    health its operator checks on the head). Serve's own proxy status is not enough: a proxy that
    Serve reports HEALTHY may still answer 404 for every path until its HAProxy has its routes, and
    ``/-/healthz`` says 503 then."""

    def call() -> list[LabNode]:
        ready = []
        for node in plan.nodes:
            with contextlib.suppress(OSError):
                if _get(f"http://{node.ip}:{plan.serve_port}/-/healthz", timeout_s=timeout_s)[0] == 200:
                    ready.append(node)
        return ready

    return from_client(plan, call)


def placement(plan: LabPlan) -> dict[str, list[str]]:
    """Each deployment's running replicas, by the name of the node each runs on."""
    by_ip = {n.ip: n.name for n in plan.nodes}
    out: dict[str, list[str]] = {}
    for app in ((serve_details(plan) or {}).get("applications") or {}).values():
        for name, dep in (app.get("deployments") or {}).items():
            reps = [r for r in dep.get("replicas") or [] if r.get("state") == "RUNNING"]
            out[name] = sorted(by_ip.get(r.get("node_ip"), str(r.get("node_ip"))) for r in reps)
    return out


def running_plan() -> LabPlan:
    """The plan of the lab that is up (from its state file), for reading it."""
    state = read_state()
    if state is None:
        raise LabError("no lab is up (no state file): `cluster lab up` first")
    src, root = state["source"], Path(state["root"])
    with contextlib.suppress(OSError):  # a lab's state without it: reading works, rejoin would not
        return plan_of(src["config"], src["settings"], (root / INTERNAL_TOKEN_FILE).read_text(), root)
    return plan_of(src["config"], src["settings"], root=root)


def addresses(plan: LabPlan) -> list[str]:
    """What a client needs, in lines: each node's Serve address, whether a Kubernetes Service of
    the Serve port would send to it, and how to reach it."""
    lines = [f"dashboard  {plan.dashboard_url}  (Ray's token: {Path(plan.root) / 'ray_auth_token'})"]
    service = {n.name for n in plan.service_nodes()}
    serving = {n.name for n in ready_pods(plan)}  # KubeRay's readiness probe: /-/healthz answers 200
    for n in plan.nodes:
        note = "" if n.name in service else "  (not in the Serve Service: excludeHeadPodFromServeSvc)"
        note = note if n.name in serving else "  (not ready: no Serve proxy, or /-/healthz not 200)"
        lines.append(f"{n.name:<10} {n.group:<8} http://{n.ip}:{plan.serve_port}/v1{note}")
    first = next((n for n in plan.service_nodes() if n.name in serving), plan.head)
    lines.append(
        f"requests come from the client namespace: ip netns exec {plan.client.netns} "
        f"curl http://{first.ip}:{plan.serve_port}/v1/models"
    )
    return lines


def status(say: Say = print) -> int:
    """Say what is up: each node's namespace, processes and Serve port, and the replicas' nodes."""
    plan = running_plan()
    for n in plan.nodes:
        procs = len(lab_net.lab_pids([n.netns], tag=None))
        health = node_health(plan, n) if procs else None
        say(f"{n.name:<10} {n.ip:<13} {procs:>3} processes  /healthz {health}")
    for app, details in ((serve_details(plan) or {}).get("applications") or {}).items():
        say(f"app {app}: {details.get('status')}")
    for dep, nodes in placement(plan).items():
        say(f"  {dep}: {', '.join(nodes) or 'no running replica'}")
    return 0


# Down ------------------------------------------------------------------------------------------
def _end_processes(namespaces: list[str]) -> list[int]:
    """Every process of the lab, ended: a TERM first, for what ends on it at once (Ray's own
    daemons take their time), then KILL a second later (all of it is thrown away), again while a
    fresh look finds any (a child started meanwhile)."""
    killed: list[int] = []
    for _ in range(3):
        found = [p for p in lab_net.lab_pids(namespaces, LAB) if p not in killed]
        if not found:
            break
        killed += lab_net.kill_all(found, grace_s=1.0)
    return killed


def down(say: Say = print) -> dict[str, list[str] | list[int]]:
    """Remove everything of the lab: its processes (TERM, then KILL), namespaces, veths, bridge
    and folder; those the state file names and any found by name or tag. Returns what it found."""
    with _locked():
        state = read_state() or {}
        nodes = [state["client"], *state["nodes"]] if state else []
        namespaces = sorted({n["netns"] for n in nodes} | set(lab_net.lab_namespaces()))
        killed = _end_processes(namespaces)
        links = sorted(
            {n["veth"] for n in nodes} | ({state["bridge"]} if state else set()) | set(lab_net.lab_links())
        )
        lab_net.remove_net(namespaces, links)
        routes = lab_net.guarded(state.get("subnet", SUBNET))
        for route in routes:
            lab_net.unguard_subnet(route)
        shutil.rmtree(state.get("root", ROOT), ignore_errors=True)
        shutil.rmtree(ROOT, ignore_errors=True)
    found: dict[str, list[str] | list[int]] = {
        "processes": killed,
        "namespaces": namespaces,
        "links": links,
        "routes": routes,
    }
    say(f"[lab] down: {_describe(found) if any(found.values()) else 'nothing was up'}")
    left = leftovers()
    if any(left.values()):
        say(f"[lab] still there: {left}")
    return left
