"""Move a vLLM replica's engine-core process between Linux scheduling classes; set the gateway's
niceness and its node's HAProxy's (:func:`renice_gateway`).

What class the engine's compute wants, and why, is ``cluster.policy.cpu_class``; this is the shell
that applies it. Only the engine core (the model's compute and its busy-waiting workers) changes
class; the replica's own process, which streams the tokens, keeps its class. A thread inherits its
creator's class, so threads the engine starts later follow. Entering ``SCHED_IDLE`` needs no
privilege; leaving it needs CAP_SYS_NICE or an RLIMIT_NICE that allows the thread's niceness
(``PermissionError`` otherwise: the caller then keeps the idle class and says so).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from cluster.policy.cpu_class import CpuClassPolicy, Klass, Mode


class Renice(TypedDict):
    """What :func:`renice_gateway` did (the gateway's status page shows it)."""

    nice: int
    pid: int
    haproxy_processes: int  # HAProxy processes of the node moved to ``nice``
    refused: str | None  # why not, when the kernel refused


# What :meth:`EngineCoreClass.report` says (the replica's stats); "class" is a keyword, hence
# TypedDict's call form.
CoreClassReport = TypedDict(
    "CoreClassReport", {"mode": Mode, "class": Klass, "cores": list[int], "changes": int, "stuck": str | None}
)

log = logging.getLogger(__name__)

ENGINE_CORE_NAMES = ("EngineCor",)  # vLLM names its engine-core process "VLLM::EngineCore"


def _stat_fields(d: Path) -> list[str]:
    """``<d>/stat``'s fields after the command name (state, ppid, ...); the name may hold ')'."""
    return (d / "stat").read_text().rsplit(")", 1)[1].split()


def parent_pid(pid: int, proc: Path = Path("/proc")) -> int:
    return int(_stat_fields(proc / str(pid))[1])


def engine_core_stats(proc: Path = Path("/proc")) -> dict[int, list[str]]:
    """PID -> the ``/proc/<pid>/stat`` fields after the command name (state, ppid, ...) of each
    live vLLM engine-core process, found by its name or its command line."""
    out = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            if not any(n in (d / "comm").read_text() for n in ENGINE_CORE_NAMES) and (
                b"EngineCore" not in (d / "cmdline").read_bytes()
            ):
                continue
            out[int(d.name)] = _stat_fields(d)
        except OSError:
            continue  # gone meanwhile
    return out


def engine_core_children(parent: int, proc: Path = Path("/proc")) -> list[int]:
    """PIDs of the engine-core processes whose parent is ``parent``."""
    return [pid for pid, f in engine_core_stats(proc).items() if int(f[1]) == parent]


POLICIES = {"idle": os.SCHED_IDLE, "normal": os.SCHED_OTHER}


def _each_thread(pid: int, proc: Path, apply: Callable[[int], object]) -> int:
    """``apply(tid)`` for every thread of ``pid``; how many it reached. A process or thread that
    ended meanwhile is skipped; anything else (``PermissionError``) is raised."""
    try:
        threads = list((proc / str(pid) / "task").iterdir())
    except FileNotFoundError:
        return 0  # the process ended meanwhile
    done = 0
    for t in threads:
        try:
            apply(int(t.name))
            done += 1
        except (ProcessLookupError, FileNotFoundError):
            continue  # the thread ended meanwhile
    return done


def set_class(pid: int, klass: str, proc: Path = Path("/proc")) -> int:
    """Every thread of ``pid`` into ``klass`` ('idle' or 'normal'); returns how many were moved."""
    policy = POLICIES[klass]
    return _each_thread(pid, proc, lambda tid: os.sched_setscheduler(tid, policy, os.sched_param(0)))


def set_nice(pid: int, nice: int, proc: Path = Path("/proc")) -> int:
    """Every thread of ``pid`` to niceness ``nice`` (Linux keeps one per thread, and a thread or a
    child process starts with its creator's); returns how many were set. Lowering it needs
    CAP_SYS_NICE: ``PermissionError`` otherwise."""
    return _each_thread(pid, proc, lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice))


def haproxy_pids(raylet: int, proc: Path = Path("/proc")) -> list[int]:
    """The Serve HAProxy of this Ray node and the actor that starts it: ``HAProxyManager``, a worker
    of the node's raylet like the caller, and the ``haproxy`` processes it runs as its children
    (HAProxy restarts on each config reload, with the manager's niceness). Another HAProxy on the
    host, or another Ray node's, is not ours to touch."""
    stats: dict[int, tuple[str, int, bytes]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm, ppid = (d / "comm").read_text().strip(), int(_stat_fields(d)[1])
            stats[int(d.name)] = (comm, ppid, (d / "cmdline").read_bytes())
        except (OSError, ValueError, IndexError):
            continue
    managers = {
        p for p, (_, pp, cmd) in stats.items() if pp == raylet and cmd.startswith(b"ray::HAProxyManager")
    }
    return sorted(
        managers | {p for p, (comm, pp, _) in stats.items() if comm == "haproxy" and pp in managers}
    )


def renice_gateway(nice: int, proc: Path = Path("/proc"), pid: int | None = None) -> Renice:
    """This process (a gateway replica; or ``pid``) and its node's HAProxy to ``nice``. A refusal
    is logged and reported, not raised: the processes keep Ray's niceness then."""
    pid = os.getpid() if pid is None else pid
    out: Renice = {"nice": nice, "pid": pid, "haproxy_processes": 0, "refused": None}
    try:
        raylet = parent_pid(pid, proc)  # the node's raylet, parent of every worker on it
        set_nice(pid, nice, proc)
        for other in haproxy_pids(raylet, proc):
            out["haproxy_processes"] += bool(set_nice(other, nice, proc))
    except (OSError, ValueError, IndexError) as exc:  # PermissionError: no CAP_SYS_NICE
        out["refused"] = f"cannot set niceness {nice}: {exc}"
        log.warning("%s (the gateway and HAProxy keep theirs)", out["refused"])
    return out


class EngineCoreClass:
    """A replica's engine cores and the scheduling class they are in, kept where its
    :class:`~cluster.policy.cpu_class.CpuClassPolicy` wants them. The replica calls
    :meth:`note_request` per request and :meth:`apply` periodically (its stats), so a class that
    is no longer wanted is left within a stats period; a change costs syscalls, a request that
    changes nothing none."""

    def __init__(self, policy: CpuClassPolicy, parent: int | None = None) -> None:
        self.policy = policy
        self.cores = engine_core_children(os.getpid() if parent is None else parent)
        self.current: Klass = "normal"  # what the engine started in
        self.changes = 0
        self.stuck: str | None = None  # why the last change failed; no further tries then
        self.apply(time.monotonic())

    def note_request(self, now: float, priority: int) -> None:
        self.policy.note_request(now, priority)
        self.apply(now)

    def apply(self, now: float) -> None:
        want = self.policy.wanted(now)
        if want == self.current or not self.cores or self.stuck is not None:
            return
        try:
            for pid in self.cores:
                set_class(pid, want)
        except PermissionError as exc:
            self.stuck = f"cannot move the engine cores to the {want} class: {exc}"
            log.warning("%s (they stay %s)", self.stuck, self.current)
            return
        self.current = want
        self.changes += 1

    def report(self) -> CoreClassReport:
        return {
            "mode": self.policy.mode,
            "class": self.current,
            "cores": self.cores,
            "changes": self.changes,
            "stuck": self.stuck,
        }
