"""KV-cache events: what an engine replica stored and evicted, in vLLM's shape, and the log that
carries them from each engine replica to every gateway replica.

The events mirror ``vllm.distributed.kv_events`` (the ``kv_events_config`` publisher): one
:class:`KVEventBatch` per engine step that changed the prefix cache, holding
:class:`BlockStored` (the engine's block hashes, the parent's hash, the blocks' token ids and the
block size), :class:`BlockRemoved` (hashes only) and :class:`AllBlocksCleared`. Block hashes are
the engine's own (vLLM's are seeded per process, the sim's are SHA-256): a router keys its index by
its own hash of the token ids and keeps the map
(:meth:`cluster.routing.affinity.AffinityRouter.apply_kv_stored`).

Transport: a log with sequence numbers. Each engine replica appends its batches to a bounded
:class:`KVEventLog` (sequence numbers from 1, an ``epoch`` drawn at start) and pushes each page of
new batches once to every gateway that subscribes (``deployments/engine/kv_pub.py``); a gateway
applies a pushed page when it follows on from the last batch it applied
(:meth:`FeedCursor.accept`) and otherwise asks the log for the batches after that one (``GET
/kv_events?after=N`` on the replica's own HTTP server; ``affinity.kv_transport: poll``: it only
asks, a long poll). Every gateway therefore applies the same batches in the same order, whenever it
started; a gateway that fell behind the log's window, or an engine that restarted (new epoch), gets
``reset``: the gateway drops that replica's entries and continues from what the log still holds
(the index may under-report, never over-report).
The replica's server publishes stores and evictions in the router's hashes (``IndexStored``,
``IndexRemoved``: :mod:`cluster.routing.event_hashes`), hashed once there rather than on every
gateway replica, and with ``affinity.claim_stride_blocks`` k > 1 only their anchors and the
``BlocksQueued`` prompts' anchors (the events' ``stride``; absent on the wire: 1, every block).

Plain Python, no I/O: the engine deployment serves the log, the gateway's feed applies pages.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.json_types import JSON, JSONObject
from cluster.routing.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """The engine cached these full blocks (consecutive, chained from ``parent_block_hash``).
    ``cache_salt``: the salt of the request that stored a chain's first block (vLLM's
    ``extra_keys`` carry it there), so a router hashes those tokens under the same salt
    (:mod:`cluster.routing.cache_salt`); later blocks inherit it from their parent."""

    block_hashes: Sequence[Hashable]
    parent_block_hash: Hashable | None
    token_ids: Sequence[int]
    block_size: int
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The engine evicted these blocks (their hashes no longer find anything)."""

    block_hashes: Sequence[Hashable]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine reset its prefix cache."""


@dataclass(frozen=True, slots=True)
class BlocksQueued:
    """Ours, not vLLM's: a request reached the replica; these are the *router's* hashes of its
    prompt's full blocks under its cache salt (:class:`cluster.routing.block_hash.BlockHasher`),
    which the engine will compute unless they are cached. Published by the replica as the request
    arrives, so that every gateway learns where a context is going before the engine's
    ``BlockStored`` (which waits for its prefill, and for the queue before it) could tell them;
    gateways count them for a short time.
    ``session_id``: the request's session, which every gateway then pins to this replica, as the
    gateway that routed it did."""

    block_hashes: Sequence[BlockHash]
    session_id: str | None = None
    stride: int = 1  # k > 1: the prompt's anchors only (block_hash.strided), as its replica publishes them


@dataclass(frozen=True, slots=True)
class IndexStored:
    """Ours, not vLLM's: a ``BlockStored`` as the engine replica publishes it to the gateways, in
    the *router's* hashes (:class:`cluster.routing.event_hashes.RouterHashes`): the gateways index
    them as they are, with no tokens to hash and no map of the engine's hashes to keep.
    ``stride`` k > 1: only the stored blocks at depths k, 2k, ... of their chain and the event's
    last (the anchors the gateways look up, :func:`cluster.routing.block_hash.strided`);
    ``blocks``: how many blocks they stand for (None: one each), so a gateway counts blocks."""

    block_hashes: Sequence[BlockHash]
    stride: int = 1
    blocks: int | None = None


@dataclass(frozen=True, slots=True)
class IndexRemoved:
    """Ours: a ``BlockRemoved`` in the router's hashes (see :class:`IndexStored`): the anchors
    among the evicted blocks, standing for ``blocks`` (None: one each)."""

    block_hashes: Sequence[BlockHash]
    blocks: int | None = None


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared | BlocksQueued | IndexStored | IndexRemoved


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One engine step's events, numbered by the replica's log."""

    seq: int
    ts: float
    events: tuple[KVCacheEvent, ...]


