"""State shared, inside the router deployment's process, between the router deployment and our
Serve ``RequestRouter``. It lives in its own module because Serve pickles the request router's
module *by value* into the handle: module globals there would be copies, while a module referenced
as a module is imported by name, so ``routing_state.VIEW`` is the one live object. Always reach it
as ``routing_state.VIEW`` (never ``from … import VIEW``): a deployment class can be pickled by value
as well, and a bound global would then be a copy.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from cluster.affinity import AffinityRouter, ReplicaLoad, RouteDecision
from cluster.config import BackendConfig
from cluster.failover import BreakerBoard
from cluster.protocol import BackendStats


@dataclass
class RoutingView:
    stats: dict[str, BackendStats] = field(default_factory=dict)  # replica unique id → snapshot
    in_flight: Counter[str] = field(default_factory=Counter)  # routed by this process, not ended
    # Chosen but not yet confirmed routed: Ray resolves choices concurrently, so a burst would
    # otherwise be decided against in-flight counts that do not yet include each other.
    pending: dict[str, str] = field(default_factory=dict)  # attempt's route key → replica
    routed: dict[str, str] = field(default_factory=dict)  # attempt's route key → replica (confirmed)
    breakers: BreakerBoard = field(default_factory=BreakerBoard)  # replaced by the router's own
    backends: dict[str, BackendConfig] = field(default_factory=dict)
    policies: dict[str, AffinityRouter] = field(default_factory=dict)  # backend name → policy
    hashes: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (request, backend) → blocks
    decisions: dict[str, RouteDecision] = field(default_factory=dict)  # route key → last decision
    decision_counts: Counter[tuple[str, str]] = field(default_factory=Counter)  # (backend, reason)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def load(self, rid: str) -> float:
        s = self.stats.get(rid)
        return self.in_flight[rid] + (s.waiting if s is not None else 0)

    def replica_load(self, rid: str, cap: int, pending: Counter[str]) -> ReplicaLoad:
        s = self.stats.get(rid)
        n = self.in_flight[rid] + pending[rid]
        if s is None:
            return ReplicaLoad(rid, in_flight=n, max_in_flight=cap)
        return ReplicaLoad(rid, n, s.waiting, s.kv_usage, s.healthy, cap)

    def forget_request(self, request_id: str, attempts: int = 1) -> None:
        for backend in self.policies:
            self.hashes.pop((request_id, backend), None)
        for a in range(attempts):
            key = f"{request_id}/{a}"
            self.pending.pop(key, None)
            self.routed.pop(key, None)
            self.decisions.pop(key, None)


VIEW = RoutingView()
