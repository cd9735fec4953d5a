"""The KV index held once per backend and mirrored by every gateway (issue 42's indexer design).

By default every gateway replica applies every engine's KV-event pages to its own
:class:`cluster.routing.affinity.AffinityRouter`: at 256 engines that is ~2,200 pages and ~500k
anchors a second on every gateway, most of them claims of contexts already where they are. Here
an *indexer* applies them (the same ``apply_kv_page``, once per backend) and every ``flush``
yields an :class:`IndexFrame`: only what a gateway's decision would now see differently,
coalesced over the frame's pages — the anchors whose holders (index and recent sends together)
or home changed, the replicas whose slot, cache fill or demand changed, the sessions bound, the
claims' clock. A gateway applies a frame with C-level bulk dict operations
(:meth:`AffinityRouter.apply_frame`) and decides on its mirror with the same code as before.

Slots. A frame names replicas by the indexer's bit positions (``names`` says which replica a slot
now is, when that changed); a gateway maps them onto its own index's bits. ``cleared``: replicas
whose index entries went (a reset page, a cleared cache, a lost feed); ``homeless``: replicas
whose homes went void (``replica_lost``). A gateway applies those first, then the entries.

Shards. ``shards`` indexers each own the anchors ``h % shards == shard`` (an anchor's holders and
home are then whole in one shard, and a gateway's one map takes every shard's frames without
merging); each takes every page and keeps its own anchors. A replica's block count and its
sessions are shard 0's alone; its placement demand is the sum of the shards' (each homes its own
anchors, all count the same requests). Shard 0 also speaks for the replicas' resets: entries
another shard sends for a replica within the frame before shard 0's reset may stay hidden until
touched again (the mirror's exactness bound).

The builder compares against what it last published (its own copy of the masks and homes: an
indexer holds its anchors twice, a gateway once), so a claim of an anchor already homed there, or
a store of one already held, publishes nothing. Raw ``BlockStored``/``BlockRemoved`` (engine
hashes, which only the indexer's per-replica maps turn into anchors) make the next frame a
``reset`` of the whole state, for everyone. :meth:`FrameBuilder.snapshot` is what the gateways hold
as of the last frame, with its number, for a gateway that starts or missed one; it changes nothing.
:class:`ShardCursor` is a gateway's place in a shard's frames.

Plain Python, no I/O; the frame's wire form is :func:`encode_frame` / :func:`decode_frame`.
"""

from __future__ import annotations

import itertools
import json
import struct
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import is_not, ne
from typing import Literal, cast

from cluster.engine.kv_events import (
    BlockRemoved,
    BlocksQueued,
    BlockStored,
    IndexRemoved,
    IndexStored,
    KVCacheEvent,
    KVEventBatch,
    KVEventPage,
)
from cluster.routing.affinity import AffinityRouter
from cluster.routing.block_hash import BlockHash, strided

MAGIC = b"IXF1"
Token = tuple[str, int]


@dataclass(slots=True)
class IndexFrame:
    """What changed in an indexer's state since its last frame (``reset``: all of it)."""

    seq: int
    reset: bool = False
    shard: int = 0  # which of ``shards`` indexers (anchors ``h % shards == shard``) built it
    shards: int = 1
    epoch: int = 0  # the indexer's run (a restarted one numbers its frames from 1 again)
    names: dict[int, str] = field(default_factory=dict)  # indexer slot -> replica, where new
    cleared: list[str] = field(default_factory=list)  # replicas whose index entries went
    homeless: list[str] = field(default_factory=list)  # replicas whose homes went void
    set_keys: Sequence[BlockHash] = ()  # anchors held by exactly one replica ...
    set_slots: Sequence[int] = ()  # ... its slot
    multi: list[tuple[BlockHash, list[int]]] = field(default_factory=list)  # anchors several replicas hold
    drop_keys: Sequence[BlockHash] = ()  # anchors no replica holds
    home_keys: Sequence[BlockHash] = ()  # anchors homed anew ...
    home_slots: Sequence[int] = ()  # ... to the replica in this slot
    home_drop: Sequence[BlockHash] = ()  # anchors with no home any more
    held: dict[str, int] = field(default_factory=dict)  # replicas whose cached blocks changed
    demand: dict[str, tuple[float, int]] = field(default_factory=dict)  # placement's decayed demand
    claims: int = 0  # placement's clock (requests claimed so far)
    sessions: list[tuple[str, str]] = field(default_factory=list)  # (session id, replica) bound

    def anchors(self) -> int:
        return (
            len(self.set_keys)
            + len(self.multi)
            + len(self.drop_keys)
            + len(self.home_keys)
            + len(self.home_drop)
        )


