"""The replica index behind cache-aware routing: which replicas hold which prefix blocks.

The index. ``block hash -> bitmask of replicas`` in an ``OrderedDict`` kept in LRU order and bounded
in blocks. :meth:`PrefixIndex.record` inserts a request's blocks tail first so the head ends up most
recent and eviction takes tails first — the index stays prefix-closed (a replica holding block k
holds blocks 0..k-1), as vLLM's own free queue does, which lets the longest match be found by a
binary search (O(log n) lookups instead of n). Removing a replica retires its bit at once (lookups
never see it again) and the stale bits are purged in one pass only after many removals, so a dying
replica never costs a full scan of a million-entry index on the event loop.

Entries come from the engines' KV events (``on_block_stored`` / ``on_block_removed``, exact) or,
for an engine that publishes none, from the requests routed to it (``record``, a guess that
forgets in LRU order). A request just sent to an event-fed replica is noted apart
(``note_recent``): its blocks count for a short time, so concurrent sharers follow it before the
engine's ``BlockStored`` arrives, and go if it never does. With ``stride`` k > 1 a prompt is
looked up by its anchors (every k-th block and the last, :func:`cluster.routing.block_hash.strided`):
a recent send notes only those (k times less work on every gateway for every request to every
engine, issue 42), and the engines publish only those of what they store and evict
(:mod:`cluster.routing.event_hashes`), so the index holds anchors, a match known to within k
blocks. ``held_blocks`` counts the blocks each replica's entries stand for (its cache's fill,
when its events feed it: each anchored event says how many blocks it stands for).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import or_

from cluster.routing.block_hash import BlockHash, strided


class PrefixIndex:
    """Bounded LRU map ``block hash -> replicas believed to hold it`` (a bitmask of replica slots)."""

    def __init__(self, capacity_blocks: int, purge_after: int = 64, stride: int = 1) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity = capacity_blocks
        self.stride = max(1, stride)  # prompts looked up by their anchors (module docstring)
        self._purge_after = purge_after
        self._map: OrderedDict[BlockHash, int] = OrderedDict()
        self._bits: dict[str, int] = {}  # live replica -> its bit
        self._names: dict[int, str] = {}  # slot number -> live replica
        self._free: list[int] = []  # slot numbers whose stale bits are purged
        self._next_slot = 0
        self._retired = 0  # bits of removed replicas still present in some entries
        self._retired_count = 0
        self._held: dict[int, int] = {}  # bit -> blocks held
        self._recent: dict[BlockHash, int] = {}  # block hash -> replicas a request was just sent to with it
        self._recent_log: deque[tuple[float, int, Sequence[BlockHash]]] = deque()  # (sent, bit, hashes)
        self.evictions = 0
        self.purges = 0
        # an indexer's (issue 42): the anchors its bound evicted and the bits purges freed since its
        # frame builder last read them (cluster/routing/index_mirror.py); None: nobody reads them
        self.evicted: list[BlockHash] | None = None
        self.freed = 0
        self.generation = 0  # bumped whenever a replica's bit may change (a mirror's slot tables)

    def __len__(self) -> int:
        return len(self._map)

    def bit(self, replica: str) -> int:
        """The replica's bit, giving it a slot on first sight."""
        b = self._bits.get(replica)
        if b is None:
            slot = self._free.pop() if self._free else self._next_slot
            if slot == self._next_slot:
                self._next_slot += 1
            b = self._bits[replica] = 1 << slot
            self._names[slot] = replica
        return b

    def bit_of(self, replica: str) -> int:
        """The replica's bit, 0 if it has none (never allocates: safe for names that may be dead)."""
        return self._bits.get(replica, 0)

    def mask(self, replicas: Iterable[str]) -> int:
        m = 0
        for r in replicas:
            m |= self.bit(r)
        return m

    def replicas(self, mask: int) -> list[str]:
        """The live replicas in ``mask``, in slot order."""
        mask &= ~self._retired
        out = []
        while mask:
            low = mask & -mask
            out.append(self._names[low.bit_length() - 1])
            mask ^= low
        return out

    def holders(self, block_hash: BlockHash) -> list[str]:
        return self.replicas(self._map.get(block_hash, 0))

    def record(self, replica: str, hashes: Sequence[BlockHash], blocks: int | None = None) -> None:
        """``replica`` now holds these blocks (a routed request, or the engine said so); ``blocks``:
        how many blocks its engine stored (anchors: ``IndexStored.blocks``), None: the new entries."""
        bit = self.bit(replica)
        m = self._map
        pop = m.pop
        added = 0
        for h in reversed(hashes):  # tail first: the head ends most recent, tails are evicted first
            old = pop(h, 0)
            m[h] = old | bit
            added += not old & bit
        self._held[bit] = self._held.get(bit, 0) + (added if blocks is None else blocks)
        over = len(m) - self.capacity
        if over > 0:
            self._evict(over)

    def _evict(self, over: int) -> None:
        """The bound: the ``over`` least recent entries go (noted for an indexer's frames)."""
        m, noted = self._map, self.evicted
        for _ in range(over):
            h, mask = m.popitem(last=False)
            self._uncount(mask)
            if noted is not None:
                noted.append(h)
        self.evictions += over

    on_block_stored = record

    def _uncount(self, mask: int) -> None:
        """An entry evicted by the bound: each of its replicas holds about ``stride`` blocks less."""
        held, k = self._held, self.stride
        while mask:
            low = mask & -mask
            if low in held:
                held[low] = max(0, held[low] - k)
            mask ^= low

    def held_blocks(self, replica: str) -> int:
        """Blocks the index says ``replica`` holds (exact when its engine's events feed it)."""
        return self._held.get(self._bits.get(replica, 0), 0)

    def on_block_removed(self, replica: str, hashes: Sequence[BlockHash], blocks: int | None = None) -> None:
        """The engine evicted these blocks from ``replica`` (``blocks`` of them in all, as in ``record``)."""
        bit = self._bits.get(replica)
        if bit is None:
            return
        m, gone = self._map, 0
        for h in hashes:
            v = m.get(h)
            if v is None or not v & bit:
                continue
            gone += 1
            v &= ~bit
            if v & ~self._retired:
                m[h] = v  # keeps its LRU position: other replicas still hold it
            else:
                del m[h]
        if gone or blocks:
            self._held[bit] = max(0, self._held.get(bit, 0) - (gone if blocks is None else blocks))

    # Recent routes: blocks a request was just sent with, before the engine's events confirm them --
    def note_recent(
        self, replica: str, hashes: Sequence[BlockHash], now: float, anchored: bool = False
    ) -> None:
        """``replica`` is computing these blocks (a request was just sent): they count for
        :meth:`longest_match` until ``expire_recent`` passes ``now + ttl``, by when the engine's
        ``BlockStored`` events have put them in the index, if it kept them. ``anchored``: the
        hashes are the prompt's anchors already (a ``BlocksQueued`` its replica strided)."""
        if not hashes:
            return
        if not anchored:
            hashes = strided(hashes, self.stride)
        bit = self.bit(replica)
        rec = self._recent
        olds = list(map(rec.get, hashes, repeat(0)))
        if olds.count(bit) != len(olds):  # else: a context just sent here again, nothing to add
            rec.update(zip(hashes, [old | bit for old in olds], strict=True))
        self._recent_log.append((now, bit, hashes))

    def expire_recent(self, before: float, touched: list[BlockHash] | None = None) -> None:
        """The recent sends older than ``before`` stop counting; ``touched`` (an indexer's frame
        builder) gets their anchors."""
        log, rec = self._recent_log, self._recent
        while log and log[0][0] < before:
            _, bit, hashes = log.popleft()
            if touched is not None:
                touched.extend(hashes)
            if list(map(rec.get, hashes, repeat(0))).count(bit) == len(hashes):  # only this replica's
                deque(map(rec.pop, hashes, repeat(None)), maxlen=0)
                continue
            for h in hashes:
                v = rec.get(h, 0) & ~bit
                if v:
                    rec[h] = v
                else:
                    rec.pop(h, None)

    def remove_replica(self, replica: str) -> None:
        """Forget the replica and every block it held (effective at once; stale bits purged later)."""
        bit = self._bits.pop(replica, None)
        if bit is None:
            return
        self.generation += 1
        del self._names[bit.bit_length() - 1]
        self._held.pop(bit, None)
        self._retired |= bit
        self._retired_count += 1
        if self._retired_count >= max(self._purge_after, len(self._bits)):
            self.purge()

    def purge(self) -> None:
        """Drop retired bits from every entry and free their slots: one O(entries) pass."""
        if not self._retired:
            return
        live, retired_bits = ~self._retired, self._retired
        self._map = OrderedDict((h, v & live) for h, v in self._map.items() if v & live)
        self._recent = {h: v & live for h, v in self._recent.items() if v & live}
        self._recent_log = deque((t, b, hs) for t, b, hs in self._recent_log if b & live)
        retired, slot = self._retired, 0
        while retired:
            if retired & 1:
                self._free.append(slot)
            retired >>= 1
            slot += 1
        self._free.sort(reverse=True)  # reuse low slots first: masks stay small
        self._retired = 0
        self._retired_count = 0
        self.purges += 1
        self.generation += 1
        self.freed |= retired_bits

    # The mirror: a gateway's copy of an indexer's index (issue 42, cluster/routing/index_mirror.py) --
    def live_masks(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The live replicas holding each anchor, index and recent sends together (an indexer's
        frame builder: what a decision would see)."""
        zeros = repeat(0)
        masks = list(map(or_, map(self._map.get, hashes, zeros), map(self._recent.get, hashes, zeros)))
        if not self._retired:
            return masks
        live = ~self._retired
        return [m & live for m in masks]

    def keys(self) -> list[BlockHash]:
        return list(self._map)

    def recent_keys(self) -> list[BlockHash]:
        return list(self._recent)

    def slots(self) -> dict[str, int]:
        """Each live replica's bit (a copy)."""
        return dict(self._bits)

    def mirror(self, keys: Iterable[BlockHash], masks: Iterable[int], gone: Iterable[BlockHash]) -> None:
        """Set these anchors' holders (masks of this index's bits) and drop those no replica
        holds: an indexer's frame, applied in C loops. The indexer owns the bound, so nothing is
        evicted or counted here."""
        m = self._map
        m.update(zip(keys, masks, strict=True))
        deque(map(m.pop, gone, repeat(None)), maxlen=0)

    def set_held(self, replica: str, blocks: int) -> None:
        self._held[self.bit(replica)] = blocks

    def drop_shard(self, shard: int, shards: int) -> None:
        """Forget the anchors of indexer ``shard`` of ``shards`` (its snapshot follows); with one
        shard, everything."""
        if shards == 1:
            self.clear()
            return
        m = self._map
        deque(map(m.pop, [h for h in m if h % shards == shard]), maxlen=0)

    def clear(self) -> None:
        """Forget everything (a mirror about to take a snapshot)."""
        self.generation += 1
        self._map.clear()
        self._bits.clear()
        self._names.clear()
        self._free.clear()
        self._next_slot = self._retired = self._retired_count = 0
        self._held.clear()
        self._recent.clear()
        self._recent_log.clear()

    def longest_match(self, hashes: Sequence[BlockHash], mask: int) -> tuple[int, int]:
        """``(blocks, holders)``: the longest prefix of ``hashes`` some replica in ``mask`` holds, and
        the replicas (a mask) holding exactly that much. Binary search: assumes prefix-closed entries.
        Block ``mid`` counts by its anchor, the first one at or after it (with a ``stride``, the
        index and the recent sends hold anchors): a match ends at an anchor."""
        get, recent, k = self._map.get, self._recent.get, self.stride
        lo, hi, best = 0, len(hashes), 0
        n = hi
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            a = hashes[mid - 1] if k == 1 else hashes[min(-(-mid // k) * k, n) - 1]
            held = (get(a, 0) | recent(a, 0)) & mask
            if held:
                lo, best = mid, held
            else:
                hi = mid - 1
        return lo, best


class SessionTable:
    """Bounded LRU ``session id -> replica`` with an idle time-to-live."""

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._map: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def get(self, session_id: str, now: float) -> str | None:
        entry = self._map.get(session_id)
        if entry is None:
            return None
        if now - entry[1] > self.ttl_s:
            del self._map[session_id]
            return None
        return entry[0]

    def bound(self) -> list[tuple[str, str]]:
        """Every ``(session id, replica)``, least recent first (an indexer's snapshot)."""
        return [(s, r) for s, (r, _) in self._map.items()]

    def bind(self, session_id: str, replica: str, now: float) -> None:
        self._map[session_id] = (replica, now)
        self._map.move_to_end(session_id)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)
