"""The two kinds of block hash, as types of their own so a signature says which it takes.

* :data:`BlockHash`: the router's hash of a full block of token ids (:class:`cluster.affinity.
  BlockHasher`, a 64-bit int chained over the blocks), which the prefix index, the placement and
  the routing view key on; every gateway replica computes the same ones.
* :data:`EngineBlockHash`: what an engine names its cached block by (the simulated engine's
  SHA-256 chain in :mod:`cluster.engine_kv`; vLLM's own in its KV events): the router maps these to
  its own as the events arrive.
"""

from __future__ import annotations

from typing import NewType

BlockHash = NewType("BlockHash", int)
EngineBlockHash = NewType("EngineBlockHash", bytes)
