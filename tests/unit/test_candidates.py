"""The bounded candidate set of a cache-aware decision (cluster/routing/candidates.py, issue 42)."""

from __future__ import annotations

import random

from cluster.config import AffinityConfig
from cluster.engine.kv_events import BlocksQueued, IndexStored, KVEventBatch, KVEventPage
from cluster.policy.failover import ReplicaEjector
from cluster.routing.affinity import AffinityParams, AffinityRouter, ReplicaLoad
from cluster.routing.candidates import bounded_pool
from cluster.routing.view import BackendView, ReplicaInfo


def _view(n: int, k: int, new_prefix: str = "home") -> BackendView:
    params = AffinityParams(min_match_tokens=4, decision_candidates=k, new_prefix=new_prefix)  # type: ignore[arg-type]
    view = BackendView("b", AffinityRouter(4, "m", params), ReplicaEjector(), 64)
    view.sync([ReplicaInfo(f"r{i}", f"http://r{i}", kv_events=True, kv_blocks=1000) for i in range(n)])
    return view


def _page(*events: object) -> KVEventPage:
    return KVEventPage(0, [KVEventBatch(1, 0.0, tuple(events))], 0, False)  # type: ignore[arg-type]


def _run(view: BackendView, seed: int, steps: int) -> list[tuple[str, str, int]]:
    """Random traffic: shared and new prompts, sessions, stores by the events, ends; the choices."""
    rng, out, open_ = random.Random(seed), [], []
    contexts = [[rng.getrandbits(62) for _ in range(12)] for _ in range(6)]
    for i in range(steps):
        hashes = (contexts[rng.randrange(6)][: rng.randint(2, 12)] if rng.random() < 0.7 else []) + [
            rng.getrandbits(62) for _ in range(rng.randint(0, 4))
        ]
        session = f"s{rng.randrange(20)}" if rng.random() < 0.5 else None
        c = view.choose(hashes, float(i), session)
        assert c is not None
        view.started(c, hashes, float(i), session)
        view.apply_kv_page(c.replica, _page(IndexStored(hashes), BlocksQueued(hashes, session)), float(i))
        open_.append(c)
        if rng.random() < 0.6:
            done = open_.pop(rng.randrange(len(open_)))
            view.ended(done.replica, done)
        out.append((c.replica, c.decision.reason, c.decision.matched_blocks))
    return out


def test_at_or_below_k_replicas_the_decision_is_the_full_one() -> None:
    for new_prefix in ("home", "least_loaded"):
        bounded, full = _view(6, 8, new_prefix), _view(6, 0, new_prefix)
        assert _run(bounded, 3, 400) == _run(full, 3, 400)


def test_the_set_is_bounded_and_holds_the_session_holders_and_home() -> None:
    view = _view(200, 4)
    policy = view.policy
    assert policy is not None
    held = [11, 12, 13, 14]
    view.apply_kv_page("r150", _page(IndexStored(held)), 0.0)
    policy.sessions.bind("s", "r7", 0.0)
    up = view.serving(0.0)
    pool, fleet, probe = bounded_pool(policy, up, frozenset(up), 0, [*held, 99], 0.0, "s", view.rng)
    assert {"r150", "r7"} <= set(pool) and len(pool) <= 4 + 2  # must-considers, then 4 drawn
    assert fleet == (200, 0) and probe is not None and probe.blocks == 4
    homed = [21, 22, 23]  # a context homed on r42 whose blocks its engine evicted: its home joins
    view.apply_kv_page("r42", _page(BlocksQueued(homed, None)), None)  # no send noted: a home only
    pool, _, probe = bounded_pool(policy, up, frozenset(up), 0, homed, 0.0, None, view.rng)
    assert "r42" in pool and probe is not None and probe.home == (3, "r42")


def test_bounded_decisions_keep_the_prefix_session_and_home_of_a_large_fleet() -> None:
    view = _view(256, 4)
    held = [31, 32, 33, 34, 35]
    view.apply_kv_page("r200", _page(IndexStored(held)), 0.0)
    for i in range(50):  # whatever is drawn, the holder wins on its prefix
        c = view.choose([*held, 1000 + i], 1.0)
        assert c is not None and (c.replica, c.decision.reason) == ("r200", "prefix")
    view.apply_kv_page("r9", _page(BlocksQueued([41, 42], "agent")), 1.0)
    c = view.choose([41, 42, 43], 2.0, "agent")
    assert c is not None and (c.replica, c.decision.reason) == ("r9", "session")
    c = view.choose([41, 42, 43, 44], 2.0)
    assert c is not None and c.replica == "r9"  # its just-sent blocks count as held (recent)


def test_the_load_bound_moves_a_hot_holders_requests_in_a_large_fleet() -> None:
    view = _view(64, 4)
    held = [51, 52, 53, 54]
    view.apply_kv_page("r5", _page(IndexStored(held)), 0.0)
    for _ in range(20):  # r5 far above the fleet's average (20 of 20 in flight, the bound ~9)
        c = view.choose(held, 1.0)
        assert c is not None
        view.started(c, held, 1.0, None)
    in_flight = view.snapshot().in_flight
    assert in_flight.get("r5", 0) < 20  # the bound moved the later ones off the holder
    assert sum(in_flight.values()) == 20


def test_the_serving_list_follows_refusals_and_their_end() -> None:
    view = _view(3, 0)
    assert view.serving(0.0) == ["r0", "r1", "r2"]
    view.mark_unreachable("r1", 0.0, hold_s=5.0)
    assert view.serving(1.0) == ["r0", "r2"]
    assert view.serving(5.0) == ["r0", "r1", "r2"]  # the hold ended
    assert view.serving(1.0) == ["r0", "r2"]  # an earlier clock is read afresh
    view.sync([ReplicaInfo("r0", "http://r0")])
    assert view.serving(6.0) == ["r0"]


def test_the_config_knobs_reach_the_policy() -> None:
    params = AffinityParams(**AffinityConfig(decision_candidates=3, index_capacity_blocks=500).params())
    policy = AffinityRouter(16, "m", params)
    assert params.decision_candidates == 3 and policy.index.capacity == 500 and policy.homes.capacity == 500


def test_decide_bounds_load_by_the_fleet_it_is_given() -> None:
    policy = AffinityRouter(4, "m", AffinityParams(min_match_tokens=4, load_slack=0))
    policy.apply_kv_page("r5", _page(IndexStored([61, 62])), 0.0)
    policy.apply_kv_page("r6", _page(), 0.0)
    loads = [ReplicaLoad("r5", in_flight=3), ReplicaLoad("r6", in_flight=0)]
    rng = random.Random(0)
    assert policy.decide([61, 62], loads, rng, 1.0).replica == "r6"  # 3 of 3 in flight: over the bound
    busy_fleet = (64, 640)  # ten in flight on each replica outside the set: r5 is below the average
    assert policy.decide([61, 62], loads, rng, 1.0, fleet=busy_fleet).replica == "r5"
