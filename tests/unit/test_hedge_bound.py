"""The hedging goal's feasibility window, read from a run's no-fault TTFTs."""

from __future__ import annotations

import pytest

from loadtest.benchmarks.hedge_bound import hedge_window
from loadtest.tables.table_format import Results


def test_a_tight_tail_leaves_no_delay_that_meets_the_goal() -> None:
    # 1,000 calls at 10-14 ms: p99 ~14, limit ~21; the delay must pass all but ~9 normal calls
    # (>= ~14 ms) yet leave a second TTFT (~12 ms) under 21: no such delay.
    xs = [10 + 4 * i / 999 for i in range(1000)]
    w = hedge_window(xs, slow_share=0.05, budget_ratio=0.05)
    assert w["unhedged_tolerated"] == 9 and w["false_hedges_allowed"] == 9
    assert w["earliest_delay_ms"] > w["latest_delay_ms"] and w["feasible"] is False


def test_a_heavy_tail_opens_the_window() -> None:
    # The same median with 2 % of calls at 40 ms: p99 40, limit 60, a hedge ends by ~52 ms.
    xs = [10 + 4 * i / 979 for i in range(980)] + [40.0] * 20
    w = hedge_window(xs, slow_share=0.05, budget_ratio=0.05)
    assert w["earliest_delay_ms"] <= w["latest_delay_ms"] and w["feasible"] is True
    # ... unless the policy's floor is later than the latest useful delay
    assert hedge_window(xs, 0.05, 0.05, floor_ms=50.0)["feasible"] is False


def test_a_budget_below_the_slow_share_is_infeasible_whatever_the_tail() -> None:
    xs = [10.0] * 990 + [40.0] * 10
    w = hedge_window(xs, slow_share=0.10, budget_ratio=0.05)
    assert w["false_hedges_allowed"] < 0 and w["earliest_delay_ms"] is None and w["feasible"] is False


def test_too_few_samples_say_so() -> None:
    assert hedge_window([10.0] * 50, 0.05, 0.05)["feasible"] is None


def _no_fault(d: dict, leg: str) -> list[float]:
    return [r[1] for r in d["legs"][leg]["requests"]["no_fault"] if r[1] is not None]


@pytest.mark.parametrize("at", ["968cfb6", "1c4e421"])  # hedging runs 10 and 11, as committed
def test_the_committed_runs_read_through_it(at: str) -> None:
    # Both legs' windows closed: the sim's by 1-2 ms, the provider's by the tail and the floor both.
    d = Results().get("hedging", at=at)
    for leg in ("sim", "provider"):
        w = hedge_window(_no_fault(d, leg), 0.05, 0.05, floor_ms=20.0)
        assert w["n"] == 1000 and w["feasible"] is False, (at, leg, w)


def test_the_result_file_holds_the_window_of_its_own_no_fault_rows() -> None:
    d = Results().get("hedging")
    for leg, x in d["legs"].items():
        w = x["feasibility"]
        assert hedge_window(_no_fault(d, leg), 0.05, 0.05, floor_ms=w["floor_ms"]) == w, leg
