"""The calibration's pure fitting math (loadtest/calibration/calibrate_engine.py) and the fidelity benchmark's
pure comparison (loadtest/benchmarks/engine_fidelity.py), on synthetic data: no engine, fast."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cluster.engine.profiles import BatchShape, LinearStepTime, get_profile
from loadtest.benchmarks.engine_fidelity import make_workload, replay_sim
from loadtest.calibration.fidelity_stats import Observed, compare, quantile
from loadtest.calibration.step_time_fit import (
    COLUMNS,
    EXTENDED_FORM,
    SHIPPED_FORM,
    ExtendedStepTime,
    StepSample,
    decode_window_step,
    fit_idle_wake,
    fit_request_latency,
    fit_step_time,
    nnls,
    predict,
)

TRUE_SHIPPED = {
    "overhead_s": 2.0e-3,
    "prefill_base_s": 0.0,
    "prefill_s_per_token": 10e-6,
    "decode_base_s": 0.3e-3,
    "decode_s_per_seq": 80e-6,
    "kv_s_per_token": 20e-9,
    "request_latency_s": 0.0,
    "request_latency_s_per_token": 0.0,
}
TRUE_EXTENDED = {
    **TRUE_SHIPPED,
    "decode_base_s": 0.0,
    "prefill_base_s": 1.0e-3,
    "request_latency_s": 2.0e-3,
    "request_latency_s_per_token": 1.0e-6,
}


def synthetic_samples(truth: dict[str, float], noise: float = 0.0, seed: int = 0) -> list[StepSample]:
    """The calibration's three kinds of rows, timed by the true coefficients (times 1 +- noise)."""
    rng = random.Random(seed)
    shapes = [("ttft", p, 0, p, True) for p in (32, 64, 128, 256, 512, 768, 1024, 1536)]
    shapes += [("itl", 0, b, b * 80, False) for b in (1, 2, 4, 8, 16, 24, 32)]
    shapes += [("itl", 0, b, b * 1070, False) for b in (1, 4, 16, 32)]
    shapes += [("mixed", p, b, p + b * 120, False) for b in (4, 16) for p in (128, 512, 1024)]
    out = []
    for kind, p, d, kv, lat in shapes:
        s = StepSample(kind, p, d, kv, 1.0, with_request_latency=lat)
        t = predict(truth, s) * (1 + rng.uniform(-noise, noise))
        out.append(StepSample(kind, p, d, kv, t, with_request_latency=lat))
    return out


# --- nnls -------------------------------------------------------------------------------------


def test_nnls_equals_least_squares_when_the_answer_is_positive() -> None:
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, size=(30, 4))
    x_true = np.array([1.0, 2.0, 0.5, 3.0])
    x = nnls(a, a @ x_true)
    assert x == pytest.approx(x_true, rel=1e-9)


def test_nnls_clamps_a_negative_coefficient_to_zero_and_refits_the_rest() -> None:
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    b = np.array([3.0, 2.0, 1.0])  # exact fit would be intercept 3, slope -1
    x = nnls(a, b)
    assert x[1] == 0.0
    assert x[0] == pytest.approx(2.0)  # the mean of b: the best constant
    assert np.all(x >= 0)


def test_nnls_of_all_negative_is_zero() -> None:
    a = np.eye(2)
    assert nnls(a, np.array([-1.0, -2.0])).tolist() == [0.0, 0.0]


# --- fit_step_time ----------------------------------------------------------------------------


def test_shipped_form_recovers_the_true_coefficients_from_exact_data() -> None:
    # Without a prefill base or latency, overhead and decode_base are told apart by the TTFT rows.
    truth = {**TRUE_SHIPPED}
    samples = [s for s in synthetic_samples(truth) if s.kind != "mixed"]
    fit = fit_step_time(samples, fixed=SHIPPED_FORM)
    for name in COLUMNS:
        assert fit.coefficients[name] == pytest.approx(truth[name], rel=1e-6, abs=1e-12), name
    assert fit.max_abs_relative_error < 1e-9


