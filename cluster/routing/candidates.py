"""A bounded candidate set for a cache-aware decision over a large fleet (issue 42).

Scoring every replica made a decision cost O(replicas) (a load record, a breaker check, a bound
test and a placement score each): at 256 replicas most of a decision's time. With
``decision_candidates`` = k (``AffinityConfig``) and more than k serving replicas,
:meth:`cluster.routing.view.BackendView.choose` scores only :func:`bounded_pool`'s set: the
replicas the policy must consider (:func:`must_consider`: the session's replica, up to k holders
of the prompt's deepest indexed prefix, and when that prefix is too short to steer the context's
home) and k drawn at random (with replacement), so its cost is at most two binary searches over
the prompt's blocks and O(k), whatever the fleet.

Exactness. With k or fewer serving replicas every one is scored: the full decision, bit for bit.
With more, a session, prefix or home decision is the full one whenever the replica the full one
would pick for that reason is in the set: the session's replica always is, the prefix holders
whenever k or fewer hold the deepest match, the home whenever no indexed prefix steers (when one
does and every holder is over the bound, the home counts only if drawn). The load bound uses the fleet's exact
average in flight (its floor, the least loaded plus the slack, is the set's least loaded: at
least the fleet's, so the bound is never tighter). The fallbacks (the least loaded replica, a new
context's least demand per KV block, a shorter prefix when every deepest holder is over the
bound) pick the best of the set instead of the fleet: power-of-k choices (Mitzenmacher). With
``new_prefix: rendezvous`` every replica is scored (its home is the top of a hash order over all).

Plain Python, no I/O.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.routing.block_hash import BlockHash, deepest_strided
from cluster.routing.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from cluster.routing.affinity import AffinityRouter, ReplicaLoad


@dataclass(frozen=True, slots=True)
class Probe:
    """What :func:`must_consider` found for a prompt, which the decision right after it reuses
    (nothing changes the index or the homes in between)."""

    blocks: int  # the deepest indexed prefix, over every replica
    holders: int  # the replicas (a mask) holding exactly that much
    home: tuple[int, str | None] | None  # ``homes.lookup`` (new_prefix home), None if not looked up


def match(
    index: PrefixIndex, hashes: Sequence[BlockHash], mask: int, known: tuple[int, int] | None = None
) -> tuple[int, int]:
    """``index.longest_match`` over ``mask``, from ``known`` (blocks, holders) over a superset of
    ``mask`` without a search when that settles it: one of those holders is in ``mask``, or no
    replica holds even the first block (prefix-closed entries: the same answer)."""
    if not hashes:
        return 0, 0
    if known is not None and (known[1] & mask or not known[0]):
        return known[0], known[1] & mask
    return index.longest_match(hashes, mask)


def must_consider(
    router: AffinityRouter,
    hashes: Sequence[BlockHash],
    session_id: str | None,
    now: float,
    rng: random.Random,
    limit: int,
) -> tuple[list[str], Probe]:
    """The replicas a bounded decision scores besides its sample (the module docstring), and the
    probe of the prompt the decision reuses."""
    out: list[str] = []
    if session_id is not None and (r := router.sessions.get(session_id, now)) is not None:
        out.append(r)
    if not hashes:
        return out, Probe(0, 0, None)
    index, params = router.index, router.params
    blocks, holders = index.longest_match(hashes, -1)
    steers = blocks >= max(router._min_blocks, math.ceil(params.min_match_ratio * len(hashes)))
    if blocks >= router._min_blocks:
        held = index.replicas(holders)
        out += held if len(held) <= limit else rng.sample(held, limit)
    looked_up = None
    if params.new_prefix == "home" and not steers:  # a prefix that steers: its holders decide
        looked_up = router.homes.lookup(hashes)
        out += [looked_up[1]] if looked_up[1] is not None else []
    elif params.new_prefix == "least_loaded" and router._stored_by and not steers:
        stride = params.claim_stride_blocks  # its last home (looked up again if used)
        last = deepest_strided(router._stored_by, hashes, stride)[1]
        out += [last] if last is not None else []
    return out, Probe(blocks, holders, looked_up)


def bounded_pool(
    router: AffinityRouter,
    up: list[str],
    up_set: frozenset[str],
    in_flight_total: int,
    hashes: Sequence[BlockHash],
    now: float,
    session_id: str | None,
    rng: random.Random,
) -> tuple[list[str], tuple[int, int] | None, Probe | None]:
    """The replicas a decision scores, with ``(replicas, in flight)`` of the fleet and the probe
    when that is a bounded set (the module docstring); every serving replica (``up``) otherwise."""
    k = router.params.decision_candidates
    if not k or len(up) <= k or router.params.new_prefix == "rendezvous":
        return up, None, None
    must, probe = must_consider(router, hashes, session_id, now, rng, k)
    pool = list(dict.fromkeys([r for r in must if r in up_set] + rng.choices(up, k=k)))
    return pool, (len(up), in_flight_total), probe


def roomiest(
    loads: Sequence[tuple[ReplicaLoad, int]], held: dict[int, int], rng: random.Random
) -> tuple[ReplicaLoad, int]:
    """A new prefix's replica under ``new_prefix="least_loaded"``: the least loaded, then the one
    whose cache the index fills least (its share of the engine's KV, or blocks when the size is
    unknown), so a new context displaces the fewest others; then ``rng``."""
    best = min([x.in_flight + x.waiting for x, _ in loads])
    ties = [xb for xb in loads if xb[0].in_flight + xb[0].waiting == best]
    if len(ties) > 1:
        fill = [held.get(b, 0) / x.kv_blocks if x.kv_blocks else float(held.get(b, 0)) for x, b in ties]
        low = min(fill)
        ties = [xb for xb, f in zip(ties, fill, strict=True) if f == low]
    return ties[0] if len(ties) == 1 else rng.choice(ties)
