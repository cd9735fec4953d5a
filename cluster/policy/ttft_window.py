"""An engine replica's recent time to first token, by request priority: what it tells every
gateway through Serve's routing stats, so that each gateway's SLO guard (:mod:`cluster.policy.slo_guard`)
sees the TTFT of every gateway's requests on that replica, not only its own clients'.

Measured from the request's arrival at the replica to its first token, so it is the engine's
queue and prefill (what lower-priority work on the same replica makes a Tab request wait for),
without the gateway's own milliseconds. Pure: the replica passes the clock.
"""

from __future__ import annotations

from collections import deque

Sample = tuple[int, float, int, float]  # (sequence number, age in s, priority, TTFT in s)


class TtftWindow:
    """The last ``max_samples`` first tokens within ``window_s``, numbered so that a reader that
    sees the same sample twice (the stats are pushed every half second) counts it once."""

    def __init__(self, window_s: float = 10.0, max_samples: int = 64) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[int, float, int, float]] = deque(maxlen=max_samples)
        self._seq = 0

    def add(self, now: float, priority: int, ttft_s: float) -> None:
        self._seq += 1
        self._samples.append((self._seq, now, priority, ttft_s))

    def report(self, now: float) -> list[Sample]:
        """The samples still within the window, oldest first, each with its age at ``now``."""
        while self._samples and self._samples[0][1] <= now - self.window_s:
            self._samples.popleft()
        return [(seq, round(now - t, 4), p, round(ttft, 5)) for seq, t, p, ttft in self._samples]
