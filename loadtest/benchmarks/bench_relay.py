"""Tokens per core through the relay (issue 44): long streams at fleet concurrency, our gateway side
by side with the Rust ``vllm-router`` peer and the direct path.

    python -m loadtest.benchmarks.bench_relay [--quick] [--out PATH]

Loopback only; every process is started here and stopped here (the overhead benchmark's machinery:
:mod:`loadtest.benchmarks.bench_overhead`, :mod:`loadtest.common.overhead_cluster`,
:mod:`loadtest.common.procs`).

Each answer is 200 content chunks 20 ms apart (50 tokens/s, an 8B model's per-stream decode
speed), then the usage and ``[DONE]``, at 64, 128, 256 and 512 concurrent streams. Four legs, A/B
interleaved (each round one batch per leg, the order rotating), each warmed alike before a level:

* **direct**: the client straight to a paced fake OpenAI upstream (:mod:`loadtest.common.fake_upstream`);
* **peer**: ``vllm-router --policy round_robin`` (PyPI ``vllm-router==0.1.17``) in front of it;
* **ours**: our cluster (``deployments.launcher.local.start``, its gateway replicas behind Serve's HAProxy)
  with one provider backend (OpenAI wire) pointing at the upstream: the provider path;
* **engine**: the same cluster's sim engine replica (``llama-3.1-8b-h100`` profile, its clock slowed
  so that a step at 256 sequences takes 20 ms: ``sim_options.speedup``), streamed through the
  engine replica's internal stream: the engine path (no direct or peer leg can stand beside it);
* **floor**: a relay with no logic at all served the way our gateway is (:mod:`loadtest.common.serve_floor`:
  a Serve deployment behind the same HAProxy, the gateway's options), in front of the upstream:
  what the shape costs before any code of ours runs.

Per leg and level: chunks/s (the answers' completion tokens, from their usage, over the batches' wall
time), TTFT (to the first content delta), the gap between reads at the client after the first content,
and the relay's CPU per 1,000 chunks from ``/proc`` (utime + stime over its own batches): the gateway
replicas plus HAProxy for ours and the engine leg (the engine replica's own apart), vllm-router's
process for the peer. *Added* = leg minus direct at the same concurrency (p50 from p50, p99 from p99).
On 2 cores the client and the upstream share the CPU with the relay: their CPU is recorded too.

Writes ``loadtest/results/relay.json`` only from a complete run (every leg started, answered and
stopped cleanly, error rate <= 1 %), anything less ``relay.partial.json`` (exit status 1);
``--quick`` (64 and 256 streams, 50-chunk answers, one round; about a minute) says so in its
``setup`` and provenance. The full run takes about 7 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp

from cluster.config import ClusterConfig, parse_config
from deployments.launcher.local import free_port
from loadtest.benchmarks.bench_overhead import error_rate_problems, start_vllm_router, write_results
from loadtest.common.overhead_client import (
    HOST,
    MODEL,
    PROMPT,
    Level,
    SSEScan,
    _loop_factory,
    client_session,
)
from loadtest.common.overhead_cluster import OursCluster, provider_config
from loadtest.common.overhead_stats import _r, summarize
from loadtest.common.procs import (
    LegFailed,
    Proc,
    box_busy_s,
    cpu_s,
    quiet_collector,
    relay_pids,
    wait_http,
)
from loadtest.common.provenance import git_state, provenance

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "loadtest" / "results"
OUT, PARTIAL = RESULTS / "relay.json", RESULTS / "relay.partial.json"
LEGS = ("direct", "peer", "ours", "engine", "floor")
SIM_MODEL = "bench-sim"
SIM_PROFILE = "llama-3.1-8b-h100"
INTERVAL_S = 0.020
HEADLINE = 256  # the concurrency the flat keys are read at
MAX_ERROR_RATE = 0.01
CHUNKS, QUICK_CHUNKS = 200, 50
FULL = tuple(Level(c, 2, c, 60.0) for c in (64, 128, 256, 512))
QUICK = tuple(Level(c, 1, c, 30.0) for c in (64, 256))
GOAL_CPS_RATIO, GOAL_VS_PEER = 0.97, 2.0
KEEPALIVE_S = 600.0  # the client keeps each leg's connections across the other legs' batches


# --- the legs --------------------------------------------------------------------------------------


def sim_speedup(interval_s: float = INTERVAL_S, sequences: int = HEADLINE) -> float:
    """``sim_options.speedup`` that makes one decode step of ``sequences`` take ``interval_s``."""
    from cluster.engine.profiles import BatchShape, get_profile

    step = get_profile(SIM_PROFILE).step_time_model()
    ctx = 120  # about the prompt plus half the answer
    return step.step_time(BatchShape(decode_tokens=sequences, kv_read_tokens=sequences * ctx)) / interval_s


def relay_config(upstream_port: int, port: int, max_streams: int) -> ClusterConfig:
    """The overhead benchmark's provider cluster with admission sized for ``max_streams``, and a sim
    engine backend beside it (its own model) for the engine path."""
    raw = provider_config(upstream_port, port).model_dump(mode="json", exclude_unset=True)
    raw["name"] = "llmc-bench-relay"
    raw["backends"][0]["max_in_flight_per_replica"] = 2 * max_streams
    raw["surfaces"][0].update(max_concurrency=2 * max_streams, max_queue=2 * max_streams)
    raw["models"].append(
        {"name": SIM_MODEL, "tokenizer": "@tiny", "context_window": 8192, "default_max_tokens": 64}
    )
    raw["backends"].append(
        {
            "name": "sim-paced",
            "kind": "sim",
            "model": SIM_MODEL,
            "replicas": 1,
            "resources": {"num_cpus": 0.1},
            "sim_profile": SIM_PROFILE,
            "sim_options": {"speedup": round(sim_speedup(), 4)},
            "max_in_flight_per_replica": 2 * max_streams,
        }
    )
    raw["routes"].append({"model": SIM_MODEL, "candidates": ["sim-paced"]})
    return parse_config(raw, source="bench_relay")


def body(model: str, chunks: int, ignore_eos: bool = False) -> bytes:
    """A streamed chat request with usage (``ignore_eos``: the sim's, which a provider refuses)."""
    req: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
    req.update(max_tokens=chunks, stream=True, stream_options={"include_usage": True})
    return json.dumps(req | ({"ignore_eos": True} if ignore_eos else {})).encode()


# --- the client ------------------------------------------------------------------------------------


@dataclass
class LongSample:
    ok: bool
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    chunks: int = 0
    gaps_ms: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class LongBatch:
    samples: list[LongSample] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # per process group, over the batch


async def stream_long(session: aiohttp.ClientSession, url: str, data: bytes) -> LongSample:
    """One long stream: TTFT, then the gap before each later read, and the events counted."""
    scan, clock = SSEScan(), time.perf_counter
    gaps: list[float] = []
    ttft = last = None
    t0 = clock()
    try:
        async with session.post(url, data=data) as resp:
            if resp.status != 200:
                return LongSample(False, error=f"HTTP {resp.status}: {(await resp.text())[:160]}")
            async for chunk in resp.content.iter_any():
                now = clock()
                if last is not None:
                    gaps.append((now - last) * 1000.0)
                    last = now
                if scan.feed(chunk) and ttft is None:
                    ttft, last = (now - t0) * 1000.0, now
    except (aiohttp.ClientError, TimeoutError) as exc:
        return LongSample(False, error=f"{type(exc).__name__}: {exc}"[:200])
    e2e = (clock() - t0) * 1000.0
    error = scan.error or (None if scan.done else "no [DONE]") or (None if ttft is not None else "no content")
    chunks = (scan.usage or {}).get("completion_tokens") or 0
    return LongSample(error is None, ttft, e2e, int(chunks), gaps, error)


async def run_batch(
    session: aiohttp.ClientSession, url: str, data: bytes, level: Level, pids: dict[str, list[int]]
) -> LongBatch:
    """``level.batch`` streams, ``level.concurrency`` at once; CPU of each group in ``pids`` over it."""
    batch, left = LongBatch(), iter(range(level.batch))
    deadline = time.perf_counter() + level.max_s

    async def worker() -> None:
        for _ in left:
            if time.perf_counter() > deadline:
                return
            batch.samples.append(await stream_long(session, url, data))

    cpu0 = {k: cpu_s(v) for k, v in pids.items()}
    box0, t0 = box_busy_s(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(level.concurrency)))
    batch.wall_s = time.perf_counter() - t0
    batch.cpu_s = {k: cpu_s(v) - cpu0[k] for k, v in pids.items()} | {"box": box_busy_s() - box0}
    return batch


