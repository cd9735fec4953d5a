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


# -- PromQL: which metrics an expression selects, and the labels each must carry -------------------
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(by|without|on|ignoring)\s*\(([^)]*)\)")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {
    *("sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile"),
    *("count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right"),
    *("and", "or", "unless", "bool", "offset", "inf", "nan"),
}


def promql_selectors(expr: str) -> dict[str, set[str]]:
    """Each metric an expression (or a Grafana ``label_values(metric, label)`` query) selects →
    the labels it must carry: those its own matchers name, and those of every ``by``/``without``
    aggregation around it (``on``/``ignoring`` apply to both sides: to every metric)."""
    lv = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*([a-zA-Z_]\w*)\s*\)\s*", expr)
    if lv:
        return {lv.group(1): {lv.group(2)}}
    text = _STRINGS.sub(lambda m: '"' + " " * (len(m.group()) - 2) + '"', expr)  # keep offsets
    text = re.sub(r"\$\{?\w+\}?", lambda m: " " * len(m.group()), text)  # Grafana variables
    text = re.sub(r"\[[^\]]*\]", lambda m: " " * len(m.group()), text)  # range selectors
    scopes: list[tuple[int, int, set[str]]] = []
    everywhere: set[str] = set()
    for g in _GROUPING.finditer(text):
        labels = {x.strip() for x in g.group(2).split(",") if x.strip()}
        if g.group(1) in ("on", "ignoring"):
            everywhere |= labels
        elif (start := text.find("(", g.end())) >= 0 and not text[g.end() : start].strip():
            scopes.append((start, _closing(text, start), labels))
    blanked = re.sub(r"\{[^}]*\}", lambda m: " " * len(m.group()), text)
    blanked = _GROUPING.sub(lambda m: " " * len(m.group()), blanked)
    out: dict[str, set[str]] = {}
    for m in _IDENT.finditer(blanked):
        word, end = m.group(), m.end()
        if word.lower() in _KEYWORDS or blanked[end:].lstrip().startswith("(") or _is_number(text, m.start()):
            continue
        labels = out.setdefault(word, set()) | everywhere
        after = text[end:].lstrip()
        if after.startswith("{"):
            labels |= set(_MATCHER.findall(after[: after.index("}")]))
        for lo, hi, scoped in scopes:
            if lo < m.start() < hi:
                labels |= scoped
        out[word] = labels
    return out


def _closing(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _is_number(text: str, at: int) -> bool:
    """An identifier-looking piece of a number (the ``e6`` of ``1e6``)."""
    return at > 0 and (text[at - 1].isdigit() or text[at - 1] == ".")


def promql_metrics(expr: str) -> set[str]:
    """Metric names an expression selects."""
    return set(promql_selectors(expr))


def promql_labels(expr: str) -> set[str]:
    """Every label name an expression matches on or groups by."""
    return set().union(*promql_selectors(expr).values())


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
