"""``cluster lab``: the RayService's cluster as a cluster on one machine. A head, a cpu pod and two
engine pods, each a Ray node in a network namespace of its own, started from the manifest rendered
from configs/sim-local.yaml and k8s/settings/lab.yaml; the app deployed with ``serve deploy`` of
its serveConfigV2; a chat completion through every node's own Serve port; the engines on the
engine nodes and the gateway on the cpu node; then ``cluster lab down`` and nothing left.

Linux, as root (network namespaces); the host's own Ray, if one runs, is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from cluster.k8s.lab_plan import LAB, ROOT, SUBNET, LabNode, LabPlan
from fixtures.haproxy_admin import admin


def _can_make_namespaces() -> bool:
    """Linux, root, iproute2, and the right to make a network namespace (a container may lack it)."""
    if sys.platform != "linux" or os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("unshare")):
        return False
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not _can_make_namespaces(), reason="network namespaces: Linux, root, iproute2"),
]
REPO = Path(__file__).resolve().parents[2]
CLUSTER = str(Path(sys.executable).parent / "cluster")
CONFIG = "configs/sim-local.yaml"


def _cluster(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLUSTER, "lab", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _host_ray() -> set[int]:
    """Every Ray or HAProxy process in the host's own network namespace (a test session's Ray)."""
    here = os.stat("/proc/self/ns/net").st_ino
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        try:
            if ("ray" in cmd or "haproxy" in cmd) and os.stat(f"/proc/{p.pid}/ns/net").st_ino == here:
                out.add(p.pid)
        except OSError:
            continue
    return out


def _lab_processes() -> list[str]:
    out = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(ROOT) in cmd or (p.info["environ"] or {}).get("LLMC_LAB") == LAB:
            out.append(f"{p.pid} {cmd[:120]}")
    return out


def assert_nothing_left() -> None:
    from deployments.launcher import lab

    assert lab.leftovers() == {"namespaces": [], "links": [], "routes": [], "processes": []}
    assert not _lab_processes()
    assert not ROOT.exists()
    prefix = SUBNET.rsplit(".", 1)[0] + "."
    listening = [c for c in psutil.net_connections("inet") if c.laddr and str(c.laddr.ip).startswith(prefix)]
    assert not listening, listening


def _chat(plan: LabPlan, node: LabNode) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """A streamed chat completion through ``node``'s Serve port, from the client namespace."""
    from deployments.launcher import lab

    body = {
        "model": "sim-llama-8b",
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": f"hello from the client to {node.name}"}],
    }
    url = f"http://{node.ip}:{plan.serve_port}/v1/chat/completions"

    def call() -> tuple[dict[str, str], list[dict[str, Any]]]:
        with httpx.stream("POST", url, json=body, timeout=30) as r:
            assert r.status_code == 200, (node.name, r.status_code, r.read())
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
            return dict(r.headers), lines

    headers, lines = lab.from_client(plan, call)
    assert lines[-1] == "[DONE]", lines
    return headers, [json.loads(x) for x in lines[:-1]]


@contextlib.contextmanager
def running_lab(label: str) -> Iterator[tuple[LabPlan, str]]:
    """`cluster lab up` of CONFIG (refused if a lab is up already), its plan and what it printed;
    `cluster lab down` on the way out, whatever happened. Both times go to stderr under ``label``."""
    from deployments.launcher import lab

    if any(lab.leftovers().values()) or lab.read_state() is not None:
        pytest.fail(f"a lab is up on this machine already: {lab.leftovers()} (`cluster lab down`)")
    t0 = time.monotonic()
    up = _cluster("up", "--config", CONFIG, timeout=420)
    print(f"\n[{label}] `cluster lab up` took {time.monotonic() - t0:.1f} s", file=sys.stderr)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield lab.running_plan(), up.stdout
    finally:
        t1 = time.monotonic()
        down = _cluster("down", timeout=180)
        print(f"[{label}] `cluster lab down` took {time.monotonic() - t1:.1f} s", file=sys.stderr)
        assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture(scope="module")
def lab_up() -> Iterator[tuple[LabPlan, str]]:
    with running_lab("test_lab") as up:
        yield up


