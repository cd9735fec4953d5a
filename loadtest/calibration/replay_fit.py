"""The calibration's last step: replay its own loaded trace on the engine model and fit what
isolated measurements cannot see (pure; :mod:`loadtest.calibration.calibrate_engine` measures the trace).

Steps timed back to back on an otherwise quiet engine run a few per cent faster than the same
steps in traffic (requests arriving, prefills interleaved with decodes, the frontend handling
arrivals), and a lone request's way in and out is shorter than one's among others. So after the
step-time fit, :func:`fit_loaded` replays a Poisson trace (private prompts of 16-1,024 tokens,
8-192 output tokens) on :class:`cluster.engine.model.EngineModel` and picks, by coordinate
search, the step-time scale (against the median end-to-end error) and the request latency
offset (against the median TTFT error) that bring the model closest to what the real engine did
on that trace. The fidelity benchmark then replays a different workload (shared prefixes, other
lengths and rate, other seeds) with those two numbers fixed."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster.engine.model import EngineModel
from cluster.engine.profiles import BatchShape, Profile, StepTimeModel
from loadtest.calibration.step_time_fit import WAKE_KEYS, ExtendedStepTime

SCALES = [round(0.85 + 0.01 * k, 2) for k in range(46)]  # 0.85 .. 1.30
OFFSETS = [round(1e-4 * k, 4) for k in range(21)]  # 0 .. 2 ms


@dataclass(frozen=True, slots=True)
class ScaledStepTime:
    """Another step-time model's steps, ``scale`` times as long."""

    inner: StepTimeModel
    scale: float

    def step_time(self, batch: BatchShape) -> float:
        return self.inner.step_time(batch) * self.scale


@dataclass(frozen=True, slots=True)
class TraceRequest:
    submit_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float


def replay(
    profile: Profile,
    trace: Sequence[TraceRequest],
    steps: StepTimeModel,
    latency: ExtendedStepTime,
    offset_s: float,
) -> list[tuple[float, float]]:
    """(TTFT, E2E) of each request on the model, arriving ``request latency + offset`` after its
    real submit. Prompts are distinct token ids: the trace has no shared prefixes."""
    engine = EngineModel(profile, step_time_model=steps)
    for i, r in enumerate(trace):
        prompt = list(range(i * 4096, i * 4096 + r.prompt_tokens))
        arrival = r.submit_s + latency.request_latency(r.prompt_tokens) + offset_s
        engine.add_request(f"t{i}", prompt, r.output_tokens, arrival_time=arrival)
    engine.run()
    out = []
    for i, r in enumerate(trace):
        q = engine.requests[f"t{i}"]
        assert q.first_token_time is not None and q.finish_time is not None
        out.append((q.first_token_time - r.submit_s, q.finish_time - r.submit_s))
    return out


def median_errors(trace: Sequence[TraceRequest], sim: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Median |sim - real| / real of TTFT and of E2E."""
    ttft = statistics.median(abs(s[0] - r.ttft_s) / r.ttft_s for r, s in zip(trace, sim, strict=True))
    e2e = statistics.median(abs(s[1] - r.e2e_s) / r.e2e_s for r, s in zip(trace, sim, strict=True))
    return ttft, e2e


def fit_loaded(
    profile: Profile, trace: Sequence[TraceRequest], coefficients: dict[str, float], wake: dict[str, float]
) -> dict[str, Any]:
    """Step-time scale and request-latency offset for ``coefficients`` (the extended fit) with
    ``wake`` laid over ``profile``'s engine; starts from ``wake['warm_offset_s']``, two rounds."""
    model = ExtendedStepTime.from_coefficients(coefficients)
    woke = profile.with_engine(**{k: wake[k] for k in WAKE_KEYS})
    scale, offset = 1.0, float(wake.get("warm_offset_s", 0.0))

    def errors(s: float, o: float) -> tuple[float, float]:
        return median_errors(trace, replay(woke, trace, ScaledStepTime(model, s), model, o))

    before = errors(scale, offset)
    for _ in range(2):
        scale = min(SCALES, key=lambda s: (errors(s, offset)[1], abs(s - 1)))
        offset = min(OFFSETS, key=lambda o: (errors(scale, o)[0], o))
    ttft, e2e = errors(scale, offset)
    return {
        "step_scale": scale,
        "request_latency_offset_s": offset,
        "trace_errors": _errors_dict(ttft, e2e),
        "trace_errors_before": _errors_dict(*before),
        "requests": len(trace),
        "method": "EngineModel replays of the calibration's loaded trace; step scale by the median E2E "
        "error, then the request latency offset by the median TTFT error, twice",
    }


def _errors_dict(ttft: float, e2e: float) -> dict[str, float]:
    return {"ttft_median_error": round(ttft, 4), "e2e_median_error": round(e2e, 4)}


def trace_from(rows: Sequence[dict[str, Any]]) -> list[TraceRequest]:
    return [TraceRequest(**r) for r in rows]
