"""BENCHMARKS.md's first table: each benchmark's command, result file, goal and status. Goals are
the issues' targets, written here (they are not measurements); every figure in a status comes
from the result file, and met / missed is computed against the goal."""

from __future__ import annotations

from collections.abc import Callable

from loadtest.tables.table_format import Results, fixed, pct, signed, table
from loadtest.tables.tables_load import hung_requests, refusal_p99_inside, tab_beside_agent
from loadtest.tables.tables_prefill import gains


def _pct(ratio: float) -> str:
    return pct(ratio)[:-1] + " %"  # the page's style in this table: "6.5 %"


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def _fidelity(r: Results) -> str:
    d = r.get("engine_fidelity")
    e2e, ttft = d["e2e_median_error"], d["ttft_median_error"]
    return f"E2E {_pct(e2e)} {_met(e2e <= d['goal'])}; TTFT {_pct(ttft)} {_met(ttft <= d['goal'])}"


def _planner(r: Results) -> str:
    d = r.get("planner_validation")

    def pair(t: float, c: float) -> str:
        return f"{_pct(t)} / {_pct(c)} {_met(max(t, c) <= d['goal'])}"

    if d.get("against") != "real vLLM-CPU deployment":  # a file from before the real leg
        return pair(d["throughput_error"], d["concurrency_error"])
    if d["throughput_error"] is None:  # the real leg ran but could not be compared (its problems say why)
        real = "not compared"
    else:
        real = pair(d["throughput_error"], d["concurrency_error"])
        if "within_objective" not in d["real"]["throughput_errors"]:
            real += " (saturation only: no level met the objective)"
    return f"real engines {real}; simulator {pair(d['sim_throughput_error'], d['sim_concurrency_error'])}"


def _micro(r: Results) -> str:
    d = r.get("affinity_micro")
    p50 = [c["p50_us"] for c in d["decide"].values()]  # every decision case
    return f"{fixed(min(p50), 0)}–{fixed(max(p50), 0)} µs p50 {_met(d['goal_met'])}"


def _kv_pressure(r: Results) -> str:
    """The goals on the virtual clock (the file's workload), then live (sim replicas through Serve,
    against Ray's emulation, which cannot be deployed live) and over the other workload seeds."""
    s = r.get("affinity")["scenarios"]
    fits, kv = s["fits"]["goals"]["virtual_clock"], s["kv_pressure"]["goals"]["virtual_clock"]

    def verdict(minus: float, over: float) -> str:
        ok = minus >= 0.05 and over >= 1.3
        return f"{'met' if ok else 'not'} ({signed(minus, 3)}, {fixed(over, 2)}×)"

    out = (
        f"fits {_met(fits['hit_rate_vs_oracle'] >= 0.95)}; kv_pressure virtual "
        f"{verdict(kv['hit_rate_minus_ray'], kv['ttft_p90_ray_over_ours'])}"
    )
    whatif = s["kv_pressure"]["virtual_clock_whatif"]
    ray, live = whatif["ray_prefix (emulated)"], s["kv_pressure"]["policies"].get("cache_aware")
    if live:
        live_v = verdict(live["hit_rate"] - ray["hit_rate"], ray["ttft_p90_sim_ms"] / live["ttft_p90_sim_ms"])
        out += f"; live {live_v}"
    seeds = whatif.get("other_workload_seeds")
    if seeds:
        m = seeds["mean"]
        minus = m["home"]["hit_rate"] - m["ray_prefix (emulated)"]["hit_rate"]
        over = m["ray_prefix (emulated)"]["ttft_p90_sim_ms"] / m["home"]["ttft_p90_sim_ms"]
        out += f", seeds {seeds['seeds'][0]}–{seeds['seeds'][-1]} {verdict(minus, over).split(' (')[0]}"
    return out + f", 2 gateways {_met(kv['two_gateways_minus_one'] <= 0.02)}"


