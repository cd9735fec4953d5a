"""No capacity (issue 40 item 3), the pure parts: a backend's view never picks a replica whose
engine is known dead (its own health report, a refused connection), says when none can take a
request, estimates when a replacement will; the candidates that can serve go first."""

from __future__ import annotations

from cluster.policy.attempts import by_capacity
from cluster.policy.failover import ReplicaEjector, counts_against_backend
from cluster.routing.view import BackendView, Outage, ReplicaInfo
from cluster.wire.errors import NoCapacity, Overloaded


def _view(*infos: ReplicaInfo) -> BackendView:
    v = BackendView("b", None, ReplicaEjector(), 8, mode="least_loaded")
    v.sync(list(infos))
    return v


def test_an_unhealthy_or_unreachable_replica_is_never_chosen() -> None:
    v = _view(ReplicaInfo("a", "http://a"), ReplicaInfo("b", "http://b", healthy=False))
    assert all(v.choose([], 0.0).replica == "a" for _ in range(5))
    v.mark_unreachable("a", now=10.0, hold_s=5.0)
    assert v.serving(11.0) == [] and v.choose([], 11.0) is None  # none can take it: no pick at all
    assert v.choose([], 15.5).replica == "a"  # the hold ran out: tried again


def test_an_unknown_or_gone_replica_is_not_held() -> None:
    v = _view(ReplicaInfo("a", "http://a"))
    v.mark_unreachable("zz", now=0.0)
    assert v.unreachable == {}
    v.mark_unreachable("a", now=0.0)
    v.sync([ReplicaInfo("c", "http://c")])  # Serve dropped it
    assert v.unreachable == {} and v.serving(1.0) == ["c"]


def test_synced_only_once_an_endpoint_was_published() -> None:
    v = BackendView("b", None, ReplicaEjector(), 8)
    v.sync([ReplicaInfo("a", None)])
    assert not v.synced
    v.sync([ReplicaInfo("a", "http://a")])
    v.sync([])
    assert v.synced and v.serving(0.0) == []


def test_the_outage_estimate_counts_down_and_learns_the_last_outage() -> None:
    o = Outage()
    o.note(False, 100.0)
    assert o.retry_after(105.0, typical_start_s=30.0) == 25.0
    assert o.retry_after(200.0, typical_start_s=30.0) == 1.0  # overdue: at least a second
    o.note(True, 112.0)  # served again after 12 s
    o.note(False, 300.0)
    assert o.retry_after(302.0, typical_start_s=30.0) == 10.0


def test_candidates_that_can_serve_go_first_in_their_order() -> None:
    up = {"prov": True, "vllm": False, "sim": True}
    assert by_capacity(["vllm", "prov", "sim"], up.__getitem__) == ["prov", "sim", "vllm"]
    assert by_capacity(["vllm"], up.__getitem__) == ["vllm"]  # nothing else: it waits for a replacement


def test_no_capacity_is_a_503_overloaded_that_opens_no_breaker() -> None:
    err = NoCapacity("none", retry_after_s=7.2, backend="b")
    assert isinstance(err, Overloaded) and err.status_code == 503 and err.code == "no_capacity"
    assert err.to_openai()["error"]["type"] == "overloaded_error"
    assert err.headers() == {"retry-after": "8"}
    assert not counts_against_backend(err)
