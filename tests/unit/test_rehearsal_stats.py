"""The rehearsal's per-event accounting (loadtest/benchmarks/rehearsal_stats.py): outcomes, windows and the
issue's flat keys from hand-made records and events."""

from __future__ import annotations

from typing import Any

from loadtest.benchmarks import rehearsal_stats as rs


def rec(t0: float, t_end: float, surface: str = "chat", **kw: Any) -> dict[str, Any]:
    base = {"surface": surface, "t0": t0, "t_end": t_end, "ttft_s": 0.05, "error": None, "cancelled": False}
    return base | kw


def test_outcomes() -> None:
    assert rs.outcome(rec(0, 1)) == "completed"
    assert rs.outcome(rec(0, 1, cancelled=True, ttft_s=None)) == "cancelled"
    assert rs.outcome(rec(0, 1, error="http_503:no_capacity", ttft_s=None)) == "failed_before_first_token"
    assert rs.outcome(rec(0, 1, error="stream:stream_interrupted")) == "mid_stream_error"
    assert rs.outcome(rec(0, 1, error="ChunkedEncodingError")) == "cut"
    assert rs.outcome(rec(0, 1, error="timeout", ttft_s=None)) == "hung"
    assert rs.outcome(rec(0, 1, error="http_400:context_length_exceeded", ttft_s=None)) == "refused_400"
    assert not rs.failed(rec(0, 1, cancelled=True)) and rs.failed(rec(0, 1, error="timeout"))


def test_summary_counts_codes_and_percentiles() -> None:
    records = [rec(0, 1, ttft_s=t / 1000) for t in range(1, 101)]
    records += [rec(0, 1, error="http_502:bad_gateway", ttft_s=None)] * 2
    s = rs.summary(records)
    assert s["outcomes"] == {"completed": 100, "failed_before_first_token": 2}
    assert s["failed_before_first_token_by_code"] == {"http_502:bad_gateway": 2}
    assert s["ttft_ms"]["chat"] == {"n": 100, "p50": 51.0, "p99": 100.0}
    records.append(
        rec(7, 9, surface="tab", ttft_s=0.9, gateway="g1", backend="sim", attempts="2", hedge_won="1")
    )
    slow = rs.summary(records)["slowest"]
    assert slow["chat"]["ttft_ms"] == 100.0 and slow["chat"]["t0"] == 0
    assert slow["tab"] | {"ttft_ms": 900.0, "gateway": "g1", "attempts": "2", "hedge_won": "1"} == slow["tab"]


def test_every_failure_says_why() -> None:
    refusal = {"code": "rate_limit_exceeded", "type": "rate_limit_error", "message": "surface 'chat': ..."}
    records = [
        rec(0, 1),
        rec(2, 2.005, error="http_429:rate_limit_exceeded", ttft_s=None, error_detail=refusal, url="u1"),
        rec(3, 4, error="ConnectionError", ttft_s=None, error_detail={"message": "reset by peer"}),
        rec(5, 6, error="http_400:context_length_exceeded", ttft_s=None),  # the request's own fault
    ]
    listed = rs.summary(records)["failures"]
    assert [f["error"] for f in listed] == ["http_429:rate_limit_exceeded", "ConnectionError"]
    assert listed[0] | refusal == listed[0] and listed[0]["ms"] == 5.0 and listed[0]["url"] == "u1"
    assert listed[1]["message"] == "reset by peer" and listed[1]["outcome"] == "failed_before_first_token"
    many = [rec(t, t + 1, error="timeout", ttft_s=None) for t in range(rs.MAX_LISTED + 5)]
    s = rs.summary(many)
    assert len(s["failures"]) == rs.MAX_LISTED and s["outcomes"] == {"hung": rs.MAX_LISTED + 5}


def test_hit_rate_recovery() -> None:
    # before: 50 % cached; after the rejoin at t=100 nothing cached until t=130, then 48 %
    records = [rec(t, t + 1, backend="sim", prompt_tokens=100, cached_tokens=50) for t in range(0, 100)]
    records += [rec(t, t + 1, backend="sim", prompt_tokens=100, cached_tokens=0) for t in range(100, 130)]
    records += [rec(t, t + 1, backend="sim", prompt_tokens=100, cached_tokens=48) for t in range(130, 200)]
    records += [rec(t, t + 1, backend="provider", prompt_tokens=100, cached_tokens=0) for t in range(0, 200)]
    assert rs.hit_rate(records[:100], "sim") == 0.5
    # the first 10 s window within 5 points: [130, 140) plus 0 s of the old → ends at t=140
    assert rs.recovery_s(records, 100.0, 200.0, 0.5, "sim") == 40.0
    assert rs.recovery_s(records, 100.0, 120.0, 0.5, "sim") is None


