"""The indexer design (issue 42, cluster/routing/index_mirror.py): one router applies every engine's
pages, every gateway mirrors it from frames. A gateway deciding on its mirror must see what the
indexer's router sees: the same holders of every prefix, the same homes, cache fill, demand and
sessions, and so the same decisions — through evictions by the bound, resets, lost replicas,
slots reused after a purge, and a gateway that joins late (a snapshot)."""

from __future__ import annotations

import random

import pytest

from cluster.engine.kv_events import (
    AllBlocksCleared,
    BlocksQueued,
    BlockStored,
    IndexRemoved,
    IndexStored,
    KVCacheEvent,
    KVEventBatch,
    KVEventPage,
)
from cluster.routing.affinity import AffinityParams, AffinityRouter, ReplicaLoad
from cluster.routing.block_hash import BlockHash, strided
from cluster.routing.index_mirror import FrameBuilder, IndexFrame, decode_frame, encode_frame

BS, K = 4, 3
NAMES = [f"r{i}" for i in range(6)]


def _router(capacity: int = 90) -> AffinityRouter:
    params = AffinityParams(
        new_prefix="home", claim_stride_blocks=K, index_capacity_blocks=capacity, min_match_tokens=BS * 2
    )
    return AffinityRouter(BS, "m", params)


def _page(events: list[KVCacheEvent], seq: int, reset: bool = False) -> KVEventPage:
    return KVEventPage(1, [KVEventBatch(seq, 0.0, tuple(events))], seq, reset)