def test_lab_serves_through_every_node_and_places_by_the_manifest(lab_up) -> None:
    from deployments.launcher import lab

    plan, out = lab_up
    assert [n.group for n in plan.nodes] == ["head", "cpu", "engine", "engine"]
    for n in plan.nodes:  # `up` printed every node's address
        assert f"http://{n.ip}:{plan.serve_port}/v1" in out
    for node in plan.nodes:
        headers, chunks = _chat(plan, node)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text and chunks[0]["model"] == "sim-llama-8b", (node.name, chunks)
        assert headers.get("x-llmc-backend") == "sim-h100", headers
    assert lab.proxied(plan) == list(plan.nodes)  # a healthy Serve proxy on every node
    placed = lab.placement(plan)
    assert placed["Gateway"] == ["cpu-0"], placed
    engines = placed["backend-sim-h100"]
    assert len(engines) == 4 and set(engines) == {"engine-0", "engine-1"}, placed
    alive = lab.alive_nodes(plan)  # Ray's own records: one node per pod, at the pod's address
    assert sorted(alive.values()) == sorted(n.ip for n in plan.nodes), alive
    refused = _cluster("up", "--config", CONFIG, timeout=60)  # a second `up` is refused, changes nothing
    assert refused.returncode == 1 and "cluster lab down" in refused.stderr, refused.stderr
    assert all(lab.node_health(plan, n) == 200 for n in plan.nodes)


def _haproxy_socket(node: LabNode) -> Path:
    """The admin socket of the HAProxy that serves ``node``'s Serve port (in its namespace)."""
    ns = os.stat(f"/run/netns/{node.netns}").st_ino
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        with contextlib.suppress(OSError):
            if "-f" in cmd and "haproxy" in " ".join(cmd) and os.stat(f"/proc/{p.pid}/ns/net").st_ino == ns:
                config = Path(cmd[cmd.index("-f") + 1]).read_text()
                return Path(next(ln.split()[2] for ln in config.splitlines() if "stats socket" in ln))
    raise AssertionError(f"no HAProxy in {node.netns}")


def _error_page(plan: LabPlan, node: LabNode) -> tuple[int, bytes]:
    """What ``node``'s HAProxy answers when no server of the app can take a request: every server
    of its backends set to maintenance through its admin socket for one request, then back."""
    from deployments.launcher import lab

    sock = _haproxy_socket(node)
    rows = [ln.split() for ln in admin(sock, "show servers state").splitlines()]
    servers = [f"{r[1]}/{r[3]}" for r in rows if len(r) > 3 and r[1].startswith("http-")]
    assert servers, rows
    url = f"http://{node.ip}:{plan.serve_port}/v1/chat/completions"
    body = {"model": "sim-llama-8b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    try:
        for s in servers:
            admin(sock, f"disable server {s}")
        r = lab.from_client(plan, lambda: httpx.post(url, json=body, timeout=10))
        return r.status_code, r.content
    finally:
        for s in servers:
            admin(sock, f"enable server {s}")


def test_every_worker_pods_haproxy_answers_with_our_error_page(lab_up) -> None:
    """A request no gateway answers (the one it reached died) gets our OpenAI 503 from every worker
    pod's HAProxy, engine pods included: the replicas replace Ray's plain-text page and have Serve
    reload HAProxy (deployments/haproxy_errors.py; the 14th rehearsal's killed gateway left 4
    clients with Ray's page, on the gateway pod and on both engine pods)."""
    plan, _ = lab_up
    for node in [n for n in plan.nodes if not n.head]:  # the head holds no replica: Ray's page
        deadline = time.monotonic() + 45  # an engine pod's HAProxy starts after its replicas
        while (got := _error_page(plan, node))[0] != 503 and time.monotonic() < deadline:
            time.sleep(1)
        status, raw = got
        assert status == 503, (node.name, status, raw[:200])
        assert json.loads(raw)["error"]["code"] == "gateway_unavailable", (node.name, raw[:300])
    _chat(plan, plan.nodes[1])  # served again


def test_upgrade_and_node_loss_under_load(lab_up, tmp_path: Path) -> None:
    """Issue 41's CI acceptance, on this lab (tests/integration/lab_rehearsal_check.py)."""
    from tests.integration.lab_rehearsal_check import check_upgrade_and_node_loss_under_load

    check_upgrade_and_node_loss_under_load(lab_up[0], tmp_path)


def test_down_leaves_nothing_and_spares_the_hosts_ray(lab_up) -> None:
    from deployments.launcher import lab

    ours = set(lab.leftovers()["processes"])
    assert len(ours) > 10, ours  # Ray's processes of four nodes, their replicas, four HAProxies
    assert not ours & _host_ray(), "down would end a process of the host's own Ray"
    down = _cluster("down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert_nothing_left()


def test_down_after_a_crashed_up() -> None:
    """``up`` killed once its head runs: ``down`` still finds and removes everything."""
    from deployments.launcher import lab

    proc = subprocess.Popen([CLUSTER, "lab", "up", "--config", CONFIG], cwd=REPO, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (lab.read_state() or {}).get("pids") and not list(ROOT.glob("*/ray-start.log")):
        assert proc.poll() is None and time.monotonic() < deadline, "up ended or never started a node"
        time.sleep(0.2)
    time.sleep(2)  # the head is starting: its processes are there
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert lab.leftovers()["processes"], "the crash left nothing to clean up: the test tests nothing"
    down = _cluster("down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert_nothing_left()
