"""Can any hedge delay meet the hedging benchmark's goal on this run's own TTFTs? (pure)

The goal: with a share ``s`` of calls slow (far past the limit), the hedge-on p99 within
``limit_ratio`` x the no-fault p99, spending at most ``budget_ratio`` extra requests. Two
conditions on one delay ``d``, read from the no-fault TTFTs of the same run:

* **the budget**: the p99 tolerates ``k`` calls above the limit, so at least ``slow - k`` slow
  calls must be hedged, which leaves ``budget - (slow - k)`` hedges for normal calls that pass the
  delay; ``d`` must be at least the TTFT that that many normal calls exceed (``earliest_delay``);
* **the tail**: a hedged slow call ends about a delay plus a normal call's TTFT after it began, so
  ``d`` must be at most ``limit - median`` (``latest_delay``), and not below the policy's floor.

Both are necessary, not sufficient (half the hedges take longer than the median, and the slow
calls come in bursts the budget cannot follow): when ``earliest_delay > latest_delay`` no delay
meets the goal on this box, whatever the policy. With ``s`` equal to the budget the window is a
few normal calls wide, so the goal needs a no-fault tail about twice the median (p99 >= ~2 x p50):
a quiet box with a tight tail makes it unreachable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from loadtest.common.stats import quantile


def hedge_window(
    no_fault_ms: Sequence[float],
    slow_share: float,
    budget_ratio: float,
    floor_ms: float = 0.0,
    limit_ratio: float = 1.5,
    q: float = 0.99,
) -> dict[str, Any]:
    xs = sorted(x for x in no_fault_ms if x == x)
    n = len(xs)
    if n < 100:
        return {"n": n, "feasible": None, "why": "fewer than 100 no-fault TTFTs"}
    p99, median = quantile(xs, q), quantile(xs, 0.5)
    limit = limit_ratio * p99
    # calls that may sit above the limit while the q quantile stays below it
    tolerated = n - 1 - math.ceil(q * (n - 1))
    slow, budget = slow_share * n, budget_ratio * n
    false_allowed = math.floor(budget - max(0.0, slow - tolerated))
    latest = limit - median
    # the delay that exactly ``false_allowed`` normal calls exceed (none: the budget alone fails)
    earliest = math.inf if false_allowed < 0 else xs[n - 1 - min(false_allowed, n - 1)]
    start = max(earliest, floor_ms)
    return {
        "n": n,
        "no_fault_p50_ms": round(median, 1),
        "no_fault_p99_ms": round(p99, 1),
        "limit_ms": round(limit, 1),
        "slow_calls": round(slow, 1),
        "budget_hedges": round(budget, 1),
        "unhedged_tolerated": tolerated,
        "false_hedges_allowed": false_allowed,
        "earliest_delay_ms": round(earliest, 1) if math.isfinite(earliest) else None,
        "floor_ms": floor_ms,
        "latest_delay_ms": round(latest, 1),
        "feasible": start <= latest,
        "p99_over_p50": round(p99 / median, 2) if median > 0 else None,
    }
