"""The engine deployments' Serve ``RequestRouter``: a shim. The gateway asks Serve to choose a
replica (``DeploymentHandle.choose_replica``) with a routing payload from
:mod:`deployments.gateway.engine_client`; Serve calls this router in the gateway's own process with the
live replica list, and the payload's routing view decides. Serve keeps owning replica
lifecycle, health checks and autoscaling; the decision and its state live in
:class:`cluster.routing.view.BackendView`, one object, owned by the gateway.

Serve pickles this module by value: what it shares with the gateway (the payload's type, the
replicas listed) lives in :mod:`deployments.gateway.router_state`, reached through that module.
"""

from __future__ import annotations

from ray.serve._private.common import ReplicaID
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deployments.gateway import router_state


class ShimRequestRouter(RequestRouter):  # type: ignore[misc]  # Ray's types are skipped: Any
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        router_state.LISTED[self._deployment_id.name] = len(self._replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        router_state.LISTED[self._deployment_id.name] = len(self._replicas)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        payload = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(payload, router_state.RoutingAsk):  # not a gateway's attempt (a handle call)
            return [candidate_replicas]  # any replica will do
        return payload.decide(candidate_replicas)
