"""``cluster serve`` as the quick start runs it, stopped by Ctrl-C in the middle of its start-up: the
signal is not lost, the cluster is stopped as soon as it is up, and nothing it started is left
(the Serve port free, no HAProxy of its own, no process in its process group).

A terminal's Ctrl-C reaches the whole foreground process group, so the test signals the group.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from cluster.config import load_config
from deployments.launcher.haproxy_procs import PREFIX, haproxy_pids
from deployments.launcher.local import free_port

ROOT = Path(__file__).resolve().parents[2]


def _read_until(proc: subprocess.Popen[str], needle: str, timeout_s: float) -> str:
    """What the process printed up to ``needle``. Read from the pipe itself: a line read through
    the text wrapper buffers the lines after it, where select() cannot see them."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen, deadline = "", time.monotonic() + timeout_s
    while needle not in seen:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, left))
        assert ready, f"no {needle!r} within {timeout_s} s:\n{seen}"
        chunk = os.read(fd, 65536)
        assert chunk, f"the process ended before {needle!r}:\n{seen}"
        seen += chunk.decode(errors="replace")
    return seen


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_ctrl_c_during_the_start_up_stops_the_cluster_once_it_is_up() -> None:
    port, mport = free_port(), free_port()
    cli = [sys.executable, "-m", "cluster", "serve", "--config", "configs/sim-local.yaml"]
    proc = subprocess.Popen(
        [*cli, "--port", str(port), "--metrics-port", str(mport)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group, as a terminal gives the command it runs
    )
    try:
        out = _read_until(proc, "[cluster] starting", 60)
        time.sleep(2.0)  # inside the start-up: Ray and Serve coming up
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=300)
        out += rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "a stop signal came during the start-up" in out, out
    assert "[cluster] serving" not in out, out  # it never went on to serve
    assert proc.returncode == 130, out
    deadline = time.monotonic() + 20
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(proc.pid), "a process it started outlived it"
    assert not _listening(port), f"the Serve port {port} is still held"
    hap = f"/tmp/llmc-hap-{proc.pid}/"
    left = subprocess.run(["pgrep", "-f", hap], capture_output=True, text=True).stdout.split()
    assert not left, f"HAProxy of this cluster still running: {left}"


def _serve(cfg: Path, port: int, mport: int) -> subprocess.Popen[str]:
    cli = [sys.executable, "-m", "cluster", "serve", "--config", str(cfg), "--port", str(port)]
    return subprocess.Popen(
        [*cli, "--metrics-port", str(mport)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group, as a shell script or a supervisor runs it
    )


def _stopped(proc: subprocess.Popen[str], port: int, sig_group: bool) -> str:
    """TERM the group or the process alone; what it printed. It must end within the bound, with
    nothing of its own left: no HAProxy, no process in its group, the port free."""
    t0 = time.monotonic()
    if sig_group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    took = time.monotonic() - t0
    assert proc.returncode == 0, out[-3000:]
    deadline = time.monotonic() + 10
    while (_group_alive(proc.pid) or _listening(port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert haproxy_pids(f"{PREFIX}{proc.pid}") == [], "its HAProxy outlived it"
    assert not _group_alive(proc.pid), "a process it started outlived it"
    assert not _listening(port), f"the Serve port {port} is still held"
    assert took < 45, f"stopping took {took:.0f} s"
    return out


def test_a_term_to_the_whole_process_group_stops_it_and_the_port_serves_again(tmp_path: Path) -> None:
    """What a shell script, a supervisor or a CI job does: TERM the group. Ray's processes get the
    signal too; `cluster serve` still stops everything (its HAProxy included) in bounded time, and
    the next start on the same port answers; that one is stopped by a TERM to its PID alone."""
    cfg = load_config(ROOT / "configs/sim-local.yaml")
    one = [b.model_copy(update={"replicas": 1}) for b in cfg.backends]  # the cheapest app that serves
    path = tmp_path / "sim-one.yaml"
    path.write_text(yaml.safe_dump(cfg.model_copy(update={"backends": one}).model_dump(mode="json")))
    port, mport = free_port(), free_port()
    first = _serve(path, port, mport)
    try:
        _read_until(first, "[cluster] serving", 300)
    finally:
        _stopped(first, port, sig_group=True)
    second = _serve(path, port, mport)
    try:
        _read_until(second, "[cluster] serving", 300)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as resp:
            assert resp.status == 200 and json.loads(resp.read())["data"]
    finally:
        _stopped(second, port, sig_group=False)
