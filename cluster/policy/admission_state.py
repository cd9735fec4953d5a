"""One surface's admission state (:mod:`cluster.policy.admission`): its limits as this gateway
replica's share, its queue of waiters, its counters, the recent durations and completions the wait
predictor and ``Retry-After`` read, and its fair-queuing clock (:mod:`cluster.policy.fair_queue`)."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from cluster.config import SurfaceConfig
from cluster.policy.admission_types import Counters
from cluster.policy.queue_wait import WAIT_SHARE, DurationWindow


@dataclass(slots=True)
class Waiter:
    id: int
    surface: str
    enqueued_at: float
    deadline: float
    candidates: tuple[str, ...]
    tenant: str | None = None
    estimated: bool = True  # queued with a wait estimate (the counters split deadline expiries by it)


class SurfaceState:
    def __init__(self, cfg: SurfaceConfig, router_replicas: int, rate_window_s: float) -> None:
        self.name = cfg.name
        self.priority = cfg.priority
        self.limit = share(cfg.max_concurrency, router_replicas)
        self.max_queue = share(cfg.max_queue, router_replicas)
        self.deadline_s = cfg.queue_deadline_ms / 1000.0
        self.max_wait_s = self.deadline_s * WAIT_SHARE  # a longer predicted wait: 429 at once
        self.in_flight = 0
        self.queue: OrderedDict[int, Waiter] = OrderedDict()  # FIFO = deadline order
        self.counters = Counters()
        self.done_times: deque[float] = deque()
        self.durations = DurationWindow()  # admitted -> ended, for the wait predictor
        self.admitted_at: dict[int, float] = {}  # tickets in flight
        self.unchecked = 0  # waiters queued with no wait estimate yet (checked once there is one)
        self.rate_window_s = rate_window_s
        self.vclock = 0.0  # fair queuing: the virtual time of the last admission
        self.vtime: dict[str, float] = {}  # by tenant: its virtual finish time

    def completion_rate(self, now: float) -> float:
        cutoff = now - self.rate_window_s
        while self.done_times and self.done_times[0] <= cutoff:
            self.done_times.popleft()
        return len(self.done_times) / self.rate_window_s


def share(limit: int, router_replicas: int) -> int:
    return math.ceil(limit / router_replicas)
