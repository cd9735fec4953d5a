"""BENCHMARKS.md's production rehearsal tables (issue 41), from ``loadtest/results/rehearsal.json``
(:mod:`loadtest.benchmarks.rehearsal`): the issue's flat keys as the file holds them, and each
event's requests by outcome and TTFT p99 (ms, one decimal as the file rounds it) against the steady
state before it."""

from __future__ import annotations

from typing import Any

from loadtest.benchmarks.rehearsal_stats import FLAT_KEYS
from loadtest.tables.table_format import Results, fixed, num, table

FLAT = ("nodes", "minutes", *FLAT_KEYS, "books_exact")  # the flat keys, in its order
OUTCOMES = (
    "completed",
    "cancelled",
    "refused_400",
    "failed_before_first_token",
    "mid_stream_error",
    "cut",
    "hung",
)


def _value(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    return "not measured" if x is None else num(x)


def rehearsal(r: Results) -> str:
    """The flat keys; ``leftovers`` as the counts the file holds."""
    d = r.get("rehearsal")
    rows = [[k, _value(d.get(k))] for k in FLAT]
    left = d.get("leftovers") or {}
    rows.append(["leftovers", ", ".join(f"{v} {k}" for k, v in sorted(left.items())) or "-"])
    return table(["key", "value"], "lr", rows)


def _p99(phase: dict[str, Any], surface: str) -> str:
    t = (phase.get("ttft_ms") or {}).get(surface) or {}
    return "-" if t.get("p99") is None else fixed(t["p99"], 1)


def rehearsal_events(r: Results) -> str:
    """Per event: the requests in flight during it by outcome; Tab and Chat TTFT p99 (ms) in the
    steady state before it, during it and after it; seconds from the fault until the lab had every
    replica back (the upgrade: until every engine replica was new); the gateways' books after it."""
    d = r.get("rehearsal")
    rows = []
    for name, ev in d["per_event"].items():
        during = ev["during"]
        counts = [num(during["outcomes"].get(o, 0)) for o in OUTCOMES]
        ttft = [" / ".join(_p99(ev[p], s) for p in ("steady", "during", "after")) for s in ("tab", "chat")]
        books = (ev["event"].get("books") or {}).get("exact")
        full = ev["event"].get("back_to_full_s", ev["event"].get("upgrade_s"))
        full_s = "-" if full is None else fixed(full, 1)
        rows.append([name, num(during["requests"]), *counts, *ttft, full_s, _value(books)])
    header = ["event", "in flight", *OUTCOMES, "Tab TTFT p99 before / during / after", "Chat the same"]
    header += ["back to full (s)", "books exact"]
    return table(header, "lrrrrrrrrrrrl", rows)