def figures(batches: Sequence[LongBatch], relay: Sequence[str]) -> dict[str, Any]:
    """One leg at one level: chunks/s, TTFT, gaps, CPU per 1,000 chunks (``relay``: the groups
    that are the relay)."""
    samples = [s for b in batches for s in b.samples]
    ok = [s for s in samples if s.ok]
    wall = sum(b.wall_s for b in batches)
    chunks = sum(s.chunks for s in ok)
    cpu = {k: sum(b.cpu_s.get(k, 0.0) for b in batches) for k in batches[0].cpu_s} if batches else {}
    per_1k = {k: _r(1e6 * v / chunks, 1) if chunks else None for k, v in cpu.items()}
    relay_cpu = sum(cpu.get(k, 0.0) for k in relay)
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            errors[str(s.error)] = errors.get(str(s.error), 0) + 1
    return {
        "requests": len(samples),
        "ok": len(ok),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "chunks": chunks,
        "chunks_per_s": _r(chunks / wall, 1) if wall > 0 else None,
        "ttft_ms": summarize([s.ttft_ms for s in ok if s.ttft_ms is not None]),
        "gap_ms": summarize([g for s in ok for g in s.gaps_ms]),
        "e2e_ms": summarize([s.e2e_ms for s in ok if s.e2e_ms is not None]),
        "cpu_ms_per_1k_chunks": per_1k,
        "relay_cpu_ms_per_1k_chunks": _r(1e6 * relay_cpu / chunks, 1) if relay and chunks else None,
    }