class _Fleet:
    """Random engine pages: recurring contexts queued, stored and evicted on six replicas."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.contexts = [[BlockHash(self.rng.getrandbits(62)) for _ in range(24)] for _ in range(10)]
        self.held: dict[str, list[list[BlockHash]]] = {n: [] for n in NAMES}
        self.seq = 0

    def prompt(self) -> list[BlockHash]:
        base = self.rng.choice(self.contexts)[: self.rng.randint(3, 24)]
        return base + [BlockHash(self.rng.getrandbits(62)) for _ in range(self.rng.randint(0, 6))]

    def page(self) -> tuple[str, KVEventPage]:
        rng, name = self.rng, self.rng.choice(NAMES)
        self.seq += 1
        roll = rng.random()
        if roll < 0.03:
            self.held[name] = []
            return name, _page([AllBlocksCleared()], self.seq)
        if roll < 0.06:
            self.held[name] = []
            return name, _page([], self.seq, reset=True)
        events: list[KVCacheEvent] = []
        for _ in range(rng.randint(1, 3)):
            p = self.prompt()
            anchors = list(strided(p, K))
            session = f"s{rng.randrange(8)}" if rng.random() < 0.5 else None
            events.append(BlocksQueued(anchors, session, K))
            if rng.random() < 0.7:
                events.append(IndexStored(anchors, K, len(p)))
                self.held[name].append(anchors)
        if self.held[name] and rng.random() < 0.4:
            gone = self.held[name].pop(rng.randrange(len(self.held[name])))
            events.append(IndexRemoved(gone[rng.randrange(len(gone)) :], len(gone)))
        return name, _page(events, self.seq)


def _seen(r: AffinityRouter, q: list[BlockHash], live: list[str], now: float) -> tuple[object, ...]:
    """What a decision reads of ``r`` for prompt ``q`` over the replicas ``live``."""
    idx = r.index
    mask = 0
    for n in live:
        mask |= idx.bit_of(n)
    blocks, holders = idx.longest_match(q, mask)
    return (
        blocks,
        sorted(idx.replicas(holders)),
        r.homes.lookup(q),
        {n: idx.held_blocks(n) for n in live},
        {n: round(r.homes.demand(n), 9) for n in live},
        {s: r.sessions.get(s, now) for s in (f"s{i}" for i in range(8))},
    )


def _decisions(
    r: AffinityRouter, prompts: list[list[BlockHash]], live: list[str], now: float
) -> list[object]:
    out = []
    for i, q in enumerate(prompts):
        loads = [ReplicaLoad(n, in_flight=(i + j) % 3, kv_blocks=100) for j, n in enumerate(live)]
        d = r.decide(q, loads, random.Random(i), now, f"s{i % 8}" if i % 2 else None)
        out.append((d.replica, d.reason, d.matched_blocks, d.best_blocks))
    return out


def _check(indexer: AffinityRouter, mirror: AffinityRouter, fleet: _Fleet, now: float) -> None:
    live = sorted(set(indexer.index.slots()) | set(NAMES))
    prompts = [fleet.prompt() for _ in range(12)]
    for q in prompts:
        assert _seen(mirror, q, live, now) == _seen(indexer, q, live, now)
    # decide() notes nothing it reads (record() does): both routers can decide on the same state
    assert _decisions(mirror, prompts, live, now) == _decisions(indexer, prompts, live, now)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_mirror_fed_by_frames_sees_and_decides_what_the_indexer_does(seed):
    builder, mirror, fleet = FrameBuilder(_router()), _router(), _Fleet(seed)
    now, frames, anchors = 0.0, 0, 0
    for step in range(400):
        now += 0.05
        for _ in range(3):
            builder.take(*fleet.page(), now)
        if step % 37 == 5:  # a replica's feed lost: its entries and homes go
            builder.router.replica_lost(fleet.rng.choice(NAMES))
        frame = builder.flush(now)
        if frame is not None:
            frames, anchors = frames + 1, anchors + frame.anchors()
            mirror.apply_frame(decode_frame(encode_frame(frame)), now)
        if step % 20 == 0:
            _check(builder.router, mirror, fleet, now)
    _check(builder.router, mirror, fleet, now)
    assert builder.router.index.evictions > 0  # the bound was exercised
    assert builder.router.index.purges > 0  # so were slots retired and reused
    assert frames > 300 and anchors > 0


def test_a_gateway_that_joins_late_takes_a_snapshot_and_then_the_frames():
    builder, fleet = FrameBuilder(_router()), _Fleet(9)
    now = 0.0
    for _ in range(100):
        now += 0.05
        builder.take(*fleet.page(), now)
        builder.flush(now)
    late = _router()
    late.apply_frame(decode_frame(encode_frame(builder.snapshot())), now)
    _check(builder.router, late, fleet, now)
    builder.take(*fleet.page(), now)  # taken, not yet published: a snapshot says the last frame's state
    snap = builder.snapshot()
    assert snap.seq == builder.seq and snap.reset
    later = _router()
    later.apply_frame(decode_frame(encode_frame(snap)), now)
    body = encode_frame(builder.flush(now) or IndexFrame(0))
    for m in (late, later):
        m.apply_frame(decode_frame(body), now)
    _check(builder.router, later, fleet, now)
    for _ in range(60):
        now += 0.05
        builder.take(*fleet.page(), now)
        frame = builder.flush(now)
        if frame is not None:
            late.apply_frame(decode_frame(encode_frame(frame)), now)
    _check(builder.router, late, fleet, now)


def test_claims_of_contexts_already_home_publish_nothing_but_the_claim_clock():
    builder = FrameBuilder(_router(capacity=10_000))
    ctx = [BlockHash(i) for i in range(1, 25)]
    anchors = list(strided(ctx, K))
    builder.take("r0", _page([BlocksQueued(anchors, None, K), IndexStored(anchors, K, 24)], 1), 0.0)
    first = builder.flush(0.0)
    assert first is not None and len(first.set_keys) == len(anchors) and len(first.home_keys) == len(anchors)
    builder.take("r0", _page([BlocksQueued(anchors, None, K)], 2), 0.1)  # the same context, again
    again = builder.flush(0.1)
    assert again is not None and again.anchors() == 0 and again.claims == 2 and not again.demand


def test_raw_engine_hashes_make_the_next_frame_a_snapshot():
    builder = FrameBuilder(_router())
    builder.take("r0", _page([BlockStored([1, 2], None, list(range(8)), BS)], 1), 0.0)
    frame = builder.flush(0.0)
    assert frame is not None and frame.reset


def test_frames_survive_the_wire_and_garbage_is_refused():
    frame = IndexFrame(
        7,
        names={0: "a", 3: "b"},
        set_keys=[BlockHash(-(2**63)), BlockHash(5)],
        set_slots=[0, 3],
        multi=[(BlockHash(9), [0, 3])],
        drop_keys=[BlockHash(2**63 - 1)],
        held={"a": 4},
        demand={"a": (1.5, 3)},
        claims=3,
        sessions=[("s", "a")],
    )
    back = decode_frame(encode_frame(frame))
    assert (list(back.set_keys), list(back.set_slots), back.multi, list(back.drop_keys)) == (
        [-(2**63), 5],
        [0, 3],
        [(9, [0, 3])],
        [2**63 - 1],
    )
    assert (back.names, back.held, back.demand, back.sessions, back.seq) == (
        {0: "a", 3: "b"},
        {"a": 4},
        {"a": (1.5, 3)},
        [("s", "a")],
        7,
    )
    top = IndexFrame(1, set_keys=[BlockHash(2**64 - 1)], set_slots=[0])
    wide = decode_frame(encode_frame(top, wide=True))
    assert list(wide.set_keys) == [2**64 - 1]
    for junk in (b"", b"IXF1", b"IXF1\xff\xff\xff\xff{}", b"nope" * 4, encode_frame(frame)[:-3]):
        with pytest.raises(ValueError):
            decode_frame(junk)


def test_a_slot_freed_by_a_purge_and_taken_by_another_replica_is_published_anew():
    """X held h; X's cache is cleared and the purge frees its slot; Y takes that slot and stores h.
    The mask is the one published for X, bit for bit: the builder must still publish it for Y."""
    builder, mirror = FrameBuilder(_router(capacity=1000)), _router(capacity=1000)
    h = [BlockHash(77)]
    builder.take("x", _page([IndexStored(h, K, 3)], 1), 0.0)
    mirror.apply_frame(decode_frame(encode_frame(builder.flush(0.0) or IndexFrame(0))), 0.0)
    builder.take("x", _page([AllBlocksCleared()], 2), 0.1)
    builder.router.index.purge()
    builder.take("y", _page([IndexStored(h, K, 3)], 1), 0.1)
    assert builder.router.index.slots()["y"] == 1  # x's old slot
    mirror.apply_frame(decode_frame(encode_frame(builder.flush(0.1) or IndexFrame(0))), 0.1)
    assert mirror.index.holders(h[0]) == ["y"]


def test_shards_by_anchor_hash_mirror_together_what_one_router_holds():
    """Three indexers, each owning the anchors ``h % 3``, fed every page; one mirror takes their
    frames (shard 0 first: it speaks for the replicas). It sees what one router fed the same pages
    sees (a bound large enough that the shards' own bounds never bite)."""
    ref, fleet = _router(capacity=100_000), _Fleet(4)
    shards = [FrameBuilder(_router(capacity=100_000), s, 3) for s in range(3)]
    mirror, now = _router(capacity=100_000), 0.0
    for step in range(300):
        now += 0.05
        for _ in range(3):
            name, page = fleet.page()
            ref.apply_kv_page(name, page, now)
            for b in shards:
                b.take(name, page, now)
        if step % 41 == 7:
            lost = fleet.rng.choice(NAMES)
            for r in (ref, *(b.router for b in shards)):
                r.replica_lost(lost)
        for b in shards:
            frame = b.flush(now)
            if frame is not None:
                mirror.apply_frame(decode_frame(encode_frame(frame)), now)
        if step % 25 == 0:
            ref.index.expire_recent(now - ref.params.recent_ttl_s)
            _check(ref, mirror, fleet, now)
    assert {len(b.router.index) for b in shards} != {0}
    with pytest.raises(ValueError):
        FrameBuilder(_router(), 3, 3)


def test_a_shard_cursor_applies_in_order_and_asks_a_snapshot_on_a_gap_or_a_new_run():
    from cluster.routing.index_mirror import ShardCursor

    c = ShardCursor()
    assert c.accept(IndexFrame(5, epoch=7)) == "gap"  # the first heard: a snapshot first
    c.advance(IndexFrame(5, reset=True, epoch=7))
    assert c.accept(IndexFrame(5, epoch=7)) == "skip"  # a heartbeat: the last number again
    assert c.accept(IndexFrame(6, epoch=7)) == "apply"
    c.advance(IndexFrame(6, epoch=7))
    assert c.accept(IndexFrame(8, epoch=7)) == "gap"  # 7 was lost
    assert c.accept(IndexFrame(1, epoch=9)) == "gap"  # a restarted indexer numbers from 1 again
