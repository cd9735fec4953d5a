"""BENCHMARKS.md's relay tables (issue 44), rendered from ``loadtest/results/relay.json``: long
streams at fleet concurrency, our gateway beside vllm-router and the direct path, and each relay's
CPU per 1,000 chunks. The run before the per-chunk cut is read from the commit that recorded it."""

from __future__ import annotations

from typing import Any

from loadtest.tables.table_format import Results, fixed, signed, table


def _three(f: dict[str, Any], key: str, digits: int) -> str:
    """vllm-router / floor / ours of one added figure (``key`` with ``{p}`` for the leg's prefix)."""
    vals = [f.get(key.format(p=p)) for p in ("peer_", "floor_", "")]
    return " / ".join("-" if v is None else signed(v, digits) for v in vals)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{fixed(x, 3)}×"


def _rows(d: dict[str, Any]) -> list[list[str]]:
    rows = []
    for level, f in d["by_level"].items():
        rows.append(
            [
                level[1:],
                fixed(f[f"direct_{level}_chunks_per_s"], 0),
                _ratio(f.get(f"peer_{level}_cps_ratio")),
                _ratio(f.get(f"floor_{level}_cps_ratio")),
                f"**{_ratio(f.get(f'{level}_cps_ratio'))}**",
                fixed(f[f"engine_{level}_chunks_per_s"], 0),
                _three(f, f"{{p}}{level}_added_ttft_p50_ms", 1),
                _three(f, f"{{p}}{level}_added_ttft_p99_ms", 1),
                _three(f, f"{{p}}{level}_added_gap_p99_ms", 1),
            ]
        )
    return rows


HEADER = [
    "streams",
    "direct chunks/s",
    "vllm-router, × direct",
    "floor, × direct",
    "ours (provider), × direct",
    "ours (engine), chunks/s",
    "added TTFT p50 (ms): vllm-router / floor / ours",
    "added TTFT p99 (ms)",
    "added gap p99 (ms)",
]


def relay(r: Results, at: str | None = None) -> str:
    """relay.json: per concurrency, chunks/s (to the chunk) and as a share of direct (3 decimals),
    added TTFT and inter-chunk gap in ms (1 decimal): vllm-router, the floor, ours."""
    return table(HEADER, "r" * len(HEADER), _rows(r.get("relay", at=at)))


def _cpu_rows(d: dict[str, Any]) -> list[list[str]]:
    keys = ("peer_cpu_ms_per_1k_chunks", "floor_cpu_ms_per_1k_chunks")
    keys += ("cpu_ms_per_1k_chunks_provider", "cpu_ms_per_1k_chunks_engine")
    return [
        [level[1:]] + ["-" if f.get(k) is None else fixed(f[k], 1) for k in keys]
        for level, f in d["by_level"].items()
    ]


CPU_HEADER = ["streams", "vllm-router", "floor (no logic, our shape)", "ours, provider", "ours, engine"]


def relay_cpu_summary(r: Results, at: str | None = None) -> str:
    """relay.json: each relay's CPU per 1,000 chunks (ms, 1 decimal) at each concurrency."""
    return table(CPU_HEADER, "rrrrr", _cpu_rows(r.get("relay", at=at)))
