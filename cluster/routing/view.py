"""One self-hosted backend's routing view, owned by the gateway process: which replicas are live
and where their token streams are served, how loaded each one is, what the gateway has in flight
on each, the cache-aware policy's state and the decisions it made.

Plain Python, no Ray, no I/O. The gateway feeds it: Serve's live replica list (with each
replica's published endpoint and engine stats) at every decision, the start and end of every
attempt it sends, and each replica's KV events (pages from its engine's log, applied by a
background feed, never per chunk). A replica that leaves Serve's list leaves the view at the next
decision: its in-flight count, stats, index entries and breaker go with it.

Prefill-aware choice (``busy_prefill_tokens``, a surface's ``avoid_prefill_tokens``): the view
counts, per replica, the prompt tokens of this gateway's attempts there that have not had their
first token yet, less what the cache-aware decision expected cached. A short, latency-bound prompt
(Tab) that lands on a replica prefilling a long one waits for that prefill's chunk to finish its
step and then shares the next step with the rest of it (the engine fills a step's token budget,
as vLLM does); on a replica only decoding, its step is short. So such a request skips the
replicas whose count is at least its threshold while another routable replica is below it. Each
gateway replica counts only its own attempts: with several, this is a partial view, never wrong
about the attempts it counts.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from cluster.engine.kv_events import KVEventPage
from cluster.policy.failover import ReplicaEjector
from cluster.routing.affinity import AffinityRouter, ReplicaLoad, RouteDecision
from cluster.routing.block_hash import BlockHash
from cluster.routing.candidates import bounded_pool
from cluster.routing.index_mirror import IndexFrame


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
    kv_pub: str | None = None  # ... and pushes them from this ZMQ address (deployments/engine/kv_pub.py)
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
    prefill_tokens: int = 0  # counted in the view's ``prefilling`` until its first token or its end


@dataclass(frozen=True, slots=True)
class ViewSnapshot:
    """One backend's routing view at one moment, as readers see it (:meth:`BackendView.snapshot`):
    its live replicas, this gateway's attempts in flight and uncached prompt tokens prefilling per
    replica (only non-zero entries), its decisions by reason, and how many decisions skipped a
    replica for its prefill."""

    backend: str
    replicas: Mapping[str, ReplicaInfo]
    in_flight: Mapping[str, int]
    prefilling: Mapping[str, int]
    decisions: Mapping[str, int]
    avoided_prefill: int


UNREACHABLE_HOLD_S = 5.0


@dataclass
class Outage:
    """When a backend last had no serving replica, and how long its last outage took to end: the
    Retry-After of a request refused for it estimates when a replacement will serve."""

    since: float | None = None
    last_s: float | None = None  # the previous outage's length

    def note(self, serving: bool, now: float) -> None:
        if serving and self.since is not None:
            self.last_s, self.since = now - self.since, None
        elif not serving and self.since is None:
            self.since = now

    def retry_after(self, now: float, typical_start_s: float) -> float:
        """Seconds until a replacement is likely to serve (at least 1)."""
        expected = self.last_s if self.last_s is not None else typical_start_s
        elapsed = now - self.since if self.since is not None else 0.0
        return max(1.0, expected - elapsed)


@dataclass
class BackendView:
    """See the module docstring. ``policy`` is None for a backend routed by load alone."""

    backend: str
    policy: AffinityRouter | None
    ejector: ReplicaEjector
    max_in_flight_per_replica: int
    mode: str = "cache_aware"  # or the baselines: least_loaded, round_robin, power_of_two
    # The counters: changed only by started() / prefilled() / ended() (one attempt's lease) and
    # sync() (a replica gone); read through snapshot().
    _in_flight: Counter[str] = field(default_factory=Counter, init=False)
    live: dict[str, ReplicaInfo] = field(default_factory=dict)
    _decisions: Counter[str] = field(default_factory=Counter, init=False)
    # uncached prompt tokens before a first token
    _prefilling: Counter[str] = field(default_factory=Counter, init=False)
    _avoided_prefill: int = field(default=0, init=False)  # decisions that skipped a replica for its prefill
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    _rr: int = 0
    # Replicas whose token endpoint refused a connection or whose engine said it is dead, until
    # when (monotonic): no request goes there meanwhile, though Serve still lists them.
    unreachable: dict[str, float] = field(default_factory=dict)
    outage: Outage = field(default_factory=lambda: Outage())
    synced: bool = False  # a replica with a published endpoint has reached it at least once
    # serving()'s answer until the next change (sync, a refusal) or an unreachable hold's end
    _up: tuple[list[str], frozenset[str], float, float] | None = None  # (up, as a set, since, until)

    def snapshot(self) -> ViewSnapshot:
        """A copy of the view's replicas and counters for readers (status, the SLO guard, load
        tools, tests): later changes do not show in it."""
        return ViewSnapshot(
            self.backend,
            MappingProxyType(dict(self.live)),
            MappingProxyType(dict(self._in_flight)),
            MappingProxyType(dict(self._prefilling)),
            MappingProxyType(dict(self._decisions)),
            self._avoided_prefill,
        )

    def sync(self, replicas: Sequence[ReplicaInfo]) -> None:
        """Serve's current replica list: replicas not in it are forgotten everywhere."""
        now_live = {r.replica: r for r in replicas if r.url}
        self.synced = self.synced or bool(now_live)
        self._up = None
        for gone in set(self.live) - set(now_live):
            self._in_flight.pop(gone, None)
            self._prefilling.pop(gone, None)
            if self.policy is not None:
                self.policy.remove_replica(gone)
        self.live = now_live
        self.ejector.sync(list(now_live))
        for gone in set(self.unreachable) - set(now_live):
            del self.unreachable[gone]

    def mark_unreachable(self, replica: str, now: float, hold_s: float = UNREACHABLE_HOLD_S) -> None:
        """The replica refused a connection, or its engine is dead: skip it for ``hold_s`` (renewed
        by each new refusal; Serve drops a dead replica meanwhile)."""
        if replica in self.live:
            self.unreachable[replica] = now + hold_s
            self._up = None

    def serving(self, now: float) -> list[str]:
        """The live replicas that can take a request: healthy by their own report and not
        unreachable. Notes the backend's outage (none of them) for :meth:`Outage.retry_after`.
        Kept until the list, a refusal or the next end of a hold changes it (read, not copied)."""
        return self._serving(now)[0]

    def _serving(self, now: float) -> tuple[list[str], frozenset[str], float, float]:
        cached = self._up
        if cached is None or not cached[2] <= now < cached[3]:
            held = self.unreachable
            up = [r for r, info in self.live.items() if info.healthy and held.get(r, 0.0) <= now]
            until = min((t for t in held.values() if t > now), default=float("inf"))
            cached = self._up = (up, frozenset(up), now, until)
        self.outage.note(bool(cached[0]), now)
        return cached

    def apply_kv_page(self, replica: str, page: KVEventPage, now: float | None = None) -> int:
        """A page of ``replica``'s KV events (the gateway's feed, off the token path). A replica
        that is no longer live is ignored: a late page must not bring a dead replica's blocks back."""
        if self.policy is None or replica not in self.live:
            return 0
        return self.policy.apply_kv_page(replica, page, now)

    def apply_index_frame(self, frame: IndexFrame, now: float) -> None:
        """A frame of the backend's indexer (:mod:`cluster.routing.index_mirror`), in sequence: the
        mirror's alternative to applying every replica's pages here."""
        if self.policy is not None:
            self.policy.apply_frame(frame, now)

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
        busy_prefill_tokens: int | None = None,
    ) -> Choice | None:
        """Pick a live replica for one attempt (None: no live replica). A hedge or a retry avoids
        the replicas its earlier attempts went to, unless nothing else is left. With
        ``busy_prefill_tokens``, the replicas prefilling at least that many tokens are skipped
        while a routable one below it is left (the module docstring). A cache-aware decision over
        more replicas than ``decision_candidates`` scores a bounded set (:mod:`.candidates`)."""
        up, up_set, _, _ = self._serving(now)
        if not up:  # none can take it: the caller waits for a replacement or refuses (503)
            return None
        skip = set(avoid)
        if skip and all(r in skip for r in up):
            skip = set()
        session_id = None if skip else session_id
        pool: list[str] = up
        fleet, probe = None, None
        if self.policy is not None and self.mode == "cache_aware":
            total = sum(self._in_flight.values())
            pool, fleet, probe = bounded_pool(
                self.policy, up, up_set, total, hashes, now, session_id, self.rng
            )
        breakers = self.ejector.breakers
        loads = [
            self._load(r, r not in skip and (b := breakers.get(r)) is not None and b.available(now))
            for r in pool
        ]
        if busy_prefill_tokens is not None:
            loads = self._off_prefill(loads, busy_prefill_tokens)
        if self.mode == "round_robin":
            decision = self._round_robin(loads, len(hashes))
        elif self.mode == "power_of_two":
            two = [x for x in loads if x.healthy]
            two = self.rng.sample(two, 2) if len(two) > 2 else two
            decision = self._least_loaded(two or loads, len(hashes))
        elif self.mode == "least_loaded" or self.policy is None:
            decision = self._least_loaded(loads, len(hashes))
        else:
            decision = self.policy.decide(hashes, loads, self.rng, now, session_id, fleet, probe)
        replica = decision.replica
        if replica is None:  # every replica at its cap: queue on the least loaded one
            replica = min(up, key=lambda r: (self._in_flight[r] + self.live[r].waiting, r))
        url = self.live[replica].url
        assert url is not None  # sync keeps only replicas with an endpoint
        ranked = self.policy if self.mode == "cache_aware" else None
        return Choice(replica, url, decision, ranked.cache_rank(decision) if ranked is not None else 0)

    def started(
        self,
        choice: Choice,
        hashes: Sequence[BlockHash],
        now: float,
        session_id: str | None,
        prompt_tokens: int = 0,
    ) -> None:
        """The attempt went out: count it, remember where its blocks now live, and count its
        prompt's tokens the decision did not expect cached as prefilling there until its first
        token (:meth:`prefilled`) or its end."""
        self._in_flight[choice.replica] += 1
        n, matched = len(hashes), choice.decision.matched_blocks
        uncached = prompt_tokens if not n else prompt_tokens * max(0, n - matched) // n
        if uncached > 0:
            choice.prefill_tokens = uncached
            self._prefilling[choice.replica] += uncached
        reason = self.mode if self.mode != "cache_aware" else choice.decision.reason
        self._decisions[reason] += 1
        if self.policy is not None:
            self.policy.record(choice.replica, hashes, now, session_id)

    def prefilled(self, choice: Choice) -> None:
        """The attempt's first token came (or it ended): its prompt no longer counts as prefilling."""
        n, choice.prefill_tokens = choice.prefill_tokens, 0
        if n > 0 and choice.replica in self._prefilling:
            _take(self._prefilling, choice.replica, n)

    def ended(self, replica: str, choice: Choice | None = None) -> None:
        if choice is not None:
            self.prefilled(choice)
        _take(self._in_flight, replica, 1)

    # -- internals ---------------------------------------------------------------------------
    def _off_prefill(self, loads: list[ReplicaLoad], busy_tokens: int) -> list[ReplicaLoad]:
        """``loads`` with the replicas prefilling ``busy_tokens`` or more marked unroutable for this
        decision, when a routable one below that (and below its cap) is left; else unchanged."""
        prefilling = self._busy_prefill()
        busy = {x.replica for x in loads if prefilling.get(x.replica, 0) >= busy_tokens}
        if not busy or not any(
            x.healthy and x.in_flight < x.max_in_flight and x.replica not in busy for x in loads
        ):
            return loads
        self._avoided_prefill += 1
        return [replace(x, healthy=False) if x.replica in busy else x for x in loads]

    def _busy_prefill(self) -> Mapping[str, int]:
        """The prefilling counts a prefill-aware decision reads (a what-if view may add to them)."""
        return self._prefilling

    def _load(self, replica: str, healthy: bool) -> ReplicaLoad:
        info = self.live[replica]
        return ReplicaLoad(
            replica,
            self._in_flight[replica],
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


def _take(counts: Counter[str], key: str, n: int) -> None:
    """``n`` off ``key``'s count, the key gone at zero (the views list only what is non-zero)."""
    left = counts[key] - n
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
