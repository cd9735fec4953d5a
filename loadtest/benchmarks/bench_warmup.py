"""A fresh replica's first requests, with and without its warm-up (issue 40 item 2).

For each engine (vLLM-CPU from ``configs/local.yaml``, the simulated H100 from
``configs/sim-local.yaml``), one app with one engine replica is deployed into a local Ray Serve
with ``engine.warmup.enabled`` on, then another with it off. As soon as each answers its health
check, ``--first`` long chat requests (distinct ~``--prompt-tokens``-token prompts, one every
``--gap-s``, streamed) measure the fresh replica's time to first token at the client; then
``--steady`` more, after a pause, the steady state. The replica's own warm-up report (its time
and per-prompt first tokens) is recorded beside them. Every variant starts from a new app, so its
replica is new; all of them run in one sitting, warm-up on and off interleaved per engine.

Run: ``python -m loadtest.benchmarks.bench_warmup`` (about 4 minutes here); results in
``loadtest/results/warmup.json``. The sim's figures are a simulation (labelled so).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from cluster.config import ClusterConfig, load_config
from loadtest.common.stats import quantile

ENGINES = {"vllm": "configs/local.yaml", "sim": "configs/sim-local.yaml"}


def variant_config(path: str, warm: bool, name: str) -> ClusterConfig:
    """The config with one engine replica, one gateway and the warm-up on or off."""
    cfg = load_config(path)
    backends = []
    for b in cfg.backends:
        if b.kind in ("vllm", "sim"):
            warmup = b.engine.warmup.model_copy(update={"enabled": warm})
            engine = b.engine.model_copy(update={"warmup": warmup})
            b = b.model_copy(update={"replicas": 1, "autoscaling": None, "engine": engine})
        backends.append(b)
    server = cfg.server.model_copy(update={"gateway_replicas": 1})
    return cfg.model_copy(update={"name": name, "backends": backends, "server": server})


def long_prompt(i: int, n_tokens: int) -> str:
    """Distinct from its first word on (no prefix shared with another request)."""
    words = max(1, n_tokens // 13)
    return f"request {i} {time.time_ns()}: " + " ".join(
        f"def w{i}_{k}(x): return x * {k}" for k in range(words)
    )


def _ttft(url: str, model: str, prompt: str) -> dict[str, Any]:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": prompt}],
    }
    t0 = time.perf_counter()
    try:
        with httpx.Client(timeout=120) as c, c.stream("POST", url, json=body) as r:
            lines = r.iter_lines()
            first = next((time.perf_counter() - t0 for x in lines if x.startswith("data: ")), None)
            for _ in lines:
                pass
            return {"status": r.status_code, "ttft_s": first, "replica": r.headers.get("x-llmc-replica")}
    except httpx.HTTPError as exc:
        return {"status": 0, "ttft_s": None, "error": repr(exc)}


def _burst(url: str, model: str, n: int, gap_s: float, tokens: int, base: int) -> list[dict[str, Any]]:
    """``n`` requests, one every ``gap_s`` (each on its own thread, as clients arrive)."""
    out: list[dict[str, Any]] = [{} for _ in range(n)]

    def one(i: int) -> None:
        out[i] = _ttft(url, model, long_prompt(base + i, tokens))

    threads = []
    for i in range(n):
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
        time.sleep(gap_s)
    for t in threads:
        t.join(180)
    return out


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r["ttft_s"] for r in rows if r.get("status") == 200 and r.get("ttft_s") is not None]
    return {
        "n": len(rows),
        "ok": len(ok),
        "ttft_ms_p50": round(1000 * quantile(ok, 0.5), 1) if ok else None,
        "ttft_ms_max": round(1000 * max(ok), 1) if ok else None,
        "ttft_ms": [round(1000 * x, 1) for x in ok],
    }


def run_variant(engine: str, warm: bool, args: argparse.Namespace, port: int) -> dict[str, Any]:
    from deployments.launcher import local

    name = f"warmup-{engine}-{'on' if warm else 'off'}"
    cfg = variant_config(ENGINES[engine], warm, name)
    t0 = time.monotonic()
    local.start(cfg, port=port, metrics_port=0, route_prefix=f"/{name}")
    ready_s = time.monotonic() - t0
    base = f"http://127.0.0.1:{port}/{name}"
    url, model = base + "/v1/chat/completions", cfg.models[0].name
    try:
        first = _burst(url, model, args.first, args.gap_s, args.prompt_tokens, 0)
        time.sleep(args.pause_s)
        steady = _burst(url, model, args.steady, args.gap_s, args.prompt_tokens, 1000)
        stats = local.replica_stats(base)
        report = {rid: s.extra.get("warmup") for rid, s in stats.items()}
    finally:
        local.remove_apps([name])
    f, s = _summary(first), _summary(steady)
    ratio = None
    if f["ttft_ms_p50"] and s["ttft_ms_p50"]:
        ratio = round(f["ttft_ms_max"] / s["ttft_ms_p50"], 2)
    return {
        "engine": engine,
        "simulated": engine == "sim",
        "warmup": warm,
        "ready_s": round(ready_s, 1),
        "first": f,
        "steady": s,
        "first_max_over_steady_p50": ratio,
        "replica_warmup_report": report,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--first", type=int, default=10, help="requests measured on the fresh replica")
    ap.add_argument("--steady", type=int, default=10, help="requests measured after the pause")
    ap.add_argument("--gap-s", type=float, default=0.5)
    ap.add_argument("--pause-s", type=float, default=3.0)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--out", default="loadtest/results/warmup.json")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from deployments.launcher import local
    from loadtest.common.provenance import git_state, provenance, write_report

    args = parse_args(argv)
    started, git, load = time.monotonic(), git_state(), os.getloadavg()
    port = local.free_port()
    runs = []
    try:
        for engine in args.engines:
            for warm in (True, False):
                runs.append(run_variant(engine, warm, args, port))
                print(
                    runs[-1]["engine"], "warm-up" if warm else "none", runs[-1]["first"], runs[-1]["steady"]
                )
    finally:
        local.stop()
    report = {"benchmark": "warmup", "runs": runs, **provenance(argv or [], git, load, started)}
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
