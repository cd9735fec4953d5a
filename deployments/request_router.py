"""Our Ray Serve ``RequestRouter`` for backend deployments: Ray calls ``choose_replicas`` in the
router deployment's process (the handle's owner) with the live replica list; the cache-aware policy
in :mod:`cluster.affinity` picks the replica and Ray sends the request there (falling back to the
next rank only if that replica's queue is full).

Why a Serve ``RequestRouter`` rather than one deployment per replica: Serve keeps owning replica
lifecycle, health checks and autoscaling, and we still pick the exact replica. The policy's inputs
live in ``routing_state.VIEW``, shared with the router deployment in the same process:
the replicas' stats (posted to the stats hub), this process's exact in-flight counts, one
``AffinityRouter`` per backend, and each request's block hashes (computed once, off the event loop,
by the router deployment before dispatch).
"""

from __future__ import annotations

import time
from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from cluster.protocol import GenerateRequest
from deployments import metrics, routing_state


def backend_of(deployment_name: str) -> str:
    return deployment_name.removeprefix("backend-")


class ClusterRequestRouter(RequestRouter):
    """``mode``: ``cache_aware`` (ours), or the baselines ``least_loaded`` and ``round_robin``."""

    def initialize_state(self, mode: str = "cache_aware", **kwargs: object) -> None:
        self.mode = mode
        self._rr = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        mode = getattr(self, "mode", "cache_aware")
        if mode == "round_robin":
            ids = sorted(by_id)
            self._rr += 1
            return [[by_id[ids[(self._rr + i) % len(ids)]]] for i in range(len(ids))]
        by_load = sorted(by_id, key=lambda rid: (routing_state.VIEW.load(rid), rid))
        backend = backend_of(self._deployment_id.name)
        policy = routing_state.VIEW.policies.get(backend) if mode == "cache_aware" else None
        req = _generate_request(pending_request)
        if policy is None or req is None:
            return [[by_id[rid]] for rid in by_load]
        view = routing_state.VIEW
        cap = view.backends[backend].max_in_flight_per_replica
        key = req.route_key
        view.pending.pop(key, None)  # a retried choice replaces its earlier one
        pending = Counter(view.pending.values())
        now = time.monotonic()
        ejector = view.breakers.replicas(backend)
        ejector.sync(list(by_id))
        routable = set(ejector.routable(now))
        # A hedge or retry avoids the replicas its earlier attempts went to (unless none is left).
        avoid = set(req.exclude_replicas) if set(by_id) - set(req.exclude_replicas) else set()
        loads = []
        for rid in by_id:
            load = view.replica_load(rid, cap, pending)
            if rid not in routable or rid in avoid:
                load.healthy = False
            loads.append(load)
        hashes = view.hashes.get((req.request_id, backend), [])
        decision = policy.decide(hashes, loads, view.rng, now, None if avoid else req.session_id)
        view.decisions[key] = decision
        if decision.replica is None:  # every replica at its cap: let Ray queue on the least loaded
            return [[by_id[rid]] for rid in by_load if rid not in avoid] + [[by_id[rid]] for rid in avoid]
        view.pending[key] = decision.replica
        rest = [rid for rid in by_load if rid != decision.replica]
        return [[by_id[decision.replica]]] + [[by_id[rid]] for rid in rest]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        rid = replica_id.unique_id
        routing_state.VIEW.in_flight[rid] += 1
        req = _generate_request(pending_request)
        if req is None:
            return
        routing_state.VIEW.pending.pop(req.route_key, None)
        routing_state.VIEW.routed[req.route_key] = rid
        backend = backend_of(self._deployment_id.name)
        policy = routing_state.VIEW.policies.get(backend)
        decision = routing_state.VIEW.decisions.get(req.route_key)
        if policy is not None:
            mode = getattr(self, "mode", "cache_aware")
            if mode != "cache_aware":
                reason = mode  # a baseline policy chose: count it under its own name
            elif decision is not None and decision.replica == rid:
                reason = decision.reason
            else:
                reason = "queue_fallback"  # our choice's queue was full: Ray took the next rank
            routing_state.VIEW.decision_counts[(backend, reason)] += 1
            metrics.ROUTING.inc(tags={"backend": backend, "reason": reason})
            policy.record(
                rid,
                routing_state.VIEW.hashes.get((req.request_id, backend), []),
                time.monotonic(),
                req.session_id,
            )

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        routing_state.VIEW.in_flight[rid] -= 1
        if routing_state.VIEW.in_flight[rid] <= 0:
            del routing_state.VIEW.in_flight[rid]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        live = {r.replica_id.unique_id for r in replicas}
        gone = {r.unique_id for r in self._replica_id_set} - live
        super().update_replicas(replicas)
        self._forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget({replica_id.unique_id})

    def _forget(self, replicas: set[str]) -> None:
        """A replica left or died: its index entries go; its sessions move on their next request."""
        policy = routing_state.VIEW.policies.get(backend_of(self._deployment_id.name))
        for rid in replicas:
            routing_state.VIEW.in_flight.pop(rid, None)
            routing_state.VIEW.stats.pop(rid, None)
            if policy is not None:
                policy.remove_replica(rid)


def _generate_request(pending: PendingRequest | None) -> GenerateRequest | None:
    if pending is None or not pending.args:
        return None
    arg = pending.args[0]
    return arg if isinstance(arg, GenerateRequest) else None
