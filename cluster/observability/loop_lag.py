"""How late a gateway replica's event loop runs: the delay every request and every relayed chunk
of that replica waits on top of its own work.

A sampler sleeps ``interval_s`` at a time and records how much later than asked it woke. One timer
per replica (never per request or chunk). The window keeps the last ``window_s`` seconds of
samples; :meth:`LoopLagWindow.summary` gives their p50, p99 and max in ms (optionally of the last
``last_s`` seconds only), for the gateway's ``/internal/status`` and the
``llmc_gateway_loop_lag_p99_seconds`` gauge. A p99 of tens of ms
means the replica's CPU is the bottleneck (add gateway replicas or cores), not admission or the
engines. :class:`SampleWindow` is the same window for any duration the gateway reports by
percentile (its time to answer a refusal, for one). Pure: the clock's readings are passed in.
"""

from __future__ import annotations

import math
from collections import deque


class SampleWindow:
    """The last ``max_samples`` durations, each stamped with when it was taken; p50/p99/max in ms."""

    def __init__(self, max_samples: int) -> None:
        if max_samples <= 0:
            raise ValueError("max_samples must be positive")
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self.count = 0  # samples ever added (the window keeps the last max_samples)

    def add(self, at: float, seconds: float) -> None:
        self._samples.append((at, max(0.0, seconds)))
        self.count += 1

    def summary(self, last_s: float | None = None, now: float | None = None) -> dict[str, float | int | None]:
        """``{"p50_ms", "p99_ms", "max_ms", "samples"}`` over the window, or over its samples of the
        ``last_s`` seconds before ``now`` (default: the newest sample's time); None without samples."""
        end = now if now is not None else (self._samples[-1][0] if self._samples else 0.0)
        since = end - last_s if last_s is not None else -math.inf
        xs = sorted(v for t, v in self._samples if t > since)
        if not xs:
            return {"p50_ms": None, "p99_ms": None, "max_ms": None, "samples": 0}

        def rank(q: float) -> float:  # nearest rank
            return xs[max(0, math.ceil(q * len(xs)) - 1)]

        return {
            "p50_ms": round(rank(0.5) * 1000, 2),
            "p99_ms": round(rank(0.99) * 1000, 2),
            "max_ms": round(xs[-1] * 1000, 2),
            "samples": len(xs),
        }


class LoopLagWindow(SampleWindow):
    def __init__(self, interval_s: float = 0.25, window_s: float = 60.0) -> None:
        if interval_s <= 0 or window_s < interval_s:
            raise ValueError("need 0 < interval_s <= window_s")
        super().__init__(math.ceil(window_s / interval_s))
        self.interval_s = interval_s

    def woke(self, asked_at: float, woke_at: float) -> None:
        """A sleep of ``interval_s`` asked at ``asked_at`` returned at ``woke_at``."""
        self.add(woke_at, woke_at - asked_at - self.interval_s)
