"""Capacity-aware placement of contexts: each context has one home replica, and new contexts go
where the hot demand on the replica's KV cache is lowest.

Used by :class:`cluster.routing.affinity.AffinityRouter` with ``new_prefix="home"``, for a request whose
prompt no eligible replica holds (enough of) in its cache. Under KV pressure the engines evict
contexts, and an index that only says what is cached forgets where a context *lived*: its next
request is placed anew, anywhere, and a group's sessions scatter over the replicas, each copy
evicting someone else's context. A home outlives the blocks: the context goes back to it (where
its group's other sessions also go), so the contexts partition over the replicas — each one
cached on one replica instead of on all — and when a replica's homes exceed its KV, its engine's
LRU evicts the coldest of them, which take the misses, not everyone.

The homes. ``block hash -> home replica`` for every full block of every prompt sent, bounded in
blocks, LRU. The first replica a block is sent to stays its home (a request diverted by the load
bound does not move its context; its own new blocks, a session's turns, are homed where it went),
until that replica leaves or its event feed is lost (its homes go void at once). Blocks are
inserted tail first, so eviction takes tails first and the homed set stays prefix-closed: the
deepest homed block of a prompt is found by binary search, and its home is the context's home.
With ``stride`` k > 1 only a chain's anchors are homed (every k-th block and its last,
:func:`cluster.routing.block_hash.strided`): k times fewer entries to claim on every gateway for
every request to every engine (issue 42), a context's depth known to within k blocks.

The demand. Each replica's hot working set: the blocks it became home to, decayed (half of it
fades every ``half_life_requests`` requests the backend receives, so a context homed long ago and
not extended since stops counting). A new context goes to the eligible replica with the least
demand per block of KV (the replicas report their KV size): online bin packing of hot prefixes
against each replica's cache, so each cache is asked to hold about the same share of what is
hot, and when the working set exceeds the cluster's KV every replica sheds its own coldest. The
load bound (applied by the caller) keeps a replica whose homes draw more traffic than its share
from queueing past the others. Counting traffic instead (blocks *sent*, so a hot context weighs
as much as several cold ones) placed worse: loadtest/benchmarks/bench_affinity.py's kv_pressure,
BENCHMARKS.md. Requests, not seconds, are the clock: the decay is then the same on a live cluster and on a
benchmark's virtual clock.

Fed by the engines' ``BlocksQueued`` announcements (every gateway replica sees every request to
every engine replica, so every gateway replica holds the same homes and demand) or, for a replica
without KV events, by the routed requests of this gateway alone.

Plain Python, no I/O; the caller passes the eligible replicas (load bound already applied) and
the random generator.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat
from typing import Protocol

from cluster.routing.block_hash import BlockHash, deepest_strided, strided


class _Load(Protocol):
    """What placement reads of a replica (:class:`cluster.routing.affinity.ReplicaLoad`)."""

    replica: str
    in_flight: int
    waiting: int
    kv_blocks: int


class ContextHomes:
    """Sticky homes of prompt blocks and each replica's decayed demand (module docstring)."""

    def __init__(self, capacity_blocks: int, half_life_requests: float, stride: int = 1) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        if half_life_requests <= 0:
            raise ValueError("half_life_requests must be positive")
        self.capacity = capacity_blocks
        self.stride = max(1, stride)  # homes keyed by a chain's anchors (module docstring)
        self._keep = 0.5 ** (1.0 / half_life_requests)
        # block hash -> its home's token; a replica's token is one shared (name, generation) tuple,
        # replaced when the replica is removed, so its homes go void at once without a scan
        self._home: OrderedDict[BlockHash, tuple[str, int]] = OrderedDict()
        self._tokens: dict[str, tuple[str, int]] = {}
        self._generation = itertools.count()
        # replica -> (decayed blocks it became home to, as of claim number); decayed when read, so
        # a claim costs O(1), not O(replicas) (issue 42: every gateway claims every engine's requests)
        self._demand: dict[str, tuple[float, int]] = {}
        self._claims = 0
        self.evicted: list[BlockHash] | None = None  # an indexer's: anchors the bound dropped (index_mirror)
        self._shard_demand: dict[int, dict[str, tuple[float, int]]] = {}  # a mirror's, per indexer shard
        self.generation = 0  # bumped whenever a replica's token changes (a mirror's slot tables)

    def __len__(self) -> int:
        return len(self._home)

    def demand(self, replica: str) -> float:
        d = self._demand.get(replica)
        return 0.0 if d is None else d[0] * self._keep ** (self._claims - d[1])

    def lookup(self, hashes: Sequence[BlockHash]) -> tuple[int, str | None]:
        """``(blocks, home)``: the deepest homed block of the prompt and its live home; ``(0, None)``
        when no block is homed, ``(blocks, None)`` when the home is gone."""
        lo, who = deepest_strided(self._home, hashes, self.stride)
        if who is None or self._tokens.get(who[0]) is not who:
            return lo, None
        return lo, who[0]

    def claim(self, replica: str, hashes: Sequence[BlockHash], anchored: bool = False) -> int:
        """A request with these blocks went to ``replica``: blocks without a live home are homed
        there and add to its demand (everyone's decays by one request); returns those blocks
        (anchors, with a ``stride``). ``anchored``: ``hashes`` are the prompt's anchors already
        (a ``BlocksQueued`` its replica strided)."""
        home, tokens = self._home, self._tokens
        token = tokens.get(replica)
        if token is None:
            token = tokens[replica] = (replica, next(self._generation))
        tail_first = (hashes if anchored else strided(hashes, self.stride))[::-1]
        olds = list(map(home.get, tail_first))
        k = len(olds)
        while k and olds[k - 1] is token:  # the head already homed here (an agent's next turn) ...
            k -= 1
        new, pop = 0, home.pop
        for h in tail_first[:k]:  # tail first: the head ends most recent, tails are evicted first
            old = pop(h, None)
            if old is not token and (old is None or tokens.get(old[0]) is not old):
                old, new = token, new + 1
            home[h] = old
        deque(map(home.move_to_end, tail_first[k:]), maxlen=0)  # ... only moves to the end, in C
        while len(home) > self.capacity:
            gone = home.popitem(last=False)[0]
            if self.evicted is not None:
                self.evicted.append(gone)
        self._claims += 1  # everyone's demand decays by one request; the claimer's adds its new blocks
        self._demand[replica] = (self.demand(replica) + new, self._claims)
        return new

    # The mirror: a gateway's copy of an indexer's homes (issue 42, cluster/routing/index_mirror.py)
    def token(self, replica: str) -> tuple[str, int]:
        """The replica's live token (made on first sight): a home's value."""
        t = self._tokens.get(replica)
        if t is None:
            t = self._tokens[replica] = (replica, next(self._generation))
        return t

    def tokens(self) -> dict[str, tuple[str, int]]:
        """Each replica's live token (a copy): the indexer's builder sees a voided one change."""
        return dict(self._tokens)

    def items(self) -> list[tuple[BlockHash, tuple[str, int]]]:
        return list(self._home.items())

    def is_live(self, token: tuple[str, int]) -> bool:
        """The token is its replica's current one (not voided by :meth:`remove_replica`)."""
        return self._tokens.get(token[0]) is token

    def homes_of(self, hashes: Sequence[BlockHash]) -> list[tuple[str, int] | None]:
        """Each anchor's home token, None where it has none."""
        return list(map(self._home.get, hashes))

    def decays_to(self, old: tuple[float, int], new: tuple[float, int]) -> bool:
        """Whether demand ``new`` is ``old`` decayed to its clock: claims that homed nothing new
        (a mirror that has ``old`` computes ``new`` itself)."""
        d, at = old
        expect: float = d * self._keep ** (new[1] - at)
        return abs(new[0] - expect) <= 1e-9 * max(1.0, abs(expect))

    def demand_state(self) -> tuple[dict[str, tuple[float, int]], int]:
        """(replica -> (decayed demand, as of claim number), claims so far): a copy."""
        return dict(self._demand), self._claims

    def mirror(
        self,
        keys: Sequence[BlockHash],
        homes: Iterable[tuple[str, int]],
        gone: Iterable[BlockHash],
    ) -> None:
        """Set these anchors' homes (tokens of :meth:`token`) and drop those gone, as an indexer's
        frame says. The indexer owns the bound."""
        home = self._home
        home.update(zip(keys, homes, strict=True))
        deque(map(home.pop, gone, repeat(None)), maxlen=0)

    def mirror_demand(
        self, shard: int, shards: int, demand: Mapping[str, tuple[float, int]], claims: int
    ) -> None:
        """The claimers' demand as indexer ``shard`` of ``shards`` has it. Each shard homes its own
        anchors and counts every request (the same clock), so a replica's demand is the sum of
        the shards' (each decayed to the latest clock)."""
        self._claims = max(self._claims, claims) if shards > 1 else claims
        if shards == 1:
            self._demand.update(demand)
            return
        parts = self._shard_demand.setdefault(shard, {})
        keep, now = self._keep, self._claims
        for name, (d, at) in demand.items():  # the total less this shard's part, plus its new part
            was_d, was_at = parts.get(name, (0.0, now))
            total = self.demand(name) - was_d * keep ** (now - was_at) + d * keep ** (now - at)
            self._demand[name] = (max(0.0, total), now)
        parts.update(demand)

    def drop_shard(self, shard: int, shards: int) -> None:
        """Forget what indexer ``shard`` of ``shards`` said (its snapshot follows); all of it for one."""
        if shards == 1:
            self.generation += 1
            self._home.clear()
            self._tokens.clear()
            self._demand.clear()
            self._shard_demand.clear()
            self._claims = 0
            return
        home = self._home
        deque(map(home.pop, [h for h in home if h % shards == shard]), maxlen=0)
        self._shard_demand.pop(shard, None)

    def place(self, eligible: Sequence[_Load], rng: random.Random) -> int:
        """The index in ``eligible`` (non-empty) of a new context's home: the least demand per KV
        block (KV size unknown: per block of the largest known), then the least loaded, then
        ``rng``."""
        size = max((x.kv_blocks for x in eligible), default=0) or 1
        keys = [(self.demand(x.replica) / (x.kv_blocks or size), x.in_flight + x.waiting) for x in eligible]
        best = min(keys)
        ties = [i for i, k in enumerate(keys) if k == best]
        return ties[0] if len(ties) == 1 else rng.choice(ties)

    def remove_replica(self, replica: str) -> None:
        """The replica left or died: its contexts lose their home (placed anew on their next
        request); if it comes back, it is home only to what is sent to it from then on."""
        self._demand.pop(replica, None)
        self._tokens.pop(replica, None)
        for parts in self._shard_demand.values():  # every shard's part of it went too
            parts.pop(replica, None)
        self.generation += 1