def test_flat_keys() -> None:
    records = [
        rec(0, 5),  # steady
        rec(12, 14, error="http_503:no_capacity", ttft_s=None),  # during the upgrade
        rec(28, 40, replica="r-lost"),  # in flight on the lost node at 30: migrated, completed
        rec(29, 41, replica="r-lost", error="stream:stream_interrupted"),  # cut with one error event
        rec(29, 41, replica="r-other"),
        rec(31, 61, error="timeout", ttft_s=None),  # hung during the node loss
        rec(51, 52, error="ConnectionError", ttft_s=None),  # 1 s after the gateway kill: not counted
        rec(54, 55, error="http_502:bad_gateway", ttft_s=None),  # 4 s after: counted
        rec(70, 71, "tab", ttft_s=0.1),
        rec(81, 82, "tab", ttft_s=0.15),
        rec(72, 73, ttft_s=0.2),  # Chat: steady 0.2 s, 0.5 s in the brownout
        rec(83, 84, ttft_s=0.5),
    ]
    events = {
        "upgrade": {"steady": [0, 10], "during": [10, 20], "after": [20, 25]},
        "node_loss": {
            "steady": [25, 30],
            "during": [30, 45],
            "after": [45, 48],
            "kill": 30.0,
            "rejoined": 38.0,
            "lost_replicas": ["r-lost"],
        },
        "gateway_replica": {"steady": [48, 50], "during": [50, 58], "after": [58, 60], "kill": 50.0},
        "provider_brownout": {"steady": [65, 80], "during": [80, 90], "after": [90, 95]},
    }
    out = rs.flat_keys(records, events, "sim")
    assert out["upgrade_failed"] == 1
    assert out["node_loss_streams_in_flight"] == 2 and out["node_loss_streams_completed"] == 1
    assert out["node_loss_hung"] == 1 and out["node_loss_failed_before_first_token"] == 0
    assert out["gateway_loss_new_failures_after_2s"] == 1
    assert out["brownout_tab_p99_ratio"] == 1.5
    assert out["brownout_chat_p99_ratio"] == 2.5
    assert out["outage_client_failures"] is None  # not run
    assert set(out) == set(rs.FLAT_KEYS)


def test_kv_feed_cut_keys() -> None:
    ev = {"steady": [0, 10], "during": [10, 40], "after": [40, 50], "catch_up_s": 0.46}
    records = [rec(t, t + 1, backend="sim", prompt_tokens=100, cached_tokens=60) for t in range(0, 10)]
    records += [rec(t, t + 1, backend="sim", prompt_tokens=100, cached_tokens=50) for t in range(10, 40)]
    records += [rec(20, 21, error="http_502:bad_gateway", ttft_s=None)]
    out = rs.flat_keys(records, {"kv_feed_cut": ev}, "sim")
    assert out["kv_feed_cut_failed"] == 1 and out["kv_feed_cut_catch_up_s"] == 0.5
    assert out["kv_feed_cut_hit_rate_points"] == -10.0  # 60 % before, 50 % during


def test_node_loss_counts_the_lost_pods_own_connections_apart() -> None:
    """A client connected to the lost pod's own HAProxy loses that connection with the pod: such
    requests are node_loss_cut_on_lost_pod, not failures before the first token, hung or streams
    in flight that could have completed elsewhere."""
    lost = "http://10.0.0.13:8000"
    records = [
        rec(28, 31, replica="r-lost", url=lost, error="ChunkedEncodingError"),  # cut with the pod
        rec(29.5, 30.5, url=lost, error="ConnectionError", ttft_s=None),  # its connect died too
        rec(28, 40, replica="r-lost", url="http://10.0.0.11:8000"),  # via another pod: migrated
        rec(31, 32, url="http://10.0.0.11:8000", error="ConnectionError", ttft_s=None),  # a failure
    ]
    events = {
        "node_loss": {
            "steady": [25, 30],
            "during": [30, 45],
            "after": [45, 48],
            "kill": 30.0,
            "lost_replicas": ["r-lost"],
            "lost_url": lost,
        }
    }
    out = rs.flat_keys(records, events, "sim")
    assert out["node_loss_cut_on_lost_pod"] == 2
    assert out["node_loss_failed_before_first_token"] == 1
    assert out["node_loss_streams_in_flight"] == 1 and out["node_loss_streams_completed"] == 1
