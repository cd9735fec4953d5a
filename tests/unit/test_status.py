"""cluster.observability.prometheus and cluster.observability.status: reading a scrape of Ray's
metrics agent, the dashboard's PromQL, and the rows of ``cluster status``."""

from __future__ import annotations

import math

import pytest

from cluster.observability.prometheus import (
    bucket_counts,
    family,
    parse,
    promql_labels,
    promql_metrics,
    promql_selectors,
    quantile,
)
from cluster.observability.status import Scrape, Window, increase, summarize

# Shaped like Ray 2.60's export: its own labels on every sample, the recording process's WorkerId.
RAY = 'Component="core_worker",NodeAddress="192.0.2.2",SessionName="s",Version="2.60.0"'
GW_A, GW_B, ENG = 'WorkerId="aaaa1111"', 'WorkerId="bbbb2222"', 'WorkerId="eeee3333"'


def exposition(ended_a: float, ttft_a: tuple[float, float, float], hits: float, queries: float) -> str:
    """Two gateway processes (a, b), one engine replica; ttft_a: cumulative counts at le 0.05,
    0.1, +Inf for gateway a."""
    lo, mid, inf = ttft_a
    return f"""# HELP ray_llmc_gateway_requests_in_flight Requests admitted and not yet ended.
# TYPE ray_llmc_gateway_requests_in_flight gauge
ray_llmc_gateway_requests_in_flight{{{RAY},{GW_A},gateway="gw-a"}} 3.0
ray_llmc_gateway_requests_waiting{{{RAY},{GW_A},gateway="gw-a"}} 1.0
ray_llmc_gateway_requests_in_flight{{{RAY},{GW_B},gateway="gw-b"}} 0.0
ray_llmc_gateway_requests_waiting{{{RAY},{GW_B},gateway="gw-b"}} 0.0
ray_llmc_requests_ended_total{{{RAY},{GW_A},outcome="completed",surface="chat"}} {ended_a}
ray_llmc_requests_ended_total{{{RAY},{GW_B},outcome="completed",surface="chat"}} 5.0
ray_llmc_ttft_seconds_bucket{{{RAY},{GW_A},backend="vllm",le="0.05",surface="chat"}} {lo}
ray_llmc_ttft_seconds_bucket{{{RAY},{GW_A},backend="vllm",le="0.1",surface="chat"}} {mid}
ray_llmc_ttft_seconds_bucket{{{RAY},{GW_A},backend="vllm",le="+Inf",surface="chat"}} {inf}
ray_llmc_ttft_seconds_count{{{RAY},{GW_A},backend="vllm",surface="chat"}} {inf}
ray_llmc_breaker_state{{{RAY},{GW_A},backend="vllm",replica=""}} 0.0
ray_llmc_breaker_state{{{RAY},{GW_A},backend="vllm",replica="r1"}} 0.0
ray_llmc_breaker_state{{{RAY},{GW_B},backend="vllm",replica="r1"}} 1.0
ray_llmc_engine_requests_running{{{RAY},{ENG},backend="vllm",replica="r1"}} 2.0
ray_llmc_engine_requests_waiting{{{RAY},{ENG},backend="vllm",replica="r1"}} 4.0
ray_llmc_kv_cache_usage_ratio{{{RAY},{ENG},backend="vllm",replica="r1"}} 0.25
ray_llmc_prefix_cache_hits_total{{{RAY},{ENG},backend="vllm",replica="r1"}} {hits}
ray_llmc_prefix_cache_queries_total{{{RAY},{ENG},backend="vllm",replica="r1"}} {queries}
ray_llmc_engine_requests_total{{{RAY},{ENG},backend="vllm",replica="r1"}} {ended_a}
ray_serve_num_http_requests_total{{{RAY},route="/"}} 9.0
"""


def test_parse_reads_labels_values_and_prefix() -> None:
    text = exposition(10, (1, 2, 3), 5, 10) + 'ray_llmc_x{a="q\\"uote",b="line\\nbreak"} 1e3\nbad line\n'
    samples = parse(text, prefix="ray_llmc_")
    assert all(s.name.startswith("ray_llmc_") for s in samples)
    x = next(s for s in samples if s.name == "ray_llmc_x")
    assert x.labels == {"a": 'q"uote', "b": "line\nbreak"} and x.value == 1000.0
    inflight = next(s for s in samples if s.name == "ray_llmc_gateway_requests_in_flight")
    assert inflight.label("gateway") == "gw-a" and inflight.label("WorkerId") == "aaaa1111"
    assert len(parse(text)) == len(samples) + 1  # the ray_serve_ sample, without a prefix


def test_family_and_quantile() -> None:
    assert family("ray_llmc_ttft_seconds_bucket") == "ray_llmc_ttft_seconds"
    assert family("ray_llmc_tokens_total") == "ray_llmc_tokens_total"
    assert quantile(0.5, {}) is None and quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    # 10 observations: 4 ≤ 0.1, 8 ≤ 0.2, 10 ≤ +Inf
    b = {0.1: 4.0, 0.2: 8.0, math.inf: 10.0}
    assert quantile(0.5, b) == pytest.approx(0.125)  # rank 5: a quarter into (0.1, 0.2]
    assert quantile(0.2, b) == pytest.approx(0.05)
    assert quantile(0.99, b) == 0.2  # in +Inf: the last finite edge, as Prometheus does
    samples = parse(exposition(0, (1, 2, 4), 0, 0))
    assert bucket_counts(samples, "ray_llmc_ttft_seconds") == {0.05: 1.0, 0.1: 2.0, math.inf: 4.0}