def test_extended_form_recovers_prefill_base_and_request_latency() -> None:
    samples = synthetic_samples(TRUE_EXTENDED)
    fit = fit_step_time(samples, fixed=EXTENDED_FORM)
    for name in COLUMNS:
        assert fit.coefficients[name] == pytest.approx(TRUE_EXTENDED[name], rel=1e-6, abs=1e-12), name


def test_fit_is_robust_to_small_noise() -> None:
    fit = fit_step_time(synthetic_samples(TRUE_EXTENDED, noise=0.03, seed=4), fixed=EXTENDED_FORM)
    c = fit.coefficients
    assert c["prefill_s_per_token"] == pytest.approx(10e-6, rel=0.1)
    assert c["decode_s_per_seq"] == pytest.approx(80e-6, rel=0.25)
    assert c["overhead_s"] + c["prefill_base_s"] + c["request_latency_s"] == pytest.approx(5e-3, rel=0.1)
    assert fit.median_abs_relative_error < 0.03


def test_shipped_form_cannot_absorb_a_request_latency() -> None:
    # A TTFT that carries 2 ms of latency outside the step loop drives the shipped form's
    # overhead up; NNLS keeps decode_base at 0 rather than negative, and the fit is off.
    fit = fit_step_time(synthetic_samples(TRUE_EXTENDED), fixed=SHIPPED_FORM)
    assert all(v >= 0 for v in fit.coefficients.values())
    assert fit.coefficients["prefill_base_s"] == 0.0 and fit.coefficients["request_latency_s"] == 0.0
    assert fit.max_abs_relative_error > 0.1


def test_fixed_coefficients_are_held() -> None:
    fit = fit_step_time(synthetic_samples(TRUE_SHIPPED), fixed={**SHIPPED_FORM, "kv_s_per_token": 0.0})
    assert fit.coefficients["kv_s_per_token"] == 0.0


def test_relative_weighting_favours_short_steps() -> None:
    # Two rows that no single constant fits: relative residuals pull toward the smaller one.
    rows = [StepSample("itl", 0, 1, 0, 1e-3), StepSample("itl", 0, 1, 0, 3e-3)]
    fixed = {c: 0.0 for c in COLUMNS if c != "overhead_s"}
    rel = fit_step_time(rows, fixed=fixed).coefficients["overhead_s"]
    absolute = fit_step_time(rows, fixed=fixed, relative=False).coefficients["overhead_s"]
    assert absolute == pytest.approx(2e-3)
    assert rel < absolute


def test_fit_needs_samples() -> None:
    with pytest.raises(ValueError):
        fit_step_time([])


def test_request_latency_fit_is_a_line_through_the_outside_core_times() -> None:
    points = [(p, 3e-3 + 0.7e-6 * p) for p in (32, 256, 1024, 1536)]
    lat = fit_request_latency(points)
    assert lat["request_latency_s"] == pytest.approx(3e-3)
    assert lat["request_latency_s_per_token"] == pytest.approx(0.7e-6)
    const = fit_request_latency(points, per_token=False)
    assert const["request_latency_s_per_token"] == 0.0
    assert min(t for _, t in points) < const["request_latency_s"] < max(t for _, t in points)


# --- the design row matches the simulator's step-time models ------------------------------------


def test_shipped_form_prediction_equals_linear_step_time() -> None:
    c = TRUE_SHIPPED
    lin = LinearStepTime(
        c["prefill_s_per_token"],
        c["decode_base_s"],
        c["decode_s_per_seq"],
        c["kv_s_per_token"],
        c["overhead_s"],
    )
    for p, d, kv in [(100, 0, 100), (0, 8, 900), (512, 4, 1000)]:
        s = StepSample("x", p, d, kv, 1.0)
        assert predict(c, s) == pytest.approx(lin.step_time(BatchShape(p, d, kv)))


