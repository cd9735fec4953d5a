"""Capacity-aware placement: sticky context homes, the hot working set per replica, and the
router's ``new_prefix="home"`` decision built on them."""

from __future__ import annotations

import random

import pytest

from cluster.engine.kv_events import BlocksQueued, KVEventLog
from cluster.routing.affinity import AffinityParams, AffinityRouter, ReplicaLoad
from cluster.routing.block_hash import deepest_strided, strided
from cluster.routing.placement import ContextHomes
from cluster.routing.prefix_index import PrefixIndex
from tests.unit.affinity_helpers import loads, toks

BS = 16
R2 = ["r0", "r1"]


def router(**params) -> AffinityRouter:
    return AffinityRouter(BS, "m", AffinityParams(new_prefix="home", min_match_ratio=0.5, **params))


def evict(rt: AffinityRouter, replica: str, hashes) -> None:
    """The engine dropped these blocks (what its BlockRemoved events do to the index)."""
    rt.index.on_block_removed(replica, hashes)


# ContextHomes ----------------------------------------------------------------------------------


def test_the_first_replica_stays_home_and_a_sessions_extension_is_homed_where_it_went():
    homes = ContextHomes(1000, 64)
    context = list(range(100, 110))
    assert homes.claim("a", context) == 10
    assert homes.claim("b", [*context, 7, 8]) == 2  # diverted: only its own new blocks are b's
    assert homes.lookup(context) == (10, "a")
    assert homes.lookup([*context, 7, 8]) == (12, "b")
    assert homes.lookup([1, 2]) == (0, None)


def test_demand_is_the_working_set_and_halves_over_the_half_life():
    homes = ContextHomes(1000, half_life_requests=2)
    homes.claim("a", list(range(8)))
    homes.claim("a", list(range(8)))  # the same context again: no new blocks, one more decay
    assert homes.demand("a") == pytest.approx(8 * 0.5**0.5)
    homes.claim("b", [50])
    assert homes.demand("a") == pytest.approx(8 * 0.5)
    assert homes.demand("b") == 1


def test_place_picks_the_least_demand_per_kv_block_then_the_least_loaded():
    homes = ContextHomes(1000, 1e9)
    homes.claim("a", list(range(10)))
    homes.claim("b", list(range(100, 115)))
    rng = random.Random(0)
    # b holds more, but has twice the KV: less demand per block
    big_b = [ReplicaLoad("a", kv_blocks=100), ReplicaLoad("b", kv_blocks=200)]
    assert big_b[homes.place(big_b, rng)].replica == "b"
    same = [ReplicaLoad("a", kv_blocks=100), ReplicaLoad("b", kv_blocks=100)]
    assert same[homes.place(same, rng)].replica == "a"
    fresh = [ReplicaLoad("c", in_flight=3), ReplicaLoad("d", in_flight=1)]  # no demand: least loaded
    assert fresh[homes.place(fresh, rng)].replica == "d"


def test_a_removed_replicas_contexts_lose_their_home_and_are_homed_anew():
    homes = ContextHomes(1000, 64)
    homes.claim("a", [1, 2, 3])
    homes.remove_replica("a")
    assert homes.lookup([1, 2, 3]) == (3, None)
    assert homes.demand("a") == 0
    assert homes.claim("b", [1, 2, 3]) == 3
    assert homes.lookup([1, 2, 3]) == (3, "b")


def test_a_replica_back_after_removal_is_home_only_to_what_is_sent_to_it_again():
    homes = ContextHomes(1000, 64)
    homes.claim("a", [1, 2, 3])
    homes.remove_replica("a")
    homes.claim("a", [9])
    assert homes.lookup([1, 2, 3]) == (3, None)
    assert homes.lookup([9]) == (1, "a")


def test_bounded_homes_evict_tails_first_so_the_deepest_homed_block_is_still_found():
    homes = ContextHomes(capacity_blocks=6, half_life_requests=64)
    homes.claim("a", [1, 2, 3, 4])
    homes.claim("b", [10, 11, 12, 13])  # over capacity by 2: a's two tail blocks go
    assert len(homes) == 6
    assert homes.lookup([1, 2, 3, 4]) == (2, "a")
    assert homes.lookup([10, 11, 12, 13]) == (4, "b")


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        ContextHomes(0, 64)
    with pytest.raises(ValueError):
        ContextHomes(10, 0)
    with pytest.raises(ValueError):
        AffinityParams(new_prefix="home", home_half_life_requests=0)


# The router with new_prefix="home" -------------------------------------------------------------


def test_an_evicted_context_goes_back_home_not_to_the_idlest_replica():
    rt = router()
    hs = rt.hash(toks(1024))
    d = rt.decide(hs, loads(R2), random.Random(0), 0, "s1")
    rt.record(d.replica, hs, 0, "s1")
    evict(rt, d.replica, hs)
    other = next(r for r in R2 if r != d.replica)
    busy = loads(R2, **{d.replica: {"in_flight": 3}})  # home busier, still within the bound
    again = rt.decide(hs, busy, random.Random(0), 1, "s2")
    assert (again.replica, again.reason, again.diverted) == (d.replica, "new_prefix", False)
    # the placement the home replaces would have sent it to the idler replica
    ll = AffinityRouter(BS, "m", AffinityParams(new_prefix="least_loaded", min_match_ratio=0.5))
    ll.record(d.replica, hs, 0, "s1")
    evict(ll, d.replica, hs)
    assert ll.decide(hs, busy, random.Random(0), 1, "s2").replica == other