def _affinity_vllm(r: Results) -> str:
    """kv_pressure's means over the rounds: ours against each peer the file holds."""
    pol = r.get("affinity_vllm")["scenarios"]["kv_pressure"]["policies"]
    ours, cells = pol["ours"], []
    for key, name in (("ray_prefix", "Ray"), ("vllm_router_cache_aware", "vllm-router")):
        peer = pol.get(key)
        if peer and peer.get("hit_rate") is not None:
            minus = ours["hit_rate"] - peer["hit_rate"]
            over = peer["ttft_p90_ms"] / ours["ttft_p90_ms"]
            cells.append(
                f"vs {name} hit rate {signed(minus, 3)} {_met(minus >= 0.05)}, TTFT p90 {fixed(over, 2)}× "
                f"{_met(over >= 1.3)}"
            )
    rounds = ours.get("rounds", 1)
    return "; ".join(cells) + f" ({rounds} round{'s' if rounds != 1 else ''})"


def _overload_shared(r: Results) -> str:
    """The sim pool's goals against its file: the feature's variant at the highest factor (``on``,
    against ``off`` for the goodput), hung requests over every phase of both variants."""
    d = r.get("overload_shared")
    variants = d["variants"]
    hung = sum(hung_requests(v) for v in variants.values())
    top = f"agent_x{max(d['factors']):g}"
    on, off = variants["on"][top], variants["off"][top]
    tab = on["surfaces"]["tab"]["ttft_p99_wall_ms"]
    ratio = on["surfaces"]["agent"]["goodput_tok_s"] / off["surfaces"]["agent"]["goodput_tok_s"]
    reject = on["reject_p99_ms"]
    inside = refusal_p99_inside(on)
    where = "" if inside is None else f" ({fixed(inside, 1)} inside the gateway)"
    return (
        f"Tab p99 {fixed(tab, 0)} ms {_met(tab <= 100)}; goodput {_pct(ratio)} {_met(ratio >= 0.8)}; "
        f"reject p99 {fixed(reject, 0)} ms {_met(reject <= 5)}{where}; {hung} hung {_met(hung == 0)}"
    )


def _overload_shared_vllm(r: Results) -> str:
    """Tab's p99 at the highest factor against Tab alone (:func:`tab_beside_agent`)."""
    if not r.exists("overload_shared_vllm"):
        return "not run"
    t = tab_beside_agent(r.get("overload_shared_vllm"))
    loaded, alone = t.tab_p99_ms, t.alone_p99_ms
    share = t.goodput_on / t.goodput_off
    reject = t.top["reject_p99_ms"]
    return (
        f"Tab p99 {fixed(loaded / alone, 1)}× alone {_met(loaded <= 1.5 * alone)}; goodput {_pct(share)} "
        f"{_met(share >= 0.8)}; reject p99 {fixed(reject, 0)} ms {_met(reject <= 5)}"
    )


_VARIANT = {"off": "no budget", "on": "a's budget", "on_short_burst": "a's budget at a 5 s burst"}


def _noisy_neighbour(r: Results) -> str:
    """Each budgeted variant's ratio against the goal, and a's 429s all with Retry-After."""
    if not r.exists("noisy_neighbour"):
        return "not run"
    v = r.get("noisy_neighbour")["variants"]
    ratios = [
        f"{_VARIANT[k]} {fixed(x['b_tab_p99_ratio'], 2)}× {_met(x['b_tab_p99_ratio'] <= 1.2)}"
        for k, x in v.items()
        if k != "off" and x["b_tab_p99_ratio"] is not None
    ]
    without = sum(x["a_flood"]["a_refusals_without_retry_after"] for x in v.values())
    return f"b's Tab p99 / alone: {', '.join(ratios)}; a's 429s with Retry-After {_met(without == 0)}"


def _prefill_avoid(r: Results) -> str:
    """Tab's p99 gain (off over on) by workload and gateway count: its least and its most."""
    if not r.exists("prefill_avoid"):
        return "not run"
    d = r.get("prefill_avoid")
    parts = []
    for workload in dict.fromkeys(x["workload"] for x in d["runs"]):
        for gw in sorted({x["gateways"] for x in d["runs"]}):
            g = gains(d, workload, gw)
            if workload == "long_context":
                parts.append(f"{gw} gateway{'s' if gw > 1 else ''} {fixed(min(g), 2)}–{fixed(max(g), 2)}×")
    long1 = gains(d, "long_context", 1) if any(x["workload"] == "long_context" for x in d["runs"]) else []
    agent_same = all(
        x["off"]["agent"]["output_tokens"] == v["agent"]["output_tokens"]
        for x in d["runs"]
        for k, v in x.items()
        if k.startswith("on_")
    )
    return (
        f"long prefills, Tab p99 off / on: {', '.join(parts)}; one gateway ≥ 2× "
        f"{_met(bool(long1) and min(long1) >= 2.0)}; Agent's output the same {_met(agent_same)}"
    )


