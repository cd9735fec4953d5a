"""Cache-aware replica choice: prefix block hashes, a bounded replica index, a bounded-load decision.

One :class:`AffinityRouter` per self-hosted backend. The router deployment tokenizes once, calls
:meth:`AffinityRouter.hash` on the prompt's token ids, :meth:`AffinityRouter.decide` with a load
snapshot of the backend's replicas, dispatches, then :meth:`AffinityRouter.record` the blocks on the
replica that took the request. Hashing: :class:`cluster.routing.block_hash.BlockHasher` (chained,
like vLLM's ``hash_block_tokens``) under the request's cache salt (:mod:`cluster.routing.cache_salt`):
tenants that do not share a cache group never share an index entry, a home or a session.

The index (:mod:`cluster.routing.prefix_index`): ``block hash -> bitmask of replicas``, bounded,
prefix-closed. Pages of the engine's KV events (:mod:`cluster.engine.kv_events`) fed to
:meth:`apply_kv_page` make it exact for that replica (to within ``claim_stride_blocks``: the
engine replica publishes its chains' anchors, :mod:`cluster.routing.event_hashes`), and a routed
request's blocks only count until ``recent_ttl_s`` unless the events confirm them. Without events
it is an optimistic guess that forgets in LRU order. The homes (:mod:`cluster.routing.placement`,
``new_prefix="home"`` only): where each context lives even after its blocks are evicted, and each
replica's hot working set, fed by the engines' ``BlocksQueued``.

The decision, in order (reason in brackets):

1. A replica is *available* when healthy and below its ``max_in_flight``; *eligible* when also
   within the bound. The bound is consistent hashing with bounded loads (Mirrokni, Thorup,
   Zadimoghaddam 2018) with an absolute slack in SGLang's manner: a replica may take a request
   while ``in_flight + 1 <= max(ceil(c * (total_in_flight + 1) / n), min_in_flight + slack)``.
   ``c = load_factor = 1.25``: under load nobody exceeds 1.25x the average, while a hot prefix keeps
   its replica up to that point (1.25 is the paper's and Vimeo's production value: most of the
   locality, a tight balance; lower spreads more, c -> inf is pure affinity). ``slack = 8``: at low
   load the relative bound alone is 1 or 2 requests per replica, which would spray a burst of one
   shared prompt over every replica and pay its prefill n times, although an idle engine batches
   8 requests at almost no cost; the slack only matters while the average is below ~32. Also
   excluded (SGLang's imbalance test on the engine's own queue): ``waiting > max(min_waiting + 16,
   1.5 * min_waiting)``, and ``kv_usage >= 0.95`` (it would evict or preempt). The least loaded
   healthy replica is always within the bound.
2. [session] the session's replica, when it is eligible.
3. [prefix] the eligible replica holding the longest cached prefix, if at least ``min_match_tokens``
   (64) match — shorter matches are chat-template boilerplate every replica holds — and at least
   ``min_match_ratio`` of the prompt's blocks; ties -> least loaded, then the random generator.
4. [new_prefix] otherwise, with ``new_prefix="least_loaded"``: the least loaded eligible replica,
   ties to the one whose cache the index fills least (held blocks over the engine's KV blocks), so
   that a new context displaces the fewest hot ones and contexts partition over the replicas.
   With ``new_prefix="home"`` (:mod:`cluster.routing.placement`): the context's sticky home — the replica
   its deepest homed block was first sent to, if that covers ``min_match_ratio`` of the prompt —
   when eligible; else (a new context, or its home over the bound) the eligible replica with the
   least hot working set per block of KV, which partitions the contexts over the replicas' caches.
   With ``new_prefix="rendezvous"``: rendezvous hashing of a home key (the session id, else the hash of the
   first ``home_key_tokens`` = 64 tokens): the eligible replica with the highest score, so
   concurrent requests that share a prefix converge on one replica instead of spraying, and when it
   is full they spill to the *next* replica in that key's order (still one place, not many).
   Replicas joining or leaving move only the keys they win or held (minimal churn).
5. [load] no full block and no session, or nothing eligible: the least loaded available replica.
6. [saturated] no available replica: ``replica`` is None; the caller tries another backend.

``diverted`` says the bound overrode the preferred replica (session, deeper prefix or home), and
``best_blocks`` what the longest match would have been: the cache hits given up to balance load.

The cache rank (:meth:`AffinityRouter.cache_rank`, ``cache_priority``): 0 when the chosen replica
holds enough of the prompt to have steered it there (the prefix rule's threshold), else 1. The
engine orders its waiting queue by (surface priority, cache rank, arrival)
(:attr:`cluster.wire.protocol.GenerateRequest.engine_priority`): within a surface, a request whose
context is cached runs before a waiting one whose context is not. Under KV pressure a queued
request does not pin its blocks, so behind a queue of other contexts' misses its cached context
is evicted before it runs and it misses too; served first, it hits, and its prefill is short
(shortest job first: the queue drains faster). SGLang reorders its own waiting queue by prefix
match for the same reason; vLLM's priority policy lets the gateway do it for vLLM.
loadtest/benchmarks/bench_affinity.py's kv_pressure measured it (BENCHMARKS.md, issue 17). A miss waits
while hits of its surface wait: under a sustained flood of hits it waits longer (admission's
limits bound the flood), never behind another surface's lower priority.
"""

