"""cluster/observability/gc_pauses.py: collections counted and timed from gc.callbacks' events,
and the startup heap frozen."""

from __future__ import annotations

import gc

import pytest

from cluster.observability.gc_pauses import GcPauses, freeze_startup_heap, install


def test_pauses_of_generations_1_and_2_are_timed_and_generation_0_only_counted() -> None:
    p = GcPauses()
    for gen, start, stop in ((0, 1.0, 1.0001), (1, 2.0, 2.002), (2, 3.0, 3.040), (2, 4.0, 4.010)):
        p.on_event("start", gen, start)
        p.on_event("stop", gen, stop)
    s = p.summary(60.0, 4.0)
    assert s["collections"] == {"gen0": 1, "gen1": 1, "gen2": 2}
    assert s["gen1_pause_last_60s"]["max_ms"] == pytest.approx(2.0)
    assert s["gen2_pause_last_60s"]["samples"] == 2
    assert s["gen2_pause_last_60s"]["max_ms"] == pytest.approx(40.0)


def test_window_forgets_old_pauses_and_a_stop_without_start_is_counted_not_timed() -> None:
    p = GcPauses()
    p.on_event("start", 2, 0.0)
    p.on_event("stop", 2, 0.05)
    p.on_event("stop", 2, 100.0)  # no start seen (installed mid-collection)
    s = p.summary(10.0, 100.0)
    assert s["collections"]["gen2"] == 2
    assert s["gen2_pause_last_10s"]["samples"] == 0


def test_install_feeds_real_collections_and_freeze_moves_the_heap() -> None:
    p = GcPauses()
    cb = install(p)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(cb)
    assert p.counts[2] >= 1
    assert p.windows[2].count >= 1
    before = len(gc.get_objects())
    try:
        frozen = freeze_startup_heap()
        assert frozen > 0
        # Frozen objects are no longer in the collected generations, so a full collection walks fewer.
        assert len(gc.get_objects()) < before
    finally:
        gc.unfreeze()
