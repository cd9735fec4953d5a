"""BENCHMARKS.md tables of the gateway's overhead and of overload (dedicated and shared pools)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadtest.tables.table_format import Results, fixed, num, signed, table


def overhead(r: Results) -> str:
    """overhead.json: TTFT and added TTFT in ms (2 decimals at 1 stream, 1 above), requests/s to 1
    decimal, vLLM E2E to the ms."""
    d = r.get("overhead")
    legs = d["legs"]

    def ttft(leg: str, c: str, digits: int) -> str:
        return fixed(legs[leg][c]["ttft_ms"]["p50"], digits)

    def added(key: str, digits: int) -> str:
        return f"**{signed(d[key], digits)}**"

    rows = [
        [
            "TTFT p50 at 1 stream (ms), added",
            ttft("direct", "c1", 2),
            f"{ttft('peer', 'c1', 2)}, {added('peer_added_ttft_p50_ms_c1', 2)}",
            f"{ttft('ours', 'c1', 2)}, {added('added_ttft_p50_ms_c1', 2)}",
        ],
        [
            "TTFT p50 at 16 streams (ms), added",
            ttft("direct", "c16", 1),
            f"{ttft('peer', 'c16', 1)}, {added('peer_added_ttft_p50_ms_c16', 1)}",
            f"{ttft('ours', 'c16', 1)}, {added('added_ttft_p50_ms_c16', 1)}",
        ],
        [
            "requests/s at 16 streams",
            fixed(d["direct_rps_c16"], 1),
            fixed(d["peer_rps_c16"], 1),
            f"**{fixed(d['rps_c16'], 1)}**",
        ],
        ["TTFT p50 at 64 streams (ms), requests/s"]
        + [
            f"{ttft(leg, 'c64', 1)}, {fixed(legs[leg]['c64']['rps'], 1)}"
            for leg in ("direct", "peer", "ours")
        ],
        [
            "vLLM-CPU E2E p50 (ms)",
            "",
            fixed(d["peer_vllm_e2e_p50_ms"], 0),
            f"**{fixed(d['vllm_e2e_p50_ms'], 0)}**",
        ],
    ]
    return table(["", "direct", "vllm-router (peer)", "ours"], "lrrr", rows)


SPLIT_ROWS = (
    ("the client's TTFT", None),
    ("in the gateway's handler (Server-Timing `ttft`)", "ttft"),
    ("of which prep (parse, validate, tokenize, route)", "prep"),
    ("of which admission's queue", "queue"),
    ("of which the upstream call to its first item", "upstream"),
    ("of which the gateway's own rest (race, accounting)", "gateway_own"),
    ("outside the handler (HAProxy, uvicorn, Serve, writes)", "outside"),
)


def overhead_split(r: Results) -> str:
    """overhead.json, ours: where the TTFT went, p50 in ms to 2 decimals (each figure is the median
    of its own per-request values, so the parts need not sum to the whole), the direct leg beside."""
    legs = r.get("overhead")["legs"]
    levels = [c for c in ("c1", "c16", "c64") if "server_timing_ms" in legs["ours"].get(c, {})]

    def cell(c: str, key: str | None) -> str:
        got = legs["ours"][c]["ttft_ms"] if key is None else legs["ours"][c]["server_timing_ms"][key]
        return fixed(got["p50"], 2)

    rows = [[label] + [cell(c, key) for c in levels] for label, key in SPLIT_ROWS]
    rows.append(
        ["the direct leg's TTFT (the upstream alone)"]
        + [fixed(legs["direct"][c]["ttft_ms"]["p50"], 2) for c in levels]
    )
    header = ["ours, p50 (ms)"] + [f"{c[1:]} stream{'s' if c != 'c1' else ''}" for c in levels]
    return table(header, "l" + "r" * len(levels), rows)


def overhead_floor(r: Results) -> str:
    """overhead.json: the floor leg (a relay with no logic, served as our gateway is) beside ours,
    what ours costs over it, and whether the floor itself meets each relay goal that run."""
    d = r.get("overhead")
    peer16, peer_rps = d["peer_added_ttft_p50_ms_c16"], d["peer_rps_c16"]
    minus, goals = d["ours_minus_floor"], list(d["floor_goals"].values())

    def meets(ok: bool | None) -> str:
        return "-" if ok is None else ("yes" if ok else "**no**")

    rows = [
        [
            "added TTFT p50 at 1 stream (ms)",
            signed(d["floor_added_ttft_p50_ms_c1"], 2),
            signed(d["added_ttft_p50_ms_c1"], 2),
            signed(minus["added_ttft_p50_ms_c1"], 2),
            "≤ +1.00",
            meets(goals[0]),
        ],
        [
            "added TTFT p50 at 16 streams (ms)",
            signed(d["floor_added_ttft_p50_ms_c16"], 1),
            signed(d["added_ttft_p50_ms_c16"], 1),
            signed(minus["added_ttft_p50_ms_c16"], 1),
            f"≤ 2 × the peer's {signed(peer16, 1)}",
            meets(goals[1]),
        ],
        [
            "requests/s at 16 streams",
            fixed(d["floor_rps_c16"], 1),
            fixed(d["rps_c16"], 1),
            f"{fixed(100 * minus['rps_c16_share'], 0)} % of the floor",
            f"≥ 0.8 × the peer's {fixed(peer_rps, 1)}",
            meets(goals[2]),
        ],
    ]
    cpu = ("relay_cpu_ms_per_request_c16", "floor_relay_cpu_ms_per_request_c16")
    cpu += ("peer_relay_cpu_ms_per_request_c16",)
    if all(d.get(k) is not None for k in cpu):  # (files before it was read have none)
        rows.append(
            [
                "relay CPU per request at 16 streams (ms)",
                fixed(d["floor_relay_cpu_ms_per_request_c16"], 2),
                fixed(d["relay_cpu_ms_per_request_c16"], 2),
                signed(minus["relay_cpu_ms_per_request_c16"], 2),
                f"none (the peer's {fixed(d['peer_relay_cpu_ms_per_request_c16'], 2)})",
                "-",
            ]
        )
    header = ["", "the floor (no logic, same shape)", "ours", "ours over the floor", "goal"]
    header.append("the floor meets it")
    return table(header, "lrrrll", rows)


def _ms(x: float) -> str:
    return fixed(x, 1) if x < 100 else fixed(x, 0)  # 1 decimal below 100 ms, whole ms above


def overload(r: Results) -> str:
    """overload.json ``surfaces``: TTFT of the admitted in simulated ms (1 decimal below 100, whole
    above), the SLO in whole ms."""
    rows = []
    for name, s in r.get("overload")["surfaces"].items():
        rows.append(
            [
                name,
                num(s["sent"]),
                num(s["admitted"]),
                num(s["rejected_429"]),
                num(s["rejected_503"]),
                num(s["hung"]),
                f"{_ms(s['ttft_p50_ms'])} / {_ms(s['ttft_p99_ms'])}",
                fixed(s["slo_ms"], 0),
                "yes" if s["slo_met"] else "no",
            ]
        )
    header = [
        "surface",
        "sent",
        "admitted",
        "429",
        "503",
        "hung",
        "TTFT p50 / p99 of admitted (ms)",
        "SLO (ms)",
        "met",
    ]
    return table(header, "lrrrrrrrl", rows)


def _tab_cell(v: dict[str, Any], phase: str) -> str:
    """Tab's TTFT p50 / p99 in one phase of a variant, whole wall-clock ms."""
    t = v[phase]["surfaces"]["tab"]
    return f"{fixed(t['ttft_p50_wall_ms'], 0)} / {fixed(t['ttft_p99_wall_ms'], 0)}"


