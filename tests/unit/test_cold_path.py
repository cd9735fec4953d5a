"""The overhead benchmark's cold-path figure: one call timed back to back and after an idle pause."""

from __future__ import annotations

from loadtest.common.cold_path import WARM_CALLS, cold_and_hot, prepare_cold_and_hot
from loadtest.common.overhead_client import relay_body
from loadtest.common.overhead_cluster import provider_config


class FakeBox:
    """A clock that a call advances by 10 µs, or by 30 µs when the box slept just before it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []
        self.cold = False
        self.calls = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s
        self.cold = True

    def call(self) -> None:
        self.calls += 1
        self.now += 30e-6 if self.cold else 10e-6
        self.cold = False


def test_each_cold_call_follows_a_pause_and_the_hot_ones_do_not() -> None:
    box = FakeBox()
    got = cold_and_hot(box.call, rounds=20, idle_s=0.005, clock=box.clock, sleep=box.sleep)
    assert got == {"idle_ms": 5.0, "hot_us": 10.0, "cold_us": 30.0, "cold_factor": 3.0}
    assert box.slept == [0.005] * 20 and box.calls == WARM_CALLS + 40


def test_the_gateways_preparation_of_the_benchmarks_request_is_timed_both_ways() -> None:
    got = prepare_cold_and_hot(provider_config(1, 2), relay_body(), rounds=5)
    assert got["what"] == "deployments.gateway.prepare.prepare" and got["idle_ms"] == 2.0
    assert got["hot_us"] > 0 and got["cold_us"] > 0
    assert got["cold_factor"] == round(got["cold_us"] / got["hot_us"], 2)
