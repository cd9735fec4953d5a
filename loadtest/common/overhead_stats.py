"""The overhead benchmark's figures (:mod:`loadtest.benchmarks.bench_overhead`), pure: percentiles, what a leg
adds over the direct path, and the goals against the Rust peer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loadtest.common.stats import quantile

GOAL_ADDED_C1_MS = 1.0
GOAL_C16_VS_PEER = 2.0
GOAL_RPS_VS_PEER = 0.8
GOAL_VLLM_VS_PEER = 1.1


# --- statistics (pure) ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default); None if empty."""
    return quantile(values, q / 100.0) if values else None


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def summarize(values: Sequence[float]) -> dict[str, Any]:
    mean = sum(values) / len(values) if values else None
    return {
        "n": len(values),
        "p50": _r(percentile(values, 50)),
        "p90": _r(percentile(values, 90)),
        "p99": _r(percentile(values, 99)),
        "mean": _r(mean),
    }


def added_ms(leg: dict[str, Any], base: dict[str, Any], q: str) -> float | None:
    """A leg's TTFT quantile minus the direct leg's, both at the same concurrency."""
    a = (leg.get("ttft_ms") or {}).get(q)
    b = (base.get("ttft_ms") or {}).get(q)
    return None if a is None or b is None else round(a - b, 3)


def overhead_figures(legs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The headline keys from ``legs[leg]["c16"] = {"ttft_ms": summary, "rps": ...}``."""

    def at(leg: str, c: int) -> dict[str, Any]:
        return legs.get(leg, {}).get(f"c{c}", {})

    def add(leg: str, c: int, q: str) -> float | None:
        return added_ms(at(leg, c), at("direct", c), q)

    def rps(leg: str, c: int) -> float | None:
        return at(leg, c).get("rps")

    fig: dict[str, Any] = {}
    for c, into in ((1, fig), (16, fig), (64, fig.setdefault("stress", {}))):
        into[f"added_ttft_p50_ms_c{c}"] = add("ours", c, "p50")
        into[f"added_ttft_p99_ms_c{c}"] = add("ours", c, "p99")
        into[f"peer_added_ttft_p50_ms_c{c}"] = add("peer", c, "p50")
        into[f"peer_added_ttft_p99_ms_c{c}"] = add("peer", c, "p99")
        into[f"floor_added_ttft_p50_ms_c{c}"] = add("floor", c, "p50")
        into[f"floor_added_ttft_p99_ms_c{c}"] = add("floor", c, "p99")
        for leg, prefix in (("ours", ""), ("peer", "peer_"), ("floor", "floor_")):
            into[f"{prefix}relay_cpu_ms_per_request_c{c}"] = at(leg, c).get("relay_cpu_ms_per_request")
        if c > 1:
            into[f"rps_c{c}"] = rps("ours", c)
            into[f"peer_rps_c{c}"] = rps("peer", c)
            into[f"direct_rps_c{c}"] = rps("direct", c)
            into[f"floor_rps_c{c}"] = rps("floor", c)
    return fig


def _holds(a: float | None, op: str, b: float | None) -> bool | None:
    if a is None or b is None:
        return None
    return a <= b if op == "<=" else a >= b


def evaluate_goals(fig: dict[str, Any], vllm: dict[str, Any] | None = None) -> dict[str, bool | None]:
    """Each goal as a boolean; None where a figure it needs was not measured."""

    def times(k: float, x: float | None) -> float | None:
        return None if x is None else k * x

    v = vllm or {}
    return {
        f"added_ttft_p50_ms_c1 <= {GOAL_ADDED_C1_MS}": _holds(
            fig.get("added_ttft_p50_ms_c1"), "<=", GOAL_ADDED_C1_MS
        ),
        f"added_ttft_p50_ms_c16 <= {GOAL_C16_VS_PEER:g} x peer": _holds(
            fig.get("added_ttft_p50_ms_c16"),
            "<=",
            times(GOAL_C16_VS_PEER, fig.get("peer_added_ttft_p50_ms_c16")),
        ),
        f"rps_c16 >= {GOAL_RPS_VS_PEER:g} x peer": _holds(
            fig.get("rps_c16"), ">=", times(GOAL_RPS_VS_PEER, fig.get("peer_rps_c16"))
        ),
        f"vllm_e2e_p50_ms <= {GOAL_VLLM_VS_PEER:g} x peer": _holds(
            v.get("vllm_e2e_p50_ms"), "<=", times(GOAL_VLLM_VS_PEER, v.get("peer_vllm_e2e_p50_ms"))
        ),
    }


def floor_goals(fig: dict[str, Any]) -> dict[str, bool | None]:
    """The relay goals met by the floor leg (a relay with no logic, served as our gateway is), with
    the same peer: where the floor misses one, no code of ours in that shape could meet it that run."""
    as_ours = {k.removeprefix("floor_"): v for k, v in fig.items() if k.startswith("floor_")}
    as_ours.update({k: fig.get(k) for k in ("peer_added_ttft_p50_ms_c16", "peer_rps_c16")})
    return {goal: ok for goal, ok in evaluate_goals(as_ours).items() if not goal.startswith("vllm")}


def ours_minus_floor(fig: dict[str, Any]) -> dict[str, float | None]:
    """What our gateway's code costs over the floor: added TTFT (ms) and relay CPU per request (ms)
    ours minus floor, and ours' requests/s as a share of the floor's."""

    def minus(k: str) -> float | None:
        a, b = fig.get(k), fig.get(f"floor_{k}")
        return None if a is None or b is None else round(a - b, 3)

    rps, floor_rps = fig.get("rps_c16"), fig.get("floor_rps_c16")
    return {
        "added_ttft_p50_ms_c1": minus("added_ttft_p50_ms_c1"),
        "added_ttft_p50_ms_c16": minus("added_ttft_p50_ms_c16"),
        "rps_c16_share": None if not rps or not floor_rps else round(rps / floor_rps, 3),
        "relay_cpu_ms_per_request_c16": minus("relay_cpu_ms_per_request_c16"),
    }