def refusal_p99_inside(phase: dict[str, Any]) -> float | None:
    """A phase's refusal p99 inside the gateway, ms; None in runs before c9c16b4 (they lack it)."""
    return (phase.get("gateway_refusal_ms_last_30s") or {}).get("p99_ms")


def floor_answer_p99(phase: dict[str, Any]) -> float | None:
    """A phase's p99 of the floor probe's answers, ms; None in runs before 9ed3b34 (they lack it)."""
    return (phase.get("floor_answer_ms") or {}).get("p99_ms")


def _load_cells(v: dict[str, Any], phase: str) -> list[str]:
    """Tab's TTFT, Agent's goodput and the reject p99 of one phase with Agent load ("not run" when
    the run left the phase out: bench_all's quick step runs 3x only)."""
    if phase not in v:
        return ["not run"] * 3
    p = v[phase]
    reject = "-" if p["reject_p99_ms"] is None else fixed(p["reject_p99_ms"], 0)
    inside = refusal_p99_inside(p)
    floor = floor_answer_p99(p)
    if inside is not None:
        reject += f" ({fixed(inside, 1)}" + ("" if floor is None else f"; floor {fixed(floor, 1)}") + ")"
    return [_tab_cell(v, phase), fixed(p["surfaces"]["agent"]["goodput_tok_s"], 0), reject]


def hung_requests(v: dict[str, Any]) -> int:
    """Hung requests over every phase of a variant (the file records them per phase)."""
    return sum(p["hung"] for p in v.values() if isinstance(p, dict) and "hung" in p)