from __future__ import annotations

import math
import random
import sys
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cluster.engine.kv_events import (
    BlockRemoved,
    BlocksQueued,
    BlockStored,
    IndexRemoved,
    IndexStored,
    KVEventPage,
)
from cluster.routing.block_hash import BlockHash, BlockHasher, HashAlgo, deepest_strided, stable_hash64
from cluster.routing.candidates import Probe, match, roomiest
from cluster.routing.event_hashes import RouterHashes
from cluster.routing.placement import ContextHomes
from cluster.routing.prefix_index import PrefixIndex, SessionTable

if TYPE_CHECKING:
    from cluster.routing.index_mirror import IndexFrame

__all__ = [
    "REASONS",
    "AffinityParams",
    "AffinityRouter",
    "BlockHasher",
    "PrefixIndex",
    "ReplicaLoad",
    "RouteDecision",
    "SessionTable",
    "stable_hash64",
]

Reason = Literal["session", "prefix", "new_prefix", "load", "saturated"]
REASONS: tuple[Reason, ...] = ("session", "prefix", "new_prefix", "load", "saturated")
NewPrefix = Literal["rendezvous", "least_loaded", "home"]
_M64 = (1 << 64) - 1
# a mirror's table of one indexer shard: ((index, homes generation), slot -> bit, slot -> home token)
_MirrorTable = tuple[tuple[int, int], dict[int, int], dict[int, tuple[str, int]]]
_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads (key ^ seed) over the top bits


@dataclass(slots=True)
class ReplicaLoad:
    """One replica in the load snapshot handed to :meth:`AffinityRouter.decide`."""

    replica: str
    in_flight: int = 0  # this router's requests on it (exact, updated at dispatch)
    waiting: int = 0  # the engine's queue (all routers; from its stats, may lag)
    kv_usage: float = 0.0  # 0..1, from the engine's stats
    healthy: bool = True
    max_in_flight: int = sys.maxsize  # router-side cap (BackendConfig.max_in_flight_per_replica)
    kv_blocks: int = 0  # the engine's KV cache in blocks (0: unknown)


