"""BENCHMARKS.md's table of the noisy neighbour (:mod:`loadtest.benchmarks.bench_noisy_neighbour`): a runaway
tenant ``a`` beside a light tenant ``b`` on the shared pool, ``a``'s budget off and on."""

from __future__ import annotations

from typing import Any

from loadtest.tables.table_format import Results, fixed, num, table


def _p50_p99(s: dict[str, Any]) -> str:
    """A surface's TTFT p50 / p99 in whole wall-clock ms."""
    if s["ttft_p99_wall_ms"] is None:
        return "-"
    return f"{fixed(s['ttft_p50_wall_ms'], 0)} / {fixed(s['ttft_p99_wall_ms'], 0)}"


def _row(variant: str, d: dict[str, Any], first: bool) -> list[str]:
    """Whole ms and tok/s; the ratio to 2 decimals; load average (1 min) start → end, 1 decimal."""
    v = d["variants"][variant]
    alone, flood = v["b_alone"], v["a_flood"]
    ba, bf = alone["tenants"]["b"], flood["tenants"]["b"]
    a = flood["tenants"]["a"]["agent"]
    label = f"`{d['machine']['git_commit']}`, capacity {d['agent_capacity_per_s']} req/s" if first else ""
    load = f"{fixed(v['load_avg_at_start'][0], 1)} → {fixed(v['load_avg_at_end'][0], 1)}"
    burst = v.get("a_burst_s") or 60  # files before TenantConfig.burst_s record none: a minute's
    budget = "none" if v["a_budget_rpm"] is None else f"{num(v['a_budget_rpm'])} rpm, {num(burst)} s burst"
    ratio = "-" if v["b_tab_p99_ratio"] is None else fixed(v["b_tab_p99_ratio"], 2) + "×"
    allowed = flood["a_admitted_allowance"]
    a_cell = f"{num(a['sent'])} / {num(a['admitted'])}" + ("" if allowed is None else f" ({num(allowed)})")
    why = flood["a_refusals"]
    refused = " / ".join(num(why.get(k, 0)) for k in ("budget", "pushed_out", "admission"))
    agent = f"{num(ba['agent']['admitted'])} of {num(ba['agent']['sent'])} → "
    agent += f"{num(bf['agent']['admitted'])} of {num(bf['agent']['sent'])}"
    goodput = f"{fixed(ba['agent']['goodput_tok_s'], 0)} → {fixed(bf['agent']['goodput_tok_s'], 0)}"
    at_once, every = flood["reject_at_once_p99_ms"], flood["reject_p99_ms"]
    reject = (
        "-" if every is None else f"{fixed(at_once, 0) if at_once is not None else '-'} ({fixed(every, 0)})"
    )
    hung = alone["hung"] + flood["hung"]
    sliced = flood.get("by_slice")  # absent in files before 9353631
    slices = "-" if sliced is None else " / ".join(fixed(x, 0) for x in sliced["b_tab_p99_ms"])
    tab = [_p50_p99(ba["tab"]), _p50_p99(bf["tab"]), ratio, slices]
    return [label, variant, load, budget, *tab, agent, goodput, a_cell, refused, reject, str(hung)]


def noisy_neighbour(r: Results) -> str:
    """noisy_neighbour.json as it stands (its history: git log -p on the file)."""
    d = r.get("noisy_neighbour")
    rows = [_row(variant, d, first=i == 0) for i, variant in enumerate(d["variants"])]
    header = [
        "commit, Agent capacity",
        "variant",
        "load avg",
        "a's budget",
        "b's Tab alone p50 / p99",
        "b's Tab beside a's flood p50 / p99",
        "p99 ratio (goal ≤ 1.2×)",
        "b's Tab p99 by 10 s of the flood",
        "b's Agent admitted: alone → flood",
        "b's Agent goodput tok/s: alone → flood",
        "a sent / admitted (budget allows)",
        "a refused: budget / pushed out / admission",
        "reject p99 at once (all)",
        "hung",
    ]
    return table(header, "lllrrrrrrrrrrr", rows)