@dataclass
class Leg:
    url: str
    body: bytes
    pids: dict[str, list[int]]  # process groups whose CPU is read over this leg's batches
    relay: tuple[str, ...]  # the groups that make up the relay
    # the cluster's groups, looked up again before each batch (Serve restarts HAProxy on a reload)
    live: Callable[[], dict[str, list[int]]] | None = None

    def groups(self) -> dict[str, list[int]]:
        return self.pids | (self.live() if self.live is not None else {})


async def measure(legs: dict[str, Leg], levels: Sequence[Level]) -> dict[str, dict[str, dict[str, Any]]]:
    """Every level, A/B interleaved rounds after one warm-up batch per leg: ``out[leg]["c256"]``."""
    quiet_collector()
    out: dict[str, dict[str, dict[str, Any]]] = {}
    async with client_session(keepalive_s=KEEPALIVE_S) as session:
        for level in levels:
            print(f"[relay] c{level.concurrency}: {level.rounds} rounds x {level.batch} streams per leg ...")
            names = list(legs)
            for n in names:  # not recorded: connections opened, caches filled, alike for every leg
                await run_batch(session, legs[n].url, legs[n].body, level, {})
            got: dict[str, list[LongBatch]] = {n: [] for n in names}
            for r in range(level.rounds):
                k = r % len(names)
                for n in names[k:] + names[:k]:
                    leg = legs[n]
                    got[n].append(await run_batch(session, leg.url, leg.body, level, leg.groups()))
            for n, batches in got.items():
                fig = {"concurrency": level.concurrency, **figures(batches, legs[n].relay)}
                out.setdefault(n, {})[f"c{level.concurrency}"] = fig
    return out


# --- the run ---------------------------------------------------------------------------------------


def start_upstream(logdir: Path, chunks: int) -> tuple[Proc, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "loadtest.common.fake_upstream", "--port", str(port)]
    cmd += ["--chunks", str(chunks)]
    proc = Proc("fake-upstream", [*cmd, "--interval-ms", str(INTERVAL_S * 1000)], logdir)
    wait_http(f"http://{HOST}:{port}/health", proc, 30)
    return proc, port