def test_promql_names_metrics_not_functions_labels_or_variables() -> None:
    e = (
        'histogram_quantile(0.95, sum by (le, backend) (rate(ray_llmc_ttft_seconds_bucket{surface="tab", '
        'backend=~"$backend"}[$__rate_interval]))) / on (backend) group_left sum(increase(x_total[5m])) * 1e6'
    )
    assert promql_metrics(e) == {"ray_llmc_ttft_seconds_bucket", "x_total"}
    assert promql_labels(e) == {"le", "backend", "surface"}
    q = "label_values(ray_llmc_ttft_seconds_count, surface)"
    assert promql_metrics(q) == {"ray_llmc_ttft_seconds_count"} and promql_labels(q) == {"surface"}
    scoped = 'sum by (backend) (rate(a{kind="x"}[5m])) / sum by (surface) (rate(b[5m])) * 3600'
    assert promql_selectors(scoped) == {"a": {"backend", "kind"}, "b": {"surface"}}
    assert promql_selectors(e)["x_total"] == {"backend"}  # on (...) matches both sides
    assert promql_metrics('sum(rate(a{le="0.1"}[5m]) or rate(b{le="1"}[5m])) / sum(rate(c[5m]))') == {
        "a",
        "b",
        "c",
    }


def test_one_scrape_is_since_start_without_rates() -> None:
    st = summarize(None, Scrape(100.0, tuple(parse(exposition(10, (2, 3, 4), 30, 100)))))
    assert st.window_s is None
    a, b = st.gateways
    assert (a.replica, a.in_flight, a.waiting, a.rps) == ("gw-a", 3, 1, None)
    assert a.ttft_p50_ms == pytest.approx(50.0) and a.ttft_p99_ms == pytest.approx(100.0)
    assert (b.replica, b.in_flight, b.ttft_p50_ms) == ("gw-b", 0, None)
    (e,) = st.engines
    assert (e.backend, e.replica, e.running, e.waiting, e.kv_usage) == ("vllm", "r1", 2, 4, 0.25)
    assert e.hit_rate == pytest.approx(0.3)
    assert e.breaker == "open"  # gateway b holds it open: the worst state is shown
    (be,) = st.backends
    assert (be.backend, be.breaker, be.rps) == ("vllm", "closed", None)


def test_window_rates_and_quantiles_cover_only_its_span() -> None:
    w = Window(span_s=60.0)
    w.add(Scrape(0.0, tuple(parse(exposition(10, (10, 10, 10), 30, 100)))))
    w.add(Scrape(20.0, tuple(parse(exposition(20, (10, 10, 12), 30, 100)))))
    w.add(Scrape(40.0, tuple(parse(exposition(30, (10, 14, 14), 80, 200)))))
    st = w.status()
    assert st.window_s == 40.0
    a = st.gateways[0]
    assert a.rps == pytest.approx(20 / 40)
    # Over the window: 0 ≤ 0.05 s, 4 in (0.05, 0.1], none above: the old fast ones do not count.
    assert a.ttft_p50_ms == pytest.approx(75.0)
    (e,) = st.engines
    assert e.hit_rate == pytest.approx(50 / 100) and e.rps == pytest.approx(20 / 40)
    assert st.backends[0].rps == pytest.approx(4 / 40)
    w.add(Scrape(90.0, tuple(parse(exposition(35, (10, 14, 14), 80, 200)))))
    assert [s.at for s in w.scrapes] == [20.0, 40.0, 90.0]  # 20 kept: the span stays full
    w.add(Scrape(100.0, tuple(parse(exposition(35, (10, 14, 14), 80, 200)))))
    assert [s.at for s in w.scrapes] == [40.0, 90.0, 100.0]
    assert Window().status().gateways == []


def test_a_restarted_counter_counts_from_zero() -> None:
    old = Scrape(0.0, tuple(parse(exposition(50, (1, 1, 1), 0, 0))))
    new = Scrape(10.0, tuple(parse(exposition(4, (1, 1, 1), 0, 0))))
    ended = [s for s in increase(old, new) if s.name == "ray_llmc_requests_ended_total"]
    assert sorted(s.value for s in ended) == [0.0, 4.0]  # b unchanged, a restarted at 4
    gauges = [s for s in increase(old, new) if s.name == "ray_llmc_gateway_requests_in_flight"]
    assert sorted(s.value for s in gauges) == [0.0, 3.0]  # gauges are values, not increases


def test_render_draws_every_row() -> None:
    from rich.console import Console

    from cluster.observability.cli_status import render

    w = Window()
    w.add(Scrape(0.0, tuple(parse(exposition(10, (1, 1, 1), 30, 100)))))
    w.add(Scrape(30.0, tuple(parse(exposition(40, (1, 2, 2), 60, 200)))))
    console = Console(record=True, width=140)
    console.print(render(w.status(), "http://x:8080/metrics"))
    out = console.export_text()
    for text in ("last 30 s", "gw-a", "gw-b", "r1", "open", "25 %", "30 %", "1.0"):
        assert text in out, text


def test_metrics_urls() -> None:
    import argparse

    from cluster.observability.cli_status import metrics_urls

    ns = argparse.Namespace(url=["h:8080", "http://h2:9090/", "http://h3:1/metrics"], config=None)
    assert metrics_urls(ns) == ["http://h:8080/metrics", "http://h2:9090/metrics", "http://h3:1/metrics"]
    ns = argparse.Namespace(url=None, config="configs/local.yaml")
    assert metrics_urls(ns) == ["http://127.0.0.1:8080/metrics"]
