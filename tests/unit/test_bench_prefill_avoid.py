"""The prefill-avoidance benchmark on the virtual clock: the gateway's own view deciding for the
engine model. A short replay where Agent's first turns are long uncached prefills."""

from __future__ import annotations

import pytest

from loadtest.benchmarks.bench_prefill_avoid import THRESHOLD, WORKLOADS, load, parse_args, replay


@pytest.fixture(scope="module")
def long_context() -> tuple[list, list]:
    from cluster import tokens

    tok = tokens.load("@tiny")
    specs = load("long_context", 4.0, 4.0, 8.0, 1)
    return specs, [tok.chat_ids(list(s.messages)) for s in specs]


def test_tab_skips_replicas_mid_prefill_and_agent_loses_nothing(long_context: tuple[list, list]) -> None:
    specs, ids = long_context
    off, on = replay(specs, ids, None, 1), replay(specs, ids, THRESHOLD, 1)
    assert off["avoided_prefill"] == 0 and on["avoided_prefill"] > 0
    assert on["tab"]["n"] == off["tab"]["n"] > 0 and on["agent"]["n"] == off["agent"]["n"] > 0
    # Agent's own requests are routed as before (the threshold is Tab's): the same tokens come out
    assert on["agent"]["output_tokens"] == off["agent"]["output_tokens"] > 0
    assert on["tab"]["ttft_p99_ms"] <= off["tab"]["ttft_p99_ms"]


def test_a_threshold_above_every_prefill_changes_nothing(long_context: tuple[list, list]) -> None:
    specs, ids = long_context
    off, never = replay(specs, ids, None, 1), replay(specs, ids, 10**9, 1)
    assert never["avoided_prefill"] == 0 and never == off


def test_the_workloads_differ_in_agents_prefills() -> None:
    assert set(WORKLOADS) == {"shared", "long_context"}
    shared, long = WORKLOADS["shared"][0]["agent"], WORKLOADS["long_context"][0]["agent"]
    assert long["num_groups"] > shared["num_groups"] and long["context_words"] > shared["context_words"]
    assert WORKLOADS["shared"][0]["tab"] == WORKLOADS["long_context"][0]["tab"]
    assert parse_args(["--workloads", "long_context", "--thresholds", "256,512"]).thresholds == [256, 512]
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "nope"])


def test_two_gateways_gain_only_when_every_engines_count_is_shared_at_once(
    long_context: tuple[list, list],
) -> None:
    from loadtest.benchmarks.bench_prefill_avoid import engine_prefill

    specs, ids = long_context
    own = replay(specs, ids, THRESHOLD, 2)
    fresh = replay(specs, ids, THRESHOLD, 2, share_every=0.0)
    assert fresh["avoided_prefill"] >= own["avoided_prefill"] > 0
    assert fresh["agent"]["output_tokens"] == own["agent"]["output_tokens"]
    assert fresh["tab"]["ttft_p99_ms"] <= own["tab"]["ttft_p99_ms"]

    from cluster.engine.model import EngineModel
    from loadtest.benchmarks.bench_prefill_avoid import profile

    e = EngineModel(profile(), scheduling_policy="priority")
    e.add_request("a", list(range(1, 3001)), 4)
    assert engine_prefill(e) == 3000  # waiting, nothing computed
    e.step()
    assert 0 < engine_prefill(e) < 3000  # one chunk of it computed
    e.run()
    assert engine_prefill(e) == 0
