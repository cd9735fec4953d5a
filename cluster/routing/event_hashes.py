"""An engine's block hashes as the router's: the map a KV-event consumer keeps per engine replica.

An engine names its cached blocks by its own hashes (vLLM seeds them per process); the router keys
its index by :class:`cluster.routing.block_hash.BlockHasher` hashes of the same tokens. A
``BlockStored`` carries its blocks' token ids and its parent's engine hash, so the router's hashes
are recomputed from the tokens, chained from the parent's router hash, which this map keeps
(bounded, least recently stored forgotten first); a ``BlockRemoved`` names engine hashes only,
which the map turns back into the router's.

Who keeps it: the engine replica itself (:class:`deployments.engine.kv_endpoint.KVEventEndpoint`), which
publishes ``IndexStored``/``IndexRemoved`` in the router's hashes, so the work (and the map's
memory) is done once per engine instead of once per engine on every gateway replica (issue 42:
at 256 engines that was most of a gateway's control-plane CPU and a map of N x 262k entries in
each gateway). :class:`cluster.routing.affinity.AffinityRouter` keeps one per replica for pages of
raw ``BlockStored`` events (an engine that publishes those).

Anchors only (``stride`` k > 1, the backend's ``affinity.claim_stride_blocks``): the gateways look
a prompt up by its anchors (every k-th block of its chain and its last,
:func:`cluster.routing.block_hash.strided`), so the replica publishes no more: of each store, the
blocks at depth k, 2k, ... of their chain and the event's last block (a chain's end: a prompt sent
again matches to its last block); of each eviction, those among the evicted; of each
``BlocksQueued``, the prompt's anchors. Every gateway receives, parses and applies about k times
fewer hashes (issue 42), and its index holds anchors only, a prefix's depth known to within k
blocks. The map keeps each block's depth for this. Plain Python, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from cluster.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlocksQueued,
    BlockStored,
    IndexRemoved,
    IndexStored,
    KVCacheEvent,
)
from cluster.routing.block_hash import BlockHash, BlockHasher, strided

# engine hash -> (router hash, depth in its chain from 1, published as an event's last block)
_Entry = tuple[BlockHash, int, bool]


class RouterHashes:
    """``engine hash -> router hash`` for one engine replica, bounded to ``capacity`` entries;
    ``stride``: the anchors' (module docstring), 1 for every block."""

    def __init__(self, hasher: BlockHasher, capacity: int = 262_144, stride: int = 1) -> None:
        if stride < 1:
            raise ValueError("stride must be >= 1")
        self.hasher = hasher
        self.capacity = capacity
        self.stride = stride
        self._map: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.unmapped = 0  # stored events whose parent is not in the map (forgotten, or never seen)
        self.mismatched = 0  # stored events in another block size than the hasher's

    def __len__(self) -> int:
        return len(self._map)

    def stored(
        self,
        block_hashes: Sequence[Hashable],
        parent_block_hash: Hashable | None,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
    ) -> list[BlockHash] | None:
        """The router's hashes of these stored blocks (None: their parent is unknown, counted)."""
        done = self._store(block_hashes, parent_block_hash, token_ids, cache_salt)
        return None if done is None else done[0]

    def _store(
        self,
        block_hashes: Sequence[Hashable],
        parent_block_hash: Hashable | None,
        token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> tuple[list[BlockHash], list[BlockHash]] | None:
        """(the router's hashes of these stored blocks, their anchors), or None (unknown parent)."""
        kv, k = self._map, self.stride
        parent, depth = None, 0
        if parent_block_hash is not None:
            entry = kv.get(parent_block_hash)
            if entry is None:
                self.unmapped += 1
                return None
            parent, depth = entry[0], entry[1]
        ours = self.hasher.hash_blocks(token_ids, parent, cache_salt)[: len(block_hashes)]
        last = len(ours) - 1
        for i, (engine_h, our_h) in enumerate(zip(block_hashes, ours, strict=False)):
            kv[engine_h] = (our_h, depth + i + 1, i == last)
            kv.move_to_end(engine_h)
        while len(kv) > self.capacity:
            kv.popitem(last=False)
        if k == 1 or not ours:
            return ours, ours
        first = (k - depth % k) % k or k  # the first depth that is a multiple of k, from 1
        anchors = ours[first - 1 :: k]
        if (depth + len(ours)) % k:
            anchors.append(ours[-1])
        return ours, anchors

    def removed(self, block_hashes: Iterable[Hashable]) -> list[BlockHash]:
        """The router's hashes of these evicted blocks (the ones the map knows), forgotten."""
        pop = self._map.pop
        return [e[0] for e in (pop(h, None) for h in block_hashes) if e is not None]

    def _removed_anchors(self, block_hashes: Iterable[Hashable]) -> tuple[list[BlockHash], int]:
        """(the anchors among these evicted blocks, how many of them the map knew), forgotten."""
        pop, k = self._map.pop, self.stride
        known = [e for e in (pop(h, None) for h in block_hashes) if e is not None]
        return [h for h, d, last in known if last or d % k == 0], len(known)

    def translate(self, events: Sequence[KVCacheEvent]) -> list[KVCacheEvent]:
        """One engine step's events as a gateway applies them: ``BlockStored``/``BlockRemoved`` as
        ``IndexStored``/``IndexRemoved`` in the router's hashes (a store in another block size, or
        chained to an unknown parent, is left out and counted), ``BlocksQueued`` as its anchors;
        with a ``stride``, anchors only (module docstring); the rest as they are."""
        out: list[KVCacheEvent] = []
        k = self.stride
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.block_size != self.hasher.block_size:
                    self.mismatched += 1
                    continue
                done = self._store(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.cache_salt)
                if done and done[0]:
                    out.append(IndexStored(done[1]) if k == 1 else IndexStored(done[1], k, len(done[0])))
            elif isinstance(ev, BlockRemoved):
                if k == 1:
                    if ours := self.removed(ev.block_hashes):
                        out.append(IndexRemoved(ours))
                elif (gone := self._removed_anchors(ev.block_hashes))[1]:
                    out.append(IndexRemoved(*gone))
            elif isinstance(ev, BlocksQueued) and k > 1 and ev.stride == 1:
                out.append(BlocksQueued(strided(ev.block_hashes, k), ev.session_id, k))
            else:
                if isinstance(ev, AllBlocksCleared):
                    self._map.clear()
                out.append(ev)
        return coalesce(out)


def coalesce(events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """Consecutive ``IndexStored`` (of one stride) as one, and consecutive ``IndexRemoved`` as one:
    a gateway applies a store or an eviction hash by hash, so one event of all their hashes and
    blocks changes its index as they would, at a fraction of the cost per event (issue 42: a step
    stores a few dozen chunks of one to 32 blocks, each its own event, and a gateway's cost went
    with the events it parsed and applied). The order of stores against evictions is kept."""
    out: list[KVCacheEvent] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, IndexStored) and isinstance(last, IndexStored) and ev.stride == last.stride:
            out[-1] = IndexStored(
                [*last.block_hashes, *ev.block_hashes], ev.stride, _sum(last.blocks, ev.blocks)
            )
        elif isinstance(ev, IndexRemoved) and isinstance(last, IndexRemoved):
            out[-1] = IndexRemoved([*last.block_hashes, *ev.block_hashes], _sum(last.blocks, ev.blocks))
        else:
            out.append(ev)
    return out


def _sum(a: int | None, b: int | None) -> int | None:
    """Two events' block counts added (None: one per hash, as both had)."""
    return None if a is None and b is None else (a or 0) + (b or 0)
