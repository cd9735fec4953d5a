"""Fitting the engine model's step time to measurements of the real engine
(:mod:`loadtest.calibration.calibrate_engine` measures; this is pure: a saved results file can be refitted):
the design matrix of step shapes, non-negative least squares, the request latency outside the
step loop, and each fitted form's errors."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# The columns of the step-time model, in design-matrix order. The first six are the step's cost
# (LinearStepTime's terms plus ``prefill_base_s``); the last two are the request's way into and
# out of the engine (the API frontend: input processing, IPC, detokenizing), which a client sees
# once per request, in its TTFT, but which does not occupy the engine's step loop.
COLUMNS = (
    "overhead_s",  # every step (LinearStepTime: the profile's engine.step_overhead_s)
    "prefill_base_s",  # a step that computes any prompt tokens (new-request setup): not in LinearStepTime
    "prefill_s_per_token",
    "decode_base_s",
    "decode_s_per_seq",
    "kv_s_per_token",
    "request_latency_s",  # once per request, outside the step loop: not in EngineModel
    "request_latency_s_per_token",  # ... growing with the prompt (input processing)
)
# The shipped form (cluster.engine.profiles.LinearStepTime): no prefill base, no request latency.
SHIPPED_FORM = {"prefill_base_s": 0.0, "request_latency_s": 0.0, "request_latency_s_per_token": 0.0}
# The extended form: overhead and decode_base only ever appear as a sum once prefill steps have
# their own base, so the fixed per-step cost is all put into overhead_s.
EXTENDED_FORM = {"decode_base_s": 0.0}


# --------------------------------------------------------------------------------------------
# Pure fitting
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step shape and its (median) duration in seconds."""

    kind: str  # "ttft", "itl" or "mixed": where the sample came from
    prefill_tokens: int
    decode_seqs: int
    kv_read_tokens: float
    seconds: float
    weight: float = 1.0  # e.g. the number of raw measurements behind the median
    with_request_latency: bool = False  # a TTFT: the step plus the request's way in and out


