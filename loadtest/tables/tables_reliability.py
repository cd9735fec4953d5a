"""BENCHMARKS.md tables of faults under load, the soak and mid-stream migration. Counts as the
files hold them; seconds to 2 decimals below 1 s, 1 decimal above."""

from __future__ import annotations

from typing import Any

from loadtest.benchmarks.faults import markdown as faults_markdown
from loadtest.tables.table_format import Results, fixed, num, signed, table


def faults_final(r: Results) -> str:
    """faults.json as it stands, through the script's own table (``--markdown``)."""
    return faults_markdown(r.get("faults"))


_ENDINGS = ("completed", "cancelled", "error_event", "error_status", "conn_error", "hung")


def _soak_row(name: str, d: dict[str, Any]) -> list[str]:
    """Sockets: end − start per actor, in the file's order; RSS growth in MB to 1 decimal (slope
    in MB/min to 1), the engines' as a range of whole MB."""
    endings = ", ".join(
        f"{num(d['endings'][k])} {k.replace('_', ' ')}" for k in _ENDINGS if d["endings"].get(k)
    )
    gws = [a for n, a in d["actors"].items() if n.startswith("Gateway#")]
    engines = [a for n, a in d["actors"].items() if n.startswith("backend-")]

    def sockets(actors: list[dict[str, Any]]) -> str:
        return ", ".join(
            signed(a["sockets_end"] - a["sockets_start"], 0)
            if a["sockets_end"] != a["sockets_start"]
            else "0"
            for a in actors
        )

    growth = [a["rss_growth_mb"] for a in engines]
    rss = (
        f"gateways {' / '.join(signed(a['rss_growth_mb'], 1) for a in gws)} MB "
        f"({' / '.join(fixed(a['rss_slope_mb_per_min'], 1) for a in gws)} MB/min); "
        f"engines {signed(min(growth), 0)} to {signed(max(growth), 0)} MB"
    )
    return [
        name,
        num(d["requests"]),
        endings,
        num(d["leaked_tasks"]),
        f"gateways {sockets(gws)}; engines {sockets(engines)}",
        rss,
    ]


def soak(r: Results) -> str:
    rows = [_soak_row(f"{name}.json", r.get(name)) for name in ("soak", "soak_rest", "soak_long")]
    header = [
        "run",
        "requests",
        "endings",
        "leaked tasks",
        "sockets at rest, end − start",
        "RSS growth (slope, 2nd half)",
    ]
    return table(header, "lrlrll", rows)


def migration(r: Results) -> str:
    """migration.json: ratios as recorded, the seam in whole ms, extra prefill in whole tokens."""
    d = r.get("migration")
    counters = ", ".join(f"`{k}` {v}" for k, v in d["gateway_migrations"].items())
    rows = [
        [f"streams on the killed replica ({d['params']['rounds']} rounds)", num(d["killed_replica_streams"])],
        ["completed_after_kill_ratio", f"**{d['completed_after_kill_ratio']}**"],
        [
            "identical to the same request's run without the fault (token ids)",
            str(d["identical_to_reference_ratio"]),
        ],
        ["streams on the other replicas completed", str(d["other_streams_completed_ratio"])],
        [
            "seam TTFT p50 / p99 (last token before the break to the first after, client side)",
            f"{fixed(d['seam_ttft_ms_p50'], 0)} / {fixed(d['seam_ttft_ms_p99'], 0)} ms",
        ],
        [
            "extra prefill tokens per migration (the continuation's prompt: client prompt + tokens sent)",
            f"{fixed(d['extra_prefill_tokens_per_migration_mean'], 0)} mean",
        ],
        ["gateway's `migrations` counters", counters],
    ]
    return table(["measure", "value"], "lr", rows)
