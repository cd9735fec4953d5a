"""Garbage-collection pauses of a serving process, and freezing the heap it built at startup.

CPython's cyclic collector stops the whole process while it runs: no chunk is relayed, no timer
fires (a hedge due, the stream watchdog), no request is admitted. A full (generation 2) collection
walks every tracked object, and a gateway or engine replica holds a few hundred thousand of them
after its imports, tokenizers and config are loaded (Ray, Serve, uvicorn, pydantic, the
tokenizer's vocabulary): about 35 ms on an idle core here, several times that on a saturated one,
each time allocation churn from requests triggers one.

:func:`freeze_startup_heap` moves everything alive at the end of a replica's startup into the
collector's permanent generation (``gc.freeze``), so later collections walk only what requests
allocated since. Those startup objects live as long as the process anyway; what they could still
leak in a cycle is bounded by what startup made. :class:`GcPauses` measures the result: fed by
``gc.callbacks`` (:func:`install`), it counts collections per generation and keeps the durations of
the generation-1 and -2 ones (generation-0 collections are only counted: they run every few hundred
allocations and take microseconds), for the replica's ``/internal/status`` and the operator's view.
Pure apart from :func:`install` and :func:`freeze_startup_heap`: the clock's readings are passed in.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from cluster.json_types import JSONObject
from cluster.observability.loop_lag import SampleWindow

TIMED_GENERATIONS = (1, 2)


class GcPauses:
    """Collections per generation, and the last ``max_samples`` pauses of generations 1 and 2."""

    def __init__(self, max_samples: int = 1024) -> None:
        self.counts = [0, 0, 0]
        self.windows = {g: SampleWindow(max_samples) for g in TIMED_GENERATIONS}
        self._started: float | None = None

    def on_event(self, phase: str, generation: int, now: float) -> None:
        """One ``gc.callbacks`` call: ``phase`` "start" or "stop" of a collection of ``generation``."""
        if phase == "start":
            self._started = now
            return
        if phase != "stop" or not 0 <= generation <= 2:
            return
        self.counts[generation] += 1
        started, self._started = self._started, None
        if started is not None and generation in self.windows:
            self.windows[generation].add(now, now - started)

    def summary(self, last_s: float, now: float) -> JSONObject:
        """Counts since the start, and each timed generation's p50/p99/max over ``last_s`` seconds."""
        return {
            "collections": {f"gen{g}": n for g, n in enumerate(self.counts)},
            **{f"gen{g}_pause_last_{last_s:g}s": w.summary(last_s, now) for g, w in self.windows.items()},
        }


def install(pauses: GcPauses, clock: Callable[[], float] = time.perf_counter) -> Callable[..., None]:
    """Feed ``pauses`` from this process's collector; returns the callback (to remove it again)."""

    def callback(phase: str, info: JSONObject) -> None:
        pauses.on_event(phase, info.get("generation", -1), clock())

    gc.callbacks.append(callback)
    return callback


def freeze_startup_heap() -> int:
    """Collect once, then move every surviving object to the permanent generation; the number of
    objects frozen. Call at the end of a replica's startup, before it serves."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
