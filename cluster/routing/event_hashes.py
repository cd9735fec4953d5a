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
raw ``BlockStored`` events (an engine that publishes those). Plain Python, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from cluster.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    IndexRemoved,
    IndexStored,
    KVCacheEvent,
)
from cluster.routing.block_hash import BlockHash, BlockHasher


class RouterHashes:
    """``engine hash -> router hash`` for one engine replica, bounded to ``capacity`` entries."""

    def __init__(self, hasher: BlockHasher, capacity: int = 262_144) -> None:
        self.hasher = hasher
        self.capacity = capacity
        self._map: OrderedDict[Hashable, BlockHash] = OrderedDict()
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
        kv = self._map
        parent = None
        if parent_block_hash is not None:
            parent = kv.get(parent_block_hash)
            if parent is None:
                self.unmapped += 1
                return None
        ours = self.hasher.hash_blocks(token_ids, parent, cache_salt)
        for engine_h, our_h in zip(block_hashes, ours, strict=False):
            kv[engine_h] = our_h
            kv.move_to_end(engine_h)
        while len(kv) > self.capacity:
            kv.popitem(last=False)
        return ours[: len(block_hashes)]

    def removed(self, block_hashes: Iterable[Hashable]) -> list[BlockHash]:
        """The router's hashes of these evicted blocks (the ones the map knows), forgotten."""
        pop = self._map.pop
        return [h for h in (pop(e, None) for e in block_hashes) if h is not None]

    def translate(self, events: Sequence[KVCacheEvent]) -> list[KVCacheEvent]:
        """One engine step's events as a gateway applies them: ``BlockStored``/``BlockRemoved`` as
        ``IndexStored``/``IndexRemoved`` in the router's hashes (a store in another block size, or
        chained to an unknown parent, is left out and counted); the rest as they are."""
        out: list[KVCacheEvent] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.block_size != self.hasher.block_size:
                    self.mismatched += 1
                    continue
                ours = self.stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.cache_salt)
                if ours:
                    out.append(IndexStored(ours))
            elif isinstance(ev, BlockRemoved):
                if ours := self.removed(ev.block_hashes):
                    out.append(IndexRemoved(ours))
            else:
                if isinstance(ev, AllBlocksCleared):
                    self._map.clear()
                out.append(ev)
        return out
