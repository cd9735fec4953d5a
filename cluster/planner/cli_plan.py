"""``cluster plan``: the capacity planner (:mod:`cluster.planner.capacity`) as a terminal table or JSON.

    cluster plan --config configs/gpu.yaml --demand configs/demand-example.yaml [--json]

Exit status 2 for a bad config or demand file (the message names the field), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence

from cluster.config import load_config
from cluster.planner.capacity import Plan, RoutePlan, plan
from cluster.planner.demand import load_demand

_NUMERIC = re.compile(r"^(-|\d[\d.,]*( ?(%|k|M|G|KiB|MiB|GiB|TiB|B))?( \(.*\))?)$")  # right-aligned


def add_plan_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "plan",
        help="capacity plan: demand vs provider RPM/TPM, KV memory, compute and bandwidth",
        description="Size the cluster for a peak demand: the binding constraint per route, replicas, "
        "GPUs, cost self-hosted vs provider, and a prefix-cache what-if.",
    )
    p.add_argument("--config", required=True, help="cluster config (configs/*.yaml)")
    p.add_argument("--demand", required=True, help="demand file (see configs/demand-example.yaml)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    result = plan(cfg, load_demand(args.demand))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(render(result, title=f"Capacity plan: {args.config} + {args.demand}"))
    return 0


# --- rendering ---------------------------------------------------------------------------------


def render(result: Plan, title: str = "Capacity plan") -> str:
    a = result.assumptions
    out = [
        f"{title}  (GPU ${a['gpu_hourly_usd']:.2f}/h, headroom {a['headroom']:.0%}, "
        f"mean/peak load {a['average_over_peak']:.2f}; TTFT = p95, ITL = mean)",
        "",
        "Demand at peak",
        _demand_table(result),
    ]
    if any(r.self_hosted is not None for r in result.routes):
        out += [
            "",
            "Self-hosted (per replica at the largest batch that meets the objectives; peak concurrency "
            "= QPS x latency, all replicas)",
            _self_hosted_table(result),
        ]
    if any(r.providers for r in result.routes):
        out += [
            "",
            "Providers (the route's whole demand against each candidate's caps)",
            _provider_table(result),
        ]
    out += ["", "Cost per route: self-hosted (its share of the GPUs, all day) vs the cheapest provider"]
    out.append(
        _table(["route", "binding", "self $/1M", "self $/day", "provider", "$/1M", "$/day"], _costs(result))
    )
    if result.backends:
        out += ["", f"Per backend (what-if: prefix-cache hit rate {a['cache_what_if_points']:+g} points)"]
        out.append(_backend_table(result))
    out += ["", _totals_line(result)]
    warnings = _warnings(result)
    if warnings:
        out += ["", "Warnings", *warnings]
    return "\n".join(out)


def _demand_table(result: Plan) -> str:
    header = ["route", "QPS", "req/min", "input tok/min", "cached", "output tok/min", "planned on"]
    rows = [
        [
            _route(r),
            _num(r.peak_qps),
            _num(r.demand.requests_per_min),
            _num(r.demand.input_tokens_per_min),
            f"{r.cached_fraction:.0%}",
            _num(r.demand.output_tokens_per_min),
            r.primary,
        ]
        for r in result.routes
    ]
    return _table(header, rows)


_SELF_HOSTED_HEADER = [
    "route",
    "backend",
    "profile",
    "SLO ms",
    "KV/req",
    "KV/replica",
    "max batch",
    "batch",
    "ITL ms",
    "TTFT95 ms",
    "req/s",
    "peak conc.",
    "replicas",
    "binding",
]


def _self_hosted_table(result: Plan) -> str:
    rows = []
    for r in result.routes:
        h = r.self_hosted
        if h is None:
            continue
        alt = "" if r.primary_kind == "self-hosted" else " (alt.)"
        rows.append(
            [
                _route(r),
                f"{h.backend}{alt}",
                h.profile,
                f"{_ms(r.ttft_slo_ms)}/{_ms(r.itl_slo_ms)}",
                _bytes(h.kv_bytes_per_request),
                _bytes(h.kv_capacity_bytes),
                f"{h.max_batch} ({_short(h.max_batch_bound)})",
                str(h.batch),
                f"{h.itl_ms:.1f}",
                f"{h.ttft_p95_ms:.0f}",
                f"{h.requests_per_s_per_replica:.2f}",
                _num(h.peak_concurrency),
                f"{h.replicas:.2f}" if h.feasible else "-",
                _binding(h.binding, h.slo_limit) + ("" if h.feasible else ": SLO unreachable"),
            ]
        )
    return _table(_SELF_HOSTED_HEADER, rows)


def _provider_table(result: Plan) -> str:
    rows = [
        [
            _route(r),
            p.backend + (" (primary)" if p.backend == r.primary else ""),
            _pct(p.rpm_utilization),
            _pct(p.tpm_utilization),
            p.binding + ("" if p.fits else " (over cap)"),
            f"{p.usd_per_mtok:.3f}",
            _num(p.usd_per_day),
        ]
        for r in result.routes
        for p in r.providers
    ]
    return _table(["route", "provider", "RPM used", "TPM used", "binding", "$/1M tok", "$/day"], rows)


def _backend_table(result: Plan) -> str:
    header = ["backend", "profile", "replicas", "GPUs", "$/day", "binding", "GPUs saved", "$/day saved"]
    rows = [
        [
            b.backend,
            b.profile,
            f"{b.replicas} ({b.replicas_exact:.2f})",
            str(b.gpus),
            _num(b.usd_per_day),
            b.binding,
            "-" if b.what_if_gpus_saved is None else str(b.what_if_gpus_saved),
            "-" if b.what_if_usd_per_day_saved is None else _num(b.what_if_usd_per_day_saved),
        ]
        for b in result.backends
    ]
    return _table(header, rows)


def _totals_line(result: Plan) -> str:
    t = result.totals
    return (
        f"Total: {t['gpus']:.0f} GPUs, ${_num(t['self_hosted_usd_per_day'])}/day self-hosted, "
        f"${_num(t['provider_usd_per_day'])}/day on providers (routes planned on them); "
        f"cache what-if saves {t['what_if_gpus_saved']:.0f} GPUs and "
        f"${_num(t['what_if_usd_per_day_saved'])}/day."
    )


def _warnings(result: Plan) -> list[str]:
    warnings = [f"  {_route(r)}: {w}" for r in result.routes for w in r.warnings]
    warnings += [
        f"  {b.backend}: not counted (objectives unreachable): {', '.join(b.unplanned_routes)}"
        for b in result.backends
        if b.unplanned_routes
    ]
    return warnings


def _costs(result: Plan) -> list[list[str]]:
    rows = []
    for r in result.routes:
        h = r.self_hosted
        cheapest = min(r.providers, key=lambda p: p.usd_per_mtok, default=None)
        rows.append(
            [
                _route(r),
                _binding(r.binding, h.slo_limit if h and r.primary_kind == "self-hosted" else ""),
                f"{h.usd_per_mtok:.3f}" if h and h.feasible else "-",
                _num(h.usd_per_day) if h and h.feasible else "-",
                cheapest.backend if cheapest else "-",
                f"{cheapest.usd_per_mtok:.3f}" if cheapest else "-",
                _num(cheapest.usd_per_day) if cheapest else "-",
            ]
        )
    return rows


def _route(r: RoutePlan) -> str:
    return f"{r.surface}/{r.model.rsplit('/', 1)[-1]}"


def _binding(binding: str, slo: str) -> str:
    return f"{binding} ({slo})" if slo else binding


def _short(bound: str) -> str:
    return {"KV memory": "KV", "max_num_seqs": "seqs", "token budget": "budget"}.get(bound, bound)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _pct(x: float | None) -> str:
    return "no cap" if x is None else f"{x:.0%}"


def _num(x: float) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def _bytes(x: float) -> str:
    for div, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if x >= div:
            return f"{x / div:.3g} {unit}"
    return f"{x:.0f} B"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    num = [bool(rows) and all(_NUMERIC.match(row[i]) for row in rows) for i in range(len(headers))]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if num[i] else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join(x.rstrip() for x in [fmt(headers), line, *(fmt(r) for r in rows)])