def test_extended_step_time_matches_the_fit_prediction_and_excludes_latency() -> None:
    ext = ExtendedStepTime.from_coefficients(TRUE_EXTENDED)
    for p, d, kv in [(100, 0, 100), (0, 8, 900), (512, 4, 1000)]:
        s = StepSample("x", p, d, kv, 1.0)  # not a TTFT row: no request latency
        assert ext.step_time(BatchShape(p, d, kv)) == pytest.approx(predict(TRUE_EXTENDED, s))
    assert ext.request_latency(1000) == pytest.approx(2e-3 + 1e-3)


# --- decode windows ---------------------------------------------------------------------------


def test_decode_window_step_uses_only_the_steps_where_all_streams_decode() -> None:
    step = 2e-3
    # Stream a starts at step 0, stream b at step 5 (its prefill was later); both end at step 50.
    a = [(i * step, i + 1) for i in range(50)]
    b = [(i * step, i - 4) for i in range(5, 50)]
    # b's outputs coalesce twice (two tokens in one output): cumulative counts still tell the steps.
    b = [x for j, x in enumerate(b) if j not in (10, 20)]
    result = decode_window_step([a, b])
    assert result is not None
    per_step, _, steps = result
    assert per_step == pytest.approx(step)
    assert steps == 44


def test_decode_window_step_needs_an_overlap() -> None:
    assert decode_window_step([[(0.0, 1), (0.001, 2)], [(0.01, 1), (0.011, 2)]]) is None


# --- fidelity comparison ----------------------------------------------------------------------


def test_quantile_interpolates() -> None:
    assert quantile([1, 2, 3, 4], 0.5) == 2.5
    assert quantile([5], 0.9) == 5
    assert quantile([0, 10], 0.9) == pytest.approx(9)


def test_compare_reports_the_median_relative_error_per_request() -> None:
    real = [
        Observed(0, 0.010, 0.100, 10, 0),
        Observed(0, 0.020, 0.200, 10, 0),
        Observed(0, 0.040, 0.400, 10, 0),
    ]
    sim = [
        Observed(0, 0.011, 0.100, 10, 0),
        Observed(0, 0.016, 0.220, 10, 0),
        Observed(0, 0.040, 0.400, 10, 0),
    ]
    c = compare(real, sim)
    assert c["ttft_median_error"] == pytest.approx(0.10)
    assert c["e2e_median_error"] == pytest.approx(0.0)
    assert c["ttft_median_signed_error"] == pytest.approx(0.0)
    assert c["ttft_real_ms"]["p50"] == pytest.approx(20.0)


def test_workload_is_deterministic_and_fits_the_context() -> None:
    w1, w2 = make_workload(80, 10.0, seed=3), make_workload(80, 10.0, seed=3)
    assert [(x.arrival_s, x.prompt, x.max_tokens) for x in w1] == [
        (x.arrival_s, x.prompt, x.max_tokens) for x in w2
    ]
    assert all(len(x.prompt) + x.max_tokens < 2048 and x.max_tokens >= 1 for x in w1)
    assert any(x.shared_prefix for x in w1) and any(not x.shared_prefix for x in w1)
    assert [x.arrival_s for x in w1] == sorted(x.arrival_s for x in w1)


def test_replay_sim_measures_from_the_submit_time_and_adds_the_request_latency() -> None:
    profile = get_profile("cpu-tiny").with_engine(block_size=32, max_num_seqs=32, max_model_len=2048)
    items = make_workload(20, 10.0, seed=5)
    submits = [x.arrival_s for x in items]
    ext = ExtendedStepTime.from_coefficients(TRUE_EXTENDED)
    plain = replay_sim(profile, items, submits, ext)
    late = replay_sim(profile, items, submits, ext, ext.request_latency)
    assert [o.output_tokens for o in plain] == [x.max_tokens for x in items]
    # The first request meets an idle engine: its TTFT is one prefill step and the idle wake of
    # the time since the engine started (+ the latency).
    first, wake = items[0], profile.engine.idle_wake
    step = ext.step_time(BatchShape(len(first.prompt), 0, len(first.prompt)))
    latency = ext.request_latency(len(first.prompt))
    assert plain[0].ttft_s == pytest.approx(step + wake(first.arrival_s))
    assert late[0].ttft_s == pytest.approx(step + latency + wake(first.arrival_s + latency))
    assert sum(o.cached_tokens for o in plain) > 0  # the shared prefixes hit