@dataclass(frozen=True, slots=True)
class AffinityParams:
    """The decision's knobs; the module docstring says why these defaults."""

    load_factor: float = 1.25  # c in CHWBL: nobody above ceil(c x average in-flight) ...
    load_slack: int = 8  # ... unless within this many requests of the least loaded (low load)
    waiting_abs_threshold: int = 16  # SGLang-style: engine queue this much above the shortest ...
    waiting_rel_threshold: float = 1.5  # ... and this many times it -> not eligible
    kv_usage_max: float = 0.95  # a replica this full would evict or preempt: not eligible
    min_match_tokens: int = 64  # shorter matches are template boilerplate, not worth a detour
    min_match_ratio: float = 0.0  # optionally also require this share of the prompt's blocks
    home_key_tokens: int = 64  # the prefix whose hash picks a new prefix's home replica
    new_prefix: NewPrefix = "rendezvous"  # or "least_loaded", or "home" (cluster/routing/placement.py)
    home_half_life_requests: float = 256.0  # "home": a replica's demand halves over this many requests
    recent_ttl_s: float = 5.0  # a sent request's blocks count for this long before events confirm them
    index_capacity_blocks: int = 1_000_000
    session_capacity: int = 100_000
    session_ttl_s: float = 1800.0
    kv_map_capacity: int = 262_144  # engine hash -> our hash, per replica (KV events)
    cache_priority: bool = True  # rank expected hits before misses in the engine's queue (docstring)
    decision_candidates: int = 0  # 0: score every replica; else a bounded set (candidates.py)
    claim_stride_blocks: int = 1  # homes and recent sends keyed by every k-th block (block_hash.strided)

    def __post_init__(self) -> None:
        if self.load_factor < 1.0:
            raise ValueError("load_factor must be >= 1 (1 is perfectly balanced)")
        if self.decision_candidates < 0:
            raise ValueError("decision_candidates must be >= 0 (0: every replica)")
        if self.claim_stride_blocks < 1:
            raise ValueError("claim_stride_blocks must be >= 1 (1: every block)")
        if self.load_slack < 0:
            raise ValueError("load_slack must be >= 0")
        if self.new_prefix not in ("rendezvous", "least_loaded", "home"):
            raise ValueError(f"unknown new_prefix placement {self.new_prefix!r}")
        if self.home_half_life_requests <= 0:
            raise ValueError("home_half_life_requests must be positive")


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica: str | None  # None only when the reason is "saturated"
    reason: Reason
    matched_blocks: int  # blocks of the prompt the chosen replica is believed to hold
    best_blocks: int  # the longest match among available replicas (> matched: hits given up)
    total_blocks: int
    diverted: bool = False  # the bound overrode the preferred replica (session, prefix or home)


def _least_loaded(loads: Sequence[tuple[ReplicaLoad, int]], rng: random.Random) -> tuple[ReplicaLoad, int]:
    """The least loaded by ``in_flight + waiting``, then ``kv_usage``; remaining ties broken by
    ``rng`` (deterministic for a seeded generator). in_flight is exact for this router; waiting
    adds what other routers queued on the engine."""
    best = min([xb[0].in_flight + xb[0].waiting for xb in loads])
    ties = [xb for xb in loads if xb[0].in_flight + xb[0].waiting == best]
    if len(ties) > 1:
        low_kv = min([xb[0].kv_usage for xb in ties])
        ties = [xb for xb in ties if xb[0].kv_usage == low_kv]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