def _slot(bit: int) -> int:
    return bit.bit_length() - 1


def _slots_of(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class FrameBuilder:
    """The indexer's side: applies engine pages to ``router`` and builds the frames (module
    docstring). The router is the indexer's own; nothing else writes it. ``shard`` of ``shards``:
    this indexer owns the anchors ``h % shards == shard`` (the module docstring's "Shards")."""

    def __init__(self, router: AffinityRouter, shard: int = 0, shards: int = 1) -> None:
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} is not one of {shards}")
        self.router = router
        self.shard, self.shards = shard, shards
        router.index.evicted = []
        router.homes.evicted = []
        self._wide = router.hasher.algo != "tuple"  # blake2b hashes are unsigned 64-bit
        self._touched: list[BlockHash] = []  # index anchors the pages named
        self._claimed: list[BlockHash] = []  # home anchors the pages claimed
        self._sessions: list[tuple[str, str]] = []
        self._replicas: set[str] = set()  # replicas whose pages were applied since the last frame
        self._pub_map: dict[BlockHash, int] = {}  # what the gateways have: anchor -> mask (indexer bits)
        self._pub_home: dict[BlockHash, Token] = {}  # anchor -> home token
        self._pub_slots: dict[str, int] = {}
        self._pub_tokens: dict[str, Token] = {}
        self._pub_held: dict[str, int] = {}
        self._pub_demand: dict[str, tuple[float, int]] = {}
        self._pub_claims = 0
        self._snapshot_due = False
        self.seq = 0
        self.pages = 0

    def take(self, replica: str, page: KVEventPage, now: float) -> int:
        """Apply one engine page (in order, as a gateway's feed did); returns the events applied."""
        page = self._own(page)
        stride = self.router.params.claim_stride_blocks
        touched, claimed = self._touched, self._claimed
        for batch in page.batches:
            for ev in batch.events:
                if isinstance(ev, BlocksQueued):
                    anchors = ev.block_hashes if ev.stride > 1 else strided(ev.block_hashes, stride)
                    touched.extend(anchors)
                    claimed.extend(anchors)
                    if ev.session_id is not None:
                        self._sessions.append((ev.session_id, replica))
                elif isinstance(ev, BlockStored | BlockRemoved):
                    self._snapshot_due = True  # engine hashes: only the full state says what changed
                else:
                    touched.extend(getattr(ev, "block_hashes", ()))
        self._replicas.add(replica)
        self.pages += 1
        return self.router.apply_kv_page(replica, page, now)

    def _own(self, page: KVEventPage) -> KVEventPage:
        """The page as this shard applies it: its own anchors; the block counts and the sessions
        (a replica's, not an anchor's) in shard 0 alone."""
        if self.shards == 1:
            return page
        k, s, first = self.shards, self.shard, self.shard == 0
        stride = self.router.params.claim_stride_blocks
        batches = []
        for b in page.batches:
            events: list[KVCacheEvent] = []
            for ev in b.events:
                if isinstance(ev, BlocksQueued):
                    hs = ev.block_hashes if ev.stride > 1 else strided(ev.block_hashes, stride)
                    mine = [h for h in hs if h % k == s]  # empty still claims: the clock is the requests'
                    sid = ev.session_id if first else None
                    events.append(BlocksQueued(mine, sid, ev.stride if ev.stride > 1 else stride))
                elif isinstance(ev, IndexStored):
                    mine = [h for h in ev.block_hashes if h % k == s]
                    events.append(IndexStored(mine, ev.stride, ev.blocks if first else 0))
                elif isinstance(ev, IndexRemoved):
                    mine = [h for h in ev.block_hashes if h % k == s]
                    events.append(IndexRemoved(mine, ev.blocks if first else 0))
                else:
                    events.append(ev)
            batches.append(KVEventBatch(b.seq, b.ts, tuple(events)))
        return KVEventPage(page.epoch, batches, page.last_seq, page.reset)

    def flush(self, now: float) -> IndexFrame | None:
        """The frame of what changed since the last one (None: nothing did), or a snapshot when
        the pages made one due. ``now`` expires the recent sends, as a decision would."""
        r, idx = self.router, self.router.index
        idx.expire_recent(now - r.params.recent_ttl_s, self._touched)
        if self._snapshot_due:
            return self._resync()
        if idx.freed:  # purged slots may be reused: what was published under them no longer holds
            keep = ~idx.freed
            self._pub_map = {h: v & keep for h, v in self._pub_map.items() if v & keep}
            idx.freed = 0
        claims = r.homes.demand_state()[1]
        frame = IndexFrame(self.seq + 1, shard=self.shard, shards=self.shards, claims=claims)
        self._entries(frame)
        self._homes(frame)
        self._replica_state(frame)
        self._names(frame)
        frame.sessions, self._sessions = self._sessions, []
        self._replicas = set()
        if not (frame.anchors() or frame.names or frame.cleared or frame.homeless) and not (
            frame.held or frame.sessions or frame.demand or frame.claims != self._pub_claims
        ):
            return None  # nothing new, not even a request (the claims' clock)
        self._pub_claims = frame.claims
        self.seq = frame.seq
        return frame

    def _entries(self, frame: IndexFrame) -> None:
        """The anchors whose holders changed: compared with what was published in C loops, then
        split into single holders (a slot each), several, and none."""
        idx = self.router.index
        assert idx.evicted is not None
        keys = list(dict.fromkeys(self._touched + idx.evicted))
        self._touched, idx.evicted = [], []
        pub = self._pub_map
        masks = idx.live_masks(keys)
        moved = list(map(ne, masks, map(pub.get, keys, repeat(0))))
        keys, masks = list(compress(keys, moved)), list(compress(masks, moved))
        slot_of = {1 << i: i for i in range(max(masks, default=0).bit_length())}
        slots = list(map(slot_of.get, masks))  # None: several holders, or none
        pub.update(zip(keys, masks, strict=True))
        frame.set_keys = list(compress(keys, slots_known := [s is not None for s in slots]))
        frame.set_slots = [s for s in slots if s is not None]
        others = [(h, v) for h, v, known in zip(keys, masks, slots_known, strict=True) if not known]
        frame.drop_keys = [h for h, v in others if not v]
        deque(map(pub.pop, frame.drop_keys), maxlen=0)
        frame.multi = [(h, _slots_of(v)) for h, v in others if v]

    def _homes(self, frame: IndexFrame) -> None:
        """The anchors whose home changed (a new token, or none), compared by identity in C."""
        homes, idx = self.router.homes, self.router.index
        assert homes.evicted is not None
        keys = list(dict.fromkeys(self._claimed + homes.evicted))
        self._claimed, homes.evicted = [], []
        pub = self._pub_home
        tokens = homes.homes_of(keys)
        moved = list(map(is_not, tokens, map(pub.get, keys)))
        keys, tokens = list(compress(keys, moved)), list(compress(tokens, moved))
        homed = [t is not None for t in tokens]
        frame.home_drop = [h for h, has in zip(keys, homed, strict=True) if not has]
        deque(map(pub.pop, frame.home_drop), maxlen=0)
        frame.home_keys, live = list(compress(keys, homed)), [t for t in tokens if t is not None]
        pub.update(zip(frame.home_keys, live, strict=True))
        slot = {n: _slot(idx.bit(n)) for n in {t[0] for t in live}}  # a slot for every home's replica
        frame.home_slots = [slot[t[0]] for t in live]

    def _replica_state(self, frame: IndexFrame) -> None:
        """Cached blocks of every replica (the bound's evictions change anyone's), placement
        demand of the replicas whose pages came in (only a claim changes it)."""
        idx = self.router.index
        for name in idx.slots():
            held = idx.held_blocks(name)
            if self._pub_held.get(name) != held:
                frame.held[name] = self._pub_held[name] = held
        homes = self.router.homes
        demand, _ = homes.demand_state()
        pub = self._pub_demand
        for n in self._replicas:  # only a claim that homed something changes more than the decay
            d = demand.get(n)
            if d is not None and (n not in pub or not homes.decays_to(pub[n], d)):
                frame.demand[n] = pub[n] = d

    def _names(self, frame: IndexFrame) -> None:
        """Slots assigned or retired, homes voided: last, after every slot the frame uses exists."""
        slots, tokens = self.router.index.slots(), self.router.homes.tokens()
        frame.cleared = [n for n, b in self._pub_slots.items() if slots.get(n) != b]
        frame.names = {_slot(b): n for n, b in slots.items() if self._pub_slots.get(n) != b}
        frame.homeless = [n for n, t in self._pub_tokens.items() if tokens.get(n) is not t]
        self._pub_slots, self._pub_tokens = slots, tokens
        for n in frame.cleared:
            self._pub_held.pop(n, None)

    def snapshot(self) -> IndexFrame:
        """What the gateways hold as of the last frame, as one ``reset`` frame with that frame's
        number: a gateway that starts (or missed a frame) applies it, then the frames after it.
        Changes nothing here. Its slot numbers are its own (a home's replica may have no slot
        now): a gateway keeps homes and masks in its own terms, so later frames' numbers may differ."""
        r = self.router
        frame = IndexFrame(self.seq, reset=True, shard=self.shard, shards=self.shards)
        frame.names = {_slot(b): n for n, b in self._pub_slots.items()}
        free = itertools.count(max(frame.names, default=-1) + 1)
        number = {n: s for s, n in frame.names.items()}
        for t in {t[0] for t in self._pub_home.values()} - set(number):
            number[t] = s = next(free)
            frame.names[s] = t
        live = sum(self._pub_slots.values())  # a mask may keep the bit of a replica cleared since
        held = [(h, v & live) for h, v in self._pub_map.items() if v & live]
        singles = [(h, v) for h, v in held if not v & (v - 1)]
        frame.set_keys, frame.set_slots = [h for h, _ in singles], [_slot(v) for _, v in singles]
        frame.multi = [(h, _slots_of(v)) for h, v in held if v & (v - 1)]
        frame.home_keys = list(self._pub_home)
        frame.home_slots = [number[t[0]] for t in self._pub_home.values()]
        frame.held = dict(self._pub_held)
        frame.demand, frame.claims = r.homes.demand_state()
        frame.sessions = r.sessions.bound()
        return frame

    def _resync(self) -> IndexFrame:
        """Publish the whole state anew (after engine-hash events, which only the state explains):
        what is published restarts from the router's state, as the next frame, for everyone."""
        r, idx = self.router, self.router.index
        assert idx.evicted is not None and r.homes.evicted is not None
        self._touched, self._claimed, idx.evicted, r.homes.evicted = [], [], [], []
        self._snapshot_due, idx.freed = False, 0
        keys = list(dict.fromkeys([*idx.keys(), *idx.recent_keys()]))
        self._pub_map = {h: v for h, v in zip(keys, idx.live_masks(keys), strict=True) if v}
        self._pub_home = {h: t for h, t in r.homes.items() if r.homes.is_live(t)}
        for name in {t[0] for t in self._pub_home.values()}:
            idx.bit(name)  # every home's replica has a slot in what is published
        self._pub_slots, self._pub_tokens = idx.slots(), r.homes.tokens()
        self._pub_held = {n: idx.held_blocks(n) for n in self._pub_slots}
        self._pub_demand = r.homes.demand_state()[0]
        self._sessions, self._replicas = [], set()
        self.seq += 1
        return self.snapshot()