def test_idle_wake_fit_recovers_the_ramp_and_ignores_a_little_noise() -> None:
    hot, wake, frm, to = 4.3e-3, 1.9e-3, 6e-3, 48e-3
    idles = [0.002, 0.004, 0.007, 0.012, 0.022, 0.037, 0.052, 0.102, 0.302, 1.002]
    rng = random.Random(3)

    def ttft(x: float) -> float:
        return hot + wake * min(1.0, max(0.0, (x - frm) / (to - frm)))

    exact = fit_idle_wake([(x, ttft(x), 10) for x in idles])
    assert exact["hot_ttft_s"] == pytest.approx(hot, rel=1e-6)
    assert exact["idle_wake_s"] == pytest.approx(wake, rel=1e-6)
    assert (exact["idle_wake_from_s"], exact["idle_wake_to_s"]) == pytest.approx((frm, to))
    noisy = fit_idle_wake([(x, ttft(x) * (1 + rng.uniform(-0.02, 0.02)), 10) for x in idles])
    assert noisy["idle_wake_s"] == pytest.approx(wake, rel=0.15)
    assert noisy["idle_wake_from_s"] <= 0.012 and 0.03 <= noisy["idle_wake_to_s"] <= 0.07


def test_idle_wake_fit_of_a_flat_curve_is_no_wake() -> None:
    flat = fit_idle_wake([(x, 5e-3, 1) for x in (0.001, 0.01, 0.1, 1.0)])
    assert flat["idle_wake_s"] == pytest.approx(0.0, abs=1e-12)
    assert flat["hot_ttft_s"] == pytest.approx(5e-3)


def test_loaded_trace_fit_recovers_the_scale_and_offset_it_was_made_with() -> None:
    """A trace the model itself produced with steps 12 % slower and requests 0.5 ms later: the
    replay fit finds both (and starts from a worse place)."""
    from loadtest.calibration.replay_fit import ScaledStepTime, TraceRequest, fit_loaded, replay

    coefficients = {**TRUE_SHIPPED, "request_latency_s": 1.5e-3, "request_latency_s_per_token": 5e-7}
    wake = {"idle_wake_s": 2e-3, "idle_wake_from_s": 0.005, "idle_wake_to_s": 0.05, "warm_offset_s": 0.0}
    profile = get_profile("cpu-tiny").with_engine(
        block_size=32, max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=2048
    )
    model = ExtendedStepTime.from_coefficients(coefficients)
    rng = random.Random(7)
    plan, t = [], 0.0
    for _ in range(60):
        t += rng.expovariate(8.0)
        plan.append(TraceRequest(t, rng.randint(16, 1024), rng.randint(8, 192), 1.0, 1.0))
    woke = profile.with_engine(idle_wake_s=2e-3, idle_wake_from_s=0.005, idle_wake_to_s=0.05)
    times = replay(woke, plan, ScaledStepTime(model, 1.12), model, 5e-4)
    trace = [
        TraceRequest(r.submit_s, r.prompt_tokens, r.output_tokens, ttft, e2e)
        for r, (ttft, e2e) in zip(plan, times, strict=True)
    ]
    fit = fit_loaded(profile, trace, coefficients, wake)
    assert fit["step_scale"] == pytest.approx(1.12, abs=0.011)
    assert fit["request_latency_offset_s"] == pytest.approx(5e-4, abs=1.1e-4)
    assert fit["trace_errors"]["e2e_median_error"] < 0.01
    assert fit["trace_errors_before"]["e2e_median_error"] > 0.05
