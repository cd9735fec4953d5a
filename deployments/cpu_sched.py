"""Put a vLLM replica's engine-core process in Linux's idle scheduling class (``SCHED_IDLE``).

On a host where the engines compute on the same cores as the gateway, HAProxy and the engine
replicas' own HTTP streams (the local CPU cluster), equal niceness lets an engine step take a core
from the relay for a whole time slice: a Tab request then waits for the loop that would admit it
(the gateway's loop lagged 17 to 85 ms at p99 beside two busy vLLM-CPU engines, BENCHMARKS.md). An
idle-class thread runs only when nothing else wants the core and is preempted at once when
something wakes, so the relay runs first and the engines still get every cycle it leaves.

Only the engine core (the model's compute and its busy-waiting workers) goes idle-class; the
replica's own process, which streams tokens to the gateway, keeps its class. A thread inherits its
creator's class, so threads the engine starts later (OpenMP's on its first parallel region) follow.
Lowering one's own class needs no privilege. Not for a GPU host: there the engine's CPU loop feeds
the GPU and must not wait behind other work.
"""

from __future__ import annotations

import os
from pathlib import Path

ENGINE_CORE_NAMES = ("EngineCor",)  # vLLM names its engine-core process "VLLM::EngineCore"


def engine_core_children(parent: int, proc: Path = Path("/proc")) -> list[int]:
    """PIDs of the engine-core processes whose parent is ``parent``."""
    found = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm = (d / "comm").read_text()
            if not any(n in comm for n in ENGINE_CORE_NAMES):
                continue
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == parent:
            found.append(int(d.name))
    return found


def set_idle_class(pid: int, proc: Path = Path("/proc")) -> int:
    """Every thread of ``pid`` into ``SCHED_IDLE``; returns how many threads were moved."""
    moved = 0
    try:
        threads = list((proc / str(pid) / "task").iterdir())
    except FileNotFoundError:
        return 0  # the process ended meanwhile
    for t in threads:
        try:
            os.sched_setscheduler(int(t.name), os.SCHED_IDLE, os.sched_param(0))
            moved += 1
        except (ProcessLookupError, FileNotFoundError):
            continue  # the thread ended meanwhile
    return moved


def idle_engine_cores(parent: int | None = None) -> dict[int, int]:
    """The engine-core children of ``parent`` (this process by default) into the idle class:
    {pid: threads moved}. Empty when the engine runs in this process (nothing is moved then: the
    replica's own HTTP stream must not go idle-class)."""
    parent = os.getpid() if parent is None else parent
    return {pid: set_idle_class(pid) for pid in engine_core_children(parent)}


def sched_class(pid: int) -> str:
    """The scheduling class of ``pid``'s main thread, by name (for stats and tests)."""
    names = {os.SCHED_OTHER: "normal", os.SCHED_IDLE: "idle", os.SCHED_BATCH: "batch"}
    return names.get(os.sched_getscheduler(pid), str(os.sched_getscheduler(pid)))
