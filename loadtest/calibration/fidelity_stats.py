"""How close the simulated engine came to the real one (:mod:`loadtest.benchmarks.engine_fidelity`): each
request's observed times, the errors of a sim replay against them, and their Markdown table."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.common.stats import quantile


@dataclass(frozen=True, slots=True)
class Observed:
    """One request's outcome, times relative to its submit."""

    submit_s: float  # from the trial's start
    ttft_s: float
    e2e_s: float
    output_tokens: int
    cached_tokens: int
    core_queued_s: float | None = None  # real only: waiting in the engine core's scheduler
    core_prefill_s: float | None = None  # real only: scheduled -> first token, inside the core
    core_decode_s: float | None = None  # real only: first -> last token, inside the core


def relative_errors(sim: Sequence[float], real: Sequence[float]) -> list[float]:
    return [(s - r) / r for s, r in zip(sim, real, strict=True)]


def compare(real: Sequence[Observed], sim: Sequence[Observed]) -> dict[str, Any]:
    """Per-request relative errors of TTFT and E2E, their medians, and both distributions."""
    out: dict[str, Any] = {"n": len(real)}
    for metric in ("ttft_s", "e2e_s"):
        r = [getattr(o, metric) for o in real]
        s = [getattr(o, metric) for o in sim]
        rel = relative_errors(s, r)
        key = metric.removesuffix("_s")
        out[f"{key}_median_error"] = statistics.median(abs(e) for e in rel)
        out[f"{key}_p90_error"] = quantile([abs(e) for e in rel], 0.9)
        out[f"{key}_median_signed_error"] = statistics.median(rel)
        out[f"{key}_real_ms"] = {"p50": quantile(r, 0.5) * 1e3, "p90": quantile(r, 0.9) * 1e3}
        out[f"{key}_sim_ms"] = {"p50": quantile(s, 0.5) * 1e3, "p90": quantile(s, 0.9) * 1e3}
    out["cached_tokens"] = {
        "real": sum(o.cached_tokens for o in real),
        "sim": sum(o.cached_tokens for o in sim),
    }
    outside = [
        o.ttft_s - o.core_queued_s - o.core_prefill_s
        for o in real
        if o.core_queued_s is not None and o.core_prefill_s is not None
    ]
    if outside:  # the part of the real TTFT outside the engine core (frontend, IPC)
        out["real_outside_core_ms"] = {
            "p50": quantile(outside, 0.5) * 1e3,
            "p90": quantile(outside, 0.9) * 1e3,
        }
        queued = [o.core_queued_s for o in real if o.core_queued_s is not None]
        out["real_core_queued_ms"] = {"p50": quantile(queued, 0.5) * 1e3, "p90": quantile(queued, 0.9) * 1e3}
    # Mean time per output token after the first, of requests with at least 8 tokens.
    long = [(r, s) for r, s in zip(real, sim, strict=True) if r.output_tokens >= 8]
    if long:
        out["itl_ms_p50"] = {
            "real": statistics.median((r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r, _ in long) * 1e3,
            "sim": statistics.median((s.e2e_s - s.ttft_s) / (s.output_tokens - 1) for _, s in long) * 1e3,
        }
        core = [r.core_decode_s / (r.output_tokens - 1) for r, _ in long if r.core_decode_s is not None]
        if core:
            out["itl_ms_p50"]["real_in_core"] = statistics.median(core) * 1e3
    return out


def markdown_table(variants: dict[str, dict[str, Any]], note: str) -> str:
    def pair(c: dict[str, Any], key: str, q: str) -> str:
        return f"{c[key + '_real_ms'][q]:.1f} / {c[key + '_sim_ms'][q]:.1f}"

    lines = [
        "| Sim model | n | TTFT p50 real / sim (ms) | TTFT p90 real / sim (ms) | TTFT median err "
        "| E2E p50 real / sim (ms) | E2E p90 real / sim (ms) | E2E median err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in variants.items():
        lines.append(
            f"| {name} | {c['n']} | {pair(c, 'ttft', 'p50')} | {pair(c, 'ttft', 'p90')} "
            f"| {c['ttft_median_error']:.1%} | {pair(c, 'e2e', 'p50')} | {pair(c, 'e2e', 'p90')} "
            f"| {c['e2e_median_error']:.1%} |"
        )
    return "\n".join(lines) + f"\n\n{note}"
