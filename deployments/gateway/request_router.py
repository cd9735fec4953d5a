"""The engine deployments' Serve ``RequestRouter``: a shim. The gateway asks Serve to choose a
replica (``DeploymentHandle.choose_replica``) with a routing payload from
:mod:`deployments.gateway.engine_client`; Serve calls this router in the gateway's own process with the
live replica list, and the payload's routing view decides. Serve keeps owning replica
lifecycle, health checks and autoscaling; the decision and its state live in
:class:`cluster.routing.view.BackendView`, one object, owned by the gateway.
"""

from __future__ import annotations

from ray.serve._private.common import ReplicaID
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# Replicas Serve's routers in this process list, by deployment name: written only by the routers
# below as Serve updates them, read through :func:`listed`.
_LISTED: dict[str, int] = {}


class RoutingAsk:
    """The gateway's routing payload (:class:`deployments.gateway.engine_client` makes it): its
    decision over the replicas Serve lists, the replicas to try, best first."""

    __slots__ = ()

    def decide(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        raise NotImplementedError


def listed(deployment: str) -> int | None:
    """How many replicas Serve lists for ``deployment`` in this process (None: no router has
    heard yet). At 0 Serve's router holds every ask without calling ours
    (``_choose_replicas_with_backoff`` waits for an update): a lost node's only replica, or every
    replica restarting in an upgrade."""
    return _LISTED.get(deployment)


class ShimRequestRouter(RequestRouter):  # type: ignore[misc]  # Ray's types are skipped: Any
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        _LISTED[self._deployment_id.name] = len(self._replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        _LISTED[self._deployment_id.name] = len(self._replicas)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        payload = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(payload, RoutingAsk):  # not a gateway's attempt (a direct handle call)
            return [candidate_replicas]  # any replica will do
        return payload.decide(candidate_replicas)
