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
