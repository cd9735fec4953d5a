"""bench_affinity --merge: another run's policies are kept only on the same workload, and every
row says which run measured it."""

from __future__ import annotations

from loadtest.benchmarks.bench_affinity import merge_policies, stamp_runs

PROV = {
    "git_commit": "abc",
    "git_dirty": False,
    "timestamp": "2026-12-03T07:00:00+00:00",
    "load_average_before": [1.0, 1.0, 1.0],
    "load_average_after": [2.0, 1.0, 1.0],
    "command": "python -m loadtest.benchmarks.bench_affinity",
}


def test_each_row_carries_the_run_that_measured_it() -> None:
    rows = stamp_runs({"cache_aware": {"hit_rate": 0.5}}, PROV)
    assert rows["cache_aware"]["hit_rate"] == 0.5
    assert rows["cache_aware"]["run"] == {k: PROV[k] for k in PROV if k != "command"}


def test_a_merge_keeps_the_old_rows_with_their_own_stamps() -> None:
    old_run = {**PROV, "git_commit": "old"}
    kept = {"workload": {"groups": 20}, "policies": stamp_runs({"round_robin": {"hit_rate": 0.1}}, old_run)}
    fresh = stamp_runs({"cache_aware": {"hit_rate": 0.5}}, PROV)
    rows, merged = merge_policies(kept, {"groups": 20}, fresh)
    assert merged
    assert rows["round_robin"]["run"]["git_commit"] == "old"
    assert rows["cache_aware"]["run"]["git_commit"] == "abc"


def test_another_workload_is_not_merged() -> None:
    kept = {"workload": {"groups": 8}, "policies": {"round_robin": {"hit_rate": 0.7}}}
    fresh = {"cache_aware": {"hit_rate": 0.5}}
    rows, merged = merge_policies(kept, {"groups": 20}, fresh)
    assert not merged and rows == fresh
