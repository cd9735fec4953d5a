"""BENCHMARKS.md tables of affinity against peers (affinity.json, one scenario per table). Hit
rates to 3 decimals; TTFT in simulated ms (1 decimal for groups, whole ms elsewhere)."""

from __future__ import annotations

from typing import Any

from loadtest.table_format import Results, fixed, table

# How the page names each policy (the file's key otherwise), in the order the rows are shown;
# each table shows the policies its scenario holds, known ones first.
POLICY_LABELS = {
    "round_robin": "round_robin",
    "power_of_two": "power_of_two",
    "ray_prefix": "ray_prefix",
    "least_loaded": "least_loaded",
    "cache_aware+previous": "cache_aware+previous (before issue 17)",
    "cache_aware": "cache_aware (ours)",
    "cache_aware+proposed": "ours + proposed change",
    "cache_aware+2gw": "cache_aware, 2 gateway replicas",
}
_KV_LIVE_LABELS = {**POLICY_LABELS, "cache_aware": "cache_aware (now)"}
WHATIF_LABELS = {
    "previous (routed records)": (
        "ours before issue 17 (routed-record index, rendezvous home, no match ratio)"
    ),
    "previous (kv events)": "same, index fed by KV events",
    "cache_aware (routed records)": "ours now without KV events (`affinity.kv_events: false`)",
    "cache_aware (kv events)": (
        "**ours now** (KV events, `min_match_ratio` 0.5, new prefix to the least loaded)"
    ),
    "cache_aware (kv events, 2 gateways)": "ours now, 2 gateway replicas on the same events",
    "ray_prefix (emulated)": "Ray's prefix router (emulated)",
}


def _ordered(held: dict[str, Any], labels: dict[str, str]) -> list[tuple[str, str]]:
    """(key, label) of every entry ``held`` has: the labelled ones in label order, then the rest."""
    known = [(k, label) for k, label in labels.items() if k in held]
    return known + [(k, k) for k in held if k not in labels]


def _scenario(r: Results, name: str) -> dict[str, Any]:
    return r.get("affinity")["scenarios"][name]


def _ttft(p: dict[str, Any], digits: int) -> str:
    return " / ".join(fixed(p[f"ttft_{q}_sim_ms"], digits) for q in ("p50", "p90", "p99"))


def _per_replica(p: dict[str, Any], replicas: int) -> str:
    """The file lists the replicas that served requests; the scenario's others served none (0)."""
    counts = list(p["requests_per_replica"])
    return ", ".join(str(n) for n in counts + [0] * (replicas - len(counts)))


def groups(r: Results) -> str:
    pol = _scenario(r, "groups")["policies"]
    rows = [
        [label, fixed(pol[k]["hit_rate"], 3), _ttft(pol[k], 1)] for k, label in _ordered(pol, POLICY_LABELS)
    ]
    return table(["policy", "hit rate", "TTFT p50 / p90 / p99 ms"], "lll", rows)


def common_prompt(r: Results) -> str:
    s = _scenario(r, "common-prompt")
    pol, n = s["policies"], s["setup"]["replicas"]
    rows = [
        [label, fixed(pol[k]["hit_rate"], 3), _ttft(pol[k], 0), _per_replica(pol[k], n)]
        for k, label in _ordered(pol, POLICY_LABELS)
    ]
    return table(["policy", "hit rate", "TTFT p50 / p90 / p99 ms", "requests per replica"], "llll", rows)


def kv_pressure_live(r: Results) -> str:
    s = _scenario(r, "kv_pressure")
    pol, n = s["policies"], s["setup"]["replicas"]
    rows = [
        [label, fixed(pol[k]["hit_rate"], 3), _ttft(pol[k], 0), _per_replica(pol[k], n)]
        for k, label in _ordered(pol, _KV_LIVE_LABELS)
    ]
    return table(["policy", "hit rate", "TTFT p50 / p90 / p99 sim ms", "requests per replica"], "llll", rows)


def _mean_and_range(v: dict[str, Any]) -> str:
    """The mean over the tie-break seeds, with their range where the seeds disagree."""
    seeds = v.get("hit_rate_per_tie_seed") or [v["hit_rate"]]
    mean = fixed(v.get("hit_rate_mean", v["hit_rate"]), 3)
    lo, hi = fixed(min(seeds), 3), fixed(max(seeds), 3)
    return mean if lo == hi else f"{mean} ({lo}–{hi})"


def kv_pressure_virtual(r: Results) -> str:
    s = _scenario(r, "kv_pressure")
    whatif = s["virtual_clock_whatif"]
    rows = [
        [
            label,
            _mean_and_range(whatif[k]),
            fixed(whatif[k].get("ttft_p90_sim_ms_mean", whatif[k]["ttft_p90_sim_ms"]), 0),
        ]
        for k, label in _ordered(whatif, WHATIF_LABELS)
    ]
    head = f"kv_pressure (oracle {fixed(s['oracle_hit_rate'], 3)})"
    return table([head, "hit rate", "TTFT p90 sim ms"], "lll", rows)
