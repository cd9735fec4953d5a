"""KV events (issue 17): the sim engine publishes vLLM's BlockStored/BlockRemoved, the numbered log
serves them, the routing index applies them; the issue's three acceptance cases on the pure parts
(the sim engine with a small KV cache, the index, the routing view)."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from cluster.engine.kv import hash_request_tokens
from cluster.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlocksQueued,
    BlockStored,
    FeedCursor,
    IndexRemoved,
    IndexStored,
    KVEventLog,
    PageEncoder,
    page_from_json,
    page_from_wire,
    page_to_wire,
)
from cluster.engine.model import EngineModel
from cluster.engine.profiles import TINY_LLAMA, EngineSpec, FittedCoefficients, Profile
from cluster.policy.failover import ReplicaEjector
from cluster.routing.affinity import AffinityParams, AffinityRouter, ReplicaLoad
from cluster.routing.block_hash import BlockHasher
from cluster.routing.event_hashes import RouterHashes
from cluster.routing.view import BackendView, Choice, ReplicaInfo

BS = 4


def profile(kv_blocks: int) -> Profile:
    return Profile(
        name="test",
        model=TINY_LLAMA,
        fitted=FittedCoefficients(prefill_s_per_token=1e-4, decode_base_s=1e-3, decode_s_per_seq=2e-4),
        engine=EngineSpec(
            block_size=BS,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=48,
            kv_cache_bytes=kv_blocks * BS * TINY_LLAMA.kv_bytes_per_token(),
            step_overhead_s=5e-4,
        ),
    )


def prompt(seed: int, n: int = 40) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(5, 2000) for _ in range(n)]


class Replica:
    """A simulated engine replica publishing into its own log, as SimBackend does."""

    def __init__(self, name: str, kv_blocks: int = 64) -> None:
        self.name = name
        self.log = KVEventLog(epoch=hash(name) & 0xFFFF)
        self.engine = EngineModel(profile(kv_blocks), on_kv_events=lambda ev, end: self.log.append(ev, end))
        self.n = 0

    def serve(self, tokens: list[int]) -> None:
        self.n += 1
        self.engine.add_request(f"{self.name}-{self.n}", tokens, 2)
        self.engine.run()


class Gateway:
    """One gateway replica's view, fed by polling every replica's log (what
    deployments/gateway/kv_feed does)."""

    def __init__(self, replicas: list[Replica], **params) -> None:
        policy = AffinityRouter(BS, "m", AffinityParams(min_match_tokens=8, **params))
        self.view = BackendView("b", policy, ReplicaEjector(), 64)
        self.replicas = replicas
        self.cursors = {r.name: FeedCursor() for r in replicas}
        self.view.sync([ReplicaInfo(r.name, f"http://{r.name}", kv_events=True) for r in replicas])

    def poll(self) -> None:
        for r in self.replicas:
            c = self.cursors[r.name]
            page = page_from_wire(page_to_wire(r.log.since(c.after, c.epoch)))  # over the wire's JSON
            self.view.apply_kv_page(r.name, page)
            c.advance(page)

    def choose(self, tokens: list[int], now: float = 0.0):
        hashes = self.view.policy.hash(tokens)
        choice = self.view.choose(hashes, now)
        assert choice is not None
        return choice


# The log -----------------------------------------------------------------------------------------


def test_log_numbers_batches_and_pages_from_a_cursor():
    log = KVEventLog(max_batches=3, epoch=7)
    log.append([], 0.0)  # a step with no events makes no batch
    for i in range(2):
        log.append([BlockRemoved([i])], float(i))
    page = log.since(0)
    assert [b.seq for b in page.batches] == [1, 2] and page.last_seq == 2 and not page.reset
    assert log.since(2, epoch=7).batches == [] and log.since(2, epoch=7).last_seq == 2
    assert [b.seq for b in log.since(0, limit=1).batches] == [1]


def test_log_answers_reset_to_a_gap_or_another_epoch():
    log = KVEventLog(max_batches=2, epoch=7)
    for i in range(5):
        log.append([BlockRemoved([i])], 0.0)
    gap = log.since(1, epoch=7)  # batches 2 and 3 fell out of the window
    assert gap.reset and [b.seq for b in gap.batches] == [4, 5]
    restarted = log.since(5, epoch=8)  # the asker saw another engine process
    assert restarted.reset and [b.seq for b in restarted.batches] == [4, 5]
    assert log.since(9, epoch=7).reset  # ahead of the log: not this log's numbers


def test_a_pushed_page_is_applied_once_in_order_and_a_gap_asks_the_log():
    log = KVEventLog(epoch=7)
    for i in range(3):
        log.append([BlockRemoved([i])], 0.0)
    cursor = FeedCursor()
    assert cursor.accept(log.since(0)) is None  # never asked the log: it must first
    cursor.advance(log.since(0, epoch=None))
    log.append([BlockRemoved([3])], 0.0)
    pushed = log.since(3, epoch=7)
    fresh = cursor.accept(pushed)
    assert fresh is not None and [b.seq for b in fresh.batches] == [4] and fresh.last_seq == 4
    cursor.advance(fresh)
    again = cursor.accept(pushed)  # a batch already applied (its catch-up ask had it): nothing new
    assert again is not None and again.batches == [] and again.last_seq == 4
    assert cursor.accept(log.since(4, epoch=7)) == again  # a heartbeat at the head: nothing new
    for i in range(2):
        log.append([BlockRemoved([5 + i])], 0.0)
    assert cursor.accept(log.since(5, epoch=7)) is None  # batch 5 was lost on the way: ask
    assert cursor.accept(log.since(6, epoch=7)) is None  # a heartbeat past it: ask
    assert cursor.accept(KVEventLog(epoch=8).since(0)) is None  # the engine restarted: ask
    overlap = cursor.accept(log.since(3, epoch=7))  # pushed after a catch-up that had some of it
    assert overlap is not None and [b.seq for b in overlap.batches] == [5, 6]


def test_wire_round_trip_and_validation():
    log = KVEventLog(epoch=1)
    log.append([BlockStored([b"\x01\x02", 5], None, [1, 2, 3, 4, 5, 6, 7, 8], 4), AllBlocksCleared()], 1.5)
    page = page_from_wire(page_to_wire(log.since(0)))
    stored, cleared = page.batches[0].events
    assert isinstance(stored, BlockStored) and stored.block_hashes == ["0102", 5]
    assert isinstance(cleared, AllBlocksCleared)
    bad = page_to_wire(log.since(0))
    bad["batches"][0]["events"][0]["block_size"] = 0
    with pytest.raises(ValidationError, match="block_size"):
        page_from_wire(bad)
    with pytest.raises(ValidationError, match="block_size"):
        page_from_json(json.dumps(bad).encode())


def test_a_pages_json_body_parses_as_its_wire_objects_do():
    """page_from_json (the feed's one-pass parse, issue 42) gives what page_from_wire gives."""
    log = KVEventLog(epoch=3)
    log.append([BlockStored([7, 8], 6, list(range(8)), 4, "t1"), BlockRemoved(["ab"])], 1.0)
    log.append([BlocksQueued([11, 12, 13], "s1"), IndexStored([21]), IndexRemoved([22])], 2.0)
    body = PageEncoder().encode(log.since(0))
    assert page_from_json(body) == page_from_wire(json.loads(body))
    assert page_from_json(body).batches[1].events[0] == BlocksQueued([11, 12, 13], "s1")
    with pytest.raises(ValidationError):
        page_from_json(body[:-1])  # cut short


# The sim engine publishes --------------------------------------------------------------------------


def test_sim_engine_publishes_stored_blocks_with_their_tokens_and_parent():
    r = Replica("r0")
    tokens = prompt(1)
    r.serve(tokens)
    stored = [e for b in r.log.since(0).batches for e in b.events if isinstance(e, BlockStored)]
    first = stored[0]
    assert first.parent_block_hash is None and first.block_size == BS
    assert first.token_ids[: 4 * BS] == tokens[: 4 * BS]
    # every full block of the prompt was announced, and each later event chains on an earlier hash
    assert sum(len(e.block_hashes) for e in stored) >= len(tokens) // BS
    announced = {h for e in stored for h in e.block_hashes}
    assert all(e.parent_block_hash in announced for e in stored[1:])


def test_sim_engine_publishes_evictions_and_a_prefix_hit_stores_nothing_new():
    r = Replica("r0", kv_blocks=16)  # one 40-token prompt takes 11 blocks
    r.serve(prompt(1))
    seq = r.log.last_seq
    r.serve(prompt(1))  # a full hit of its prompt blocks: only the new output block is stored
    again = [e for b in r.log.since(seq).batches for e in b.events]
    assert not any(isinstance(e, BlockRemoved) for e in again)
    r.serve(prompt(2))  # does not fit beside it: the first prompt's blocks are evicted
    removed = [
        h
        for b in r.log.since(seq).batches
        for e in b.events
        if isinstance(e, BlockRemoved)
        for h in e.block_hashes
    ]
    assert removed and r.engine.kv.pool.evictions == len(removed)


# Acceptance 1: an eviction drops the prefix from the index; the next request is placed as new -------


def engine_held(r: Replica, tokens: list[int]) -> int:
    """Leading blocks of ``tokens`` the engine itself has cached."""
    return len(r.engine.kv.pool.lookup(hash_request_tokens(tokens, BS)))


def test_evicted_prefix_leaves_the_index_and_the_next_request_is_placed_as_new():
    a, b = Replica("a", kv_blocks=12), Replica("b", kv_blocks=12)  # a 40-token prompt takes 11
    gw = Gateway([a, b])
    index = gw.view.policy.index
    p1 = prompt(1)
    a.serve(p1)
    gw.poll()
    hashes = gw.view.policy.hash(p1)
    assert index.longest_match(hashes, index.mask(["a"]))[0] == engine_held(a, p1) == 10
    first = gw.choose(p1)
    assert (first.replica, first.decision.reason) == ("a", "prefix")
    a.serve(prompt(2))  # evicts p1's blocks on a, tail first
    gw.poll()
    assert index.longest_match(hashes, index.mask(["a", "b"]))[0] == engine_held(a, p1) < 2
    after = gw.choose(p1)
    assert after.decision.reason == "new_prefix" and after.decision.best_blocks == engine_held(a, p1)


def test_routed_records_alone_keep_steering_to_the_evicted_holder():
    """Why the events matter: without them the index only knows where it sent blocks."""
    a = Replica("a", kv_blocks=16)
    policy = AffinityRouter(BS, "m", AffinityParams(min_match_tokens=8))
    p1 = prompt(1)
    policy.record("a", policy.hash(p1), 0.0)
    a.serve(p1)
    policy.record("a", policy.hash(prompt(2)), 0.0)
    a.serve(prompt(2))  # a evicted p1, but the routed record still says a holds it
    d = policy.decide(policy.hash(p1), [ReplicaLoad("a"), ReplicaLoad("b")], random.Random(0), 0.0)
    assert (d.replica, d.reason) == ("a", "prefix")


# Acceptance 2: two gateway replicas fed the same events decide the same ------------------------------


def test_two_gateways_fed_the_same_events_make_the_same_prefix_decision():
    reps = [Replica(n, kv_blocks=32) for n in ("a", "b", "c")]
    gw1, gw2 = Gateway(reps), Gateway(reps)
    groups = [prompt(s) for s in range(6)]
    for i, p in enumerate(groups):
        choice = gw1.choose(p, now=float(i))  # only the first gateway routes: the second never sees them
        gw1.view.started(choice, gw1.view.policy.hash(p), float(i), None)
        gw1.view.ended(choice.replica)
        next(r for r in reps if r.name == choice.replica).serve(p)
    gw1.poll()
    gw2.poll()
    for p in groups:
        d1, d2 = gw1.choose(p, now=100.0), gw2.choose(p, now=100.0)
        assert (d1.replica, d1.decision.reason, d1.decision.matched_blocks) == (
            d2.replica,
            d2.decision.reason,
            d2.decision.matched_blocks,
        )
    # the prefixes that survived in the engines steer both gateways to their holder
    held = [p for p in groups if gw2.choose(p, now=100.0).decision.reason == "prefix"]
    assert held


# Acceptance 3: a killed replica's entries are gone before the next decision -------------------------


def test_killed_replica_entries_are_gone_before_the_next_decision_and_late_pages_are_ignored():
    a, b = Replica("a"), Replica("b")
    gw = Gateway([a, b])
    p1 = prompt(1)
    a.serve(p1)
    gw.poll()
    assert gw.choose(p1).replica == "a"
    a.serve(prompt(3))  # events a's log still holds when a dies
    gw.view.sync([ReplicaInfo("b", "http://b", kv_events=True)])  # Serve's list without a
    assert gw.view.policy.index.held_blocks("a") == 0 and "a" not in gw.view.policy.event_fed
    gw.poll()  # a late page from the dead replica
    assert gw.view.policy.index.held_blocks("a") == 0
    choice = gw.choose(p1)
    assert choice.replica == "b" and choice.decision.reason == "new_prefix"


def test_a_lost_connection_drops_the_entries_while_serve_still_lists_the_replica():
    a, b = Replica("a"), Replica("b")
    gw = Gateway([a, b])
    p1 = prompt(1)
    a.serve(p1)
    gw.poll()
    gw.view.replica_lost("a")  # the feed's connection to a was refused: its process is gone
    assert "a" in gw.view.live and gw.view.policy.index.held_blocks("a") == 0
    assert gw.choose(p1).decision.reason == "new_prefix"
    lost = Choice("a", "http://a", gw.choose(p1).decision)
    gw.view.started(lost, gw.view.policy.hash(p1), 0.0, None)  # an attempt sent before Serve drops it
    assert gw.view.policy.index.held_blocks("a") == 0  # only counted briefly, not indexed
    gw.cursors["a"] = FeedCursor()  # it answers again (a restart would be a new replica id)
    gw.poll()
    assert gw.choose(p1).decision.reason == "prefix"


# The index with events ------------------------------------------------------------------------------


def test_sent_blocks_count_until_the_ttl_unless_events_confirm_them():
    a, b = Replica("a"), Replica("b")
    gw = Gateway([a, b], recent_ttl_s=5.0)
    gw.poll()  # both replicas are now event-fed
    p1, p2 = prompt(1), prompt(2)
    for p in (p1, p2):
        c = gw.choose(p, now=0.0)
        gw.view.started(c, gw.view.policy.hash(p), 0.0, None)
    sent_p1 = gw.choose(p1, now=1.0)
    assert sent_p1.decision.reason == "prefix"  # a concurrent sharer follows before any event
    holder = sent_p1.replica
    next(r for r in (a, b) if r.name == holder).serve(p1)  # the engine computes p1, not p2
    gw.poll()
    assert gw.choose(p1, now=10.0).decision.reason == "prefix"  # confirmed by BlockStored
    assert gw.choose(p2, now=10.0).decision.reason == "new_prefix"  # never stored: expired


def test_first_page_replaces_routed_guesses_with_the_engines_word():
    a = Replica("a")
    gw = Gateway([a])
    policy = gw.view.policy
    policy.record("a", policy.hash(prompt(9)), 0.0)  # a guess from before the feed started
    assert policy.index.held_blocks("a") > 0
    a.serve(prompt(1))
    gw.poll()
    assert policy.index.longest_match(policy.hash(prompt(9)), policy.index.mask(["a"]))[0] == 0
    assert policy.index.longest_match(policy.hash(prompt(1)), policy.index.mask(["a"]))[0] >= 8


def test_new_prefix_least_loaded_prefers_the_emptier_cache_on_equal_load():
    a, b = Replica("a", kv_blocks=64), Replica("b", kv_blocks=64)
    gw = Gateway([a, b], new_prefix="least_loaded")
    for s in (1, 2, 3):
        a.serve(prompt(s))
    gw.poll()
    for s in range(10, 16):
        c = gw.choose(prompt(s))
        assert (c.replica, c.decision.reason) == ("b", "new_prefix")


def test_a_queued_request_reaches_every_gateway_before_its_blocks_are_stored():
    """BlocksQueued (published by the engine replica as the request arrives): the other gateway
    counts its blocks and pins its session at once, and forgets the blocks if nothing stores them."""
    a, b = Replica("a"), Replica("b")
    gw1, gw2 = Gateway([a, b], recent_ttl_s=5.0), Gateway([a, b], recent_ttl_s=5.0)
    p1 = prompt(1)
    hashes = gw1.view.policy.hash(p1)
    c = gw1.view.choose(hashes, 0.0, "sess-1")
    gw1.view.started(c, hashes, 0.0, "sess-1")
    holder = next(r for r in (a, b) if r.name == c.replica)
    # what deployments/engine/engine.py does on arrival
    holder.log.append([BlocksQueued(hashes, "sess-1")], 0.0)
    page = holder.log.since(gw2.cursors[holder.name].after)
    gw2.view.apply_kv_page(holder.name, page_from_wire(page_to_wire(page)), now=0.5)
    assert gw2.view.policy.sessions.get("sess-1", 1.0) == holder.name
    d = gw2.view.choose(hashes, 1.0)
    assert (d.replica, d.decision.reason) == (holder.name, "prefix")
    assert gw2.view.choose(hashes, 10.0).decision.reason == "new_prefix"  # never stored: expired


def test_a_new_prefix_returns_to_the_replica_that_last_stored_it():
    """Evicted everywhere, a context's next request goes back where its engine last cached it
    (learnt from events, so every gateway agrees), not to whichever replica is idlest."""
    a, b = Replica("a", kv_blocks=12), Replica("b", kv_blocks=12)
    gw = Gateway([a, b], new_prefix="least_loaded")
    p1 = prompt(1)
    a.serve(p1)
    a.serve(prompt(2))  # evicts p1 on a
    gw.poll()
    hashes = gw.view.policy.hash(p1)
    assert gw.view.policy.index.longest_match(hashes, gw.view.policy.index.mask(["a", "b"]))[0] < 2
    for _ in range(3):
        c = gw.view.choose(hashes, 0.0)
        assert (c.replica, c.decision.reason) == ("a", "new_prefix")


# The engine replica publishes the router's hashes (issue 42) ------------------------------------


def test_router_hashed_events_build_the_same_index_as_the_raw_ones():
    """The replica's log keeps stores and evictions in the router's hashes (what
    deployments/engine/kv_endpoint.py sets up): a gateway fed those holds exactly the index, the
    last-stored-by map and the decisions of one that hashes the raw events itself, with no map
    of the engine's hashes of its own; tokens no longer cross the wire."""
    a, b = Replica("a", kv_blocks=16), Replica("b", kv_blocks=16)
    # least_loaded: the placement that reads the last-stored-by map (the others keep none)
    raw, hashed = Gateway([a, b], new_prefix="least_loaded"), Gateway([a, b], new_prefix="least_loaded")
    twins = {}
    for r in (a, b):  # the same events into a second log, as the replica's server keeps them
        twin = twins[r.name] = KVEventLog(epoch=1)
        twin.translate = RouterHashes(BlockHasher(BS, "m")).translate
        r.engine._on_kv_events = lambda ev, end, r=r, twin=twin: (r.log.append(ev, end), twin.append(ev, end))
    prompts = [prompt(i) for i in range(5)]
    for i, p in enumerate(prompts + prompts[:2]):  # evictions (16 blocks, 11 a prompt) and hits
        (a if i % 2 else b).serve(p)
    twin_events = [e for t in twins.values() for bt in t.since(0).batches for e in bt.events]
    assert {type(e) for e in twin_events} == {IndexStored, IndexRemoved}
    assert "token_ids" not in str(page_to_wire(twins["a"].since(0)))
    raw.poll()
    for r in (a, b):
        c = hashed.cursors[r.name]
        page = page_from_wire(page_to_wire(twins[r.name].since(c.after, c.epoch)))
        hashed.view.apply_kv_page(r.name, page)
        c.advance(page)
    pr, ph = raw.view.policy, hashed.view.policy
    assert list(ph.index._map.items()) == list(pr.index._map.items()) and len(pr.index) > 0
    assert list(ph._stored_by.items()) == list(pr._stored_by.items()) and pr._stored_by
    assert [ph.index.held_blocks(n) for n in "ab"] == [pr.index.held_blocks(n) for n in "ab"]
    assert not ph._kv_maps and pr._kv_maps
    for p in prompts:
        assert hashed.choose(p).decision == raw.choose(p).decision


def test_router_hashes_leave_out_what_they_cannot_name():
    rh = RouterHashes(BlockHasher(BS, "m"), capacity=2)
    t = prompt(3, 12)
    out = rh.translate([BlockStored([b"e0", b"e1", b"e2"], None, t, BS), BlockStored([b"x"], None, t[:8], 8)])
    assert len(out) == 1 and out[0].block_hashes == BlockHasher(BS, "m").hash_blocks(t)
    assert rh.mismatched == 1 and len(rh) == 2  # bounded: e0 forgotten
    assert rh.translate([BlockStored([b"e3"], b"e0", t[:4], BS)]) == [] and rh.unmapped == 1
    assert rh.translate([BlockRemoved([b"e0", b"e2"])]) == [IndexRemoved([out[0].block_hashes[2]])]
    assert rh.translate([AllBlocksCleared()]) == [AllBlocksCleared()] and len(rh) == 0


def test_page_encoder_writes_json_dumps_bytes_and_encodes_each_batch_once():
    log = KVEventLog(epoch=3)
    enc = PageEncoder(keep=2)
    for i in range(6):
        log.append([IndexStored([i, i + 1]), BlocksQueued([7], "s" if i % 2 else None)], float(i))
        for after in (0, max(0, log.last_seq - 2)):
            page = log.since(after)
            assert enc.encode(page) == json.dumps(page_to_wire(page)).encode()
    assert len(enc._done) <= 4  # bounded: twice the window it keeps
    assert enc.encode(log.since(99)) == json.dumps(page_to_wire(log.since(99))).encode()  # reset
    other = KVEventLog(epoch=4)  # a restarted engine: its seqs start over
    other.append([IndexRemoved([1])], 0.0)
    assert enc.encode(other.since(0)) == json.dumps(page_to_wire(other.since(0))).encode()


def test_a_steps_stores_and_evictions_go_out_as_one_event_each_in_their_order():
    """issue 42: each stored chunk was its own event, and a gateway's cost went with the events it
    applied; consecutive stores (of one stride) and consecutive evictions are one event, with all
    their hashes and blocks, and a store after an eviction stays after it."""
    from cluster.routing.event_hashes import coalesce

    t = prompt(4, 20)
    rh = RouterHashes(BlockHasher(BS, "m"), stride=2)
    out = rh.translate(
        [BlockStored([b"a0", b"a1"], None, t[:8], BS), BlockStored([b"a2", b"a3", b"a4"], b"a1", t[8:20], BS)]
    )
    assert len(out) == 1 and isinstance(out[0], IndexStored) and out[0].blocks == 5 and out[0].stride == 2
    assert len(out[0].block_hashes) == 3  # depths 2, 4 and the chain's end at 5
    s1, s2, r1 = IndexStored([1, 2]), IndexStored([3]), IndexRemoved([9], 4)
    merged = coalesce(
        [s1, s2, r1, IndexRemoved([8], 2), IndexStored([5]), BlocksQueued([7]), IndexStored([6])]
    )
    assert merged == [
        IndexStored([1, 2, 3]),
        IndexRemoved([9, 8], 6),
        IndexStored([5]),
        BlocksQueued([7]),
        IndexStored([6]),
    ]
    assert coalesce([IndexStored([1], 2, 2), IndexStored([2], 4, 4)]) == [
        IndexStored([1], 2, 2),
        IndexStored([2], 4, 4),
    ]
