"""Child processes a benchmark starts on loopback and must stop: each in its own process group with a
tag in its environment, dying with its parent; what outlives a stop is found by its tag and ended
by PID. Used by :mod:`loadtest.benchmarks.bench_overhead`. Also the box's and vLLM engine cores' CPU time from
``/proc`` (:mod:`loadtest.calibration.calibrate_host`, :mod:`loadtest.benchmarks.planner_real`)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path

from deployments.cpu_sched import engine_core_stats

ROOT = Path(__file__).resolve().parents[2]  # children run from the repository root
HOST = "127.0.0.1"
TAG_VAR = "LLMC_BENCH_TAG"  # in every child's environment: finds what a leg left behind


class LegFailed(Exception):
    """A leg could not be started or did not answer; the run goes on without it."""


# --- processes -------------------------------------------------------------------------------------


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine, a listener is not
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def tagged_processes(tag: str) -> dict[int, str]:
    """PID -> command name of every live process whose environment carries ``TAG_VAR=tag``."""
    needle = f"{TAG_VAR}={tag}".encode()
    found: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (d / "environ").read_bytes().split(b"\0"):
                found[int(d.name)] = (d / "comm").read_text().strip()
    return found


def _wait_gone(tag: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and tagged_processes(tag):
        time.sleep(0.1)


def sweep(tag: str, settle_s: float = 3.0, grace_s: float = 5.0) -> dict[int, str]:
    """End, by PID, what a leg left running (e.g. a ``haproxy`` that outlived ``serve.shutdown()``):
    what has not exited by itself ``settle_s`` after the stop (a resource tracker may take a moment)
    gets SIGTERM, then SIGKILL after ``grace_s``. Returns what had to be signalled."""
    _wait_gone(tag, settle_s)
    left = tagged_processes(tag)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    _wait_gone(tag, grace_s if left else 0.0)
    for pid in tagged_processes(tag):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when this benchmark's process dies, however it dies."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Proc:
    """A child in its own session (process group), its output in a log file, tagged for :func:`sweep`,
    sent SIGTERM if this process dies first."""

    settle_s = 3.0  # after the stop, how long its children may take to exit by themselves

    def __init__(
        self, name: str, cmd: list[str], logdir: Path, env: dict[str, str] | None = None, stdin: bool = False
    ) -> None:
        self.name = name
        self.tag = f"{uuid.uuid4().hex[:12]}-{name}"
        self.log = logdir / f"{name}.log"
        self.leftovers: dict[int, str] = {}
        self.stopped = False
        full_env = {**os.environ, **(env or {}), TAG_VAR: self.tag}
        with self.log.open("wb") as log:
            self.p = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the child's process group, SIGKILL after ``grace_s``, then the leftover sweep."""
        if self.stopped:
            return
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(5)
        self.leftovers = sweep(self.tag, self.settle_s)
        self.stopped = True

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


def wait_http(url: str, proc: Proc, timeout_s: float) -> float:
    """Poll ``GET url`` until 200; seconds waited. Raises LegFailed if the process dies or time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not proc.alive():
            raise LegFailed(f"{proc.name} exited ({proc.p.returncode}):\n{proc.tail()}")
        with contextlib.suppress(OSError), _NO_PROXY.open(url, timeout=2) as resp:
            if resp.status == 200:
                return time.monotonic() - t0
        time.sleep(0.2)
    raise LegFailed(f"{proc.name}: {url} not ready after {timeout_s:.0f} s:\n{proc.tail()}")


# --- CPU time: the relay benchmarks' processes, the host-CPU calibration, the planner's real leg ----

TICK = os.sysconf("SC_CLK_TCK")


def box_busy_s() -> float:
    """CPU seconds the whole box has been busy (every core, every process), from /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / TICK


def cpu_s(pids: Sequence[int]) -> float:
    """utime + stime of ``pids`` (every thread of each), seconds; a gone process counts 0."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
    return total / TICK


def _cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def relay_pids(tag: str) -> dict[str, list[int]]:
    """A benchmark cluster's processes by part, found by its tag: gateway replicas, HAProxy, the
    relay benchmark's engine replica (``sim-paced``) and the no-logic floor's replicas."""
    out: dict[str, list[int]] = {"gateway": [], "haproxy": [], "engine_replica": [], "floor": []}
    for pid, comm in sorted(tagged_processes(tag).items()):
        cmd = _cmdline(pid)
        if comm == "haproxy":
            out["haproxy"].append(pid)
        elif b"ServeReplica" in cmd and b"Gateway" in cmd:
            out["gateway"].append(pid)
        elif b"ServeReplica" in cmd and b"sim-paced" in cmd:
            out["engine_replica"].append(pid)
        elif b"ServeReplica" in cmd and b"FloorRelay" in cmd:
            out["floor"].append(pid)
    return out


def engine_cores_s() -> dict[int, float]:
    """PID -> CPU seconds of each live vLLM engine-core process."""
    # fields 11 and 12 after the name: utime and stime, in clock ticks
    return {pid: (int(f[11]) + int(f[12])) / TICK for pid, f in engine_core_stats().items()}


def quiet_collector() -> None:
    """Freeze this (measuring) process's heap before a measurement, so that the collector's full
    passes, which stop the process (over 150 ms here with Ray, the cluster and vLLM imported), walk
    only what the measurement allocates: a pause of the load generator's own would read as server
    latency in every request in flight. The gateway and engine replicas freeze theirs the same way
    (cluster/observability/gc_pauses.py). Cheap when repeated: only what is new is collected."""
    from cluster.observability.gc_pauses import freeze_startup_heap

    freeze_startup_heap()
