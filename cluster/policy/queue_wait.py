"""How long a new waiter would wait: the estimate behind admission's fast, honest rejects.

A request that joins a surface's queue behind ``ahead`` others gets a slot when the
``ahead + 1``-th slot of that surface frees (whatever binds it: the surface's limit, a backend cap,
or the SLO guard's cap on lower-priority work, its slots come back as its own requests end). Each
of the surface's requests in flight frees its slot after the time such a request still takes, given
how long it has run: the mean of the recent durations longer than its elapsed time, less that time
(another mean ``D`` when it has run longer than every recent one); then a slot frees every ``D``
again as the waiters before this one take it and end in turn (when a cap on the surface's work was
lowered below what it has in flight, the first completions free nothing: they are skipped). A
request that had run past the mean used to count as freeing its slot at once, which predicts too
short a wait whenever requests run longer than the window remembers (a flood's ramp). When that
time exceeds
the queue deadline, the request would only wait the deadline out and then get a 429: admission
answers the 429 at once instead, with the estimate as ``Retry-After``.

Durations, not a completion rate: requests admitted together end together, and a rate counted
over such bursts overstates how soon the next slot frees. With fewer than ``min_samples`` recent
durations, or nothing of the surface in flight, there is no estimate: the request queues and its
deadline still bounds the wait. Pure: ``now`` and the samples are passed in.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

# A new waiter is refused at once when its predicted wait passes this share of its queue deadline,
# not the whole deadline. Under a sustained flood the queue fills up to the predicted-wait limit, so
# its last waiters always sit at the limit, and any error in the prediction makes them wait the
# deadline out for a 429 anyway: bench_overload_shared's vLLM-CPU leg at 3x had 22-36 of ~1,400
# Agent refusals after the 5 s deadline in four runs (runs 12-15); in run 15, which counted it,
# every one had queued on an estimate (deadline_unestimated 0). The margin refuses at once the
# waiters an estimate puts that close to their deadline.
WAIT_SHARE = 0.8


@dataclass(frozen=True, slots=True)
class WaitEstimate:
    wait_s: float  # predicted time until a slot
    mean_duration_s: float  # the recent mean request duration it was computed from


class DurationWindow:
    """The surface's recent request durations (admitted → ended), at most ``maxlen`` of the last
    ``window_s`` seconds."""

    def __init__(self, window_s: float = 30.0, maxlen: int = 64) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=maxlen)  # (ended at, duration)

    def add(self, ended_at: float, duration_s: float) -> None:
        self._samples.append((ended_at, max(0.0, duration_s)))

    def mean(self, now: float, min_samples: int) -> float | None:
        while self._samples and self._samples[0][0] <= now - self.window_s:
            self._samples.popleft()
        if len(self._samples) < min_samples:
            return None
        return sum(d for _, d in self._samples) / len(self._samples)

    def remaining(self, elapsed_s: float, mean: float) -> float:
        """How much longer a request that has run ``elapsed_s`` is expected to take: the mean of the
        recent durations longer than that, less ``elapsed_s`` (the empirical mean residual life); a
        request past every recent one takes another ``mean``. Call after :meth:`mean` (it expires)."""
        longer = [d for _, d in self._samples if d > elapsed_s]
        return sum(longer) / len(longer) - elapsed_s if longer else mean


def slot_times(
    elapsed_in_flight: Iterable[float],
    durations: DurationWindow,
    now: float,
    count: int,
    *,
    skip: int = 0,
    min_samples: int = 3,
) -> tuple[list[float], float] | None:
    """When the next ``count`` slots free for the waiters in order (and the mean duration), given
    how long each of the surface's requests in flight has run; ``skip``: the first completions free
    no slot (work over a cap that was lowered). None when there is no estimate."""
    mean = durations.mean(now, min_samples)
    if mean is None:
        return None
    frees = [durations.remaining(e, mean) for e in elapsed_in_flight]
    heapq.heapify(frees)
    for _ in range(min(skip, len(frees))):
        heapq.heappop(frees)
    if not frees:
        return None
    out = []
    for _ in range(count):  # each waiter takes the next free slot and holds it for ``mean``
        out.append(frees[0])
        heapq.heapreplace(frees, frees[0] + mean)
    return out, mean


def predict_wait(
    ahead: int,
    elapsed_in_flight: Iterable[float],
    durations: DurationWindow,
    now: float,
    *,
    skip: int = 0,
    min_samples: int = 3,
) -> WaitEstimate | None:
    """The wait of a waiter joining behind ``ahead`` others; None when there is no estimate."""
    got = slot_times(elapsed_in_flight, durations, now, ahead + 1, skip=skip, min_samples=min_samples)
    return None if got is None else WaitEstimate(got[0][ahead], got[1])
