"""What the engine deployments' Serve router (:mod:`deployments.gateway.request_router`) shares with
the gateway's code in the same process: the routing payload's type and how many replicas Serve
lists per deployment.

Kept out of the router's own module on purpose. Serve pickles a custom request router *by value*
(``RequestRouterConfig._serialize_request_router_cls`` registers the router's module with
``cloudpickle.register_pickle_by_value``), so in the gateway's process the router's module-level
objects are copies: a class defined there is not the class the gateway instantiates, and a dict
defined there is not the dict the gateway reads. Objects of this module are pickled by reference
(the router reaches them through the module, ``router_state.X``), so both sides see the same ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.serve.request_router import RunningReplica

# Replicas Serve's routers in this process list, by deployment name: written only by the routers
# as Serve updates them, read through :func:`listed`.
LISTED: dict[str, int] = {}


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
    return LISTED.get(deployment)
