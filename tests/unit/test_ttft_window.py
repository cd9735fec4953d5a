"""An engine replica's recent first tokens, as it reports them to every gateway."""

from __future__ import annotations

from cluster.policy.ttft_window import TtftWindow


def test_samples_are_numbered_aged_and_forgotten_past_the_window() -> None:
    w = TtftWindow(window_s=10.0, max_samples=3)
    w.add(1.0, 0, 0.05)
    w.add(2.0, 2, 1.5)
    assert w.report(3.0) == [(1, 2.0, 0, 0.05), (2, 1.0, 2, 1.5)]
    assert w.report(11.5) == [(2, 9.5, 2, 1.5)]  # the first is older than the window


def test_the_report_is_bounded_and_keeps_counting() -> None:
    w = TtftWindow(window_s=10.0, max_samples=3)
    for i in range(5):
        w.add(float(i), 0, 0.01)
    assert [seq for seq, *_ in w.report(5.0)] == [3, 4, 5]  # numbers go on: readers dedupe by them
