"""The operator's view of the live session cluster: every Grafana query in k8s/monitoring names a
metric the cluster exports (with the labels the query uses), and ``cluster status`` reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cluster.observability.prometheus import Sample, family, parse, promql_metrics, promql_selectors
from cluster.observability.status import Scrape, summarize

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "k8s/monitoring/grafana-dashboard.json"
# Counters Ray exports only after their first increment, and what increments them: the session
# cluster (vLLM only, no provider, no overload, no failure) may have had none. Absent from the
# scrape, they must still be declared in deployments/metrics.py with every label the panels use.
EVENT_COUNTERS = {
    "ray_llmc_rejections_total": "an admission refusal (429, 503)",
    "ray_llmc_hedges_total": "a hedged attempt",
    "ray_llmc_failovers_total": "an attempt abandoned for the next candidate",
    "ray_llmc_cost_usd_total": "a request to a backend with prices (a provider)",
    "ray_llmc_extra_attempts_total": "a retry or a hedge",
    "ray_llmc_context_reroutes_total": "a prompt sent to a model's overflow_to (none configured)",
    "ray_llmc_migrations_total": "a self-hosted stream that broke after its first token",
    "ray_llmc_migration_prefill_tokens_total": "a stream continued on another replica",
    "ray_llmc_migration_seam_seconds": "a stream continued on another replica (a histogram)",
    "ray_llmc_refusal_seconds": "an admission refusal (a histogram)",
    "ray_llmc_no_capacity_total": "a request no replica could take by its queue deadline",
    "ray_llmc_replica_unreachable_total": "a replica that refused a connection or whose engine died",
}
# Ray's node metrics for GPUs: exported only by a node that has one. Checked against Ray's source.
GPU_NODE_METRICS = {"ray_node_gpus_utilization": "GpuIndex", "ray_node_gram_used": "GpuIndex"}
SCRAPER_LABELS = {"instance", "job", "le"}  # added by Prometheus (``le``: checked on buckets)


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    return exprs + [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]


def declared() -> dict[str, tuple[str, ...]]:
    """Our metrics as Ray exports them (``ray_`` + name) → their tag keys."""
    from ray.util.metrics import Metric

    from deployments import metrics

    return {
        "ray_" + m._name: m._tag_keys for m in vars(metrics).values() if isinstance(m, Metric)
    }  # Ray keeps name and tags private


def post(cluster, path: str, body: dict, surface: str, session: str | None = None) -> httpx.Response:
    headers = {"x-surface": surface, **({"x-session-id": session} if session else {})}
    return httpx.post(cluster.base_url + path, json=body, headers=headers, timeout=120)


def send_traffic(cluster) -> set[str]:
    """A little of everything the dashboard plots: streamed and whole answers on each surface, a
    shared prefix (prefix-cache hits), completions, and a context-window refusal. Returns the
    gateway replicas that served the answers."""
    gateways = set()
    prefix = " ".join(f"def helper_{i}(x): return x + {i}" for i in range(40))
    for i, surface in enumerate(("tab", "chat", "agent", "chat")):
        body = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": f"{prefix}\nexplain helper_{i}"}],
            "max_tokens": 8,
            "stream": i % 2 == 0,
            "stream_options": {"include_usage": True} if i % 2 == 0 else None,
        }
        r = post(cluster, "/chat/completions", body, surface, session="obs")
        assert r.status_code == 200
        gateways.add(r.headers["x-llmc-gateway"])
    body = {"model": "tiny-llama", "prompt": "def add(a, b):", "max_tokens": 4}
    r = post(cluster, "/completions", body, "tab")
    assert r.status_code == 200
    gateways.add(r.headers["x-llmc-gateway"])
    too_long = {"model": "tiny-llama", "prompt": list(range(5, 2100)), "max_tokens": 4}
    assert post(cluster, "/completions", too_long, "chat").status_code == 400
    return gateways


def scrape(url: str) -> list[Sample]:
    return parse(httpx.get(url, timeout=10, trust_env=False).text)


@pytest.fixture(scope="module")
def served_by(cluster) -> set[str]:
    return send_traffic(cluster)


@pytest.fixture(scope="module")
def exported(cluster, served_by: set[str]) -> list[Sample]:
    """A scrape once every metric the dashboard needs live has been pushed (Ray exports in
    batches, every 2 s on a local cluster): polled, since when is up to Ray."""
    wanted = {n for q in dashboard_queries() for n in promql_metrics(q) if family(n) not in EVENT_COUNTERS}
    wanted -= set(GPU_NODE_METRICS)
    deadline = time.monotonic() + 60
    samples = scrape(cluster.metrics_url)
    while wanted - {s.name for s in samples} and time.monotonic() < deadline:
        time.sleep(1.0)
        samples = scrape(cluster.metrics_url)
    return samples


def test_every_dashboard_query_names_an_exported_metric(exported: list[Sample]) -> None:
    live: dict[str, set[str]] = {}
    for s in exported:
        live.setdefault(s.name, set()).update(s.labels)
    ours = declared()
    ray_source = _ray_reporter_source()
    problems = []
    for q in dashboard_queries():
        for name, used in promql_selectors(q).items():
            labels = used - SCRAPER_LABELS
            if name in live:
                missing = labels - live[name]
                if name.endswith("_bucket") and "le" not in live[name]:
                    missing.add("le")
            elif family(name) in EVENT_COUNTERS and family(name) in ours:
                missing = labels - set(ours[family(name)]) - {"le"}
            elif name in GPU_NODE_METRICS and name.removeprefix("ray_") in ray_source:
                missing = labels - {GPU_NODE_METRICS[name]}
            else:
                problems.append(f"{name}: not exported (query: {q})")
                continue
            if missing:
                problems.append(f"{name}: no label {sorted(missing)} (query: {q})")
    assert problems == []
    # And the other way round: every metric we declare has a panel.
    shown = {family(n) for q in dashboard_queries() for n in promql_metrics(q)}
    assert sorted(set(ours) - shown) == []


def _ray_reporter_source() -> str:
    import ray.dashboard.modules.reporter.reporter_agent as agent

    return Path(agent.__file__).read_text()


def test_status_reads_the_live_cluster(cluster, served_by: set[str], exported: list[Sample]) -> None:
    # The session's Ray may hold other tests' apps too: this cluster's rows are its backend's and
    # its gateway replicas'.
    engines = set(cluster.replica_stats())
    st = summarize(None, Scrape(time.monotonic(), tuple(exported)))
    mine = [e for e in st.engines if e.backend == "vllm-tiny"]
    assert {e.replica for e in mine} == engines and len(engines) == 2
    assert all(e.breaker == "closed" for e in mine)
    assert any(e.hit_rate for e in mine)  # the shared prefix, pinned by its session
    rows = {g.replica: g for g in st.gateways}
    assert served_by <= set(rows)
    assert all(rows[g].ttft_p50_ms is not None for g in served_by)  # each measured first tokens
    assert "vllm-tiny" in [b.backend for b in st.backends]
    out = subprocess.run(
        [sys.executable, "-m", "cluster", "status", "--url", cluster.metrics_url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "160"},
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    for rid in engines:
        assert rid in out.stdout
    assert "gateway replicas" in out.stdout and "vllm-tiny" in out.stdout