def start_legs(
    stack: contextlib.ExitStack, logdir: Path, chunks: int, max_streams: int, out: dict[str, Any]
) -> dict[str, Leg]:
    """The upstream, the peer and our cluster; each leg's URL, body and processes."""
    upstream, up_port = start_upstream(logdir, chunks)
    stack.enter_context(upstream)
    up = {"upstream": [upstream.p.pid]}
    provider_body = body(MODEL, chunks)
    legs = {"direct": Leg(f"http://{HOST}:{up_port}/v1/chat/completions", provider_body, up, ())}
    router, rport = start_vllm_router("peer-router", [f"http://{HOST}:{up_port}"], "round_robin", logdir)
    stack.enter_context(router)
    peer_pids = {**up, "vllm_router": [router.p.pid]}
    legs["peer"] = Leg(
        f"http://{HOST}:{rport}/v1/chat/completions", provider_body, peer_pids, ("vllm_router",)
    )
    port, up_url = free_port(), f"http://{HOST}:{up_port}/v1/chat/completions"
    cfg = relay_config(up_port, port, max_streams)
    ours = stack.enter_context(OursCluster("ours", cfg, port, logdir, floor_upstream=up_url))
    out["clusters"].append(ours)
    out["startup_s"]["ours"] = _r(ours.wait_ready(300), 1)
    pids = relay_pids(ours.tag)
    out["processes"] = {k: len(v) for k, v in pids.items()}
    if not all(pids.values()):
        raise LegFailed(f"ours: relay processes not found by tag: {pids}")
    relay = ("gateway", "haproxy")
    legs["ours"] = Leg(ours.url, provider_body, up, relay, lambda: relay_pids(ours.tag))
    legs["engine"] = Leg(
        ours.url, body(SIM_MODEL, chunks, ignore_eos=True), {}, relay, lambda: relay_pids(ours.tag)
    )
    floor = ("floor", "haproxy")
    legs["floor"] = Leg(ours.floor_url or "", provider_body, up, floor, lambda: relay_pids(ours.tag))
    return legs


async def _smoke(legs: dict[str, Leg]) -> list[str]:
    async with client_session() as session:
        got = {n: await stream_long(session, leg.url, leg.body) for n, leg in legs.items()}
    return [f"{n}: the first request failed: {s.error}" for n, s in got.items() if not s.ok]


def run_legs(levels: Sequence[Level], chunks: int, logdir: Path, runner: asyncio.Runner) -> dict[str, Any]:
    out: dict[str, Any] = {"legs": {}, "startup_s": {}, "problems": [], "clusters": []}
    max_streams = max(level.concurrency for level in levels)
    try:
        with contextlib.ExitStack() as stack:
            legs = start_legs(stack, logdir, chunks, max_streams, out)
            out["problems"] += runner.run(_smoke(legs))
            if not out["problems"]:
                out["legs"] = runner.run(measure(legs, levels))
    except LegFailed as exc:
        out["problems"].append(str(exc))
        print(f"[relay] failed: {exc}", file=sys.stderr)
    for ours in out.pop("clusters"):
        out["stop"] = ours.stop_info
        out["problems"] += ours.problems()
    out["problems"] += error_rate_problems(out["legs"])
    return out


# --- results ---------------------------------------------------------------------------------------


def headline(legs: dict[str, dict[str, dict[str, Any]]], c: int = HEADLINE) -> dict[str, Any]:
    """The flat keys at ``c`` streams: ours (the provider path) and the peer against direct, and
    each relay's CPU per 1,000 chunks."""

    def at(leg: str) -> dict[str, Any]:
        return legs.get(leg, {}).get(f"c{c}", {})

    def ratio(leg: str) -> float | None:
        a, b = at(leg).get("chunks_per_s"), at("direct").get("chunks_per_s")
        return _r(a / b) if a and b else None

    def added(leg: str, key: str, q: str) -> float | None:
        a, b = (at(leg).get(key) or {}).get(q), (at("direct").get(key) or {}).get(q)
        return None if a is None or b is None else _r(a - b)

    out: dict[str, Any] = {}
    for prefix, leg in (("", "ours"), ("peer_", "peer"), ("floor_", "floor")):
        out[f"{prefix}c{c}_cps_ratio"] = ratio(leg)
        out[f"{prefix}c{c}_added_ttft_p50_ms"] = added(leg, "ttft_ms", "p50")
        out[f"{prefix}c{c}_added_ttft_p99_ms"] = added(leg, "ttft_ms", "p99")
        out[f"{prefix}c{c}_added_gap_p99_ms"] = added(leg, "gap_ms", "p99")
    out["cpu_ms_per_1k_chunks_provider"] = at("ours").get("relay_cpu_ms_per_1k_chunks")
    out["cpu_ms_per_1k_chunks_engine"] = at("engine").get("relay_cpu_ms_per_1k_chunks")
    out["peer_cpu_ms_per_1k_chunks"] = at("peer").get("relay_cpu_ms_per_1k_chunks")
    out["floor_cpu_ms_per_1k_chunks"] = at("floor").get("relay_cpu_ms_per_1k_chunks")
    out[f"direct_c{c}_chunks_per_s"] = at("direct").get("chunks_per_s")
    out[f"engine_c{c}_chunks_per_s"] = at("engine").get("chunks_per_s")
    return out


