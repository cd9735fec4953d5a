"""The replica choice while Serve lists no replica of an engine deployment (its only replica's
node lost, or every replica restarting in an upgrade): Serve's router then holds an ask without
bound and never calls ours. An attempt goes elsewhere at once when another candidate can take the
request, and otherwise waits there for the replacement (never a 503 for a gap Serve will fill).
Serve's router is stood in for by a small object with its behaviour on an empty list."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from cluster.policy.failover import ReplicaEjector
from cluster.routing.view import BackendView, ReplicaInfo
from cluster.wire.errors import NoCapacity
from deployments.gateway import engine_client, router_state
from deployments.gateway.engine_client import ReplicaPicker


@dataclass(frozen=True)
class _Id:
    unique_id: str


@dataclass
class _Replica:
    replica_id: _Id
    routing_stats: dict[str, Any] = field(default_factory=dict)


class _Serve:
    """Serve's router for deployment ``eng``: holds an ask while it lists no replica (as
    ``_choose_replicas_with_backoff`` does), else runs the payload on its list; every list it
    gets is recorded where the shim records it."""

    deployment_name = "eng"

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.replicas: list[_Replica] = []
        self.updated = asyncio.Event()
        self.asks = 0
        monkeypatch.setitem(router_state.LISTED, self.deployment_name, 0)

    def update(self, *names: str) -> None:
        self.replicas = [_Replica(_Id(n), {"url": f"http://{n}:1"}) for n in names]
        router_state.LISTED[self.deployment_name] = len(self.replicas)
        self.updated.set()

    @contextlib.asynccontextmanager
    async def choose_replica(self, pick: Any, _reserve: bool) -> AsyncIterator[None]:
        self.asks += 1
        while not self.replicas:
            self.updated.clear()
            await self.updated.wait()
        pick.decide(self.replicas)
        yield


def _picker(serve: _Serve) -> ReplicaPicker:
    view = BackendView("eng", None, ReplicaEjector(), 8, mode="least_loaded")
    view.synced = True  # it served before: no start-up grace
    return ReplicaPicker(serve, view)


@pytest.fixture(autouse=True)
def _short_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_client, "ASK_SLICE_S", 0.05)


async def test_goes_elsewhere_at_once_when_serve_lists_none(monkeypatch: pytest.MonkeyPatch) -> None:
    serve = _Serve(monkeypatch)
    picker = _picker(serve)
    assert picker.unlisted() and not picker.ready(time.monotonic())
    t0 = time.monotonic()
    with pytest.raises(NoCapacity) as err:
        await picker.pick([], None, [], elsewhere=lambda: True)
    assert time.monotonic() - t0 < 0.05  # not even one slice: Serve's list was known empty
    assert serve.asks == 0 and err.value.backend == "eng" and err.value.retry_after_s >= 1


async def test_waits_for_the_replacement_past_the_queue_deadline_when_nothing_else_can(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    serve = _Serve(monkeypatch)
    picker = _picker(serve)
    task = asyncio.ensure_future(picker.pick([], None, [], wait_until=time.monotonic()))
    await asyncio.sleep(0.3)  # six slices, the queue deadline long past: still waiting, no 503
    assert not task.done() and serve.asks >= 3
    serve.update("new")  # the upgrade's new replica runs
    lease = await asyncio.wait_for(task, 1)
    assert lease.replica == "new" and picker.ready(time.monotonic())
    lease.close()


async def test_a_wait_ends_when_another_candidate_becomes_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    serve = _Serve(monkeypatch)
    picker = _picker(serve)
    other = {"ready": False}
    task = asyncio.ensure_future(picker.pick([], None, [], elsewhere=lambda: other["ready"]))
    await asyncio.sleep(0.12)
    assert not task.done()
    other["ready"] = True  # e.g. the other engine backend's replica came back first
    with pytest.raises(NoCapacity):
        await asyncio.wait_for(task, 0.5)


async def test_listed_replicas_none_reachable_fail_over_at_once_with_somewhere_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A continuation after its replica's node died, before Serve drops that replica: the listed
    replica refused the connection (marked unreachable), so the attempt goes to the other backend
    at once; with nowhere else it waits its queue deadline, then gets the 503."""
    serve = _Serve(monkeypatch)
    serve.update("dead")
    picker = _picker(serve)
    picker.view.sync([ReplicaInfo("dead", "http://dead:1", 0, 0.0)])
    picker.view.mark_unreachable("dead", time.monotonic())
    t0 = time.monotonic()
    with pytest.raises(NoCapacity):
        await asyncio.wait_for(picker.pick([], None, [], elsewhere=lambda: True), 0.5)
    assert time.monotonic() - t0 < 0.05
    with pytest.raises(NoCapacity):
        await asyncio.wait_for(picker.pick([], None, [], wait_until=time.monotonic() + 0.2), 1)
    assert time.monotonic() - t0 >= 0.2


def test_the_router_serve_pickles_by_value_shares_the_payload_type_and_the_listing() -> None:
    """Serve pickles a custom request router by value (``RequestRouterConfig`` registers its module
    with ``cloudpickle.register_pickle_by_value``): in the gateway's process the router's own
    module-level objects are copies. Serialized in another process exactly as Serve does it, the
    router must still recognise the gateway's payload (a copied class did not: every ask spun
    without a decision and the gateway stopped answering its health checks) and write the listing
    the gateway reads (a copied dict never reached ``listed()``)."""
    import base64
    import subprocess
    import sys

    from ray import cloudpickle

    from cluster.dataplane import SHIM_ROUTER
    from deployments.gateway.engine_client import _Pick

    code = (
        "import base64, sys; from ray.serve.config import RequestRouterConfig; "
        f"c = RequestRouterConfig(request_router_class={SHIM_ROUTER!r}); "
        "sys.stdout.write(base64.b64encode(c.get_serialized_request_router_cls()).decode())"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=99, check=True)
    shim = cloudpickle.loads(base64.b64decode(run.stdout))
    assert shim.choose_replicas.__globals__["router_state"] is router_state  # by reference: shared

    class _Pending:
        def __init__(self, payload: object) -> None:
            self.args = [payload]

    view = BackendView("eng", None, ReplicaEjector(), 8, mode="least_loaded")
    pick = _Pick(view, [], None, [])
    replica = _Replica(_Id("r1"), {"url": "http://r1:1"})
    chosen = asyncio.run(shim.choose_replicas(None, [replica], _Pending(pick)))
    assert pick.asked and pick.choice is not None and chosen == [[replica]]
    assert asyncio.run(shim.choose_replicas(None, [replica], _Pending("not ours"))) == [[replica]]