def design_row(s: StepSample) -> list[float]:
    """The sample's column values in :data:`COLUMNS` order."""
    p, d, lat = float(s.prefill_tokens), float(s.decode_seqs), s.with_request_latency
    return [
        1.0,
        1.0 if p else 0.0,
        p,
        1.0 if d else 0.0,
        d,
        float(s.kv_read_tokens),
        float(lat),
        p if lat else 0.0,
    ]


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0, exactly, by trying every set of free columns.

    The optimum's free columns solve an unconstrained least-squares problem with a non-negative
    answer, so the best non-negative answer over all column subsets is the optimum. 2**n solves:
    fine for the handful of coefficients here (and needs nothing beyond numpy)."""
    n = a.shape[1]
    if n > 12:
        raise ValueError("subset enumeration is for a few coefficients")
    best, best_cost = np.zeros(n), float(b @ b)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            x_sub, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x_sub < 0):
                continue
            r = sub @ x_sub - b
            cost = float(r @ r)
            if cost < best_cost * (1 - 1e-12):
                best, best_cost = np.zeros(n), cost
                best[list(cols)] = x_sub
    return best


@dataclass(frozen=True)
class Fit:
    coefficients: dict[str, float]
    relative_errors: list[float]  # (predicted - measured) / measured, per sample
    median_abs_relative_error: float
    max_abs_relative_error: float


def predict(coefficients: dict[str, float], s: StepSample) -> float:
    return sum(coefficients.get(name, 0.0) * v for name, v in zip(COLUMNS, design_row(s), strict=True))


def fit_step_time(
    samples: Sequence[StepSample], *, relative: bool = True, fixed: dict[str, float] | None = None
) -> Fit:
    """Non-negative least squares for the coefficients in :data:`COLUMNS` not held in ``fixed``.

    ``relative``: minimise (predicted - measured) / measured, so a 2 ms decode step weighs as much
    as a 20 ms prefill. ``fixed``: coefficients held at a value (:data:`SHIPPED_FORM`: the form
    LinearStepTime has; :data:`EXTENDED_FORM`)."""
    if not samples:
        raise ValueError("no samples to fit")
    fixed = dict(fixed or {})
    unknown_names = [c for c in COLUMNS if c not in fixed]
    rows = np.array([design_row(s) for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    for name, value in fixed.items():
        y = y - rows[:, COLUMNS.index(name)] * value
    a = rows[:, [COLUMNS.index(c) for c in unknown_names]]
    w = np.sqrt(np.array([s.weight for s in samples], dtype=float))
    if relative:
        w = w / np.array([s.seconds for s in samples], dtype=float)
    x = nnls(a * w[:, None], y * w)
    found = {**dict(zip(unknown_names, (float(v) for v in x), strict=True)), **fixed}
    coefficients = {c: found[c] for c in COLUMNS}
    rel = [(predict(coefficients, s) - s.seconds) / s.seconds for s in samples]
    return Fit(
        coefficients=coefficients,
        relative_errors=rel,
        median_abs_relative_error=statistics.median(abs(e) for e in rel),
        max_abs_relative_error=max(abs(e) for e in rel),
    )


def fit_request_latency(points: Sequence[tuple[int, float]], per_token: bool = True) -> dict[str, float]:
    """``request_latency_s + request_latency_s_per_token * P`` through (prompt tokens, seconds)
    points (non-negative, relative residuals): the part of a TTFT spent outside the engine core.
    ``per_token=False``: the best constant (what SimBackend's ``extra_latency_s`` can express)."""
    if not points:
        raise ValueError("no points to fit")
    a = np.array([[1.0, float(p)] if per_token else [1.0] for p, _ in points])
    y = np.array([t for _, t in points], dtype=float)
    w = 1.0 / y
    x = nnls(a * w[:, None], y * w)
    return {
        "request_latency_s": float(x[0]),
        "request_latency_s_per_token": float(x[1]) if per_token else 0.0,
    }


@dataclass(frozen=True, slots=True)
class ExtendedStepTime:
    """LinearStepTime plus ``prefill_base_s`` on steps that compute prompt tokens; a StepTimeModel
    for ``EngineModel(step_time_model=...)``. The request latency is not a step cost: the caller
    adds it to a request's arrival (:meth:`request_latency`)."""

    overhead_s: float
    prefill_base_s: float
    prefill_s_per_token: float
    decode_base_s: float
    decode_s_per_seq: float
    kv_s_per_token: float
    request_latency_s: float = 0.0
    request_latency_s_per_token: float = 0.0

    @classmethod
    def from_coefficients(cls, c: dict[str, float]) -> ExtendedStepTime:
        return cls(**{name: float(c.get(name, 0.0)) for name in COLUMNS})

    def step_time(self, batch: Any) -> float:
        t = self.overhead_s + self.kv_s_per_token * batch.kv_read_tokens
        if batch.prefill_tokens:
            t += self.prefill_base_s + self.prefill_s_per_token * batch.prefill_tokens
        if batch.decode_tokens:
            t += self.decode_base_s + self.decode_s_per_seq * batch.decode_tokens
        return t

    def request_latency(self, prompt_tokens: int) -> float:
        return self.request_latency_s + self.request_latency_s_per_token * prompt_tokens


def decode_window_step(streams: Sequence[Sequence[tuple[float, int]]]) -> tuple[float, float, int] | None:
    """Time per decode step while every stream is decoding.

    ``streams``: per request, ``(arrival time, cumulative tokens)`` of each output it received.
    The window runs from the last stream's first token to the first stream's last token; within
    it each step gives every stream one token. Returns (median seconds per step over streams,
    mean tokens generated per stream at the window's middle, steps in the window), or None if the
    window holds fewer than two steps."""
    start = max(s[0][0] for s in streams)
    end = min(s[-1][0] for s in streams)
    per_step, mids, steps = [], [], []
    for s in streams:
        inside = [(t, n) for t, n in s if start <= t <= end]
        if len(inside) < 2 or inside[-1][1] == inside[0][1]:
            continue
        k = inside[-1][1] - inside[0][1]
        per_step.append((inside[-1][0] - inside[0][0]) / k)
        mids.append((inside[-1][1] + inside[0][1]) / 2)
        steps.append(k)
    if not per_step or statistics.median(steps) < 2:
        return None
    return statistics.median(per_step), statistics.fmean(mids), int(statistics.median(steps))


def profile_snippet(coefficients: dict[str, float], wake: dict[str, float] | None = None) -> str:
    """The coefficients as they go into cluster/engine/profiles.py's cpu-tiny profile."""
    c = coefficients
    engine = f"step_overhead_s={c['overhead_s']:.3g}"
    if wake is not None:
        engine += "".join(f", {k}={wake[k]:.3g}" for k in WAKE_KEYS)
    return (
        "fitted=FittedCoefficients(\n"
        f"    prefill_base_s={c['prefill_base_s']:.3g},\n"
        f"    prefill_s_per_token={c['prefill_s_per_token']:.3g},\n"
        f"    decode_base_s={c['decode_base_s']:.3g},\n"
        f"    decode_s_per_seq={c['decode_s_per_seq']:.3g},\n"
        f"    kv_s_per_token={c['kv_s_per_token']:.3g},\n"
        "),\n"
        f"engine=EngineSpec(..., {engine})"
    )


WAKE_KEYS = ("idle_wake_s", "idle_wake_from_s", "idle_wake_to_s")


def _ramp(x: np.ndarray, start: float, end: float) -> np.ndarray:
    return np.clip((x - start) / (end - start), 0.0, 1.0)


def fit_idle_wake(points: Sequence[tuple[float, float, float]]) -> dict[str, float]:
    """The idle wake (``EngineSpec.idle_wake``) through (idle seconds, TTFT seconds, weight)
    points of a lone request: ``TTFT = hot + idle_wake_s * ramp(idle)``, the ramp 0 up to
    ``idle_wake_from_s`` and 1 from ``idle_wake_to_s``, linear between. A grid over the ramp's
    ends (1 ms steps to 60 ms, then coarser), least squares on relative residuals for ``hot`` and
    a non-negative ``idle_wake_s`` at each; the cheapest wins (no wake unless a ramp beats it)."""
    if len(points) < 3:
        raise ValueError("need at least three idle times")
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    w = np.sqrt(np.array([p[2] for p in points], dtype=float)) / y
    ends = [k / 1000 for k in range(0, 61)] + [k / 1000 for k in range(70, 301, 10)]
    flat = float((y * w * w).sum() / (w * w).sum())  # no wake: the weighted mean
    res0 = (flat - y) * w
    best = (float(res0 @ res0), flat, 0.0, 0.0, 0.0)
    for a, b in itertools.combinations(ends, 2):
        r = _ramp(x, a, b)
        if np.ptp(r) == 0:  # the same at every point: no different from no wake
            continue
        sol = nnls(np.stack([np.ones_like(x), r], axis=1) * w[:, None], y * w)
        res = (sol[0] + sol[1] * r - y) * w
        cost = float(res @ res)
        if cost < best[0] * (1 - 1e-9):
            best = (cost, float(sol[0]), float(sol[1]), a, b)
    _, hot, wake, a, b = best
    rel = (hot + (wake * _ramp(x, a, b) if b > a else 0.0) - y) / y
    return {
        "hot_ttft_s": hot,
        "idle_wake_s": wake,
        "idle_wake_from_s": a,
        "idle_wake_to_s": b,
        "median_abs_relative_error": round(float(np.median(np.abs(rel))), 4),
    }


def samples_from(ttft: list[dict], itl: list[dict], mixed: list[dict]) -> list[StepSample]:
    """Step shapes of the measurements. KV read = every scheduled sequence's context after the
    step (as EngineModel counts it)."""
    samples = [
        StepSample(
            "ttft",
            r["prompt_tokens"],
            0,
            r["prompt_tokens"],
            r["ttft_s_median"],
            len(r["ttft_s"]),
            with_request_latency=True,
        )
        for r in ttft
    ]
    for r in itl:
        ctx = r["prompt_tokens"] + r["generated_mid"]
        samples.append(
            StepSample("itl", 0, r["batch"], r["batch"] * ctx, r["step_s_median"], len(r["step_s"]))
        )
    for r in mixed:
        b, p = r["batch"], r["prefill_tokens"]
        kv = p + b * (r["context_tokens"] + r["generated_mean"] + 1)
        samples.append(StepSample("mixed", p, b, kv, r["step_s_median"], r["n"] / b))
    # The prefill step alone, timed inside the engine core (no request latency).
    for r in ttft:
        if "core_prefill_s_median" in r:
            p = r["prompt_tokens"]
            samples.append(StepSample("prefill", p, 0, p, r["core_prefill_s_median"], len(r["ttft_s"])))
    return samples


def fit_summary(fit: Fit, samples: Sequence[StepSample]) -> dict[str, Any]:
    by_kind: dict[str, list[float]] = {}
    for s, e in zip(samples, fit.relative_errors, strict=True):
        by_kind.setdefault(s.kind, []).append(abs(e))
    return {
        "coefficients": fit.coefficients,
        "median_abs_relative_error": round(fit.median_abs_relative_error, 4),
        "max_abs_relative_error": round(fit.max_abs_relative_error, 4),
        "median_abs_relative_error_by_kind": {k: round(statistics.median(v), 4) for k, v in by_kind.items()},
        "per_sample_relative_error": [round(e, 4) for e in fit.relative_errors],
    }


FITS = ("fit_linear_ttft", "fit_linear_steps", "fit_extended")
RAW_KEYS = (
    "what",
    "config",
    "engine",
    "machine",
    "runtime_s",
    "ttft_vs_prompt",
    "itl_vs_batch",
    "mixed_steps",
    "ttft_vs_idle",
    "loaded_trace",
)


def fit_all(measured: dict[str, Any]) -> dict[str, Any]:
    """The model forms fitted to the measurements (pure: a saved file can be refitted).

    * ``fit_linear_ttft``: LinearStepTime's form with a client's TTFT taken as one prefill step
      (what EngineModel alone can express: the request latency is folded into the steps);
    * ``fit_linear_steps``: LinearStepTime's form fitted to steps alone (in-core prefill steps,
      decode and mixed steps); the request latency (``request_latency_fit``) is left to the
      caller (SimBackend's ``sim_options.extra_latency_s``);
    * ``fit_extended``: as ``fit_linear_steps`` plus ``prefill_base_s``."""
    ttft, itl, mixed = measured["ttft_vs_prompt"], measured["itl_vs_batch"], measured["mixed_steps"]
    samples = samples_from(ttft, itl, mixed)
    client_rows = [s for s in samples if s.kind != "prefill"]
    step_rows = [s for s in samples if s.kind != "ttft"]
    outside = [(r["prompt_tokens"], r["outside_core_s_median"]) for r in ttft]
    latency = fit_request_latency(outside)
    linear_ttft = fit_step_time(client_rows, fixed=SHIPPED_FORM)
    linear_steps = fit_step_time(step_rows, fixed={**SHIPPED_FORM, **latency})
    extended = fit_step_time(step_rows, fixed={**EXTENDED_FORM, **latency})
    wake = _wake_fit(measured.get("ttft_vs_idle"), ExtendedStepTime.from_coefficients(extended.coefficients))
    linear = (
        "step = overhead_s + prefill_s_per_token*P + [decode_base_s + decode_s_per_seq*D if D>0] "
        "+ kv_s_per_token*K"
    )
    return {
        **{k: measured[k] for k in RAW_KEYS if k in measured},  # not a refitted file's old fits
        "samples": [asdict(s) for s in samples],
        "method": "non-negative least squares on relative residuals, rows weighted by repeats; "
        "medians of repeated measurements",
        "request_latency_fit": latency,
        "request_latency_constant": fit_request_latency(outside, per_token=False),
        "fit_linear_ttft": {
            "model": linear
            + " (cluster.engine.profiles.LinearStepTime); TTFT = one step; rows: ttft, itl, mixed",
            **fit_summary(linear_ttft, client_rows),
        },
        "fit_linear_steps": {
            "model": linear + "; TTFT = request_latency_s + request_latency_s_per_token*P + step; "
            "rows: in-core prefill, itl, mixed",
            **fit_summary(linear_steps, step_rows),
        },
        "fit_extended": {
            "model": "step = overhead_s + [prefill_base_s + prefill_s_per_token*P if P>0] "
            "+ decode_s_per_seq*D + kv_s_per_token*K; "
            "TTFT = request_latency_s + request_latency_s_per_token*P + step; "
            "rows: in-core prefill, itl, mixed",
            **fit_summary(extended, step_rows),
        },
        **({"idle_wake_fit": wake} if wake is not None else {}),
    }


def _wake_fit(rows: list[dict[str, Any]] | None, model: ExtendedStepTime) -> dict[str, Any] | None:
    """The idle wake through ``ttft_vs_idle``. The engine's idle time is the client's gap plus
    the request's way in (the request latency, as the simulator delays an arrival): the same
    clock EngineModel measures idle time on.

    Also ``warm_offset_s``: how much longer a lone request took with the engine awake but not in
    a back-to-back run (the fit's ``hot_ttft_s``, from requests a few ms after the previous one)
    than ``model`` predicts from the back-to-back TTFT rows (request latency + one prefill step).
    Traffic with any gaps runs in that state, not in the back-to-back one; the simulator adds it
    to the request latency."""
    if not rows:
        return None
    points = [
        (r["gap_s"] + model.request_latency(r["prompt_tokens"]), r["ttft_s_median"], len(r["ttft_s"]))
        for r in rows
    ]
    fit = fit_idle_wake(points)
    p = rows[0]["prompt_tokens"]
    lone = model.request_latency(p) + model.step_time(_Batch(p, 0, p))
    return {
        **fit,
        "warm_offset_s": max(0.0, fit["hot_ttft_s"] - lone),
        "model": "TTFT of a lone request = hot + idle_wake_s * clamp((idle - idle_wake_from_s) / "
        "(idle_wake_to_s - idle_wake_from_s), 0, 1); idle = gap + request latency; warm_offset_s = "
        "hot - (request latency + prefill step) of the back-to-back fit, at the same prompt length",
    }


@dataclass(frozen=True, slots=True)
class _Batch:
    """The fields of a step shape ExtendedStepTime reads."""

    prefill_tokens: int
    decode_tokens: int
    kv_read_tokens: int
