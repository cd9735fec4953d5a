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
from collections.abc import Sequence
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
            home.popitem(last=False)
        self._claims += 1  # everyone's demand decays by one request; the claimer's adds its new blocks
        self._demand[replica] = (self.demand(replica) + new, self._claims)
        return new

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
