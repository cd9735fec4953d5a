"""BENCHMARKS.md tables of the engine model, the GPU profiles, the capacity planner, the affinity
decision's cost and hedging."""

from __future__ import annotations

from typing import Any

from cluster.engine.profiles import BatchShape, get_profile
from loadtest.benchmarks.planner_real import real_markdown
from loadtest.benchmarks.planner_validation import markdown as planner_markdown
from loadtest.tables.table_format import Results, fixed, pct, table

_FIDELITY_NAMES = {  # the file's variant keys, as the page names them
    "profile": "profile",
    "profile+latency": "profile + request latency",
    "linear-ttft": "linear-ttft",
    "extended+latency": "extended + latency",
    "calibrated": "calibrated",
}


def _headline(d: dict[str, Any]) -> str:
    """The variant the file's headline figures are: named since 1167c9a; before, the one whose
    errors the headline copied."""
    if "headline_variant" in d:
        return str(d["headline_variant"])
    pair = (d["ttft_median_error"], d["e2e_median_error"])
    return next(
        k for k, v in d["variants"].items() if (v["ttft_median_error"], v["e2e_median_error"]) == pair
    )


def engine_fidelity(r: Results) -> str:
    """engine_fidelity.json ``variants``: ms to 1 decimal, errors as % to 1 decimal."""

    def pair(v: dict[str, Any], key: str, q: str) -> str:
        return f"{fixed(v[key + '_real_ms'][q], 1)} / {fixed(v[key + '_sim_ms'][q], 1)}"

    rows = []
    d = r.get("engine_fidelity")
    for key, v in d["variants"].items():
        ttft_err, e2e_err = pct(v["ttft_median_error"]), pct(v["e2e_median_error"])
        name = _FIDELITY_NAMES.get(key, key)
        if key == _headline(d):
            name, ttft_err, e2e_err = f"**{name}** (headline)", f"**{ttft_err}**", f"**{e2e_err}**"
        ttft = [pair(v, "ttft", "p50"), pair(v, "ttft", "p90"), ttft_err]
        rows.append([name, str(v["n"]), *ttft, pair(v, "e2e", "p50"), pair(v, "e2e", "p90"), e2e_err])
    header = ["Sim model", "n", "TTFT p50 real / sim (ms)", "TTFT p90 real / sim (ms)", "TTFT median err"]
    header += ["E2E p50 real / sim (ms)", "E2E p90 real / sim (ms)", "E2E median err"]
    return table(header, "lrrrrrrr", rows)


GPU_PROFILES = {
    "llama-3.1-8b-h100": "Llama-3.1-8B, 1× H100 SXM",
    "llama-3.1-8b-h200": "Llama-3.1-8B, 1× H200",
    "llama-3.1-70b-h100-tp4": "Llama-3.1-70B, 4× H100 (TP=4)",
}
CONTEXT, CHUNK = 1024, 8192  # decode at 1,024 tokens of context per sequence; one 8,192-token prefill


def gpu_profiles(_: Results) -> str:
    """Not measured: computed here from cluster/engine/profiles.py's step-time model. ITL in ms to 2
    decimals, prefill tokens/s to the token, KV capacity = KV blocks x block size."""
    rows = []
    for name, label in GPU_PROFILES.items():
        p = get_profile(name)
        step = p.step_time_model().step_time
        d1, d64 = (
            step(BatchShape(decode_tokens=b, kv_read_tokens=b * CONTEXT, attn_pairs=b * CONTEXT))
            for b in (1, 64)
        )
        causal = CHUNK * (CHUNK + 1) // 2  # the chunk's query x key pairs
        prefill = step(BatchShape(prefill_tokens=CHUNK, kv_read_tokens=CHUNK, attn_pairs=causal))
        kv = p.num_kv_blocks() * p.engine.block_size
        rows.append([label, fixed(d1 * 1e3, 2), fixed(d64 * 1e3, 2), fixed(CHUNK / prefill, 0), f"{kv:,}"])
    caption = (
        "Computed, not measured: `python -m loadtest.tables.bench_tables` evaluates "
        "`cluster/engine/profiles.py`'s step-time model for these rows (no result file holds them).\n\n"
    )
    header = ["profile", "decode ITL batch 1 (ms)", "decode ITL batch 64 (ms)", "prefill tokens/s"]
    return caption + table([*header, "KV capacity (tokens)"], "lrrrr", rows)


def planner_validation(r: Results) -> str:
    """planner_validation.json ``cases``, through the script's own table (req/s to 2 decimals,
    concurrency to 1, errors as % to 1)."""
    return planner_markdown(r.get("planner_validation")["cases"])


def planner_real(r: Results) -> str:
    """planner_validation.json ``real``, through the script's own table (2 decimals, errors as % to
    1); a line saying so when the file has no real run."""
    real = r.get("planner_validation").get("real")
    return real_markdown(real) if real else "No real deployment in this run (`--no-real`)."