class AffinityRouter:
    """Per-backend affinity state (index, sessions, KV-event maps) and the decision."""

    def __init__(
        self,
        block_size: int,
        model: str,
        params: AffinityParams | None = None,
        *,
        salt: str = "",
        algo: HashAlgo = "tuple",
    ) -> None:
        self.params = p = params or AffinityParams()
        self.hasher = BlockHasher(block_size, model, salt, algo)
        self.index = PrefixIndex(p.index_capacity_blocks, stride=p.claim_stride_blocks)
        self.sessions = SessionTable(p.session_capacity, p.session_ttl_s)
        self._min_blocks = max(1, math.ceil(p.min_match_tokens / block_size))
        self._home_block = max(1, math.ceil(p.home_key_tokens / block_size))
        self._seeds: dict[str, int] = {}
        self._kv_maps: dict[str, RouterHashes] = {}  # raw BlockStored only (IndexStored needs none)
        self.kv_unmapped = 0  # stored events whose parent we never saw (subscribed late)
        self.kv_mismatched = 0  # events in another block size or stride than ours (misconfiguration)
        # our block hash -> the replica whose engine stored it last (kept after eviction): a new
        # prefix's last home, the same on every gateway replica since only events write it
        self._stored_by: OrderedDict[BlockHash, str] = OrderedDict()
        self.event_fed: set[str] = set()  # replicas whose index entries come from their engine's events
        self.homes = ContextHomes(p.index_capacity_blocks, p.home_half_life_requests, p.claim_stride_blocks)
        self._homing, self._last_homes = p.new_prefix == "home", p.new_prefix == "least_loaded"  # readers
        self._mirror_names: dict[int, dict[int, str]] = {}  # a mirror's: indexer shard -> slot -> replica
        self._mirrored = False  # apply_frame: every replica's entries come from the indexers
        # shard -> ((index, homes generation), slot -> bit, slot -> home token): _mirror_table's
        self._mirror_tables: dict[
            int, tuple[tuple[int, int], dict[int, int], dict[int, tuple[str, int]]]
        ] = {}

    def hash(self, token_ids: Sequence[int], salt: str | None = None) -> list[BlockHash]:
        """The prompt's block hashes under its cache salt (:mod:`cluster.routing.cache_salt`)."""
        return self.hasher.hash_blocks(token_ids, salt=salt)

    # The decision ------------------------------------------------------------------------------
    def decide(
        self,
        hashes: Sequence[BlockHash],
        loads: Sequence[ReplicaLoad],
        rng: random.Random,
        now: float,
        session_id: str | None = None,
        fleet: tuple[int, int] | None = None,
        probe: Probe | None = None,
    ) -> RouteDecision:
        """Pick a replica for a request with these block hashes (see the module docstring).
        ``fleet``: ``(replicas, their in-flight total)`` when ``loads`` is a bounded candidate set
        (:mod:`cluster.routing.candidates`), so the load bound is the fleet's average, not the candidates';
        ``probe``: what ``candidates.must_consider`` found for these hashes just before (no search twice)."""
        if not loads:
            raise ValueError("decide() needs at least one candidate replica")
        p, index, n_blocks = self.params, self.index, len(hashes)
        if index._recent_log:
            index.expire_recent(now - p.recent_ttl_s)
        avail, healthy_mask = self._available(loads)
        if not avail:
            return RouteDecision(None, "saturated", 0, 0, n_blocks)
        eligible, avail_mask, elig_mask = self._eligible(avail, loads, fleet)
        best = match(index, hashes, avail_mask, (probe.blocks, probe.holders) if probe else None)
        best_all = best[0]

        diverted = False
        if session_id is not None:
            r = self.sessions.get(session_id, now)
            if r is not None:
                rbit = index.bit_of(r)
                if rbit & elig_mask:
                    return RouteDecision(
                        r, "session", match(index, hashes, rbit, best)[0], best_all, n_blocks
                    )
                diverted = bool(rbit & healthy_mask)  # overloaded, not gone: the bound moved it
        if not eligible:
            chosen, b = _least_loaded(avail, rng)
            matched = match(index, hashes, b, best)[0]
            return RouteDecision(chosen.replica, "load", matched, best_all, n_blocks, True)

        if n_blocks:
            matched, holders = match(index, hashes, elig_mask, best)
            if matched >= max(self._min_blocks, math.ceil(p.min_match_ratio * n_blocks)):
                chosen, _ = _least_loaded([xb for xb in eligible if xb[1] & holders], rng)
                diverted = diverted or best_all > matched
                return RouteDecision(chosen.replica, "prefix", matched, best_all, n_blocks, diverted)
        if session_id is None and not n_blocks:
            chosen, _ = _least_loaded(eligible, rng)
            return RouteDecision(chosen.replica, "load", 0, 0, 0, diverted)
        home = probe.home if probe is not None else None
        chosen, b, moved = self._new_prefix(hashes, session_id, avail, eligible, elig_mask, rng, home)
        matched = match(index, hashes, b, best)[0]
        return RouteDecision(chosen.replica, "new_prefix", matched, best_all, n_blocks, diverted or moved)

    def _available(self, loads: Sequence[ReplicaLoad]) -> tuple[list[tuple[ReplicaLoad, int]], int]:
        """(healthy replicas below their cap with their index bits, the mask of healthy ones)."""
        bits, bit = self.index._bits, self.index.bit
        healthy_mask = 0
        avail: list[tuple[ReplicaLoad, int]] = []
        for x in loads:
            if x.healthy:
                b = bits.get(x.replica) or bit(x.replica)
                healthy_mask |= b
                if x.in_flight < x.max_in_flight:
                    avail.append((x, b))
        return avail, healthy_mask

    def _eligible(
        self,
        avail: Sequence[tuple[ReplicaLoad, int]],
        loads: Sequence[ReplicaLoad],
        fleet: tuple[int, int] | None = None,
    ) -> tuple[list[tuple[ReplicaLoad, int]], int, int]:
        """(the available replicas within the bound, the available mask, the eligible mask)."""
        p = self.params
        healthy = [x.in_flight for x in loads if x.healthy]
        count, total = fleet if fleet is not None else (len(healthy), sum(healthy))
        bound = max(math.ceil(p.load_factor * (total + 1) / max(count, 1)), min(healthy) + p.load_slack)
        min_wait = min(x.waiting for x, _ in avail)
        wait_cap = max(min_wait + p.waiting_abs_threshold, p.waiting_rel_threshold * min_wait)
        kv_max = p.kv_usage_max
        avail_mask = elig_mask = 0
        eligible: list[tuple[ReplicaLoad, int]] = []
        for x, b in avail:
            avail_mask |= b
            if x.in_flight < bound and x.waiting <= wait_cap and x.kv_usage < kv_max:
                elig_mask |= b
                eligible.append((x, b))
        return eligible, avail_mask, elig_mask

    def _new_prefix(
        self,
        hashes: Sequence[BlockHash],
        session_id: str | None,
        avail: Sequence[tuple[ReplicaLoad, int]],
        eligible: Sequence[tuple[ReplicaLoad, int]],
        elig_mask: int,
        rng: random.Random,
        looked_up: tuple[int, str | None] | None = None,
    ) -> tuple[ReplicaLoad, int, bool]:
        """(replica, its bit, diverted) for a prompt no eligible replica holds enough of, by the
        ``new_prefix`` placement; diverted: the load bound kept it from its home. ``looked_up``:
        ``homes.lookup(hashes)``, when the caller has it."""
        p = self.params
        if p.new_prefix == "home":
            blocks, home = looked_up if looked_up is not None else self.homes.lookup(hashes)
            if blocks < max(self._min_blocks, math.ceil(p.min_match_ratio * len(hashes))):
                home = None  # a shared preamble, not this prompt's context: placed as new
            at_home = next((xb for xb in eligible if xb[0].replica == home), None)
            if at_home is not None:
                return (*at_home, False)
            x, b = eligible[self.homes.place([x for x, _ in eligible], rng)]
            return x, b, home is not None  # a home, but the load bound (or its health) kept it away
        if p.new_prefix == "least_loaded":
            return (*(self._last_home(hashes, eligible) or roomiest(eligible, self.index._held, rng)), False)
        if session_id is not None:
            key = stable_hash64("session", session_id)
        else:
            key = hashes[min(self._home_block, len(hashes)) - 1]
        home_x, chosen, b = self._rendezvous(key, avail, elig_mask)
        return chosen, b, home_x is not chosen

    def _last_home(
        self, hashes: Sequence[BlockHash], eligible: Sequence[tuple[ReplicaLoad, int]]
    ) -> tuple[ReplicaLoad, int] | None:
        """The eligible replica whose engine last stored the longest prefix of these blocks (at
        least ``min_match_tokens``), though it evicted them since: where the context's sessions
        went before. Learnt from the events alone, so every gateway replica agrees on it."""
        hist = self._stored_by  # prefix-closed like the index (head stored before tail), anchors like it
        if not hist or not hashes:
            return None
        lo, who = deepest_strided(hist, hashes, self.params.claim_stride_blocks)
        if who is None or lo < self._min_blocks:
            return None
        return next((xb for xb in eligible if xb[0].replica == who), None)

    def cache_rank(self, d: RouteDecision) -> int:
        """The request's cache rank on the chosen replica (module docstring): 0 when it holds at
        least the prefix rule's share of the prompt, else 1; always 0 with ``cache_priority`` off
        (the engine then orders by surface and arrival alone)."""
        if not self.params.cache_priority:
            return 0
        need = max(self._min_blocks, math.ceil(self.params.min_match_ratio * d.total_blocks))
        return 0 if d.total_blocks and d.matched_blocks >= need else 1

    def _rendezvous(
        self, key: int, avail: Sequence[tuple[ReplicaLoad, int]], elig_mask: int
    ) -> tuple[ReplicaLoad, ReplicaLoad, int]:
        """(home, chosen, chosen's bit): the top-scoring available replica for ``key``, and the
        top-scoring eligible one — CHWBL's walk down the key's order, skipping the full ones."""
        seeds = self._seeds
        home: ReplicaLoad | None = None
        chosen: ReplicaLoad | None = None
        home_s = chosen_s = -(1 << 64)
        chosen_b = 0
        for x, b in avail:
            seed = seeds.get(x.replica)
            if seed is None:
                seed = seeds[x.replica] = stable_hash64("replica", x.replica)
            s = ((key ^ seed) * _GOLDEN) & _M64
            if s > home_s:
                home, home_s = x, s
            if s > chosen_s and b & elig_mask:
                chosen, chosen_s, chosen_b = x, s, b
        assert home is not None and chosen is not None  # callers pass >= 1 eligible replica
        return home, chosen, chosen_b

    # Updates ---------------------------------------------------------------------------------
    def record(
        self, replica: str, hashes: Sequence[BlockHash], now: float, session_id: str | None = None
    ) -> None:
        """After dispatch: ``replica`` will hold these blocks; the session now lives there. For a
        replica fed by its engine's KV events the blocks only count for ``recent_ttl_s`` (until its
        ``BlockStored`` events confirm them); for the others they stay until LRU drops them."""
        if self._mirrored or replica in self.event_fed:  # its BlocksQueued claims the homes everywhere
            self.index.note_recent(replica, hashes, now)
        else:
            self.index.record(replica, hashes)
            if self._homing:
                self.homes.claim(replica, hashes)
        if session_id is not None:
            self.sessions.bind(session_id, replica, now)

    def remove_replica(self, replica: str) -> None:
        """A replica left or died: its blocks go; its sessions move on their next request."""
        self.index.remove_replica(replica)
        self._seeds.pop(replica, None)
        self._kv_maps.pop(replica, None)
        self.event_fed.discard(replica)
        self.homes.remove_replica(replica)

    # Engine KV events (vLLM BlockStored / BlockRemoved / AllBlocksCleared) ---------------------
    def apply_kv_stored(
        self,
        replica: str,
        block_hashes: Sequence[Hashable],
        parent_block_hash: Hashable | None,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
    ) -> int:
        """The engine stored these blocks. Its hashes are not ours (vLLM seeds its own), so ours are
        recomputed from the event's tokens, chained from the parent's (a chain's first blocks under
        the ``cache_salt`` the event carries); returns blocks indexed."""
        kv = self._kv_maps.get(replica)
        if kv is None:
            kv = self._kv_maps[replica] = RouterHashes(self.hasher, self.params.kv_map_capacity)
        stored = kv.stored(block_hashes, parent_block_hash, token_ids, cache_salt)
        if stored is None:
            self.kv_unmapped += 1
            return 0
        return self.apply_index_stored(replica, stored)

    def apply_index_stored(self, replica: str, stored: Sequence[BlockHash], blocks: int | None = None) -> int:
        """The engine stored these blocks, named by the router's hashes (``IndexStored``: its replica
        hashed them; anchors for ``blocks``); returns entries indexed. Who stored each: for its reader."""
        self.index.on_block_stored(replica, stored, blocks)
        hist = self._stored_by
        for h in stored if self._last_homes else ():  # issue 42: every gateway, every engine's stores
            hist[h] = replica
            hist.move_to_end(h)
        while len(hist) > self.params.index_capacity_blocks:
            hist.popitem(last=False)
        return len(stored)

    def apply_kv_removed(self, replica: str, block_hashes: Iterable[Hashable]) -> None:
        kv = self._kv_maps.get(replica)
        if kv is not None:
            self.index.on_block_removed(replica, kv.removed(block_hashes))

    def replica_lost(self, replica: str) -> None:
        """The replica's process is gone or going (its event feed broke) though Serve still lists
        it: its cached blocks go, and its contexts lose their home, so they are placed elsewhere
        rather than sent back to it; it stays event-fed (see :class:`cluster.routing.view.BackendView`)."""
        self.apply_kv_cleared(replica)
        self.homes.remove_replica(replica)

    def apply_kv_cleared(self, replica: str) -> None:
        """The engine reset its prefix cache: its blocks go (the replica gets a new slot)."""
        self.index.remove_replica(replica)
        self._kv_maps.pop(replica, None)

    def apply_frame(self, frame: IndexFrame, now: float) -> None:
        """A gateway's mirror of its backend's indexer (:mod:`cluster.routing.index_mirror`): take
        one frame, in sequence. The index and the homes hold what the indexer's do (in this
        router's bits); this router's own sends still count as recent sends, as before."""
        index, homes = self.index, self.homes
        self._mirrored = True
        names = self._mirror_names.setdefault(frame.shard, {})  # each shard numbers its own slots
        if frame.reset:
            names.clear()
            index.drop_shard(frame.shard, frame.shards)
            homes.drop_shard(frame.shard, frame.shards)
        if frame.shard == 0:
            self._replica_frame(frame, now)
        if frame.names:
            names.update(frame.names)
            self.event_fed.update(frame.names.values())
        bits, tokens = self._mirror_table(frame.shard, bool(frame.names or frame.reset))
        masks = [sum(bits.get(s, 0) for s in ss) for _, ss in frame.multi]
        index.mirror(frame.set_keys, map(bits.__getitem__, frame.set_slots), frame.drop_keys)
        index.mirror([h for h, _ in frame.multi], masks, ())
        homes.mirror(frame.home_keys, map(tokens.__getitem__, frame.home_slots), frame.home_drop)
        homes.mirror_demand(frame.shard, frame.shards, frame.demand, frame.claims)

    def _mirror_table(self, shard: int, renamed: bool) -> tuple[dict[int, int], dict[int, tuple[str, int]]]:
        """The shard's slots in this router's bits and home tokens: made again only when the slots
        were renamed or a replica's bit or token changed here (every frame would cost O(replicas))."""
        key = (self.index.generation, self.homes.generation)
        cached = self._mirror_tables.get(shard)
        if cached is None or renamed or cached[0] != key:
            names = self._mirror_names[shard]
            bits = dict(zip(names, map(self.index.bit, names.values()), strict=True))
            tokens = dict(zip(names, map(self.homes.token, names.values()), strict=True))
            cached = self._mirror_tables[shard] = (
                (self.index.generation, self.homes.generation),
                bits,
                tokens,
            )
        return cached[1], cached[2]

    def _replica_frame(self, frame: IndexFrame, now: float) -> None:
        """A replica's own state, which shard 0 speaks for: its entries cleared, its homes voided,
        its blocks held, its sessions bound."""
        index = self.index
        for name in frame.cleared:
            index.remove_replica(name)
        for name in frame.homeless:
            self.homes.remove_replica(name)
        for name, held in frame.held.items():
            index.set_held(name, held)
        for session, replica in frame.sessions:
            self.sessions.bind(session, replica, now)

    def apply_kv_page(self, replica: str, page: KVEventPage, now: float | None = None) -> int:
        """Apply one replica's page of KV events (:mod:`cluster.engine.kv_events`), in order; returns the
        events applied. The first page, or one that says ``reset``, replaces what the index held
        for the replica (routed guesses or a window of events it missed) with the engine's word.
        ``now`` (the clock ``decide`` is given) dates the ``BlocksQueued`` sends; None skips them."""
        if page.reset or replica not in self.event_fed:
            self.apply_kv_cleared(replica)
            self.event_fed.add(replica)
        n = 0
        for batch in page.batches:
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    if ev.block_size != self.hasher.block_size:  # another engine setting: not ours
                        self.kv_mismatched += 1
                        continue
                    self.apply_kv_stored(
                        replica, ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.cache_salt
                    )
                elif isinstance(ev, IndexStored):
                    self.apply_index_stored(replica, ev.block_hashes, ev.blocks)
                elif isinstance(ev, IndexRemoved):
                    self.index.on_block_removed(replica, ev.block_hashes, ev.blocks)
                elif isinstance(ev, BlockRemoved):
                    self.apply_kv_removed(replica, ev.block_hashes)
                elif isinstance(ev, BlocksQueued):  # its anchors only, when its replica strided it
                    anchored, ours = ev.stride > 1, ev.stride in (1, self.params.claim_stride_blocks)
                    self.kv_mismatched += not ours  # another stride: no homes, no recent send
                    if self._homing and ours:
                        self.homes.claim(replica, ev.block_hashes, anchored)
                    if now is not None and ours:
                        self.index.note_recent(replica, ev.block_hashes, now, anchored)
                    if now is not None and ev.session_id is not None:
                        self.sessions.bind(ev.session_id, replica, now)
                else:
                    self.apply_kv_cleared(replica)
                n += 1
        return n
