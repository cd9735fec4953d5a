"""Finding and stopping the local launcher's HAProxy processes, by their config path only.

Serve's HAProxy runs as ``haproxy -db -f <folder>/<node id>/haproxy.cfg ...``, with its files in a
folder per driver process (``/tmp/llmc-hap-<driver pid>``, ``deployments/launcher/local.py``): the folder
in a process's command line says whose it is. A driver stops its own HAProxy in ``local.stop()``;
one whose driver died without that (killed, or aborted in Ray's own signal handler) is *stale*:
its driver pid no longer runs, or runs a process that started after it (the pid was reused). The
next start stops stale ones, so they never keep the API port. Only processes and folders of this
user are considered, and only HAProxy processes: never another process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

PREFIX = "/tmp/llmc-hap-"
PROC = Path("/proc")


def _cmdline(d: Path) -> list[str]:
    with contextlib.suppress(OSError):
        return (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
    return []


def _mine(d: Path) -> bool:
    with contextlib.suppress(OSError):
        return d.stat().st_uid == os.getuid()
    return False


def _started(d: Path) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((d / "stat").read_text().rsplit(")", 1)[1].split()[19])
    return None


def _haproxies(proc: Path) -> dict[int, list[str]]:
    """This user's HAProxy processes: pid → command line."""
    out: dict[int, list[str]] = {}
    for d in proc.iterdir():
        if d.name.isdigit() and _mine(d):
            cmd = _cmdline(d)
            if cmd and os.path.basename(cmd[0]) == "haproxy":
                out[int(d.name)] = cmd
    return out


def haproxy_pids(folder: str, proc: Path = PROC) -> list[int]:
    """HAProxy processes started with a config under ``folder`` (never anyone else's)."""
    under = folder.rstrip("/") + "/"
    return sorted(pid for pid, cmd in _haproxies(proc).items() if any(a.startswith(under) for a in cmd))


def _driver(cmd: list[str], prefix: str) -> int | None:
    for arg in cmd:
        if arg.startswith(prefix):
            head = arg[len(prefix) :].split("/", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def _gone(driver: int, since: int | None, proc: Path) -> bool:
    """Whether the driver that started an HAProxy (started at ``since``) no longer runs."""
    d = proc / str(driver)
    if not d.is_dir():
        return True
    started = _started(d)
    return since is not None and started is not None and started > since  # a reused pid


def stale_haproxy(prefix: str = PREFIX, proc: Path = PROC) -> dict[int, int]:
    """HAProxy pid → its driver's pid, for every HAProxy of ours whose driver is gone."""
    out: dict[int, int] = {}
    for pid, cmd in _haproxies(proc).items():
        driver = _driver(cmd, prefix)
        if driver is not None and driver != os.getpid() and _gone(driver, _started(proc / str(pid)), proc):
            out[pid] = driver
    return out


def stale_folders(prefix: str = PREFIX, proc: Path = PROC) -> list[Path]:
    """This user's launcher folders whose driver no longer runs."""
    parent, stem = os.path.split(prefix)
    out = []
    for p in Path(parent).glob(f"{stem}*"):
        pid = p.name[len(stem) :]
        if pid.isdigit() and int(pid) != os.getpid() and not (proc / pid).is_dir() and _mine(p):
            out.append(p)
    return out


def terminate(pids: list[int], folder_of: Path | None = None, wait_s: float = 10.0) -> None:
    """SIGTERM each (an HAProxy stops at once on it), SIGKILL what is left after ``wait_s``. With
    ``folder_of``, a pid counts as left only while it is still an HAProxy of that folder."""

    def alive() -> list[int]:
        if folder_of is not None:
            return [p for p in haproxy_pids(str(folder_of)) if p in pids]
        return [p for p in pids if (PROC / str(p)).is_dir()]

    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def stop_stale(prefix: str = PREFIX) -> list[str]:
    """Stop every stale HAProxy of ours and remove the folders of drivers that are gone; returns a
    line per HAProxy stopped (for the log)."""
    stale = stale_haproxy(prefix)
    for pid, driver in stale.items():
        terminate([pid], Path(f"{prefix}{driver}"), wait_s=5.0)
    for folder in stale_folders(prefix):
        if not haproxy_pids(str(folder)):
            shutil.rmtree(folder, ignore_errors=True)
    return [
        f"stopped a stale HAProxy (pid {p}) of a cluster whose driver (pid {d}) is gone"
        for p, d in stale.items()
    ]
