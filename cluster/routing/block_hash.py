"""The two kinds of block hash, as types of their own so a signature says which it takes.

* :data:`BlockHash`: the router's hash of a full block of token ids (:class:`BlockHasher`, a
  64-bit int chained over the blocks), which the prefix index, the placement and
  the routing view key on; every gateway replica computes the same ones.
* :data:`EngineBlockHash`: what an engine names its cached block by (the simulated engine's
  SHA-256 chain in :mod:`cluster.engine.kv`; vLLM's own in its KV events): the router maps these to
  its own as the events arrive.

Hashing. Like vLLM's ``hash_block_tokens``: only full blocks, each block's hash chains its parent's
hash, its tokens and the extra keys (the model name and a salt, folded into one 64-bit integer).
The default hash is CPython's tuple hash over ints: ints hash to themselves modulo 2**61-1 and the
tuple hash is a fixed xxHash-style mix, so unlike ``hash(str)`` it does *not* depend on
``PYTHONHASHSEED`` — the same tokens give the same hashes in every process of one CPython build
(checked by a test that runs two interpreters with different seeds). It is 64-bit, not
cryptographic: a collision or a crafted prompt can only mislead a routing hint, never the engine,
which keeps its own hashes. ``algo="blake2b"`` is the portable alternative (any Python version),
measured about 3x slower (see loadtest/benchmarks/bench_affinity_micro.py).

A request's cache salt (its tenant's cache group, :mod:`cluster.routing.cache_salt`) changes the
chain's root, as vLLM's ``cache_salt`` enters only the first block's extra keys: every block of a
salted prompt differs from the same tokens under another salt, and a chain continued from a
known parent (the engine's KV events) carries its salt along. No salt: the root, and every hash,
is the one it always was.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Literal, NewType, TypeVar, cast

BlockHash = NewType("BlockHash", int)
EngineBlockHash = NewType("EngineBlockHash", bytes)
T = TypeVar("T")
HashAlgo = Literal["tuple", "blake2b"]


def deepest_held(held: Mapping[BlockHash, T], hashes: Sequence[BlockHash]) -> tuple[int, T | None]:
    """How many leading blocks of ``hashes`` ``held`` has, and its value for the last of them
    (``(0, None)``: not even the first). Binary search: ``held`` must be prefix-closed over a chain
    (a block is held only if the blocks before it are), as the index and the homes are."""
    lo, hi, value = 0, len(hashes), None
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        v = held.get(hashes[mid - 1])
        if v is not None:
            lo, value = mid, v
        else:
            hi = mid - 1
    return lo, value


def strided(hashes: Sequence[BlockHash], stride: int) -> Sequence[BlockHash]:
    """A chain's anchors: every ``stride``-th block (positions ``stride``, ``2 stride``, ... counted
    from 1) and its last block. A block's position in any chain that holds it is fixed (the hashes
    chain from the root), so two prompts agree on their shared prefix's anchors, and a structure
    keyed by anchors only stays prefix-closed. ``stride`` 1: the chain itself."""
    if stride <= 1:
        return hashes
    out = list(hashes[stride - 1 :: stride])
    if len(hashes) % stride:
        out.append(hashes[-1])
    return out


def deepest_strided(
    held: Mapping[BlockHash, T], hashes: Sequence[BlockHash], stride: int
) -> tuple[int, T | None]:
    """:func:`deepest_held` over a map keyed by :func:`strided` anchors: the blocks covered by
    the deepest anchor held (a multiple of ``stride``, or the whole chain when its last is held)."""
    if stride <= 1:
        return deepest_held(held, hashes)
    j, value = deepest_held(held, strided(hashes, stride))
    return min(j * stride, len(hashes)), value


def stable_hash64(*parts: str) -> int:
    """A 64-bit hash of strings that is the same in every process (``hash(str)`` is seeded)."""
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class BlockHasher:
    """Chained hashes of full token blocks: ``h_i = H(h_{i-1}, extra, tokens of block i)``."""

    def __init__(self, block_size: int, model: str, salt: str = "", algo: HashAlgo = "tuple") -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if algo not in ("tuple", "blake2b"):
            raise ValueError(f"unknown hash algo {algo!r}")
        self.block_size = block_size
        self.algo = algo
        self.extra = stable_hash64("extra", model, salt)  # vLLM's extra_keys: model + cache salt
        self.root = stable_hash64("root", str(block_size), algo)  # vLLM's NONE_HASH, but fixed
        self._salted: dict[str, int] = {}  # a request's cache salt -> its chain's root

    def salted_root(self, salt: str | None) -> int:
        """The root of a chain under ``salt`` (the plain root without one)."""
        if not salt:
            return self.root
        root = self._salted.get(salt)
        if root is None:
            if len(self._salted) >= 4096:  # salts are cache groups: few; bounded all the same
                self._salted.clear()
            root = self._salted[salt] = stable_hash64("root", str(self.block_size), self.algo, "salt", salt)
        return root

    def hash_blocks(
        self, token_ids: Sequence[int], parent: BlockHash | None = None, salt: str | None = None
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids``; ``parent`` continues an existing chain (which
        carries its own salt), else the chain starts at ``salt``'s root."""
        bs = self.block_size
        n = len(token_ids) - len(token_ids) % bs
        h: int = parent if parent is not None else self.salted_root(salt)
        out: list[int] = []  # BlockHash values: the NewType's call per block is left out (hot path)
        if self.algo == "tuple":
            toks = tuple(token_ids)
            extra = self.extra
            for i in range(0, n, bs):
                h = hash((h, extra, toks[i : i + bs]))
                out.append(h)
            return cast("list[BlockHash]", out)
        arr = array("i", token_ids[:n])
        if sys.byteorder == "big":
            arr.byteswap()
        packed = arr.tobytes()
        extra_b = self.extra.to_bytes(8, "little")
        step = 4 * bs
        for i in range(0, 4 * n, step):
            digest = hashlib.blake2b(
                h.to_bytes(8, "little") + extra_b + packed[i : i + step], digest_size=8
            ).digest()
            h = int.from_bytes(digest, "little")
            out.append(h)
        return cast("list[BlockHash]", out)