def _shared_row(variant: str, d: dict[str, Any], first: bool) -> list[str]:
    """Whole ms and tok/s; load average (1 min) at the variant's start → end, 1 decimal."""
    v = d["variants"][variant]
    label = f"`{d['machine']['git_commit']}`, capacity {d['agent_capacity_per_s']} req/s" if first else ""
    load = f"{fixed(v['load_avg_at_start'][0], 1)} → {fixed(v['load_avg_at_end'][0], 1)}"
    cells = [_tab_cell(v, "tab_alone"), *_load_cells(v, "agent_x1"), *_load_cells(v, "agent_x3")]
    return [label, variant, load, *cells, str(hung_requests(v))]


def overload_shared(r: Results) -> str:
    """overload_shared.json as it stands (its history: git log -p on the file)."""
    d = r.get("overload_shared")
    rows = [_shared_row(variant, d, first=i == 0) for i, variant in enumerate(("off", "on"))]
    header = [
        "commit, Agent capacity",
        "variant",
        "load avg",
        "Tab alone p50 / p99",
        "Tab at 1× p50 / p99",
        "Agent goodput 1× (tok/s)",
    ]
    header += [
        "reject p99 1× (in gateway; floor)",
        "Tab at 3× p50 / p99",
        "Agent goodput 3× (tok/s)",
        "reject p99 3× (in gateway; floor)",
        "hung",
    ]
    return table(header, "lllrrrrrrrr", rows)


def _vllm_label(d: dict[str, Any]) -> str:
    """The run's commit, prefill step and the engines' / gateway's CPU priority settings."""
    step = d.get("max_num_batched_tokens", "the config")
    nice = f", nice +{d['engine_cpu_nice']}" if d.get("engine_cpu_nice") else ""
    sched = {"idle": ", idle class", "auto": ", idle class with Tab"}
    nice += sched.get(d.get("engine_cpu_sched", "normal"), "")
    if d.get("gateway_nice") is not None:
        nice += f", gateway nice {d['gateway_nice']}"
    return f"`{d['provenance']['git_commit'][:7]}`, {step}{nice}"


def overload_shared_vllm(r: Results) -> str:
    """overload_shared_vllm.json as it stands (its history: git log -p on the file): whole ms and
    tok/s; at 3×, the refusals that came after waiting in the queue (deadline expiries + waiters a
    lowered guard cap cut off) of all refusals."""
    d = r.get("overload_shared_vllm")
    rows = []
    for i, variant in enumerate(("off", "on")):
        v = d["variants"][variant]
        x3 = v["agent_x3"]
        eng = x3.get("engine_tab_ttft_ms")
        inside = f"{fixed(eng['p50_ms'], 0)} / {fixed(eng['p99_ms'], 0)}" if eng else "-"
        late = f"{num(x3['admission_delta']['rejected_deadline'])} + "
        late += f"{num(x3['admission_delta']['rejected_unreachable'])} of {num(x3['rejects'])}"
        cells = [_tab_cell(v, "tab_alone"), *_load_cells(v, "agent_x1"), *_load_cells(v, "agent_x3")]
        label = _vllm_label(d) if i == 0 else ""
        rows.append([label, variant, *cells, inside, late, str(hung_requests(v))])
    header = ["commit, step tokens", "variant", "Tab alone p50 / p99", "Tab at 1× p50 / p99"]
    header += [
        "Agent goodput 1× (tok/s)",
        "reject p99 1× (in gateway; floor)",
        "Tab at 3× p50 / p99",
        "Agent goodput 3× (tok/s)",
    ]
    header += ["reject p99 3× (in gateway; floor)", "Tab at 3× inside the engines p50 / p99"]
    header += ["refused after waiting at 3× (deadline + guard cut) of all", "hung"]
    return table(header, "llrrrrrrrrrr", rows)


@dataclass(frozen=True)
class TabBesideAgent:
    """A shared-pool run's headline at its highest Agent factor: Tab's p99 with the feature on
    against Tab alone (the lower of the two variants' alone p99s: the feature has nothing to do
    alone, so one noisy alone phase cannot make the ratio look met), and Agent's goodput on / off."""

    factor: float
    top: dict[str, Any]  # the feature's variant at that factor (its phase record)
    tab_p99_ms: float
    alone_p99_ms: float
    goodput_on: float
    goodput_off: float


def tab_beside_agent(v: dict[str, Any]) -> TabBesideAgent:
    factor = max(v["factors"])
    top = f"agent_x{factor:g}"
    on, off = v["variants"]["on"], v["variants"]["off"]
    alone = min(x["tab_alone"]["surfaces"]["tab"]["ttft_p99_wall_ms"] for x in v["variants"].values())
    return TabBesideAgent(
        factor=factor,
        top=on[top],
        tab_p99_ms=on[top]["surfaces"]["tab"]["ttft_p99_wall_ms"],
        alone_p99_ms=alone,
        goodput_on=on[top]["surfaces"]["agent"]["goodput_tok_s"],
        goodput_off=off[top]["surfaces"]["agent"]["goodput_tok_s"],
    )
