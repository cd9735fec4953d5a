"""The simulated engine's paged KV cache with prefix caching, in the manner of vLLM v1
(``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py``), written for reading, not speed.

* The cache is ``num_blocks`` blocks of ``block_size`` tokens. A request holds a list of blocks
  covering its computed tokens (and the ones being computed this step).
* Only *full* blocks are cached. A block's hash chains over the whole prefix:
  ``hash(parent block's hash, this block's token ids, extra keys)``, so equal hashes mean equal
  prefixes. The first block's parent is a fixed root. Hashes are SHA-256 (deterministic across
  processes, unlike Python's ``hash``). A request's cache salt (its tenant's cache group,
  :mod:`cluster.routing.cache_salt`; an extra key ``("cache_salt", salt)``, :func:`salt_keys`)
  keys its first block only, as vLLM's ``cache_salt`` does: the same tokens under another salt
  find nothing, so one tenant's cache never answers another's prompt; ``BlockStored`` for a
  chain's first blocks carries it.
* A block has a reference count. At zero it goes to the tail of the free queue but keeps its hash
  and stays findable: a later request may take it back (a prefix hit). Allocation pops the head of
  the free queue, evicting that block's hash: the least recently freed block goes first (LRU). A
  request frees its blocks tail first, so a prompt's private end is evicted before a shared head.
* A lookup finds the longest run of cached leading blocks, at most ``num_tokens - 1`` tokens: the
  last token is always computed, because its logits give the next token.

* KV events (``events_enabled``), as vLLM's ``kv_events_config`` publisher emits them
  (:mod:`cluster.engine.kv_events`): ``BlockStored`` for each run of blocks newly registered under their
  hashes (with the parent's hash and the blocks' token ids), ``BlockRemoved`` for each cached block
  whose hash an allocation evicts. :meth:`KVCacheManager.take_events` hands them over (once a step).

Simplifications: one block per hash (vLLM allows duplicates until one is evicted); no null block;
no sliding window.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeGuard

from cluster.engine.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from cluster.routing.block_hash import EngineBlockHash

BlockHash = EngineBlockHash  # this module's name for it (cluster.engine.model imports it from here)

ROOT_HASH = BlockHash(hashlib.sha256(b"cluster.engine.kv root").digest())
SALT_TAG = "cache_salt"  # an extra key ``(SALT_TAG, salt)``: vLLM's cache_salt (first block only)
ExtraKeys = tuple[Hashable, ...]  # what a block hash folds in besides its tokens (vLLM's extra_keys)


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
) -> BlockHash:
    """The chained hash of one full block: (parent hash, token ids, extra keys)."""
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(array("q", token_ids).tobytes())  # fixed width: a full block's encoding is unambiguous
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return BlockHash(h.digest())


def salt_keys(cache_salt: str | None) -> ExtraKeys | None:
    """A request's extra keys for its cache salt (None: none), tagged as vLLM tags its own."""
    return ((SALT_TAG, cache_salt),) if cache_salt else None


def _is_salt(key: object) -> TypeGuard[tuple[str, str]]:
    return isinstance(key, tuple) and key[:1] == (SALT_TAG,)


def salt_of(extra_keys: ExtraKeys | None) -> str | None:
    """The cache salt among a request's extra keys (:func:`salt_keys`), if any."""
    return next((k[1] for k in extra_keys or () if _is_salt(k)), None)


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: ExtraKeys | None = None,
    hashes: list[BlockHash] | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids``; extends ``hashes`` (already-hashed leading blocks).
    A cache salt among the extra keys keys the first block only, as in vLLM: the chain carries it."""
    out = hashes if hashes is not None else []
    parent = out[-1] if out else None
    rest = tuple(k for k in extra_keys if not _is_salt(k)) or None if extra_keys else None
    for start in range(len(out) * block_size, len(token_ids) - block_size + 1, block_size):
        extra = extra_keys if start == 0 else rest
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        out.append(parent)
    return out


class _Seq(Protocol):
    """What :meth:`KVCacheManager.cache_request` reads of a sequence (the engine model's request)."""

    request_id: str
    token_ids: list[int]
    extra_keys: ExtraKeys | None
    num_computed_tokens: int
    block_hashes: list[BlockHash]


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Blocks, their free queue (LRU order) and the hash → block map of cached blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.evictions = 0  # cached blocks whose hash was dropped to reuse the block
        self.events: list[KVCacheEvent] | None = None  # a list: KV events are recorded into it

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks nobody references (some still hold a cached prefix and can be hit)."""
        return len(self._free)

    def usage(self) -> float:
        """Share of blocks referenced by requests: vLLM's ``kv_cache_usage``."""
        return 1.0 - self.num_free / self.num_blocks

    def free_queue(self) -> list[int]:
        """Block ids in eviction order (next to be reused first)."""
        return list(self._free)

    def cached(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def lookup(self, block_hashes: Iterable[BlockHash]) -> list[KVBlock]:
        """The longest run of leading blocks that are cached."""
        hits: list[KVBlock] = []
        for h in block_hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on hit blocks; a free one leaves the free queue (it is no longer evictable)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                    self.evictions += 1
                    if self.events is not None:
                        self._removed(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference on each block, in the order given; unreferenced ones join the queue's tail."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full block under its hash (first writer wins: one block per hash); True if
        this block is now the one the hash finds."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block
            return True
        return False

    def _removed(self, block_hash: BlockHash) -> None:
        assert self.events is not None
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):  # one event for a run of evictions, as vLLM batches them
            assert isinstance(last.block_hashes, list)
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash]))