def _overhead(r: Results) -> str:
    d = r.get("overhead")
    added = d["added_ttft_p50_ms_c1"]
    peer = f"peer {signed(d['peer_added_ttft_p50_ms_c1'], 1)}"
    floor = d.get("floor_added_ttft_p50_ms_c1")  # a relay with no logic in the same shape (9265544 on)
    if floor is not None:
        peer += f", no-logic floor {signed(floor, 2)}"
    return f"{signed(added, 1)} ms ({peer}) {_met(added <= 1.0)}"


def _faults(r: Results) -> str:
    """Where every hung request came from one fault window, name it (``gateway kill 2 of 2``)."""
    d = r.get("faults")
    hung = d["endings"].get("hung", 0)
    where = ""
    for fault in dict.fromkeys(f["fault"] for f in d["faults"]):
        windows = [f for f in d["faults"] if f["fault"] == fault]
        for i, f in enumerate(windows, 1):
            if hung and f["hung"] == hung:
                where = f" in {fault} window {i} of {len(windows)}"
    size = " (--long)" if "--long" in d.get("provenance", {}).get("argv", []) else ""
    return f"{hung} hung{where}{size}: {_met(hung == 0)}"


def _migration(r: Results) -> str:
    d = r.get("migration")
    n, ratio = d["killed_replica_streams"], d["completed_after_kill_ratio"]
    # "k of n": k = ratio x n, the streams that completed (the file holds the ratio and n).
    return f"{ratio} ({round(ratio * n)} of {n}) {_met(ratio == 1.0)}"


def _gpu(r: Results) -> str:
    return "see below" if r.exists("gpu_overhead") else "not run yet: no GPU lent"


def _affinity_peers(r: Results) -> str:
    """Ours' hit rate against the oracle's and its TTFT p90 against Ray's emulation, per scenario."""
    s = r.get("affinity")["scenarios"]
    cells = []
    for name in ("groups", "common-prompt"):
        g = s[name]["goals"]
        over = g["virtual_clock"]["ttft_p90_ray_over_ours"]
        cells.append(
            f"{name} {_pct(g['hit_rate_vs_oracle'])} of oracle {_met(g['hit_rate_goal_met'])}, "
            f"{fixed(over, 2)}× {_met(over >= 1.3)}"
        )
    return "; ".join(cells)


def _overload(r: Results) -> str:
    d = r.get("overload")["surfaces"]
    tab = d["tab"]
    hung = sum(x["hung"] for x in d.values())
    return f"Tab p99 {fixed(tab['ttft_p99_ms'], 1)} ms {_met(tab['slo_met'])}; {hung} hung"


def _hedging(r: Results) -> str:
    legs = r.get("hedging")["legs"]
    cells = [
        f"{k} {fixed(x['hedge_on_p99_over_no_fault_p99'], 2)}× {_met(x['goal_met'])}" for k, x in legs.items()
    ]
    return "; ".join(cells)


def _soak(r: Results) -> str:
    runs = [r.get(name) for name in ("soak", "soak_rest", "soak_long") if r.exists(name)]
    leaked = sum(d["leaked_tasks"] for d in runs)
    return f"{leaked} leaked tasks in {len(runs)} runs {_met(leaked == 0)}; RSS: see its table"