@dataclass(slots=True)
class KVEventPage:
    """An answer to "the batches after ``after``": ``reset`` when the asker must forget the
    replica's entries first (it missed batches: the log moved past them, or the engine restarted)."""

    epoch: int
    batches: list[KVEventBatch]
    last_seq: int
    reset: bool = False


class KVEventLog:
    """The engine replica's bounded, numbered log of event batches (oldest dropped first)."""

    def __init__(self, max_batches: int = 8192, epoch: int | None = None) -> None:
        if max_batches <= 0:
            raise ValueError("max_batches must be positive")
        self.epoch = epoch if epoch is not None else random.getrandbits(48)
        self._batches: deque[KVEventBatch] = deque(maxlen=max_batches)
        self.last_seq = 0
        self.on_append: Callable[[], None] | None = None  # the server wakes its long polls
        # what the log keeps of a step's events (the replica's server: the router's hashes)
        self.translate: Callable[[Sequence[KVCacheEvent]], Sequence[KVCacheEvent]] | None = None

    def append(self, events: Sequence[KVCacheEvent], ts: float) -> None:
        if self.translate is not None:
            events = self.translate(events)
        if not events:
            return
        self.last_seq += 1
        self._batches.append(KVEventBatch(self.last_seq, ts, tuple(events)))
        if self.on_append is not None:
            self.on_append()

    def since(self, after: int, epoch: int | None = None, limit: int = 512) -> KVEventPage:
        """The batches numbered above ``after`` (at most ``limit``). ``epoch`` is the one the asker
        saw last (None: its first ask): another one, or a gap, answers ``reset``."""
        first = self._batches[0].seq if self._batches else self.last_seq + 1
        reset = (epoch is not None and epoch != self.epoch) or after < first - 1 or after > self.last_seq
        if reset:
            after = first - 1
        out = [b for b in self._batches if b.seq > after][:limit] if after < self.last_seq else []
        return KVEventPage(self.epoch, out, out[-1].seq if out else after, reset)


# -- the wire: JSON between the engine replica and the gateways --------------------------------


def _hash_to_wire(h: Hashable) -> int | str:
    if isinstance(h, bytes):
        return h.hex()
    if isinstance(h, int):
        return h
    return str(h)


def event_to_wire(ev: KVCacheEvent) -> JSONObject:
    if isinstance(ev, BlockStored):
        parent = ev.parent_block_hash
        out: JSONObject = {
            "type": "BlockStored",
            "block_hashes": [_hash_to_wire(h) for h in ev.block_hashes],
            "parent_block_hash": None if parent is None else _hash_to_wire(parent),
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
        }
        if ev.cache_salt is not None:
            out["cache_salt"] = ev.cache_salt
        return out
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [_hash_to_wire(h) for h in ev.block_hashes]}
    if isinstance(ev, BlocksQueued):
        out = {"type": "BlocksQueued", "block_hashes": list(ev.block_hashes), "session_id": ev.session_id}
        if ev.stride != 1:  # left out at 1: the wire before anchors, byte for byte
            out["stride"] = ev.stride
        return out
    if isinstance(ev, IndexStored | IndexRemoved):
        out = {"type": type(ev).__name__, "block_hashes": list(ev.block_hashes)}
        if isinstance(ev, IndexStored) and ev.stride != 1:
            out["stride"] = ev.stride
        if ev.blocks is not None:
            out["blocks"] = ev.blocks
        return out
    return {"type": "AllBlocksCleared"}


def batch_to_wire(b: KVEventBatch) -> JSONObject:
    return {"seq": b.seq, "ts": b.ts, "events": [event_to_wire(e) for e in b.events]}


def page_to_wire(page: KVEventPage) -> JSONObject:
    return {
        "epoch": page.epoch,
        "last_seq": page.last_seq,
        "reset": page.reset,
        "batches": [batch_to_wire(b) for b in page.batches],
    }


class PageEncoder:
    """A log's pages as JSON bytes, each batch encoded once however many gateways ask for it
    (every gateway replica polls every engine replica: issue 42). The bytes are
    ``json.dumps(page_to_wire(page))``'s. ``keep``: batches remembered (the log's window)."""

    def __init__(self, keep: int = 8192) -> None:
        self.keep = keep
        self._done: dict[int, bytes] = {}  # seq -> the batch's JSON (a log's seqs never repeat an epoch's)
        self._epoch: int | None = None

    def encode(self, page: KVEventPage) -> bytes:
        if page.epoch != self._epoch:
            self._done.clear()
            self._epoch = page.epoch
        done, parts = self._done, []
        for b in page.batches:
            enc = done.get(b.seq)
            if enc is None:
                enc = done[b.seq] = json.dumps(batch_to_wire(b)).encode()
            parts.append(enc)
        if len(done) > 2 * self.keep:  # forget the batches the log has dropped since
            for seq in sorted(done)[: len(done) - self.keep]:
                del done[seq]
        head = f'{{"epoch": {page.epoch}, "last_seq": {page.last_seq}, "reset": {json.dumps(page.reset)}, '
        return head.encode() + b'"batches": [' + b", ".join(parts) + b"]}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WireStored(_Strict):
    type: Literal["BlockStored"]
    block_hashes: list[int | str]
    parent_block_hash: int | str | None
    token_ids: list[int]
    block_size: int = Field(gt=0)
    cache_salt: str | None = None


