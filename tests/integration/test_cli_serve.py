"""``cluster serve`` as the quick start runs it, stopped by Ctrl-C in the middle of its start-up: the
signal is not lost, the cluster is stopped as soon as it is up, and nothing it started is left
(the Serve port free, no HAProxy of its own, no process in its process group).

A terminal's Ctrl-C reaches the whole foreground process group, so the test signals the group.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from deployments.local import free_port

ROOT = Path(__file__).resolve().parents[2]


def _read_until(proc: subprocess.Popen[str], needle: str, timeout_s: float) -> str:
    assert proc.stdout is not None
    seen, deadline = "", time.monotonic() + timeout_s
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} within {timeout_s} s:\n{seen}"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        line = proc.stdout.readline() if ready else ""
        assert ready and line, f"the process ended before {needle!r}:\n{seen}"
        seen += line
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