# -- the wire ------------------------------------------------------------------------------------

_ARRAYS = ("set_keys", "set_slots", "drop_keys", "home_keys", "home_slots", "home_drop")
_U32 = struct.Struct("<I")


def encode_frame(frame: IndexFrame, wide: bool = False) -> bytes:
    """A frame's bytes: a JSON header (the small parts) and the anchor arrays packed (int64, or
    uint64 when ``wide``; slots uint16)."""
    header = {
        "seq": frame.seq,
        "reset": frame.reset,
        "shard": frame.shard,
        "shards": frame.shards,
        "epoch": frame.epoch,
        "names": {str(k): v for k, v in frame.names.items()},
        "cleared": frame.cleared,
        "homeless": frame.homeless,
        "multi": frame.multi,
        "held": frame.held,
        "demand": frame.demand,
        "claims": frame.claims,
        "sessions": frame.sessions,
        "wide": wide,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [MAGIC, _U32.pack(len(head)), head]
    for name in _ARRAYS:
        code = "H" if name.endswith("slots") else ("Q" if wide else "q")
        data = array(code, getattr(frame, name)).tobytes()
        parts += [_U32.pack(len(data)), data]
    return b"".join(parts)


def decode_frame(body: bytes) -> IndexFrame:
    """The inverse of :func:`encode_frame`; ValueError for anything that is not a frame."""
    if body[:4] != MAGIC:
        raise ValueError("not an index frame")
    try:
        (n,) = _U32.unpack_from(body, 4)
        h = json.loads(body[8 : 8 + n])
        pos, arrays = 8 + n, {}
        for name in _ARRAYS:
            (size,) = _U32.unpack_from(body, pos)
            code = "H" if name.endswith("slots") else ("Q" if h["wide"] else "q")
            arrays[name] = cast("Sequence[BlockHash]", array(code, body[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        return IndexFrame(
            seq=int(h["seq"]),
            reset=bool(h["reset"]),
            shard=int(h["shard"]),
            shards=int(h["shards"]),
            epoch=int(h["epoch"]),
            names={int(k): str(v) for k, v in h["names"].items()},
            cleared=list(h["cleared"]),
            homeless=list(h["homeless"]),
            multi=[(BlockHash(int(k)), list(s)) for k, s in h["multi"]],
            held={str(k): int(v) for k, v in h["held"].items()},
            demand={str(k): (float(v[0]), int(v[1])) for k, v in h["demand"].items()},
            claims=int(h["claims"]),
            sessions=[(str(s), str(r)) for s, r in h["sessions"]],
            **arrays,
        )
    except (struct.error, KeyError, TypeError, ValueError, IndexError) as e:
        raise ValueError(f"malformed index frame: {e}") from e


def bits_for(slots: Iterable[int], table: dict[int, int]) -> int:
    """The mask of these indexer slots in a gateway's bits (``table``: slot -> bit)."""
    mask = 0
    for s in slots:
        mask |= table.get(s, 0)
    return mask


@dataclass(slots=True)
class ShardCursor:
    """A gateway's place in one indexer shard's frames: which run (``epoch``) and frame it has."""

    epoch: int | None = None
    seq: int = 0

    def accept(self, frame: IndexFrame) -> Literal["apply", "skip", "gap"]:
        """``apply`` the next frame; ``skip`` a heartbeat or one already had; ``gap``: a snapshot
        is due first (the first frame heard, a new run, or a frame missed)."""
        if self.epoch is None or frame.epoch != self.epoch:
            return "gap"
        if frame.seq <= self.seq:
            return "skip"
        return "apply" if frame.seq == self.seq + 1 else "gap"

    def advance(self, frame: IndexFrame) -> None:
        """The frame (or snapshot) was applied."""
        self.epoch, self.seq = frame.epoch, frame.seq
