"""Our Ray Serve ``RequestRouter`` for backend deployments: Ray calls ``choose_replicas`` in the
router deployment's process (the handle's owner) with the live replica list; we rank replicas by
the policy in :mod:`cluster` and Ray sends the request to the first one whose queue is not full.

Why a Serve ``RequestRouter`` rather than one deployment per replica: Serve keeps owning replica
lifecycle, health checks and autoscaling, and we still pick the exact replica. The policy's view of
load (posted by replicas to the stats hub, plus this process's own in-flight counts) lives in
:data:`VIEW`, a module-level object the router deployment in the same process keeps fresh.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from cluster.protocol import BackendStats, GenerateRequest


@dataclass
class RoutingView:
    stats: dict[str, BackendStats] = field(default_factory=dict)  # replica unique id → snapshot
    in_flight: Counter[str] = field(default_factory=Counter)  # routed by this process, not ended
    policy: Any = None  # an object with .rank(req, replica_ids, view) -> list[str] (best first)

    def load(self, rid: str) -> float:
        s = self.stats.get(rid)
        waiting = s.waiting if s is not None else 0
        return self.in_flight[rid] + waiting


VIEW = RoutingView()


class ClusterRequestRouter(RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        req = _generate_request(pending_request)
        if VIEW.policy is not None and req is not None:
            order = VIEW.policy.rank(req, list(by_id), VIEW)
        else:
            order = sorted(by_id, key=lambda rid: (VIEW.load(rid), rid))
        # One rank per replica: Ray tries the first, and only if its queue is full the next.
        return [[by_id[rid]] for rid in order if rid in by_id]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        VIEW.in_flight[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        VIEW.in_flight[rid] -= 1
        if VIEW.in_flight[rid] <= 0:
            del VIEW.in_flight[rid]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        VIEW.in_flight.pop(replica_id.unique_id, None)
        VIEW.stats.pop(replica_id.unique_id, None)


def _generate_request(pending: PendingRequest | None) -> GenerateRequest | None:
    if pending is None or not pending.args:
        return None
    arg = pending.args[0]
    return arg if isinstance(arg, GenerateRequest) else None
