"""The engine deployments' Serve ``RequestRouter``: a shim. The gateway asks Serve to choose a
replica (``DeploymentHandle.choose_replica``) with a routing payload from
:mod:`deployments.gateway.engine_client`; Serve calls this router in the gateway's own process with the
live replica list, and the payload's routing view decides. Serve keeps owning replica
lifecycle, health checks and autoscaling; the decision and its state live in
:class:`cluster.routing.view.BackendView`, one object, owned by the gateway.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class ShimRequestRouter(RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        payload = pending_request.args[0] if pending_request is not None and pending_request.args else None
        decide = getattr(payload, "decide", None)
        if decide is None:  # not a gateway's attempt (a direct handle call): any replica will do
            return [candidate_replicas]
        return decide(candidate_replicas)
