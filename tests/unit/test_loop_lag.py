"""The gateway's event-loop lag window: lateness of each timed sleep, bounded by time, summarized."""

from __future__ import annotations

import pytest

from cluster.observability.loop_lag import LoopLagWindow, SampleWindow


def test_lag_is_the_lateness_past_the_interval_and_never_negative() -> None:
    w = LoopLagWindow(interval_s=0.1, window_s=1.0)
    assert w.summary() == {"p50_ms": None, "p99_ms": None, "max_ms": None, "samples": 0}
    for i in range(8):  # on time (or, by clock jitter, early): 0 ms
        w.woke(float(i), i + 0.1 - (0.001 if i % 2 else 0.0))
    w.woke(10.0, 10.125)  # 25 ms late
    w.woke(11.0, 11.3)  # 200 ms late
    s = w.summary()
    assert s["samples"] == 10 and s["p50_ms"] == 0.0
    assert s["p99_ms"] == pytest.approx(200.0) and s["max_ms"] == pytest.approx(200.0)


def test_the_window_keeps_only_its_last_seconds_of_samples() -> None:
    w = LoopLagWindow(interval_s=0.1, window_s=1.0)  # 10 samples
    w.woke(0.0, 0.6)  # 500 ms late, then pushed out by ten on-time samples
    for i in range(10):
        w.woke(1.0 + i, 1.1 + i)
    assert w.summary()["max_ms"] == pytest.approx(0.0) and w.summary()["samples"] == 10


def test_bad_windows_are_refused() -> None:
    with pytest.raises(ValueError):
        LoopLagWindow(interval_s=0.0)
    with pytest.raises(ValueError):
        LoopLagWindow(interval_s=2.0, window_s=1.0)


def test_a_summary_can_cover_only_the_last_seconds() -> None:
    w = LoopLagWindow(interval_s=0.1, window_s=60.0)
    w.woke(0.0, 0.6)  # 500 ms late at t = 0.6
    for i in range(1, 21):  # on time, t = 1.1 .. 20.1
        w.woke(float(i), i + 0.1)
    assert w.summary()["max_ms"] == pytest.approx(500.0) and w.summary()["samples"] == 21
    recent = w.summary(last_s=10.0)  # after t = 10.1: ten samples, all on time
    assert recent["samples"] == 10 and recent["max_ms"] == pytest.approx(0.0)


def test_sample_window_summarises_the_last_seconds_before_now() -> None:
    w = SampleWindow(max_samples=3)
    assert w.summary()["samples"] == 0
    for at, took in ((1.0, 0.002), (2.0, 0.004), (3.0, 0.010), (4.0, -1.0)):
        w.add(at, took)  # the oldest falls out; a negative duration counts as 0
    assert w.summary() == {"p50_ms": 4.0, "p99_ms": 10.0, "max_ms": 10.0, "samples": 3}
    assert w.count == 4  # every sample ever added, the dropped one too
    assert w.summary(last_s=1.5)["samples"] == 2  # 3.0 and 4.0: within 1.5 s of the newest
    assert w.summary(last_s=1.5, now=100.0)["samples"] == 0  # nothing in the 1.5 s before now
    with pytest.raises(ValueError):
        SampleWindow(0)
