"""Traces: with an OTLP endpoint configured, one trace per request across the gateway and the
engine replica (admission, the attempt with its routing decision, first token, end), in
OpenTelemetry's GenAI conventions, received by an in-process OTLP/HTTP collector."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from cluster.config import ClusterConfig
from cluster.observability.trace import traceparent
from fixtures.servers.otlp_collector import OtlpCollector, Span

pytestmark = pytest.mark.integration
MODEL = "traced-sim"
CLIENT_TRACE, CLIENT_SPAN = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331


@pytest.fixture(scope="module")
def collector() -> Iterator[OtlpCollector]:
    with OtlpCollector() as c:
        yield c


@pytest.fixture(scope="module")
def traced(deploy, collector: OtlpCollector):
    sim = {
        "sim_profile": "llama-3.1-8b-h100",
        "sim_options": {"speedup": 50.0},
        "resources": {"num_cpus": 0.1},
    }
    cfg = ClusterConfig.model_validate(
        {
            "name": "llm-cluster-traced",
            "server": {"gateway_replicas": 1},
            "models": [{"name": MODEL, "tokenizer": "@tiny", "context_window": 8192}],
            "backends": [{"name": "tr-sim", "kind": "sim", "model": MODEL, "replicas": 1, **sim}],
            "surfaces": [{"name": "chat", "priority": 1}],
            "tracing": {"otlp_endpoint": collector.url, "service_name": "llmc-test", "export_delay_ms": 200},
        }
    )
    return deploy(cfg, "/traced")


def _of_trace(spans: list[Span], trace_id: str) -> list[Span]:
    return [s for s in spans if s["trace_id"] == trace_id]


def test_one_trace_per_request_across_gateway_and_engine(traced, collector: OtlpCollector) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "trace me"}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-surface": "chat", "traceparent": traceparent(CLIENT_TRACE, CLIENT_SPAN)}
    with httpx.stream(
        "POST", traced.base_url + "/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        replica = r.headers["x-llmc-replica"]
        assert any(line.startswith("data: [DONE]") for line in r.iter_lines())
    trace_id = f"{CLIENT_TRACE:032x}"
    spans = collector.wait(lambda got: len(_of_trace(got, trace_id)) >= 4)
    mine = _of_trace(spans, trace_id)
    by_kind: dict[str, list[Span]] = {}
    for s in mine:
        by_kind.setdefault(s["kind"], []).append(s)
    roots = [s for s in by_kind.get("server", []) if s["parent_span_id"] == f"{CLIENT_SPAN:016x}"]
    assert len(roots) == 1, mine  # the gateway's span joins the client's trace
    root = roots[0]
    a = root["attributes"]
    assert root["name"] == f"chat {MODEL}" and root["resource"]["service.name"] == "llmc-test"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.usage.output_tokens"] == 6
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.response.finish_reasons"] == ["length"]
    assert (
        a["llmc.outcome"] == "completed" and a["llmc.ttft_s"] > 0 and "gen_ai.first_token" in root["events"]
    )
    (admission,) = [s for s in mine if s["name"] == "admission"]
    assert admission["parent_span_id"] == root["span_id"]
    (attempt,) = by_kind["client"]
    assert attempt["parent_span_id"] == root["span_id"]
    assert attempt["attributes"]["llmc.replica"] == replica and attempt["attributes"]["llmc.routing.reason"]
    assert (
        attempt["attributes"]["gen_ai.provider.name"] == "sim"
        and attempt["attributes"]["llmc.attempt.verdict"] == "won"
    )
    engine = [s for s in by_kind["server"] if s["parent_span_id"] == attempt["span_id"]]
    assert len(engine) == 1  # the engine replica's own span, a child of the gateway's attempt
    assert engine[0]["attributes"]["llmc.replica"] == replica
    assert engine[0]["attributes"]["gen_ai.usage.output_tokens"] == 6
    assert (
        root["start_ns"]
        <= attempt["start_ns"]
        <= engine[0]["start_ns"]
        <= engine[0]["end_ns"]
        <= root["end_ns"]
    )
