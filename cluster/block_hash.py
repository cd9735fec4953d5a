"""The two kinds of block hash, as types of their own so a signature says which it takes.

* :data:`BlockHash`: the router's hash of a full block of token ids (:class:`cluster.affinity.
  BlockHasher`, a 64-bit int chained over the blocks), which the prefix index, the placement and
  the routing view key on; every gateway replica computes the same ones.
* :data:`EngineBlockHash`: what an engine names its cached block by (the simulated engine's
  SHA-256 chain in :mod:`cluster.engine_kv`; vLLM's own in its KV events): the router maps these to
  its own as the events arrive.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NewType, TypeVar

BlockHash = NewType("BlockHash", int)
EngineBlockHash = NewType("EngineBlockHash", bytes)
T = TypeVar("T")


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
