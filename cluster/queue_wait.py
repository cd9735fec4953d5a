"""How long a new waiter would wait: the estimate behind admission's fast, honest rejects.

A request that joins a surface's queue behind ``ahead`` others gets a slot after ``ahead + 1`` of
that surface's requests end (whatever binds it: the surface's limit, a backend cap, or the SLO
guard's cap on lower-priority work, the slots it can have come back as its own requests end). So
the wait is ``(ahead + 1) / r`` with ``r`` the surface's recent completion rate. When that exceeds
the queue deadline the request would only wait the deadline out and then get a 429: admission
answers the 429 at once instead, with the estimate as ``Retry-After``.

The rate is counted over the completions of the last ``window_s`` seconds, divided by the time
they span (not by the whole window, which would understate the rate right after a start). With
fewer than ``min_samples`` completions there is no estimate: the request queues, and its deadline
still bounds the wait. Pure: ``now`` and the completion times are passed in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MIN_SPAN_S = 0.05  # a burst of completions in one instant says little about a rate


@dataclass(frozen=True, slots=True)
class WaitEstimate:
    wait_s: float  # predicted time until a slot
    rate_per_s: float  # the completion rate it was computed from


def completion_rate(done_times: deque[float], now: float, window_s: float, min_samples: int) -> float | None:
    """Completions per second over the last ``window_s`` (older entries are dropped from the
    deque); None with fewer than ``min_samples`` in the window."""
    cutoff = now - window_s
    while done_times and done_times[0] <= cutoff:
        done_times.popleft()
    n = len(done_times)
    if n < min_samples:
        return None
    return n / max(now - done_times[0], MIN_SPAN_S)


def predict_wait(
    ahead: int, done_times: deque[float], now: float, *, window_s: float = 10.0, min_samples: int = 3
) -> WaitEstimate | None:
    """The wait of a waiter joining behind ``ahead`` others, or None when the rate is unknown."""
    rate = completion_rate(done_times, now, window_s, min_samples)
    if rate is None:
        return None
    return WaitEstimate((ahead + 1) / rate, rate)
