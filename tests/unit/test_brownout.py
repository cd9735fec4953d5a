"""Brownout demotion (cluster/policy/brownout.py): a backend whose first tokens turn far slower
than its own baseline goes behind the other candidates, comes back through one probe at a time
once its hold is over, and is demoted for twice as long when the probe is slow too."""

from __future__ import annotations

import pytest

from cluster.policy.brownout import Brownout, BrownoutConfig

CANDS = ["provider", "engine"]


def steady(b: Brownout, now: float = 0.0, ttft: float = 0.1, n: int = 20) -> None:
    for i in range(n):
        b.observe("tab", "provider", ttft, now + i * 0.01)
        b.observe("tab", "engine", 0.04, now + i * 0.01)


def slow(b: Brownout, *at: float, ttft: float = 1.0, complete: bool = True) -> None:
    for t in at:
        b.observe("tab", "provider", ttft, t, complete=complete)


def test_half_of_the_recent_first_tokens_slow_demote_the_backend() -> None:
    b = Brownout()
    b.observe("tab", "provider", 5.0, 0.0)  # no baseline yet: not judged
    steady(b)
    assert b.baseline("tab", "provider") == 0.1 and b.order(CANDS, 1.0) == CANDS
    b.observe("tab", "provider", 0.25, 1.0)  # x2.5: not slow
    slow(b, 1.1, 1.2)
    assert b.order(CANDS, 1.25) == CANDS  # two slow among four fast of the last six: a tail
    slow(b, 1.3)
    assert b.order(CANDS, 1.4) == ["engine", "provider"]
    assert b.order(["engine", "provider"], 1.4) == ["engine", "provider"]  # already behind
    assert b.order(["provider"], 1.4) == ["provider"]  # no one else: the order stands
    assert b.status(1.4)["provider"]["demoted"] and b.status(1.4)["provider"]["demotions"] == 1


def test_hedges_won_against_a_backend_are_evidence() -> None:
    b = Brownout()
    steady(b)
    b.observe("tab", "provider", 0.12, 1.0, complete=False)  # the client left early: no evidence
    slow(b, 1.0, 1.05, ttft=0.15, complete=False)  # hedges won at 1.5x its usual first token
    assert b.order(CANDS, 1.1) == CANDS  # two of the last six
    slow(b, 1.1, ttft=0.15, complete=False)
    assert b.order(CANDS, 1.2) == ["engine", "provider"]
    assert b.baseline("tab", "provider") == 0.1  # neither joined the baseline


def test_probation_one_probe_then_restored_or_held_twice_as_long() -> None:
    cfg = BrownoutConfig(hold_s=5.0)
    b = Brownout(cfg)
    steady(b, now=-20.0)  # older than window_s: only the slow ones below are judged
    slow(b, 1.0, 1.0)  # demoted until 6.0
    assert b.order(CANDS, 5.9) == ["engine", "provider"]
    assert b.order(CANDS, 6.1) == CANDS  # the hold is over: this request is the probe
    assert b.order(CANDS, 6.2) == ["engine", "provider"]  # one probe at a time
    b.observe("tab", "provider", 1.0, 7.1)  # the probe was slow: demoted for 10 s
    assert b.order(CANDS, 16.0) == ["engine", "provider"] and b.order(CANDS, 17.2) == CANDS
    b.observe("tab", "provider", 0.11, 17.3)  # the next probe is fast: restored
    assert b.order(CANDS, 17.4) == CANDS and b.order(CANDS, 17.5) == CANDS
    assert not b.status(17.5)["provider"]["demoted"]


def test_a_lost_probe_lets_the_next_one_go_and_disabled_never_demotes() -> None:
    b = Brownout(BrownoutConfig(hold_s=1.0, probe_timeout_s=3.0))
    steady(b)
    slow(b, 1.0, 1.0, 1.0)
    assert b.order(CANDS, 2.5) == CANDS  # probe sent, never answered (client left)
    assert b.order(CANDS, 4.0) == ["engine", "provider"]
    assert b.order(CANDS, 5.6) == CANDS  # its slot expired: another probe
    off = Brownout(BrownoutConfig(enabled=False))
    steady(off)
    slow(off, 1.0, 1.1, 1.2, 1.3, ttft=2.0)
    assert off.order(CANDS, 6.0) == CANDS


def test_hedges_that_won_demote_the_primary() -> None:
    b = Brownout()
    b.hedge_won("tab", "provider", 0.0)  # no baseline yet: nothing to judge against
    assert b.status(0.0) == {}
    steady(b)
    for t in (1.0, 1.1):
        b.hedge_won("tab", "provider", t)
    assert b.order(CANDS, 1.15) == CANDS  # two of the last six
    b.hedge_won("tab", "provider", 1.2)
    assert b.order(CANDS, 1.3) == ["engine", "provider"]


def test_a_probe_races_the_next_candidate_once_it_is_as_slow_as_a_brownout() -> None:
    """The rehearsal's brownout (run at 25ceedb): 8 of Tab's 10 slowest first tokens (1.0-1.9 s,
    its p99 2.6x steady) were probes of the slow provider. A probe now hedges at slow_factor x its
    baseline (0.3 s here), whatever its surface's hedging and budget."""
    b = Brownout(BrownoutConfig(hold_s=5.0))
    steady(b, now=-20.0)
    assert b.probe_hedge_delay("tab", "provider") is None  # in good standing: no probe
    slow(b, 1.0, 1.0)
    assert b.order(CANDS, 5.9) == ["engine", "provider"]
    assert b.probe_hedge_delay("tab", "provider") is None  # demoted, no probe out
    assert b.order(CANDS, 6.1) == CANDS  # this request is the probe
    assert b.probe_hedge_delay("tab", "provider") == pytest.approx(0.3)
    assert b.probe_hedge_delay("tab", "engine") is None
    b.observe("tab", "provider", 0.11, 6.3)  # a fast probe: restored, no more probing
    assert b.probe_hedge_delay("tab", "provider") is None


def test_a_surface_without_its_own_baseline_is_judged_against_the_backends() -> None:
    """Chat rarely reaching the provider (few first tokens of its own there) still races it from a
    brownout's threshold, and its slow probe demotes the provider again instead of restoring it."""
    b = Brownout(BrownoutConfig(hold_s=1.0))
    steady(b)
    b.observe("chat", "provider", 0.12, 0.5)  # one of its own: too few
    assert b.baseline("chat", "provider") == b.baseline("tab", "provider") == 0.1
    assert b.slow_threshold("chat", "provider") == pytest.approx(0.3)
    slow(b, 1.0, 1.0, 1.0)  # demoted until 2.0
    assert b.order(CANDS, 2.1) == CANDS  # the hold is over: a chat request is the probe
    assert b.probe_hedge_delay("chat", "provider") == pytest.approx(0.3)
    b.observe("chat", "provider", 1.0, 3.1)  # its first token as slow as the brownout's
    assert b.order(CANDS, 3.2) == ["engine", "provider"]  # held again, not restored
    assert b.baseline("chat", "engine") == 0.04 and b.baseline("agent", "nowhere") is None
    st = b.status(3.2)["provider"]
    assert st["demoted"] and not st["probe_out"] and st["slow_from_ms"] == {"chat": 300.0, "tab": 300.0}