Row = tuple[str, str, str, str, Callable[[Results], str]]
ROWS: list[Row] = [
    (
        "Engine model fidelity",
        "`python -m loadtest.calibration.calibrate_engine` then "
        "`python -m loadtest.benchmarks.engine_fidelity`",
        "engine_calibration.json, engine_fidelity.json",
        "≤ 10 % median error",
        _fidelity,
    ),
    (
        "Planner validation",
        "`python -m loadtest.calibration.calibrate_host` then "
        "`python -m loadtest.benchmarks.planner_validation "
        "--host-calibration loadtest/results/host_cpu.json`",
        "host_cpu.json, planner_validation.json",
        "≤ 15 %",
        _planner,
    ),
    (
        "Affinity decision cost",
        "`python -m loadtest.benchmarks.bench_affinity_micro`",
        "affinity_micro.json",
        "≤ 50 µs at 64 replicas, 1M blocks",
        _micro,
    ),
    (
        "Affinity vs peers",
        "`python -m loadtest.benchmarks.bench_affinity`",
        "affinity.json",
        "≥ 95 % of oracle hit rate, ≥ 1.3× TTFT p90 vs Ray",
        _affinity_peers,
    ),
    (
        "Affinity under KV pressure",
        "`python -m loadtest.benchmarks.bench_affinity --scenario fits,kv_pressure`",
        "affinity.json",
        "fits ≥ 95 % of oracle; kv_pressure ≥ Ray + 0.05, ≥ 1.3× TTFT p90; 2 gateways within 0.02",
        _kv_pressure,
    ),
    (
        "Affinity on vLLM-CPU",
        "`python -m loadtest.benchmarks.bench_affinity_vllm`",
        "affinity_vllm.json",
        "kv_pressure ≥ each peer's hit rate + 0.05, ≥ 1.3× TTFT p90 (Ray's prefix router, vllm-router)",
        _affinity_vllm,
    ),
    (
        "Overload",
        "`python -m loadtest.benchmarks.bench_overload`",
        "overload.json",
        "Tab p99 TTFT within SLO at 3× capacity",
        _overload,
    ),
    (
        "Overload, shared pool (sim)",
        "`python -m loadtest.benchmarks.bench_overload_shared --factors 1,3`",
        "overload_shared.json",
        "at 3×: Tab p99 ≤ 100 ms; Agent goodput on ≥ 80 % of off; reject p99 ≤ 5 ms; 0 hung",
        _overload_shared,
    ),
    (
        "Overload, shared pool (vLLM-CPU)",
        "`python -m loadtest.benchmarks.bench_overload_shared --engine vllm --factors 1,2,3`",
        "overload_shared_vllm.json",
        "at 3×: Tab p99 ≤ 1.5× Tab alone; Agent goodput on ≥ 80 % of off; reject p99 ≤ 5 ms",
        _overload_shared_vllm,
    ),
    (
        "Noisy neighbour, shared pool",
        "`python -m loadtest.benchmarks.bench_noisy_neighbour`",
        "noisy_neighbour.json",
        "tenant b's Tab p99 ≤ 1.2× b alone while tenant a sends 10× its budget on Agent; a gets 429s "
        "with Retry-After",
        _noisy_neighbour,
    ),
    (
        "Tab off replicas mid-prefill (virtual clock)",
        "`python -m loadtest.benchmarks.bench_prefill_avoid`",
        "prefill_avoid.json",
        "Tab p99 lower with `avoid_prefill_tokens` where Agent's prefills are long; Agent's output unchanged",
        _prefill_avoid,
    ),
    (
        "Hedging",
        "`python -m loadtest.benchmarks.bench_hedging`",
        "hedging.json",
        "hedge-on p99 ≤ 1.5× no-fault p99 at ≤ 5 % extra requests",
        _hedging,
    ),
    (
        "Gateway overhead",
        "`python -m loadtest.benchmarks.bench_overhead`",
        "overhead.json",
        "≤ 1 ms p50 added TTFT",
        _overhead,
    ),
    (
        "Faults under load",
        "`python -m loadtest.benchmarks.faults [--long]`",
        "faults.json",
        "0 hung",
        _faults,
    ),
    (
        "Soak",
        "`python -m loadtest.benchmarks.soak --minutes 10`",
        "soak.json, soak_rest.json, soak_long.json",
        "bounded RSS, no leaked tasks",
        _soak,
    ),
    (
        "Mid-stream migration",
        "`python -m loadtest.benchmarks.bench_migration`",
        "migration.json",
        "completed_after_kill_ratio 1.0 (self-hosted)",
        _migration,
    ),
    (
        "GPU path",
        "`scripts/gpu-check.sh` (on an NVIDIA GPU)",
        "gpu_overhead.json, gpu_affinity.json",
        "< 10 min end to end",
        _gpu,
    ),
]


def summary(r: Results) -> str:
    """One row per benchmark: its result file, goal and status (its command is in its section)."""
    rows = [[name, files, goal, status(r)] for name, _cmd, files, goal, status in ROWS]
    return table(["benchmark", "result file", "goal", "status"], "llll", rows)
