"""Prometheus text, read without a Prometheus: samples from an exposition, the metric and label
names a PromQL expression refers to, and quantiles from histogram buckets.

Pure (no I/O): ``cluster status`` and the tests that hold the Grafana dashboard to what the cluster
exports read a scrape of Ray's metrics agent with it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float

    def label(self, key: str, default: str = "") -> str:
        return self.labels.get(key, default)


def parse(text: str, prefix: str = "") -> list[Sample]:
    """The samples of an exposition whose metric name starts with ``prefix`` (comments skipped)."""
    out = []
    for line in text.splitlines():
        if not line or line[0] == "#" or not line.startswith(prefix):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        pairs = {k: _unescape(v) for k, v in _LABEL.findall(labels or "")}
        out.append(Sample(name, pairs, value))
    return out


def _unescape(v: str) -> str:
    return v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


def family(name: str) -> str:
    """A histogram's family name from one of its series (``x_bucket`` → ``x``); others unchanged."""
    for part in _HISTOGRAM_PARTS:
        if name.endswith(part):
            return name[: -len(part)]
    return name


# -- PromQL: which metrics and labels an expression names ------------------------------------------
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {
    *("sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile"),
    *("count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right"),
    *("and", "or", "unless", "bool", "offset", "inf", "nan", "le"),
    *("rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "label_values"),
    *("abs", "ceil", "floor", "round", "clamp", "clamp_min", "clamp_max", "vector", "scalar", "time"),
    *("sort", "sort_desc", "absent", "absent_over_time", "changes", "resets", "label_replace"),
    *("avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "count_over_time"),
}


def promql_metrics(expr: str) -> set[str]:
    """Metric names an expression (or a Grafana ``label_values(metric, label)`` query) selects."""
    text = _STRINGS.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", "{}", text)  # matchers name labels, not metrics
    text = _RANGES.sub("", text)
    text = _GROUPING.sub("", text)
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables
    text = re.sub(r"label_values\(([^,)]*),[^)]*\)", r"\1", text)
    names = set()
    for m in _IDENT.finditer(text):
        word, end = m.group(), m.end()
        rest = text[end:].lstrip()
        if word.lower() in _KEYWORDS or rest.startswith("("):
            continue
        if re.fullmatch(r"\d[\w.]*|e\d+", word):
            continue
        names.add(word)
    return names


def promql_labels(expr: str) -> set[str]:
    """Label names an expression matches on or groups by (``le`` of a histogram included)."""
    labels: set[str] = set()
    for group in _GROUPING.findall(expr):
        labels.update(x.strip() for x in group.split(",") if x.strip())
    for m in re.finditer(r"\{([^}]*)\}", expr):
        labels.update(_MATCHER.findall(m.group(1)))
    for m in re.finditer(r"label_values\([^,)]*,\s*([a-zA-Z_]\w*)\s*\)", expr):
        labels.add(m.group(1))
    return labels


# -- histograms --------------------------------------------------------------------------------
def bucket_counts(samples: Iterable[Sample], metric: str) -> dict[float, float]:
    """Cumulative counts per upper edge of one histogram, summed over every series given."""
    out: dict[float, float] = {}
    for s in samples:
        if s.name != f"{metric}_bucket" or "le" not in s.labels:
            continue
        le = s.labels["le"]
        edge = math.inf if le in ("+Inf", "Inf", "inf") else float(le)
        out[edge] = out.get(edge, 0.0) + s.value
    return out


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear inside the bucket that holds rank ``q``; the last
    finite edge when the rank falls in +Inf; None without observations."""
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0.0
    if total <= 0:
        return None
    rank = q * total
    prev_edge, prev_count = 0.0, 0.0
    for e in edges:
        c = buckets[e]
        if c >= rank:
            if math.isinf(e):
                return prev_edge
            frac = (rank - prev_count) / (c - prev_count) if c > prev_count else 0.0
            return prev_edge + (e - prev_edge) * frac
        prev_edge, prev_count = e, c
    return None