def goals(fig: dict[str, Any], c: int = HEADLINE) -> dict[str, bool | None]:
    """Issue 44's goals at ``c`` streams; None where a figure was not measured."""

    def vs_peer(key: str, peer: str, k: float = GOAL_VS_PEER) -> bool | None:
        a, b = fig.get(key), fig.get(peer)
        # an added figure the peer keeps at or under 0 ms is held to 1 ms (noise, not a ratio)
        return None if a is None or b is None else a <= k * max(b, 1.0)

    ratio = fig.get(f"c{c}_cps_ratio")
    peer_cpu = "peer_cpu_ms_per_1k_chunks"
    return {
        f"c{c}_cps_ratio >= {GOAL_CPS_RATIO}": None if ratio is None else ratio >= GOAL_CPS_RATIO,
        f"c{c}_added_ttft_p99_ms <= 2 x peer": vs_peer(
            f"c{c}_added_ttft_p99_ms", f"peer_c{c}_added_ttft_p99_ms"
        ),
        f"c{c}_added_gap_p99_ms <= 2 x peer": vs_peer(
            f"c{c}_added_gap_p99_ms", f"peer_c{c}_added_gap_p99_ms"
        ),
        "cpu_ms_per_1k_chunks_provider <= 2 x peer": vs_peer("cpu_ms_per_1k_chunks_provider", peer_cpu),
        "cpu_ms_per_1k_chunks_engine <= 2 x peer": vs_peer("cpu_ms_per_1k_chunks_engine", peer_cpu),
    }


def print_summary(result: dict[str, Any]) -> None:
    for level, direct in result.get("legs", {}).get("direct", {}).items():
        cells = [f"direct {direct['chunks_per_s']} chunks/s"]
        for leg in LEGS[1:]:
            f = result["legs"].get(leg, {}).get(level)
            if f:
                t, g = f["ttft_ms"], f["gap_ms"]
                cells.append(
                    f"{leg} {f['chunks_per_s']}/s ttft p50 {t['p50']} p99 {t['p99']} gap p99 {g['p99']} "
                    f"cpu/1k {f['relay_cpu_ms_per_1k_chunks']}"
                )
        print(f"{level:<5} " + " | ".join(cells))
    for k, v in result.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            print(f"{k}: {v}")
    for goal, ok in result["goals"].items():
        print(f"goal {goal}: {ok}")
    for p in result["problems"]:
        print(f"problem: {p.splitlines()[0]}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_relay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 and 256 streams, 50-chunk answers, one round")
    ap.add_argument("--out", type=Path, help="write here instead of relay.json / relay.partial.json")
    ap.add_argument("--keep-logs", action="store_true", help="keep the children's logs after a clean run")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every child is stopped
    started, load_before, git = time.monotonic(), os.getloadavg(), git_state()
    logdir = Path(tempfile.mkdtemp(prefix="llmc-bench-relay-"))
    levels, chunks = (QUICK, QUICK_CHUNKS) if args.quick else (FULL, CHUNKS)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        run = run_legs(levels, chunks, logdir, runner)
    fig = headline(run["legs"])
    result: dict[str, Any] = {**fig, "goals": goals(fig), "problems": run["problems"]}
    # every level's figures as the flat keys have them at 256 (the tables read them from here)
    result["by_level"] = {f"c{x.concurrency}": headline(run["legs"], x.concurrency) for x in levels}
    result["complete"] = complete = set(run["legs"]) == set(LEGS) and not run["problems"]
    result["setup"] = {
        "levels": [asdict(level) for level in levels],
        "chunks": chunks,
        "interval_ms": INTERVAL_S * 1000,
        "sim_profile": SIM_PROFILE,
        "sim_speedup": round(sim_speedup(), 4),
        "processes": run.get("processes"),
        "startup_s": run["startup_s"],
        "stop": run.get("stop"),
    }
    result["legs"] = run["legs"]
    result["provenance"] = provenance(argv or sys.argv[1:], git, load_before, started)
    path = args.out or (OUT if complete else PARTIAL)
    write_results(result, path)
    print_summary(result)
    print(f"wrote {path} ({'complete' if complete else 'partial'} run)")
    if complete and not args.keep_logs:
        shutil.rmtree(logdir, ignore_errors=True)
    else:
        print(f"children's logs: {logdir}")
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())