class WireRemoved(_Strict):
    type: Literal["BlockRemoved"]
    block_hashes: list[int | str]


class WireCleared(_Strict):
    type: Literal["AllBlocksCleared"]


class WireQueued(_Strict):
    type: Literal["BlocksQueued"]
    block_hashes: list[BlockHash]
    session_id: str | None = None
    stride: int = Field(1, ge=1)


class WireIndexStored(_Strict):
    type: Literal["IndexStored"]
    block_hashes: list[BlockHash]
    stride: int = Field(1, ge=1)
    blocks: int | None = Field(None, ge=0)


class WireIndexRemoved(_Strict):
    type: Literal["IndexRemoved"]
    block_hashes: list[BlockHash]
    blocks: int | None = Field(None, ge=0)


WireEvent = WireStored | WireRemoved | WireCleared | WireQueued | WireIndexStored | WireIndexRemoved


class WireBatch(_Strict):
    seq: int = Field(ge=1)
    ts: float
    events: list[Annotated[WireEvent, Field(discriminator="type")]]


class WirePage(_Strict):
    """``GET /kv_events`` answer, validated by the gateway (off the token path)."""

    epoch: int
    last_seq: int = Field(ge=0)
    reset: bool = False
    batches: list[WireBatch] = Field(default_factory=list)


def page_from_wire(data: JSON) -> KVEventPage:
    """Parse and validate a page (pydantic's ValidationError on a malformed one)."""
    return _page(WirePage.model_validate(data))


def page_from_json(body: bytes | str) -> KVEventPage:
    """:func:`page_from_wire` of an answer's JSON body, parsed and validated in one pass by
    pydantic's own JSON parser: about half the CPU of ``json.loads`` and then validating its
    objects (issue 42: every gateway parses every engine's pages)."""
    return _page(WirePage.model_validate_json(body))


def _page(p: WirePage) -> KVEventPage:
    batches = []
    for b in p.batches:
        events: list[KVCacheEvent] = []
        for e in b.events:  # type() is: pydantic's isinstance goes through ABCMeta (issue 42: a hot loop)
            if type(e) is WireStored:
                events.append(
                    BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.cache_salt)
                )
            elif type(e) is WireRemoved:
                events.append(BlockRemoved(e.block_hashes))
            elif type(e) is WireQueued:
                events.append(BlocksQueued(e.block_hashes, e.session_id, e.stride))
            elif type(e) is WireIndexStored:
                events.append(IndexStored(e.block_hashes, e.stride, e.blocks))
            elif type(e) is WireIndexRemoved:
                events.append(IndexRemoved(e.block_hashes, e.blocks))
            else:
                events.append(AllBlocksCleared())
        batches.append(KVEventBatch(b.seq, b.ts, tuple(events)))
    return KVEventPage(p.epoch, batches, p.last_seq, p.reset)


# -- the consumer's cursor: one per (gateway, engine replica) -----------------------------------


@dataclass(slots=True)
class FeedCursor:
    """Where a gateway is in one replica's log."""

    epoch: int | None = None
    after: int = 0
    resets: int = 0
    batches: int = 0
    events: int = 0

    def accept(self, page: KVEventPage) -> KVEventPage | None:
        """A page pushed to every subscriber (:mod:`deployments.engine.kv_pub`: the batches after
        the last one pushed, or none, a heartbeat with the log's head), as this reader may apply
        it: the batches it has not applied yet (an empty page: nothing new); None when it missed
        some (a new epoch, a batch after a gap, a head past it, or no ask yet): it must ask the
        log for what it missed (``since``) before it applies pushed pages again."""
        if self.epoch is None or page.epoch != self.epoch or page.reset:
            return None
        first = page.batches[0].seq if page.batches else page.last_seq + 1
        if first > self.after + 1 or (not page.batches and page.last_seq > self.after):
            return None
        fresh = [b for b in page.batches if b.seq > self.after]
        return KVEventPage(page.epoch, fresh, max(page.last_seq, self.after))

    def advance(self, page: KVEventPage) -> None:
        if page.reset:
            self.resets += 1
        self.epoch = page.epoch
        self.after = page.last_seq
        self.batches += len(page.batches)
        self.events += sum(len(b.events) for b in page.batches)
