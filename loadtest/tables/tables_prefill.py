"""BENCHMARKS.md's table of Tab kept off replicas mid-prefill
(:mod:`loadtest.benchmarks.bench_prefill_avoid`), on the virtual clock: one row per workload, Agent rate and
gateway count, the seeds side by side."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loadtest.tables.table_format import Results, fixed, num, table


def _by_load(d: dict[str, Any]) -> dict[tuple[str, float, int], list[dict[str, Any]]]:
    rows: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
    for run in d["runs"]:
        rows.setdefault((run["workload"], run["agent_rate"], run["gateways"]), []).append(run)
    return rows


def _on(run: dict[str, Any]) -> dict[str, Any]:
    """The first threshold's variant (the shipped 512 in the default run; not the what-ifs)."""
    return next(v for k, v in run.items() if k.startswith("on_"))


def _seeds(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], float], digits: int = 0) -> str:
    """``off → on`` per seed (``get`` of each variant), ``/`` between seeds, ``digits`` decimals."""
    off = " / ".join(fixed(get(r["off"]), digits) for r in runs)
    on = " / ".join(fixed(get(_on(r)), digits) for r in runs)
    return f"{off} → {on}"


def gains(d: dict[str, Any], workload: str, gateways: int) -> list[float]:
    """Tab's p99 off over on, each load and seed of one workload at one gateway count."""
    return [
        r["off"]["tab"]["ttft_p99_ms"] / _on(r)["tab"]["ttft_p99_ms"]
        for r in d["runs"]
        if r["workload"] == workload and r["gateways"] == gateways
    ]


def prefill_avoid(r: Results) -> str:
    d = r.get("prefill_avoid")
    rows = []
    for (workload, rate, gateways), runs in _by_load(d).items():
        tokens = [(x["off"]["agent"]["output_tokens"], _on(x)["agent"]["output_tokens"]) for x in runs]
        agent = " / ".join(num(a) for a, _ in tokens)
        agent = (
            f"{agent} (on: the same)"
            if all(a == b for a, b in tokens)
            else f"{agent} → " + " / ".join(num(b) for _, b in tokens)
        )
        rows.append(
            [
                workload,
                num(rate),
                str(gateways),
                _seeds(runs, lambda v: v["tab"]["ttft_p50_ms"]),
                _seeds(runs, lambda v: v["tab"]["ttft_p99_ms"]),
                " / ".join(num(_on(x)["avoided_prefill"]) for x in runs),
                agent,
                _seeds(runs, lambda v: v["hit_rate"], 3),
            ]
        )
    header = [
        "workload",
        "Agent req/s",
        "gateways",
        "Tab TTFT p50 off → on (per seed)",
        "Tab TTFT p99 off → on (per seed)",
        "decisions that avoided (per seed)",
        "Agent output tokens off (per seed)",
        "prefix hit rate off → on (per seed)",
    ]
    return table(header, "lrrrrrrr", rows)


def prefill_avoid_shared(r: Results) -> str:
    """Two gateways: Tab's p99 per seed without the threshold, with it (each gateway its own count),
    and with every engine's count shared every S seconds (the what-ifs), whole virtual ms."""
    loads = [(w, rate, runs) for (w, rate, gw), runs in _by_load(r.get("prefill_avoid")).items() if gw > 1]
    names = [k for k in loads[0][2][0] if k == "off" or k.startswith(("on_", "shared_"))] if loads else []
    rows = [
        [w, num(rate), *(" / ".join(fixed(x[k]["tab"]["ttft_p99_ms"], 0) for x in runs) for k in names)]
        for w, rate, runs in loads
    ]
    header = ["workload", "Agent req/s", *(f"Tab p99 {k} (per seed)" for k in names)]
    return table(header, "l" + "r" * (len(header) - 1), rows)
