"""The control-plane benchmark's indexer design (issue 42) runs the real builder and mirror: a small
fleet, short, to keep the script honest (the figures come from the script, not from here)."""

from __future__ import annotations

from cluster.engine.profiles import get_profile
from loadtest.benchmarks import bench_control_plane as b


def test_the_indexer_design_runs_engines_an_indexer_and_mirroring_gateways():
    rates = b.engine_rates(get_profile("llama-3.1-8b-h100"), 0.5, 8192, 0.8, 64).scaled(0.05)
    r = b.simulate(4, 3, rates, 0.5, 256, 1, indexer=True)
    assert r["design"] == "indexer" and r["connections_total"] == 4 + 3
    assert r["frames_per_s"] > 0 and r["frame_anchors_per_s"] > 0 and r["indexer_pages_per_s"] > 0
    assert 0 < r["gateway_cpu_share"] < r["indexer_cpu_share"]  # the gateways apply less than it takes
    assert r["lag_p50_ms"] <= r["lag_p99_ms"] and r["mirror_floor_ns_per_anchor"] > 0
