"""The Grafana dashboard against Grafana's own schema (the types of grafana-foundation-sdk, which
Grafana generates from its dashboard schema) and against the PromQL reader. The live test that its
metrics exist is tests/integration/test_observability.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from cluster.observability.prometheus import promql_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s/monitoring/grafana-dashboard.json"


def lost(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """What of ours did not survive the round trip: fields the schema does not know (dropped) and
    values it read differently. Fields the schema adds with their defaults are not ours to check."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = [f"{path}/{k} dropped" for k in ours if k not in theirs]
        return out + [x for k in ours if k in theirs for x in lost(ours[k], theirs[k], f"{path}/{k}")]
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [
            x for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) for x in lost(a, b, f"{path}[{i}]")
        ]
    return [] if ours == theirs else [f"{path}: {ours!r} read as {theirs!r}"]


def test_dashboard_loads_in_grafanas_schema_without_losing_a_field() -> None:
    ours = json.loads(DASHBOARD.read_text())
    theirs = json.loads(json.dumps(Dashboard.from_json(ours), cls=JSONEncoder))
    assert lost(ours, theirs) == []
    assert lost({"panels": [{"type": "row", "titel": "typo"}]}, {"panels": [{"type": "row"}]}) == [
        "/panels[0]/titel dropped"
    ]


def test_every_dashboard_query_names_a_ray_metric() -> None:
    """The live test compares these names with a scrape; here, that the reader finds one in each."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) > 30
    for e in exprs:
        names = promql_metrics(e)
        assert names and all(n.startswith("ray_") for n in names), (e, names)