_MICRO_CASES = {
    "prefix_hit": "prefix hit ({matched_blocks} blocks matched)",
    "prefix_hit_holder_over_bound": "prefix holder over the load bound (diverted)",
    "new_prefix_rendezvous": "new prefix (rendezvous home)",
    "session_sticky": "session sticky",
    "short_prompt_load_only": "short prompt, load only",
}


def _us(x: float) -> str:
    return fixed(x, 0) if x >= 100 else fixed(x, 1)  # µs: 1 decimal below 100, whole above


def affinity_micro(r: Results) -> str:
    """affinity_micro.json: p50 / p99 µs (1 decimal below 100 µs, whole µs above)."""
    d = r.get("affinity_micro")
    rows = [
        [label.format(**d["decide"][k]), _us(d["decide"][k]["p50_us"]), _us(d["decide"][k]["p99_us"])]
        for k, label in _MICRO_CASES.items()
    ]
    h = d["hash_4096_tokens"]["tuple"]
    rows.append(
        [
            f"hashing the {d['prompt_tokens']:,} tokens (done once per request, off the event loop)",
            _us(h["p50_us"]),
            _us(h["p99_us"]),
        ]
    )
    return table(["case", "p50 µs", "p99 µs"], "lrr", rows)


_HEDGE_VARIANTS = {
    "no_fault": "no fault",
    "hedge_off": "faults, hedging off",
    "hedge_on": "faults, hedging on",
}


def hedging_window(r: Results) -> str:
    """hedging.json ``legs.*.feasibility`` (loadtest/benchmarks/hedge_bound.py): ms to 1 decimal."""
    rows = []
    for leg, d in r.get("hedging")["legs"].items():
        w = d.get("feasibility")
        if not w or w.get("feasible") is None:
            continue
        earliest = fixed(w["earliest_delay_ms"], 1) if w["earliest_delay_ms"] is not None else "none"
        rows.append(
            [
                leg,
                f"{fixed(w['no_fault_p50_ms'], 1)} / {fixed(w['no_fault_p99_ms'], 1)}",
                fixed(w["limit_ms"], 1),
                str(w["false_hedges_allowed"]),
                earliest,
                fixed(w["floor_ms"], 1),
                fixed(w["latest_delay_ms"], 1),
                "open" if w["feasible"] else "closed",
            ]
        )
    header = [
        "leg",
        "no-fault TTFT p50 / p99 (ms)",
        "limit: 1.5 × p99 (ms)",
        "hedges left for normal calls",
        "earliest delay the budget allows (ms)",
        "policy floor (ms)",
        "latest delay a hedge can still win by (ms)",
        "window",
    ]
    return table(header, "lrrrrrrl", rows)


def hedging(r: Results) -> str:
    """hedging.json ``legs``: ms to 1 decimal, extra requests as % to 1 decimal; the upstream
    columns are the engines' or the loopback server's own counts."""
    rows = []
    for leg, d in r.get("hedging")["legs"].items():
        for key, label in _HEDGE_VARIANTS.items():
            v = d["variants"][key]
            up = v["upstream"]
            hedged = f"{v['hedged']} / {v['hedges_won']}" if v["hedged"] else "–"
            extra = pct(v["extra_request_ratio"]) if v["extra_request_ratio"] else "0"
            rows.append(
                [
                    leg,
                    label,
                    fixed(v["ttft_p50_ms"], 1),
                    fixed(v["ttft_p99_ms"], 1),
                    hedged,
                    extra,
                    f"{up['losers']} / {up['losers_not_cancelled']}",
                ]
            )
    header = [
        "leg",
        "variant",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "hedged / hedge won",
        "extra upstream requests",
        "losers upstream / not cancelled",
    ]
    return table(header, "llrrrrr", rows)


def warmup(r: Results) -> str:
    """A fresh replica's first requests against its steady state, its warm-up on and off
    (:mod:`loadtest.benchmarks.bench_warmup`): TTFT at the client, ms."""
    d = r.get("warmup")
    rows = []
    for run in d["runs"]:
        first, steady = run["first"], run["steady"]
        reports = [x for x in run["replica_warmup_report"].values() if x]
        took = fixed(reports[0]["total_ms"], 0) if reports else "—"
        rows.append(
            [
                run["engine"] + (" (simulated)" if run["simulated"] else ""),
                "on" if run["warmup"] else "off",
                took,
                f"{fixed(first['ttft_ms_p50'], 1)} / {fixed(first['ttft_ms_max'], 1)}",
                f"{fixed(steady['ttft_ms_p50'], 1)} / {fixed(steady['ttft_ms_max'], 1)}",
                fixed(run["first_max_over_steady_p50"], 2),
                f"{first['ok']} of {first['n']}",
            ]
        )
    header = [
        "engine",
        "warm-up",
        "warm-up took (ms)",
        "first requests TTFT p50 / max",
        "steady TTFT p50 / max",
        "first max / steady p50",
        "first answered",
    ]
    return table(header, "llrrrrr", rows)
