"""The load tests' one quantile: linear between the closest ranks (numpy's default method)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``values`` (any order); nan for no values."""
    v = sorted(values)
    if not v:
        return math.nan
    pos = (len(v) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` percentile (0 to 100): a value that occurred; None for no values.
    What the affinity and overload benchmarks' files were written with (they quote p50/p90/p99 of
    at most a few hundred requests, where an interpolated figure would be one nobody saw)."""
    if not values:
        return None
    v = sorted(values)
    return v[max(0, min(len(v) - 1, math.ceil(q / 100 * len(v)) - 1))]