def test_a_groups_sessions_share_the_home_of_their_context():
    rt = router()
    context = toks(1024)
    first = rt.hash(context + toks(64, seed=1))
    d = rt.decide(first, loads(R2), random.Random(0), 0, "s1")
    rt.record(d.replica, first, 0, "s1")
    evict(rt, d.replica, first)
    for s in range(2, 6):  # new sessions, each with its own question after the shared context
        hs = rt.hash(context + toks(64, seed=s))
        quiet = loads(R2, **{d.replica: {"in_flight": 2}})
        assert rt.decide(hs, quiet, random.Random(s), 1, f"s{s}").replica == d.replica


def test_new_contexts_partition_by_kv_capacity():
    """Contexts placed one after another on an idle cluster: each replica is home to a share of
    them proportional to its KV cache, instead of every context on the least loaded."""
    rt = router()
    cluster = loads(["big", "small"], big={"kv_blocks": 2000}, small={"kv_blocks": 1000})
    placed = []
    for c in range(9):
        hs = rt.hash(toks(1024, seed=100 + c))
        d = rt.decide(hs, cluster, random.Random(c), 0)
        rt.record(d.replica, hs, 0)
        placed.append(d.replica)
    assert placed.count("big") == 6 and placed.count("small") == 3


def test_a_home_over_the_load_bound_is_diverted_and_keeps_the_context():
    rt = router(load_slack=2)
    hs = rt.hash(toks(1024))
    d = rt.decide(hs, loads(R2), random.Random(0), 0)
    rt.record(d.replica, hs, 0)
    evict(rt, d.replica, hs)
    other = next(r for r in R2 if r != d.replica)
    over = loads(R2, **{d.replica: {"in_flight": 4}})  # bound max(ceil(1.25*5/2), 0+2) = 4
    spill = rt.decide(hs, over, random.Random(0), 1)
    assert (spill.replica, spill.reason, spill.diverted) == (other, "new_prefix", True)
    rt.record(spill.replica, hs, 1)
    evict(rt, spill.replica, hs)
    assert rt.decide(hs, loads(R2), random.Random(0), 2).replica == d.replica  # still its home


def test_a_shared_preamble_below_the_match_ratio_does_not_pull_a_new_context_home():
    rt = router()
    preamble = toks(256)
    hs = rt.hash(preamble + toks(768, seed=1))
    d = rt.decide(hs, loads(R2), random.Random(0), 0)
    rt.record(d.replica, hs, 0)
    evict(rt, d.replica, hs)
    other_ctx = rt.hash(preamble + toks(768, seed=2))  # 16 of 64 blocks homed: < 0.5
    assert rt.homes.lookup(other_ctx)[0] == 16
    d2 = rt.decide(other_ctx, loads(R2), random.Random(0), 1)
    assert d2.replica != d.replica  # placed as new: the other replica has no working set yet


def test_two_gateways_fed_the_same_queued_events_hold_the_same_homes():
    """Homes and demand come from the engines' BlocksQueued, which every gateway replica reads:
    a context placed by one gateway goes to the same home from the other."""
    gw1, gw2 = router(), router()
    logs = {r: KVEventLog(epoch=k) for k, r in enumerate(R2)}

    def poll(rt: AffinityRouter, now: float) -> None:
        for r, log in logs.items():
            rt.apply_kv_page(r, log.since(0), now)

    for gw in (gw1, gw2):
        poll(gw, 0.0)  # first pages: both replicas event-fed
    for c in range(6):
        hs = gw1.hash(toks(1024, seed=c))
        d = gw1.decide(hs, loads(R2), random.Random(c), 0.0)
        gw1.record(d.replica, hs, 0.0)
        logs[d.replica].append([BlocksQueued(hs, None)], 0.0)  # the engine replica's announcement
    for gw in (gw1, gw2):
        poll(gw, 100.0)  # long after the recent sends expired: only the homes remember
    for c in range(6):
        hs = gw1.hash(toks(1024, seed=c))
        assert gw2.homes.lookup(hs) == gw1.homes.lookup(hs)
        d1 = gw1.decide(hs, loads(R2), random.Random(9), 200.0)
        d2 = gw2.decide(hs, loads(R2), random.Random(9), 200.0)
        assert d1.replica == d2.replica == gw1.homes.lookup(hs)[1]
    assert gw1.homes.demand("r0") == gw2.homes.demand("r0") > 0


def test_a_removed_replicas_context_is_placed_as_new_and_rehomed():
    rt = router()
    hs = rt.hash(toks(1024))
    rt.record("r0", hs, 0)
    rt.remove_replica("r0")
    d = rt.decide(hs, loads(["r1", "r2"]), random.Random(0), 1)
    assert (d.reason, d.diverted) == ("new_prefix", False)  # no home to be kept from
    rt.record(d.replica, hs, 1)
    assert rt.homes.lookup(hs) == (len(hs), d.replica)


