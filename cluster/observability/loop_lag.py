"""How late a gateway replica's event loop runs: the delay every request and every relayed chunk
of that replica waits on top of its own work.

A sampler sleeps ``interval_s`` at a time and records how much later than asked it woke. One timer
per replica (never per request or chunk). The window keeps the last ``window_s`` seconds of
samples; :meth:`LoopLagWindow.summary` gives their p50, p99 and max in ms (optionally of the last
``last_s`` seconds only), for the gateway's ``/internal/status`` and the
``llmc_gateway_loop_lag_p99_seconds`` gauge. A p99 of tens of ms
means the replica's CPU is the bottleneck (add gateway replicas or cores), not admission or the
engines. Pure: the clock's readings are passed in.
"""

from __future__ import annotations

import math
from collections import deque


class LoopLagWindow:
    def __init__(self, interval_s: float = 0.25, window_s: float = 60.0) -> None:
        if interval_s <= 0 or window_s < interval_s:
            raise ValueError("need 0 < interval_s <= window_s")
        self.interval_s = interval_s
        self._lags: deque[tuple[float, float]] = deque(maxlen=math.ceil(window_s / interval_s))

    def woke(self, asked_at: float, woke_at: float) -> None:
        """A sleep of ``interval_s`` asked at ``asked_at`` returned at ``woke_at``."""
        self._lags.append((woke_at, max(0.0, woke_at - asked_at - self.interval_s)))

    def summary(self, last_s: float | None = None) -> dict[str, float | int | None]:
        """``{"p50_ms", "p99_ms", "max_ms", "samples"}`` over the window, or over its samples of the
        ``last_s`` seconds before the newest (None without samples)."""
        since = self._lags[-1][0] - last_s if last_s is not None and self._lags else -math.inf
        xs = sorted(lag for t, lag in self._lags if t > since)
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
