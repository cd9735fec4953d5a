"""The relay benchmark's pure parts (loadtest/benchmarks/bench_relay.py): a leg's figures from its batches,
the flat keys against the direct leg, the goals against the peer, and the paced fake upstream."""

from __future__ import annotations

import time

import aiohttp
from aiohttp.test_utils import TestClient, TestServer

from loadtest.benchmarks import bench_relay as br
from loadtest.common.fake_upstream import build_app


def _batch(ttft: float, gaps: list[float], chunks: int, wall: float, cpu: dict[str, float]) -> br.LongBatch:
    ok = br.LongSample(True, ttft_ms=ttft, e2e_ms=1000.0, chunks=chunks, gaps_ms=gaps)
    bad = br.LongSample(False, error="no [DONE]")
    return br.LongBatch([ok, bad], wall_s=wall, cpu_s=cpu)


def test_figures_count_chunks_of_completed_streams_and_cpu_of_the_relay_groups() -> None:
    batches = [
        _batch(
            10.0, [20.0, 21.0], 200, 2.0, {"gateway": 0.010, "haproxy": 0.002, "upstream": 0.5, "box": 1.0}
        ),
        _batch(
            30.0, [19.0, 40.0], 200, 2.0, {"gateway": 0.014, "haproxy": 0.006, "upstream": 0.5, "box": 1.0}
        ),
    ]
    fig = br.figures(batches, ("gateway", "haproxy"))
    assert (fig["requests"], fig["ok"], fig["chunks"]) == (4, 2, 400)
    assert fig["errors"] == {"no [DONE]": 2}
    assert fig["chunks_per_s"] == 100.0  # 400 chunks over 4 s of batches
    assert fig["relay_cpu_ms_per_1k_chunks"] == 80.0  # 32 ms over 400 chunks
    assert fig["cpu_ms_per_1k_chunks"]["upstream"] == 2500.0
    assert fig["gap_ms"]["n"] == 4 and fig["ttft_ms"]["p50"] == 20.0


def _leg(cps: float, ttft: tuple[float, float], gap99: float, cpu: float | None) -> dict:
    return {
        "c256": {
            "chunks_per_s": cps,
            "ttft_ms": {"p50": ttft[0], "p99": ttft[1]},
            "gap_ms": {"p99": gap99},
            "relay_cpu_ms_per_1k_chunks": cpu,
        }
    }


def test_headline_keys_and_goals_against_direct_and_the_peer() -> None:
    legs = {
        "direct": _leg(10000.0, (5.0, 10.0), 25.0, None),
        "peer": _leg(9900.0, (8.0, 30.0), 28.0, 20.0),
        "ours": _leg(9800.0, (20.0, 50.0), 40.0, 39.0),
        "engine": _leg(9000.0, (30.0, 60.0), 30.0, 41.0),
    }
    fig = br.headline(legs)
    assert fig["c256_cps_ratio"] == 0.98 and fig["peer_c256_cps_ratio"] == 0.99
    assert fig["c256_added_ttft_p99_ms"] == 40.0 and fig["peer_c256_added_ttft_p99_ms"] == 20.0
    assert fig["c256_added_gap_p99_ms"] == 15.0 and fig["peer_c256_added_gap_p99_ms"] == 3.0
    assert fig["cpu_ms_per_1k_chunks_provider"] == 39.0 and fig["cpu_ms_per_1k_chunks_engine"] == 41.0
    got = br.goals(fig)
    assert got == {
        "c256_cps_ratio >= 0.97": True,
        "c256_added_ttft_p99_ms <= 2 x peer": True,
        "c256_added_gap_p99_ms <= 2 x peer": False,  # 15 > 2 x 3
        "cpu_ms_per_1k_chunks_provider <= 2 x peer": True,
        "cpu_ms_per_1k_chunks_engine <= 2 x peer": False,  # 41 > 2 x 20
    }
    assert set(br.goals(br.headline({})).values()) == {None}


def test_the_sim_is_paced_to_the_interval_at_the_headline_concurrency() -> None:
    from cluster.engine.profiles import BatchShape, get_profile

    step = get_profile(br.SIM_PROFILE).step_time_model()
    shape = BatchShape(decode_tokens=br.HEADLINE, kv_read_tokens=br.HEADLINE * 120)
    assert abs(step.step_time(shape) / br.sim_speedup() - br.INTERVAL_S) < 1e-9
    cfg = br.relay_config(9001, 9002, 512)
    assert [b.kind for b in cfg.backends] == ["provider", "sim"]
    assert cfg.surfaces[0].max_concurrency >= 512


async def test_the_fake_upstream_paces_its_chunks_on_schedule() -> None:
    async with TestClient(TestServer(build_app(chunks=6, interval_s=0.02))) as client:
        t0 = time.perf_counter()
        resp = await client.post("/v1/chat/completions", json={"stream": True})
        got = b""
        async for data in resp.content.iter_any():
            got += data
        took = time.perf_counter() - t0
    assert got.count(b'"content"') == 6 and got.endswith(b"data: [DONE]\n\n")
    assert 0.095 <= took < 0.5  # five 20 ms waits between six chunks
    assert isinstance(resp, aiohttp.ClientResponse)
