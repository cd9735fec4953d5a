"""Affinity: chained block hashes, the bounded replica index, the bounded-load decision, sessions."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from cluster.routing.affinity import (
    REASONS,
    AffinityParams,
    AffinityRouter,
    PrefixIndex,
    ReplicaLoad,
    SessionTable,
)
from cluster.routing.block_hash import BlockHasher, stable_hash64
from tests.unit.affinity_helpers import loads, toks

BS = 16
ROOT = Path(__file__).resolve().parents[2]


def router(**params) -> AffinityRouter:
    return AffinityRouter(BS, "m", AffinityParams(**params))


R4 = ["r0", "r1", "r2", "r3"]

# Hashing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["tuple", "blake2b"])
def test_only_full_blocks_are_hashed(algo):
    h = BlockHasher(BS, "m", algo=algo)
    assert len(h.hash_blocks(toks(15))) == 0
    assert len(h.hash_blocks(toks(16))) == 1
    assert len(h.hash_blocks(toks(47))) == 2
    assert h.hash_blocks([]) == []


@pytest.mark.parametrize("algo", ["tuple", "blake2b"])
def test_hashes_chain_like_vllm(algo):
    h = BlockHasher(BS, "m", algo=algo)
    t = toks(64)
    base = h.hash_blocks(t)
    assert len(set(base)) == 4
    # a prefix hashes to a prefix of the hashes, and a chain continues from its parent
    assert h.hash_blocks(t[:32]) == base[:2]
    assert h.hash_blocks(t[32:], parent=base[1]) == base[2:]
    # a change in block 1 keeps block 0 and changes every later block (the chain)
    t2 = list(t)
    t2[20] += 1
    changed = h.hash_blocks(t2)
    assert changed[0] == base[0]
    assert all(a != b for a, b in zip(changed[1:], base[1:], strict=True))
    # the same block after a different parent hashes differently
    assert h.hash_blocks(t[16:32]) != [base[1]]


def test_tuple_hash_is_the_documented_formula():
    h = BlockHasher(BS, "m", "salt")
    t = toks(32)
    h0 = hash((h.root, h.extra, tuple(t[:16])))
    assert h.hash_blocks(t) == [h0, hash((h0, h.extra, tuple(t[16:32])))]
    assert h.extra == stable_hash64("extra", "m", "salt")


@pytest.mark.parametrize("algo", ["tuple", "blake2b"])
def test_extra_keys_model_and_salt_change_every_hash(algo):
    t = toks(32)
    a = BlockHasher(BS, "m", algo=algo).hash_blocks(t)
    assert set(a).isdisjoint(BlockHasher(BS, "other", algo=algo).hash_blocks(t))
    assert set(a).isdisjoint(BlockHasher(BS, "m", "salt", algo=algo).hash_blocks(t))
    assert a == BlockHasher(BS, "m", algo=algo).hash_blocks(t)


def test_hasher_rejects_bad_arguments():
    with pytest.raises(ValueError):
        BlockHasher(0, "m")
    with pytest.raises(ValueError):
        BlockHasher(BS, "m", algo="md5")  # type: ignore[arg-type]


def test_hashes_are_the_same_in_processes_with_different_hash_seeds():
    code = (
        "from cluster.routing.block_hash import BlockHasher;"
        "print(BlockHasher(16, 'm', 's').hash_blocks(list(range(64))),"
        "BlockHasher(16, 'm', 's', 'blake2b').hash_blocks(list(range(64))))"
    )
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.add(run.stdout)
    here = f"{BlockHasher(16, 'm', 's').hash_blocks(list(range(64)))} "
    here += f"{BlockHasher(16, 'm', 's', 'blake2b').hash_blocks(list(range(64)))}\n"
    assert outs == {here}


# The index --------------------------------------------------------------------------------------


def test_longest_prefix_and_holders():
    idx = PrefixIndex(100)
    hs = list(range(1000, 1010))
    idx.record("a", hs[:4])
    idx.record("b", hs[:7])
    assert idx.holders(hs[0]) == ["a", "b"]
    assert idx.holders(hs[5]) == ["b"]
    both = idx.mask(["a", "b"])
    n, holders = idx.longest_match(hs, both)
    assert (n, idx.replicas(holders)) == (7, ["b"])
    n, holders = idx.longest_match(hs, idx.mask(["a"]))
    assert (n, idx.replicas(holders)) == (4, ["a"])
    assert idx.longest_match(hs, idx.mask(["c"])) == (0, 0)
    assert idx.longest_match([], both) == (0, 0)
    assert idx.longest_match(hs[:3], both)[0] == 3


def test_index_is_bounded_and_evicts_tails_first():
    idx = PrefixIndex(10)
    a = list(range(8))
    b = list(range(100, 104))
    idx.record("r1", a)
    idx.record("r2", b)
    assert len(idx) == 10
    assert idx.evictions == 2
    assert idx.holders(a[7]) == [] and idx.holders(a[6]) == []  # the tails went, not the head
    assert idx.longest_match(a, idx.mask(["r1"]))[0] == 6
    # re-recording refreshes: now b's tail is the oldest
    idx.record("r1", a[:6])
    idx.record("r3", [200, 201])
    assert idx.holders(b[3]) == [] and idx.holders(b[2]) == []
    assert idx.longest_match(a, idx.mask(["r1"]))[0] == 6
    assert len(idx) == 10


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_block_removed_events_update_the_index():
    idx = PrefixIndex(100)
    hs = [1, 2, 3, 4]
    idx.on_block_stored("a", hs)
    idx.on_block_stored("b", hs[:2])
    idx.on_block_removed("a", [hs[3], hs[1]])
    assert idx.holders(hs[1]) == ["b"]
    assert idx.holders(hs[3]) == []
    assert 4 not in idx._map  # empty entries are dropped
    assert len(idx) == 3
    idx.on_block_removed("nobody", hs)  # unknown replica: nothing happens
    assert len(idx) == 3


def test_remove_replica_forgets_it_at_once_and_purges_later():
    idx = PrefixIndex(100, purge_after=3)
    idx.record("a", [1, 2, 3])
    idx.record("b", [1, 9])
    bit_a = idx.bit("a")
    idx.remove_replica("a")
    assert idx.holders(1) == ["b"]
    assert idx.holders(2) == []
    assert idx.replicas(bit_a) == []  # callers only pass live replicas' bits
    assert idx.bit_of("a") == 0
    # the slot is not reused before a purge: a newcomer cannot inherit a's blocks
    assert idx.bit("c") != bit_a
    assert idx.holders(2) == []
    idx.purge()
    assert len(idx) == 2 and set(idx._map) == {1, 9}
    assert idx.bit("d") == bit_a  # purged slots are reused, lowest first
    assert idx.holders(2) == [] and idx.holders(1) == ["b"]


def test_purge_runs_by_itself_after_enough_removals():
    idx = PrefixIndex(100, purge_after=2)
    for r in ("a", "b", "c"):
        idx.record(r, [ord(r)])
    idx.remove_replica("a")
    assert idx.purges == 0 and len(idx) == 3
    idx.remove_replica("b")
    assert idx.purges == 1 and len(idx) == 1
    idx.remove_replica("zzz")  # unknown: no-op
    assert idx.purges == 1


# Sessions ---------------------------------------------------------------------------------------


def test_session_table_ttl_and_lru_bound():
    st = SessionTable(capacity=2, ttl_s=10)
    st.bind("s1", "a", now=0)
    st.bind("s2", "b", now=1)
    assert st.get("s1", now=10) == "a"
    assert st.get("s1", now=10.5) is None  # idle for more than ttl since its bind
    st.bind("s1", "a", now=11)
    st.bind("s3", "c", now=12)  # over capacity: the least recently bound (s2) goes
    assert (st.get("s2", 12), st.get("s1", 12), st.get("s3", 12)) == (None, "a", "c")
    assert len(st) == 2


# The decision -----------------------------------------------------------------------------------


def test_prefers_the_longest_cached_prefix():
    rt = router()
    hs = rt.hash(toks(1024))
    rt.record("r1", hs[:10], 0)
    rt.record("r2", hs[:40], 0)
    d = rt.decide(hs, loads(R4), random.Random(0), 0)
    assert (d.replica, d.reason, d.matched_blocks, d.best_blocks, d.total_blocks, d.diverted) == (
        "r2",
        "prefix",
        40,
        40,
        64,
        False,
    )
    assert d.reason in REASONS


def test_a_match_below_the_minimum_goes_to_the_home_replica():
    rt = router(min_match_tokens=64)  # 4 blocks
    hs = rt.hash(toks(1024))
    rt.record("r1", hs[:3], 0)
    d = rt.decide(hs, loads(R4), random.Random(0), 0)
    assert d.reason == "new_prefix" and d.best_blocks == 3
    home = d.replica
    # the home depends only on the first 64 tokens, not on the rest of the prompt
    other = rt.hash(toks(64) + toks(960, seed=9))
    assert rt.decide(other, loads(R4), random.Random(5), 0).replica == home
    # the ratio threshold also applies when set
    rt2 = router(min_match_tokens=16, min_match_ratio=0.5)
    rt2.record("r1", hs[:31], 0)
    assert rt2.decide(hs, loads(R4), random.Random(0), 0).reason == "new_prefix"
    rt2.record("r1", hs[:32], 0)
    assert rt2.decide(hs, loads(R4), random.Random(0), 0).reason == "prefix"


def test_cache_rank_says_whether_the_chosen_replica_holds_the_prompts_context():
    rt = router(min_match_tokens=16, min_match_ratio=0.5)
    hs = rt.hash(toks(1024))  # 64 blocks
    rt.record("r1", hs[:40], 0)
    hit = rt.decide(hs, loads(R4), random.Random(0), 0)
    assert (hit.replica, hit.reason, rt.cache_rank(hit)) == ("r1", "prefix", 0)
    # r1 over the bound: the prompt goes elsewhere and misses there
    busy = rt.decide(hs, loads(R4, r1={"in_flight": 20}), random.Random(0), 0)
    assert busy.replica != "r1" and busy.best_blocks == 40 and rt.cache_rank(busy) == 1
    new = rt.decide(rt.hash(toks(1024, seed=3)), loads(R4), random.Random(0), 0)
    assert new.reason == "new_prefix" and rt.cache_rank(new) == 1
    # below the prefix rule's share of the prompt, a partial match does not rank as a hit
    rt.record("r2", hs[:31], 0)
    partial = rt.decide(hs, loads(R4, r1={"healthy": False}), random.Random(0), 0)
    assert partial.matched_blocks in (0, 31) and rt.cache_rank(partial) == 1
    assert rt.cache_rank(rt.decide([], loads(R4), random.Random(0), 0)) == 1  # no full block
    off = router(min_match_tokens=16, min_match_ratio=0.5, cache_priority=False)
    assert off.cache_rank(new) == 0 and off.cache_rank(hit) == 0  # the engine orders by surface alone


def test_new_prefix_homes_spread_over_replicas():
    rt = router()
    names = [f"r{i}" for i in range(8)]
    homes = Counter(
        rt.decide(rt.hash(toks(256, seed=s)), loads(names), random.Random(0), 0).replica for s in range(800)
    )
    assert set(homes) == set(names)
    assert max(homes.values()) < 1.5 * 100 and min(homes.values()) > 0.5 * 100


def test_ties_among_holders_go_to_the_least_loaded_then_the_rng():
    rt = router()
    hs = rt.hash(toks(512))
    for r in ("r1", "r2", "r3"):
        rt.record(r, hs, 0)
    d = rt.decide(
        hs,
        loads(R4, r1={"in_flight": 2}, r2={"in_flight": 1}, r3={"in_flight": 1, "kv_usage": 0.5}),
        random.Random(0),
        0,
    )
    assert d.replica == "r2"
    even = loads(R4)
    picks = {rt.decide(hs, even, random.Random(seed), 0).replica for seed in range(40)}
    assert picks == {"r1", "r2", "r3"}
    a = [rt.decide(hs, even, random.Random(7), 0).replica for _ in range(5)]
    assert len(set(a)) == 1  # the same seed, the same choice


def test_bound_respected_and_a_hot_prefix_converges_then_spills():
    rt = router()
    names = [f"r{i}" for i in range(8)]
    inflight = dict.fromkeys(names, 0)
    shared = toks(512)
    chosen = []
    for i in range(200):
        hs = rt.hash(shared + toks(256, seed=1000 + i))
        snap = [ReplicaLoad(n, in_flight=inflight[n]) for n in names]
        total, low = sum(inflight.values()), min(inflight.values())
        bound = max(math.ceil(1.25 * (total + 1) / 8), low + 8)
        d = rt.decide(hs, snap, random.Random(i), 0)
        assert inflight[d.replica] + 1 <= bound
        inflight[d.replica] += 1
        rt.record(d.replica, hs, 0)
        chosen.append(d)
    # converges: the first 8 (within the low-load slack) all land on one replica
    assert len({d.replica for d in chosen[:8]}) == 1
    assert chosen[0].reason == "new_prefix" and all(d.reason == "prefix" for d in chosen[1:8])
    # then the bound spills it, and in the end nobody is above ceil(1.25 x average)
    assert any(d.diverted for d in chosen)
    assert max(inflight.values()) <= math.ceil(1.25 * 200 / 8)
    # every spill still carried the shared prefix's blocks where some replica had them
    assert all(d.matched_blocks >= 32 for d in chosen[100:])


def test_pure_chwbl_without_slack_spreads_at_once():
    rt = router(load_slack=0)
    names = [f"r{i}" for i in range(4)]
    inflight = dict.fromkeys(names, 0)
    hs = rt.hash(toks(512))
    got = []
    for _ in range(4):
        d = rt.decide(hs, [ReplicaLoad(n, in_flight=inflight[n]) for n in names], random.Random(0), 0)
        inflight[d.replica] += 1
        got.append(d.replica)
    # bounds ceil(1.25 x (T + 1) / 4) for T = 0..3 are 1, 1, 1, 2: three homes in the key's
    # rendezvous order, then the first one again
    assert len(set(got[:3])) == 3 and got[3] == got[0]
    assert not any(d.diverted for d in [rt.decide(hs, loads(names), random.Random(0), 0)])


def test_concurrent_burst_of_a_new_prefix_goes_to_one_replica():
    rt = router()
    names = [f"r{i}" for i in range(16)]
    shared = toks(300)
    # no record() in between: the requests are routed concurrently, before any finishes
    got = {
        rt.decide(rt.hash(shared + toks(100, seed=s)), loads(names), random.Random(s), 0).replica
        for s in range(10)
    }
    assert len(got) == 1


def test_overloaded_holders_are_excluded_by_the_imbalance_thresholds():
    rt = router()
    hs = rt.hash(toks(512))
    rt.record("r1", hs, 0)
    rt.record("r2", hs[:8], 0)
    d = rt.decide(hs, loads(R4, r1={"waiting": 17}), random.Random(0), 0)
    assert (d.replica, d.reason, d.matched_blocks, d.best_blocks, d.diverted) == ("r2", "prefix", 8, 32, True)
    # 16 above the shortest queue is still fine; relative threshold: 1.5 x the shortest
    assert rt.decide(hs, loads(R4, r1={"waiting": 16}), random.Random(0), 0).replica == "r1"
    busy = {r: {"waiting": 40} for r in R4}
    busy["r1"] = {"waiting": 60}
    assert rt.decide(hs, loads(R4, **busy), random.Random(0), 0).replica == "r1"
    busy["r1"] = {"waiting": 61}
    assert rt.decide(hs, loads(R4, **busy), random.Random(0), 0).replica == "r2"
    d = rt.decide(hs, loads(R4, r1={"kv_usage": 0.95}), random.Random(0), 0)
    assert d.replica == "r2" and d.diverted


def test_caps_health_and_saturation():
    rt = router()
    hs = rt.hash(toks(512))
    rt.record("r1", hs, 0)
    d = rt.decide(hs, loads(R4, r1={"in_flight": 4, "max_in_flight": 4}), random.Random(0), 0)
    assert d.replica != "r1"
    d = rt.decide(hs, loads(R4, r1={"healthy": False}), random.Random(0), 0)
    assert d.replica != "r1" and d.best_blocks == 0
    full = {r: {"in_flight": 2, "max_in_flight": 2} for r in R4}
    d = rt.decide(hs, loads(R4, **full), random.Random(0), 0)
    assert (d.replica, d.reason) == (None, "saturated")
    with pytest.raises(ValueError):
        rt.decide(hs, [], random.Random(0), 0)


def test_nothing_eligible_falls_back_to_the_least_loaded():
    rt = router(kv_usage_max=0.5)
    hot = {r: {"kv_usage": 0.9, "in_flight": 3} for r in R4}
    hot["r2"] = {"kv_usage": 0.9, "in_flight": 1}
    d = rt.decide(rt.hash(toks(512)), loads(R4, **hot), random.Random(0), 0)
    assert (d.replica, d.reason, d.diverted) == ("r2", "load", True)


def test_short_prompts_without_session_go_by_load():
    rt = router()
    d = rt.decide(
        rt.hash(toks(10)),
        loads(R4, r0={"in_flight": 1}, r1={"waiting": 1}, r3={"in_flight": 1}),
        random.Random(0),
        0,
    )
    assert (d.replica, d.reason, d.total_blocks) == ("r2", "load", 0)


def test_params_are_validated():
    with pytest.raises(ValueError):
        AffinityParams(load_factor=0.9)
    with pytest.raises(ValueError):
        AffinityParams(load_slack=-1)


# Sessions in the decision -----------------------------------------------------------------------


def test_a_session_sticks_to_its_replica_while_healthy_and_within_bound():
    rt = router()
    hs = rt.hash(toks(512))
    rt.record("r3", hs[:2], 0, session_id="s")
    rt.record("r1", hs, 0)  # a longer prefix elsewhere does not move the session
    d = rt.decide(hs, loads(R4), random.Random(0), 1, session_id="s")
    assert (d.replica, d.reason, d.matched_blocks, d.best_blocks) == ("r3", "session", 2, 32)
    assert rt.decide(hs, loads(R4), random.Random(0), 1).replica == "r1"  # without the session
    # over the bound: it goes elsewhere, marked diverted
    over = loads(R4, r3={"in_flight": 20})
    d = rt.decide(hs, over, random.Random(0), 2, session_id="s")
    assert (d.replica, d.reason, d.diverted) == ("r1", "prefix", True)
    # unhealthy: elsewhere, not a diversion
    d = rt.decide(hs, loads(R4, r3={"healthy": False}), random.Random(0), 2, session_id="s")
    assert (d.replica, d.diverted) == ("r1", False)
    # expired after its idle TTL
    rt2 = router(session_ttl_s=5)
    rt2.record("r3", [], 0, session_id="s")
    assert rt2.decide([], loads(R4), random.Random(0), 5, session_id="s").reason == "session"
    assert rt2.decide([], loads(R4), random.Random(0), 6, session_id="s").reason == "new_prefix"


def test_session_churn_when_replicas_leave_and_join():
    rt = router()
    names = [f"r{i}" for i in range(16)]
    sessions = [f"sess-{i}" for i in range(2000)]
    home = {}
    for s in sessions:
        d = rt.decide([], loads(names), random.Random(0), 0, session_id=s)
        assert d.reason == "new_prefix"
        rt.record(d.replica, [], 0, session_id=s)
        home[s] = d.replica
    spread = Counter(home.values())
    assert len(spread) == 16 and max(spread.values()) < 1.4 * 125

    # a replica dies: exactly its sessions move, and they spread instead of herding
    gone = "r5"
    rt.remove_replica(gone)
    left = [n for n in names if n != gone]
    moved = {}
    for s in sessions:
        d = rt.decide([], loads(left), random.Random(0), 1, session_id=s)
        if home[s] != gone:
            assert (d.replica, d.reason) == (home[s], "session")
        else:
            moved[s] = d.replica
            rt.record(d.replica, [], 1, session_id=s)
    assert len(moved) == spread[gone]
    assert len(set(moved.values())) >= 10 and max(Counter(moved.values()).values()) <= 25

    # a replica joins: bound sessions stay where they are (zero churn)
    joined = [*left, "r16"]
    stay = sum(
        rt.decide([], loads(joined), random.Random(0), 2, session_id=s).reason == "session" for s in sessions
    )
    assert stay == len(sessions)
    # and for unbound keys rendezvous moves only about 1/17 of them to the newcomer
    fresh = router()
    before = {s: fresh.decide([], loads(left), random.Random(0), 0, session_id=s).replica for s in sessions}
    after = {s: fresh.decide([], loads(joined), random.Random(0), 0, session_id=s).replica for s in sessions}
    changed = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == "r16" for s in changed)
    assert 0.03 < len(changed) / len(sessions) < 0.10


# KV events -------------------------------------------------------------------------------------


def test_engine_kv_events_make_the_index_exact():
    rt = router(min_match_tokens=16)
    t = toks(64)
    hs = rt.hash(t)
    # vLLM's hashes are its own; ours are recomputed from the event's tokens, chained by parent
    assert rt.apply_kv_stored("r2", [b"e0", b"e1"], None, t[:32]) == 2
    assert rt.index.longest_match(hs, rt.index.bit("r2"))[0] == 2
    assert rt.apply_kv_stored("r2", [b"e2", b"e3"], b"e1", t[32:64]) == 2
    d = rt.decide(hs, loads(R4), random.Random(0), 0)
    assert (d.replica, d.reason, d.matched_blocks) == ("r2", "prefix", 4)
    rt.apply_kv_removed("r2", [b"e3", b"unknown"])
    assert rt.decide(hs, loads(R4), random.Random(0), 0).matched_blocks == 3
    # a child whose parent we never saw (subscribed late) cannot be chained: skipped, counted
    assert rt.apply_kv_stored("r1", [b"x5"], b"x4", t[:16]) == 0
    assert rt.kv_unmapped == 1
    rt.apply_kv_removed("r9", [b"e0"])  # no map for r9: nothing happens
    rt.apply_kv_cleared("r2")
    assert rt.decide(hs, loads(R4), random.Random(0), 0).best_blocks == 0


def test_kv_map_is_bounded_per_replica():
    rt = router(kv_map_capacity=3)
    t = toks(80)
    rt.apply_kv_stored("r1", [f"e{i}".encode() for i in range(5)], None, t)
    assert len(rt._kv_maps["r1"]) == 3
    assert rt.apply_kv_stored("r1", [b"e6"], b"e0", t[:16]) == 0  # e0 was forgotten