class KVCacheManager:
    """Per-request block tables on top of a :class:`BlockPool`."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, events_enabled: bool = False
    ) -> None:
        self.pool = BlockPool(num_blocks)
        if events_enabled and enable_caching:
            self.pool.events = []
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._tables: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of a request already registered

    def blocks_of(self, request_id: str) -> list[KVBlock]:
        return self._tables.get(request_id, [])

    def computed_blocks(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> list[KVBlock]:
        """Cached leading blocks for a request of ``num_tokens`` tokens (at most num_tokens - 1 hit)."""
        if not self.enable_caching:
            return []
        return self.pool.lookup(block_hashes[: (num_tokens - 1) // self.block_size])

    def allocate_slots(self, request_id: str, num_tokens: int, hits: Sequence[KVBlock] = ()) -> bool:
        """Make the request's table cover ``num_tokens`` tokens, taking ``hits`` first; False if no room."""
        table = self._tables.get(request_id)
        have = len(table) if table is not None else 0
        assert not hits or have == 0, "prefix hits only extend an empty block table"
        need = -(-num_tokens // self.block_size) - have - len(hits)
        if need <= 0 and not hits:
            return True
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)  # taking them shrinks the free queue
        if max(need, 0) + evictable_hits > self.pool.num_free:
            return False
        if table is None:
            table = self._tables[request_id] = []
        self.pool.touch(hits)
        table.extend(hits)
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def cache_request(self, seq: _Seq) -> None:
        """:meth:`cache_blocks` for a sequence, its cache salt from its extra keys."""
        salt = salt_of(seq.extra_keys)
        self.cache_blocks(seq.request_id, seq.block_hashes, seq.num_computed_tokens, seq.token_ids, salt)

    def cache_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_computed: int,
        token_ids: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> None:
        """Register the request's full, computed blocks that are not registered yet (``token_ids``:
        the request's tokens, and ``cache_salt`` its salt, for the ``BlockStored`` events)."""
        if not self.enable_caching:
            return
        table = self._tables.get(request_id, [])
        done = self._num_cached.get(request_id, 0)
        full = min(num_computed // self.block_size, len(block_hashes), len(table))
        events = self.pool.events
        run_start = -1
        for i in range(done, full):
            stored = self.pool.cache(table[i], block_hashes[i])
            if events is None:
                continue
            if stored and run_start < 0:
                run_start = i
            elif not stored and run_start >= 0:
                self._stored(block_hashes, token_ids, run_start, i, cache_salt)
                run_start = -1
        if events is not None and run_start >= 0:
            self._stored(block_hashes, token_ids, run_start, full, cache_salt)
        self._num_cached[request_id] = max(done, full)

    def _stored(
        self, hashes: Sequence[BlockHash], token_ids: Sequence[int], lo: int, hi: int, salt: str | None
    ) -> None:
        assert self.pool.events is not None
        bs = self.block_size
        parent = hashes[lo - 1] if lo > 0 else None
        tokens = list(token_ids[lo * bs : hi * bs])
        salt = salt if parent is None else None  # vLLM's extra keys carry it on the first block only
        self.pool.events.append(BlockStored(list(hashes[lo:hi]), parent, tokens, bs, salt))

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events recorded since the last call (empty when events are off)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (a prompt's private end is evicted before its head)."""
        table = self._tables.pop(request_id, [])
        self._num_cached.pop(request_id, None)
        self.pool.free(reversed(table))
