"""BENCHMARKS.md's control-plane tables (issue 42): ``control_plane.json``, the design before the
issue (``before_``), the changed index on the long poll (``poll_``) and pushed (``after_``), side by
side; and the indexer design measured in the simulation (``indexer_``, not wired into the gateway:
cluster/routing/index_mirror.py), whose own process has a column of its own."""

from __future__ import annotations

from loadtest.tables.table_format import Results, fixed, num, pct, table

_DESIGNS = {"before": "before", "poll": "after, polled", "after": "after, pushed", "indexer": "indexer"}


def control_plane(r: Results) -> str:
    """Each sweep point at the largest N or M: gateway CPU in cores (2 decimals), its transport
    share, engine CPU as a share of a core (2 decimals of a %), lag ms (1 decimal), decision µs
    (1 decimal), index MB (whole)."""
    d = r.get("control_plane")
    rows = []
    for key, label in _DESIGNS.items():
        sweep = d.get(f"{key}_sweep", [])
        n_max, m_max = max((p["n"] for p in sweep), default=0), max((p["m"] for p in sweep), default=0)
        for p in sweep:  # growth in N at the most gateways, in M at the most engines (the file has all)
            if (p["n"] != n_max or key == "indexer") and p["m"] != m_max:
                continue
            rows.append(
                [
                    f"{label}, N {p['n']}, M {p['m']}",
                    fixed(p["gateway_cpu_share"], 2),
                    fixed(p["gateway_http_cpu_share"], 2),
                    fixed(p["indexer_cpu_share"], 2) if "indexer_cpu_share" in p else "",
                    pct(p["engine_cpu_share"], 2),
                    f"{fixed(p['lag_p50_ms'], 1)} / {fixed(p['lag_p99_ms'], 1)}",
                    f"{fixed(p['decision_p50_us'], 1)} / {fixed(p['decision_p99_us'], 1)}",
                    fixed(p["index_mb"], 0),
                    num(p["connections_total"]),
                ]
            )
    header = [
        "design, engines N, gateways M",
        "gateway CPU (cores)",
        "of it transport",
        "indexer CPU",
        "engine CPU",
        "lag p50 / p99 ms",
        "decision p50 / p99 µs",
        "index MB",
        "connections",
    ]
    return table(header, "lrrrrrrrr", rows)


def control_plane_fits(r: Results) -> str:
    """The growth exponents (3 decimals) and where a gateway's control plane reaches 5 % of a core
    and a whole core (engines, 1 decimal)."""
    d = r.get("control_plane")
    rows = []
    for key, label in _DESIGNS.items():
        f = d.get(f"{key}_fits")
        if f is None:
            continue
        rows.append(
            [
                label,
                fixed(f["gateway_cpu_share_exponent_in_n"], 3),
                fixed(f["engine_cpu_share_exponent_in_m"], 3),
                fixed(f["index_mb_exponent_in_n"], 3),
                fixed(f["gateway_n_at_5pct_core"], 1),
                fixed(f["gateway_n_at_one_core"], 1),
            ]
        )
    header = [
        "design",
        "gateway CPU ~ N^b: b",
        "engine CPU ~ M^b: b",
        "index MB ~ N^b: b",
        "N at 5 % of a core",
        "N at one core",
    ]
    return table(header, "lrrrrr", rows)