def test_a_lost_replicas_contexts_are_placed_elsewhere_while_serve_still_lists_it():
    rt = router()
    hs = rt.hash(toks(1024))
    rt.record("r0", hs, 0)
    rt.replica_lost("r0")  # its event feed broke: the process died, Serve has not noticed yet
    assert rt.homes.lookup(hs) == (len(hs), None)
    d = rt.decide(hs, loads(R2, r0={"in_flight": 1}), random.Random(0), 1)
    assert (d.replica, d.diverted) == ("r1", False)  # placed as new, not sent back to a dead home


def test_a_next_turn_homes_only_its_new_tail_and_keeps_lru_order():
    """An agent's next turn (its context homed here, a new tail): the head is only moved to the
    end (the fast path, issue 42), in the order the one-by-one loop left it: head most recent."""
    homes = ContextHomes(1000, half_life_requests=1e9)
    assert homes.claim("a", [1, 2, 3]) == 3
    homes.claim("b", [9])
    assert homes.claim("a", [1, 2, 3, 4, 5]) == 2
    assert list(homes._home) == [9, 5, 4, 3, 2, 1]
    assert homes.claim("b", [1, 2, 7]) == 1  # a's head stays a's; only 7 is new, homed to b
    assert homes.lookup([1, 2, 7]) == (3, "b") and homes.lookup([1, 2]) == (2, "a")
    assert homes.demand("a") == pytest.approx(5) and homes.demand("b") == pytest.approx(2)


# Anchors: the homes and the recent sends keyed by every k-th block (issue 42) -----------------


def test_strided_keeps_every_kth_block_and_the_last():
    chain = list(range(10, 30))  # 20 blocks
    assert strided(chain, 8) == [17, 25, 29] and strided(chain[:16], 8) == [17, 25]
    assert strided(chain, 1) is chain and strided(chain[:3], 8) == [12]
    held = dict.fromkeys(strided(chain, 8), "a")
    assert deepest_strided(held, chain, 8) == (20, "a")
    assert deepest_strided(held, chain[:19], 8) == (16, "a")  # its last is no anchor: within 8
    assert deepest_strided(held, chain[:7], 8) == (0, None)


def test_strided_homes_find_a_context_to_within_the_stride_at_an_eighth_of_the_entries():
    homes, exact = ContextHomes(1000, 64, stride=8), ContextHomes(1000, 64)
    context = list(range(100, 164))  # 64 blocks
    assert homes.claim("a", context) == 8 and exact.claim("a", context) == 64
    assert len(homes) == 8
    assert homes.lookup(context) == exact.lookup(context) == (64, "a")
    turn = [*context, *range(500, 520)]  # the next turn, diverted: its 20 new blocks are b's
    homes.claim("b", turn)
    exact.claim("b", turn)
    assert homes.lookup(turn) == exact.lookup(turn) == (84, "b")
    assert homes.lookup([*context, 500, 501]) == (64, "a")  # exact says (66, "b"): within the stride
    assert exact.lookup([*context, 500, 501]) == (66, "b")


def test_strided_recent_sends_match_to_within_the_stride_and_expire():
    idx = PrefixIndex(1000, stride=8)
    sent = list(range(1, 21))  # 20 blocks: anchors 8, 16 and the last
    idx.note_recent("a", sent, now=0.0)
    a = idx.mask(["a"])
    assert len(idx._recent) == 3
    assert idx.longest_match(sent, a) == (20, a)
    assert idx.longest_match([*sent[:18], 99], a)[0] == 16  # shares 18 blocks: counted to 16
    assert idx.longest_match(sent[:5], a)[0] == 0  # within one stride of the root: not counted
    idx.record("b", sent[:5])  # the index itself stays exact, next to the recent anchors
    assert idx.longest_match(sent[:12], idx.mask(["a", "b"])) == (8, a)
    idx.expire_recent(before=1.0)
    assert not idx._recent and idx.longest_match(sent, a) == (0, 0)


def test_the_configured_stride_reaches_the_homes_and_the_recent_sends():
    rt = router(claim_stride_blocks=4)
    assert rt.homes.stride == 4 and rt.index.stride == 4
    with pytest.raises(ValueError):
        AffinityParams(claim_stride_blocks=0)


def test_only_the_least_loaded_placement_keeps_who_stored_each_block():
    """The last-stored-by map is read by new_prefix least_loaded alone: the others skip it (every
    gateway applies every engine's stores, issue 42)."""
    home, last = router(), AffinityRouter(BS, "m", AffinityParams(new_prefix="least_loaded"))
    for rt in (home, last):
        assert rt.apply_index_stored("r0", [1, 2, 3]) == 3
        assert rt.index.longest_match([1, 2, 3], rt.index.mask(["r0"]))[0] == 3
    assert not home._stored_by and list(last._stored_by.items()) == [(1, "r0"), (2, "r0"), (3, "r0")]
