"""The engine compute's scheduling class from the traffic (cluster.policy.cpu_class)."""

from __future__ import annotations

from cluster.policy.cpu_class import CpuClassPolicy


def test_fixed_modes_ignore_the_traffic() -> None:
    for mode in ("normal", "idle"):
        p = CpuClassPolicy(mode)
        assert p.wanted(0.0) == mode
        p.note_request(1.0, priority=0)
        p.note_request(1.0, priority=2)
        assert p.wanted(1.0) == mode


def test_auto_is_normal_until_an_urgent_request_then_idle_for_the_hold() -> None:
    p = CpuClassPolicy("auto", hold_s=10.0)
    assert p.wanted(0.0) == "normal"
    p.note_request(1.0, priority=2)  # Agent alone: the engines keep their throughput
    p.note_request(1.5, priority=1)  # Chat too
    assert p.wanted(2.0) == "normal"
    p.note_request(3.0, priority=0)  # Tab arrives: the relay goes first
    assert p.wanted(3.0) == "idle"
    assert p.wanted(12.9) == "idle"
    p.note_request(12.0, priority=2)  # other work does not extend the hold
    assert p.wanted(13.0) == "normal"


def test_each_urgent_request_extends_the_hold() -> None:
    p = CpuClassPolicy("auto", hold_s=5.0)
    for t in (0.0, 4.0, 8.0):
        p.note_request(t, priority=0)
    assert p.wanted(12.0) == "idle"
    assert p.wanted(13.0) == "normal"


def test_the_urgent_priority_is_configurable() -> None:
    p = CpuClassPolicy("auto", hold_s=5.0, urgent_priority=1)
    p.note_request(0.0, priority=1)
    assert p.wanted(1.0) == "idle"
    q = CpuClassPolicy("auto", hold_s=5.0, urgent_priority=-1)
    q.note_request(0.0, priority=0)
    assert q.wanted(1.0) == "normal"
