"""What the affinity and placement tests build their cases from: random prompts and load snapshots."""

from __future__ import annotations

import random
from typing import Any

from cluster.routing.affinity import ReplicaLoad


def toks(n: int, seed: int = 0) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(50_000) for _ in range(n)]


def loads(names: list[str], **per: dict[str, Any]) -> list[ReplicaLoad]:
    """Loads for ``names``; ``per`` maps a replica to a dict of field overrides."""
    return [ReplicaLoad(n, **per.get(n, {})) for n in names]
