"""SLO-aware admission: lower-priority work on a backend is capped while Tab's recent TTFT nears its
objective, raised again as Tab recovers, and uncapped as soon as Tab is quiet."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import SurfaceConfig
from cluster.policy.admission import AdmissionController, Queued, Rejection, Ticket
from cluster.policy.guard_caps import GuardCaps
from cluster.policy.slo_guard import SloGuard, SloGuardConfig, guarded_backends

SURFACES = {"tab": (0, 0.1), "chat": (1, 1.0), "agent": (2, 3.0)}
CFG = SloGuardConfig(min_samples=2, quiet_s=2.0, increase_step=2, decrease_factor=0.5)


def guard() -> SloGuard:
    return SloGuard(CFG, SURFACES, ["gpu"])


def tab_ttfts(g: SloGuard, now: float, *ttfts_s: float) -> None:
    g.arrived("tab", now)
    for t in ttfts_s:
        g.observe("tab", "gpu", t, now)


def test_only_the_top_priority_surface_is_protected() -> None:
    g = guard()
    assert set(g.slo_s) == {"tab"} and g.deferrable == {"chat", "agent"}
    g.arrived("agent", 0.0)
    g.observe("agent", "gpu", 99.0, 0.0)  # not protected: never a reason to cap
    assert g.update(0.1, {"gpu": 10}, {"gpu": 64}) == {"gpu": None}


def test_pressure_halves_then_recovery_raises_then_quiet_lifts() -> None:
    g = guard()
    tab_ttfts(g, 1.0, 0.05, 0.09)  # p90 0.09 s: 90 % of 100 ms
    assert g.update(1.0, {"gpu": 16}, {"gpu": 64}) == {"gpu": 8}
    assert g.last["gpu"].reason == "pressure"
    # The same samples do not cut again: only samples after a change count.
    assert g.update(1.5, {"gpu": 8}, {"gpu": 64}) == {"gpu": 8}
    tab_ttfts(g, 2.0, 0.085, 0.09)
    assert g.update(2.0, {"gpu": 8}, {"gpu": 64}) == {"gpu": 4}
    tab_ttfts(g, 2.5, 0.02, 0.03)  # well under half the objective
    assert g.update(2.5, {"gpu": 4}, {"gpu": 64}) == {"gpu": 6}
    assert g.last["gpu"].reason == "recovered"
    tab_ttfts(g, 3.0, 0.06, 0.065)  # between the fractions: hold
    assert g.update(3.0, {"gpu": 6}, {"gpu": 64}) == {"gpu": 6}
    # Tab goes quiet: the cap goes at once, spare capacity is Agent's again.
    assert g.update(5.0, {"gpu": 6}, {"gpu": 64}) == {"gpu": None}
    assert g.last["gpu"].reason == "quiet"
    # The status page's record of the changes: the two cuts and the raise, holds and quiet left out.
    changes = g.recent_changes(6.0)
    assert [(c["age_s"], c["reason"], c["cap"], c["samples"]) for c in changes] == [
        (5.0, "pressure", 8, 2),
        (4.0, "pressure", 4, 2),
        (3.5, "recovered", 6, 2),
    ]
    assert changes[0]["quantile_ratio"] == pytest.approx(0.9)


def test_by_default_one_slow_first_token_is_not_pressure() -> None:
    """The default asks for 10 samples, the fewest whose 0.9 quantile is not their slowest one: a
    CI lab run at 7ab7e4d had a new gateway halve Chat's cap on 4 samples (then the default), one
    of them 105 ms, and refuse 287 Chat requests in the 2.5 s before it recovered."""
    g = SloGuard(SloGuardConfig(), SURFACES, ["gpu"])
    tab_ttfts(g, 1.0, 0.02, 0.02, 0.02, 0.105)
    assert g.update(1.0, {"gpu": 4}, {"gpu": 64}) == {"gpu": None}  # too few to judge
    tab_ttfts(g, 1.5, *[0.02] * 6)
    assert g.update(1.5, {"gpu": 4}, {"gpu": 64}) == {"gpu": None}  # 10: one slow of ten is a tail
    assert g.last["gpu"].quantile_ratio == pytest.approx(0.2)  # judged: the 0.9 quantile is 20 ms
    tab_ttfts(g, 2.0, 0.105)
    assert g.update(2.0, {"gpu": 4}, {"gpu": 64}) == {"gpu": 2}  # two of eleven: the 0.9 quantile


def test_the_cap_goes_once_it_no_longer_binds_or_reaches_the_static_limit() -> None:
    g = guard()
    tab_ttfts(g, 1.0, 0.09, 0.09)
    assert g.update(1.0, {"gpu": 4}, {"gpu": 4}) == {"gpu": 2}
    tab_ttfts(g, 1.5, 0.01, 0.01)
    assert g.update(1.5, {"gpu": 2}, {"gpu": 4}) == {"gpu": None}  # 4: the static limit
    g2 = guard()
    tab_ttfts(g2, 1.0, 0.09, 0.09)
    assert g2.update(1.0, {"gpu": 20}, {"gpu": None}) == {"gpu": 10}
    tab_ttfts(g2, 1.5, 0.01, 0.01)
    assert g2.update(1.5, {"gpu": 3}, {"gpu": None}) == {"gpu": None}  # demand fell under the cap


def test_disabled_never_caps() -> None:
    g = SloGuard(SloGuardConfig(enabled=False, min_samples=1), SURFACES, ["gpu"])
    tab_ttfts(g, 1.0, 5.0, 5.0)
    assert g.update(1.0, {"gpu": 16}, {"gpu": 64}) == {"gpu": None}


def _surf(name: str, priority: int) -> SurfaceConfig:
    return SurfaceConfig(name=name, priority=priority, max_concurrency=100, max_queue=100)


def test_admission_defers_capped_work_and_resumes_it_when_the_cap_lifts() -> None:
    c = AdmissionController([_surf("tab", 0), _surf("agent", 2)], {"gpu": 100}, queue_while_capped=True)
    agents = [c.try_admit("agent", 0.0, ["gpu"]) for _ in range(4)]
    assert all(isinstance(t, Ticket) for t in agents)
    assert c.deferred_in_flight() == {"gpu": 4} and c.backend_cap("gpu") == 100
    assert c.set_guard_caps({"gpu": 2}, 0.1) == ([], [])
    deferred = c.try_admit("agent", 0.2, ["gpu"])
    assert isinstance(deferred, Queued)  # 4 in flight > cap 2: waits
    assert isinstance(c.try_admit("tab", 0.2, ["gpu"]), Ticket)  # Tab is never capped
    for t in agents[:2]:
        assert c.release(t, "completed", 0.3) == []  # 3, then 2 in flight: still at the cap
    admitted = c.release(agents[2], "completed", 0.4)
    assert [t.id for t in admitted] == [deferred.id]  # 1 in flight < 2: the waiter goes
    queued = c.try_admit("agent", 0.5, ["gpu"])
    assert isinstance(queued, Queued)
    admitted, rejected = c.set_guard_caps({"gpu": None}, 0.6)
    assert [t.id for t in admitted] == [queued.id] and rejected == []  # lifted: resumes
    assert c.counters().balanced()


def _agent_busy_on_gpu(c: AdmissionController, running: int) -> None:
    """Three Agent requests of 1 s each on ``gpu`` (the wait estimate's durations), then
    ``running`` more admitted there at 10 s."""
    for i in range(3):
        t = c.try_admit("agent", float(i), ["gpu"])
        assert isinstance(t, Ticket)
        c.release(t, "completed", i + 1.0)
    for _ in range(running):
        assert isinstance(c.try_admit("agent", 10.0, ["gpu"]), Ticket)


def test_a_lowered_cap_rejects_at_once_the_waiters_it_puts_past_their_deadline() -> None:
    agent = SurfaceConfig(
        name="agent", priority=2, max_concurrency=100, max_queue=100, queue_deadline_ms=1500
    )
    c = AdmissionController([_surf("tab", 0), agent], {"gpu": 100}, queue_while_capped=True)
    _agent_busy_on_gpu(c, running=4)
    c.set_guard_caps({"gpu": 4}, 10.0)
    waiters = [c.try_admit("agent", 10.0, ["gpu"]) for _ in range(3)]
    assert all(isinstance(w, Queued) for w in waiters)  # 4 slots free in 1 s: all fit
    # Cap cut to 2: the first two completions free nothing, so slots come at 1, 1, 2 s.
    assert c.predicted_wait_s("agent", 10.0) == 1.0  # before the cut: a 4th waiter at 1 s
    admitted, rejected = c.set_guard_caps({"gpu": 2}, 10.0)
    assert admitted == [] and [r.entry_id for r in rejected] == [waiters[2].id]
    assert rejected[0].reason == "predicted_wait" and rejected[0].error.status_code == 429
    n = c.counters("agent")
    assert (n.rejected_unreachable, n.waiting) == (1, 2) and n.balanced()


def test_each_deferrable_surface_keeps_its_floor_under_a_cap_another_surface_fills() -> None:
    """A cap of 1 held by a long Agent stream: with a floor of 1 per surface Chat still starts one
    request (it waited behind the stream to its deadline before, a 429 in CI's smoke run); a
    second Chat request and a second Agent one wait."""
    surfaces = [_surf("tab", 0), _surf("chat", 1), _surf("agent", 2)]
    c = AdmissionController(surfaces, {"gpu": 100}, guard_floor=1, queue_while_capped=True)
    stream = c.try_admit("agent", 0.0, ["gpu"])
    assert isinstance(stream, Ticket)
    c.set_guard_caps({"gpu": 1}, 0.1)
    chat = c.try_admit("chat", 0.2, ["gpu"])
    assert isinstance(chat, Ticket)  # Chat's own in flight (0) is under the floor
    assert c.deferred_in_flight() == {"gpu": 2}
    assert isinstance(c.try_admit("chat", 0.2, ["gpu"]), Queued)
    assert isinstance(c.try_admit("agent", 0.2, ["gpu"]), Queued)
    admitted = c.release(chat, "completed", 0.3)  # Chat back under its floor: its waiter goes
    assert [t.surface for t in admitted] == ["chat"]
    without = AdmissionController(
        surfaces, {"gpu": 100}, queue_while_capped=True
    )  # floor 0: the cap binds alone
    assert isinstance(without.try_admit("agent", 0.0, ["gpu"]), Ticket)
    without.set_guard_caps({"gpu": 1}, 0.1)
    assert isinstance(without.try_admit("chat", 0.2, ["gpu"]), Queued)


def test_guard_caps_skip_counts_only_completions_that_free_nothing() -> None:
    g = GuardCaps({"chat", "agent"}, floor=1)
    for _ in range(5):
        g.count("gpu", "agent", +1)
    g.count("gpu", "chat", +1)
    g.set({"gpu": 2})
    assert g.skip("tab") == 0  # protected: never capped
    assert g.skip("chat") == 0  # Chat's one completion puts it under its floor
    assert g.skip("agent") == 4  # 6 in flight, cap 2: 4 of Agent's 5 free nothing, the 5th does
    assert not g.has_room("gpu", "agent") and not g.has_room("gpu", "chat")
    assert g.has_room("gpu", "tab") and g.has_room("cpu", "agent")  # uncapped backend
    assert g.set({"gpu": 1}) and not g.set({"gpu": 3}) and g.set({"gpu": None}) is False


def test_a_gateway_that_saw_no_tab_caps_agent_from_the_engines_own_ttft() -> None:
    """Two gateway replicas: only A's clients send Tab, B takes the Agent flood. Without the
    engines' samples B saw Tab quiet and admitted Agent up to the static limit."""
    a, b = guard(), guard()
    tab_ttfts(a, 1.0, 0.09, 0.095)
    slow_tab = [(1, 0.2, 0, 0.09), (2, 0.1, 0, 0.095), (3, 0.05, 2, 2.5)]  # (seq, age, priority, ttft)
    assert b.update(1.0, {"gpu": 16}, {"gpu": 64}) == {"gpu": None}  # alone: Tab looks quiet
    assert b.absorb("gpu", "replica-1", slow_tab, 1.0) == 2  # the Agent sample is not Tab's
    assert a.absorb("gpu", "replica-1", slow_tab, 1.0) == 2
    assert b.update(1.0, {"gpu": 16}, {"gpu": 64}) == {"gpu": 8}
    assert a.update(1.0, {"gpu": 16}, {"gpu": 64}) == {"gpu": 8}  # the same decision on both
    assert b.last["gpu"].reason == "pressure"


def test_an_engine_sample_read_twice_counts_once_and_a_gone_replica_is_forgotten() -> None:
    g = guard()
    report = [(1, 0.3, 0, 0.02), (2, 0.2, 0, 0.03)]
    assert g.absorb("gpu", "r1", report, 1.0) == 2
    assert g.absorb("gpu", "r1", report, 1.5) == 0  # pushed again with the next stats
    assert g.absorb("gpu", "r1", [*report, (3, 0.0, 0, 0.04)], 1.5) == 1
    assert g.absorb("gpu", "r2", report, 1.5) == 2  # another replica numbers its own
    assert g.absorb("nope", "r1", report, 1.5) == 0  # not a backend of this guard
    g.forget_replicas("gpu", ["r2"])
    assert g.absorb("gpu", "r1", report, 2.0) == 2  # a replica seen anew starts afresh


def test_by_default_work_the_guard_keeps_off_every_backend_is_refused_at_once() -> None:
    """No waiting behind a binding cap: a 429 with Retry-After at once (counted as ``guard``);
    a backend the guard leaves room on, or a static cap, still takes or queues the request."""
    c = AdmissionController([_surf("tab", 0), _surf("agent", 2)], {"gpu": 100, "cpu": 1})
    _agent_busy_on_gpu(c, running=2)
    c.set_guard_caps({"gpu": 2}, 10.0)
    r = c.try_admit("agent", 10.1, ["gpu"])
    assert isinstance(r, Rejection) and r.reason == "guard" and r.error.status_code == 429
    assert r.error.retry_after_s == pytest.approx(0.9)  # the first slot frees when a 1 s request ends
    assert isinstance(c.try_admit("tab", 10.1, ["gpu"]), Ticket)  # the protected surface: never
    # Another candidate with room takes it; one full by its static cap makes it queue instead.
    other = c.try_admit("agent", 10.1, ["gpu", "cpu"])
    assert isinstance(other, Ticket) and other.backend == "cpu"
    assert isinstance(c.try_admit("agent", 10.2, ["gpu", "cpu"]), Queued)
    n = c.counters("agent")
    assert (n.rejected_guard, n.queued, n.waiting) == (1, 1, 1) and n.balanced()


def test_precheck_refuses_before_parsing_when_the_guard_binds_on_every_backend() -> None:
    """The gateway's precheck (before the body is parsed and tokenized) gives the same ``guard``
    refusal when no backend at all has room for the surface under the guard; one backend the
    guard leaves room on, or ``queue_while_capped``, lets the request go on to admission."""
    c = AdmissionController([_surf("tab", 0), _surf("agent", 2)], {"gpu": 100, "cpu": 100})
    for b in ("gpu", "cpu"):
        assert isinstance(c.try_admit("agent", 0.0, [b]), Ticket)
    c.set_guard_caps({"gpu": 1}, 0.1)
    assert c.precheck("agent", 0.2) is None  # cpu is uncapped
    c.set_guard_caps({"gpu": 1, "cpu": 1}, 0.3)
    r = c.precheck("agent", 0.4)
    assert isinstance(r, Rejection) and r.reason == "guard" and r.error.retry_after_s
    assert c.precheck("tab", 0.4) is None  # the protected surface is never deferred
    assert c.counters("agent").rejected_guard == 1
    queueing = AdmissionController(
        [_surf("tab", 0), _surf("agent", 2)], {"gpu": 100}, queue_while_capped=True
    )
    assert isinstance(queueing.try_admit("agent", 0.0, ["gpu"]), Ticket)
    queueing.set_guard_caps({"gpu": 1}, 0.1)
    assert queueing.precheck("agent", 0.2) is None


def test_a_guard_refusal_asks_for_a_retry_when_the_cap_is_revised_not_after_the_queue() -> None:
    """Admission's estimate is the queue's wait (15-30 s in the rehearsals, where the caps lasted
    0.5-2.5 s): a 429 the guard's cap gave says at most ``guard_retry_after_s``; any other 429
    keeps its estimate."""
    agent = SurfaceConfig(
        name="agent", priority=2, max_concurrency=100, max_queue=100, queue_deadline_ms=30_000
    )
    c = AdmissionController([_surf("tab", 0), agent], {"gpu": 100}, guard_retry_after_s=2.0)
    for _ in range(40):  # an agent backlog, no completion yet: the estimate is its queue deadline
        assert isinstance(c.try_admit("agent", 0.0, ["gpu"]), Ticket)
    c.set_guard_caps({"gpu": 2}, 1.0)
    for _ in range(3):
        assert isinstance(c.try_admit("tab", 1.0, ["gpu"]), Ticket)
    r = c.try_admit("agent", 1.1, ["gpu"])
    assert isinstance(r, Rejection) and r.reason == "guard"
    assert 0 < r.error.retry_after_s <= 2.0
    unbounded = AdmissionController([_surf("tab", 0), agent], {"gpu": 100}, guard_retry_after_s=1e9)
    for _ in range(40):
        assert isinstance(unbounded.try_admit("agent", 0.0, ["gpu"]), Ticket)
    unbounded.set_guard_caps({"gpu": 2}, 1.0)
    r2 = unbounded.try_admit("agent", 1.1, ["gpu"])
    assert isinstance(r2, Rejection) and r2.error.retry_after_s == pytest.approx(30.0)  # the deadline


def test_providers_are_never_guarded() -> None:
    """A provider's TTFT does not depend on our deferrable work there: only the engines are guarded.
    The rehearsal's upgrade: a loopback provider's steady 100 ms first token held Tab's p90 at its
    objective, the provider stayed capped and a Chat request it could have served got a 429."""
    from cluster.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs/gpu.yaml")
    assert guarded_backends(cfg.backends) == ["vllm-llama-8b"]
    g = SloGuard(CFG, SURFACES, ["gpu"])  # the gateway passes guarded_backends(cfg.backends)
    c = AdmissionController([_surf("tab", 0), _surf("agent", 2)], {"gpu": 100, "openai": 100})
    for b in ("gpu", "openai", "openai"):
        assert isinstance(c.try_admit("agent", 0.0, [b]), Ticket)
    g.arrived("tab", 0.0)
    for b in ("gpu", "openai"):
        for _ in range(4):
            g.observe("tab", b, 0.1, 0.0)  # Tab at its objective on both
    caps = g.update(0.5, c.deferred_in_flight(), {"gpu": 100, "openai": 100})
    assert caps == {"gpu": 1}  # pressure on the engine; the provider is not the guard's
    c.set_guard_caps(caps, 0.5)
    assert c.precheck("agent", 0.6) is None
    got = c.try_admit("agent", 0.6, ["openai", "gpu"])
    assert isinstance(got, Ticket) and got.backend == "openai"
    r = c.try_admit("agent", 0.6, ["gpu"])  # the engine alone: deferred, as before
    assert isinstance(r, Rejection) and r.reason == "guard"


def test_waiters_queued_before_any_estimate_are_checked_once_there_is_one() -> None:
    """A cold start into a flood: the first waiters queue with no wait estimate (no request has
    ended yet). Once three have ended, the next guard tick (caps unchanged) rejects at once those
    whose slot comes after their deadline; they used to wait it out (bench_overload_shared's
    vLLM leg straight at 3x: 36 Agent refusals after the 5 s deadline)."""
    agent = SurfaceConfig(name="agent", priority=2, max_concurrency=4, max_queue=100, queue_deadline_ms=1500)
    c = AdmissionController([_surf("tab", 0), agent], {"gpu": 100})
    running = [c.try_admit("agent", 0.0, ["gpu"]) for _ in range(4)]
    assert all(isinstance(t, Ticket) for t in running)
    waiters = [c.try_admit("agent", 0.1, ["gpu"]) for _ in range(8)]
    assert all(isinstance(w, Queued) for w in waiters)  # no estimate: all queue
    assert c.set_guard_caps({"gpu": None}, 0.2) == ([], [])  # still none: nothing to check
    for t in running[:3]:  # three 1 s requests end: the estimate is 1 s per slot
        c.release(t, "completed", 1.0)
    c.release(running[3], "completed", 1.0)
    # The 4 slots freed at 1.0 went to waiters 0-3 (in flight since then); waiters 4-7 would get
    # the next ones at 2.0, after their deadline (queued at 0.1 + 1.5 s = 1.6).
    admitted, rejected = c.set_guard_caps({"gpu": None}, 1.1)
    assert admitted == []
    assert sorted(r.entry_id for r in rejected) == sorted(w.id for w in waiters[4:])
    assert all(r.reason == "predicted_wait" and r.error.status_code == 429 for r in rejected)
    n = c.counters("agent")
    assert (n.rejected_unreachable, n.waiting, n.in_flight) == (4, 0, 4) and n.balanced()
    # Checked once: later ticks with unchanged caps re-check nothing new.
    assert c.set_guard_caps({"gpu": None}, 1.2) == ([], [])
