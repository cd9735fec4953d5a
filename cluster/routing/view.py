"""One self-hosted backend's routing view, owned by the gateway process: which replicas are live
and where their token streams are served, how loaded each one is, what the gateway has in flight
on each, the cache-aware policy's state and the decisions it made.

Plain Python, no Ray, no I/O. The gateway feeds it: Serve's live replica list (with each
replica's published endpoint and engine stats) at every decision, the start and end of every
attempt it sends, and each replica's KV events (pages from its engine's log, applied by a
background feed, never per chunk). A replica that leaves Serve's list leaves the view at the next
decision: its in-flight count, stats, index entries and breaker go with it.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.engine.kv_events import KVEventPage
from cluster.policy.failover import ReplicaEjector
from cluster.routing.affinity import AffinityRouter, ReplicaLoad, RouteDecision
from cluster.routing.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """A live replica as Serve reports it: its id, the URL of its token stream and its last
    published engine stats (which lag by up to the stats period)."""

    replica: str
    url: str | None
    waiting: int = 0
    kv_usage: float = 0.0
    healthy: bool = True
    kv_events: bool = False  # the replica serves its engine's KV events (GET /kv_events)
    kv_blocks: int = 0  # its KV cache in blocks (0: unknown)
    ttft: tuple[
        tuple[int, float, int, float], ...
    ] = ()  # its recent first tokens (cluster.policy.ttft_window)


@dataclass
class Choice:
    """The decision for one attempt: the replica's id and endpoint, why, and the attempt's cache
    rank there (:meth:`cluster.routing.affinity.AffinityRouter.cache_rank`; 0 without a policy)."""

    replica: str
    url: str
    decision: RouteDecision
    cache_rank: int = 0


@dataclass
class BackendView:
    """See the module docstring. ``policy`` is None for a backend routed by load alone."""

    backend: str
    policy: AffinityRouter | None
    ejector: ReplicaEjector
    max_in_flight_per_replica: int
    mode: str = "cache_aware"  # or the baselines: least_loaded, round_robin, power_of_two
    in_flight: Counter[str] = field(default_factory=Counter)
    live: dict[str, ReplicaInfo] = field(default_factory=dict)
    decision_counts: Counter[str] = field(default_factory=Counter)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    _rr: int = 0

    def sync(self, replicas: Sequence[ReplicaInfo]) -> None:
        """Serve's current replica list: replicas not in it are forgotten everywhere."""
        now_live = {r.replica: r for r in replicas if r.url}
        for gone in set(self.live) - set(now_live):
            self.in_flight.pop(gone, None)
            if self.policy is not None:
                self.policy.remove_replica(gone)
        self.live = now_live
        self.ejector.sync(list(now_live))

    def apply_kv_page(self, replica: str, page: KVEventPage, now: float | None = None) -> int:
        """A page of ``replica``'s KV events (the gateway's feed, off the token path). A replica
        that is no longer live is ignored: a late page must not bring a dead replica's blocks back."""
        if self.policy is None or replica not in self.live:
            return 0
        return self.policy.apply_kv_page(replica, page, now)

    def replica_lost(self, replica: str) -> None:
        """The feed lost the replica's connection (its process died, or is dying): its index entries
        go now, before Serve's list drops it; it stays routable by load until then (the breakers and
        the race handle a dead one), and its next page of events, if any, starts afresh."""
        if self.policy is not None:
            # Still event-fed: attempts routed to it until Serve drops it count only briefly.
            self.policy.replica_lost(replica)

    def choose(
        self,
        hashes: Sequence[BlockHash],
        now: float,
        session_id: str | None = None,
        avoid: Sequence[str] = (),
    ) -> Choice | None:
        """Pick a live replica for one attempt (None: no live replica). A hedge or a retry avoids
        the replicas its earlier attempts went to, unless nothing else is left."""
        if not self.live:
            return None
        routable = set(self.ejector.routable(now))
        skip = set(avoid) if set(self.live) - set(avoid) else set()
        loads = [self._load(r, r in routable and r not in skip) for r in self.live]
        if self.mode == "round_robin":
            decision = self._round_robin(loads, len(hashes))
        elif self.mode == "power_of_two":
            two = [x for x in loads if x.healthy]
            two = self.rng.sample(two, 2) if len(two) > 2 else two
            decision = self._least_loaded(two or loads, len(hashes))
        elif self.mode == "least_loaded" or self.policy is None:
            decision = self._least_loaded(loads, len(hashes))
        else:
            decision = self.policy.decide(hashes, loads, self.rng, now, None if skip else session_id)
        replica = decision.replica
        if replica is None:  # every replica at its cap: queue on the least loaded one
            replica = min(self.live, key=lambda r: (self.in_flight[r] + self.live[r].waiting, r))
        url = self.live[replica].url
        assert url is not None  # sync keeps only replicas with an endpoint
        ranked = self.policy is not None and self.mode == "cache_aware"
        return Choice(replica, url, decision, self.policy.cache_rank(decision) if ranked else 0)

    def started(
        self, choice: Choice, hashes: Sequence[BlockHash], now: float, session_id: str | None
    ) -> None:
        """The attempt went out: count it, remember where its blocks now live."""
        self.in_flight[choice.replica] += 1
        reason = self.mode if self.mode != "cache_aware" else choice.decision.reason
        self.decision_counts[reason] += 1
        if self.policy is not None:
            self.policy.record(choice.replica, hashes, now, session_id)
        breaker = self.ejector.breakers.get(choice.replica)
        if breaker is not None:
            breaker.allow(now)  # takes a half-open probe slot, if that is what this is

    def ended(self, replica: str) -> None:
        n = self.in_flight[replica] - 1
        if n > 0:
            self.in_flight[replica] = n
        else:
            self.in_flight.pop(replica, None)

    # -- internals ---------------------------------------------------------------------------
    def _load(self, replica: str, healthy: bool) -> ReplicaLoad:
        info = self.live[replica]
        return ReplicaLoad(
            replica,
            self.in_flight[replica],
            info.waiting,
            info.kv_usage,
            healthy and info.healthy,
            self.max_in_flight_per_replica,
            info.kv_blocks,
        )

    def _least_loaded(self, loads: list[ReplicaLoad], n_blocks: int) -> RouteDecision:
        ok = [x for x in loads if x.healthy and x.in_flight < x.max_in_flight]
        if not ok:
            return RouteDecision(None, "saturated", 0, 0, n_blocks)
        best = min(ok, key=lambda x: (x.in_flight + x.waiting, x.kv_usage, x.replica))
        return RouteDecision(best.replica, "load", 0, 0, n_blocks)

    def _round_robin(self, loads: list[ReplicaLoad], n_blocks: int) -> RouteDecision:
        ok = sorted(x.replica for x in loads if x.healthy)
        if not ok:
            return RouteDecision(None, "saturated", 0, 0, n_blocks)
        self._rr += 1
        return RouteDecision(ok[self._rr % len(ok)], "load", 0, 0, n_blocks)
