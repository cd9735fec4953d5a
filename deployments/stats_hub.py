"""A small named actor where every backend replica posts its stats snapshot a few times a second.

The router reads one consolidated view from it (load for routing, engine prefix-cache counters for
metrics), and tests and operators can ask it what each replica reports. Replicas that stop posting
fall out after ``stale_after_s``: a dead replica disappears from routing by itself.
"""

from __future__ import annotations

import time

import ray

from cluster.protocol import BackendStats

HUB_NAME = "llmc-stats-hub"


@ray.remote(num_cpus=0)
class StatsHub:
    def __init__(self, stale_after_s: float = 3.0) -> None:
        self.stale_after_s = stale_after_s
        self._stats: dict[str, tuple[float, BackendStats]] = {}

    def report(self, stats: BackendStats) -> None:
        self._stats[stats.replica] = (time.monotonic(), stats)

    def forget(self, replica: str) -> None:
        self._stats.pop(replica, None)

    def snapshot(self) -> dict[str, BackendStats]:
        now = time.monotonic()
        for rid in [r for r, (t, _) in self._stats.items() if now - t > self.stale_after_s]:
            del self._stats[rid]
        return {rid: s for rid, (_, s) in self._stats.items()}


def get_hub(app_name: str) -> ray.actor.ActorHandle:
    """The hub of one Serve application, created on first use (idempotent across processes)."""
    return StatsHub.options(
        name=f"{HUB_NAME}-{app_name}", namespace="serve", get_if_exists=True, lifetime="detached"
    ).remote()
