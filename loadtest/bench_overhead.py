"""Gateway overhead: the same streaming requests sent straight to a backend and through the stack.

    python loadtest/bench_overhead.py [--quick] [--profile] [--serve-env K=V ...]
        [--variant-env RAY_SERVE_THROUGHPUT_OPTIMIZED=1 ...]

What is compared (one machine, loopback, the same client, the same backend class and config):

* **direct** — the simulated engine (:class:`cluster.sim_backend.SimBackend`, profile
  ``llama-3.1-8b-h100``) in-process behind a minimal OpenAI-compatible HTTP server in its own
  process: FastAPI + uvicorn (uvloop, httptools), the request validated with the same pydantic
  schema, tokenized with the same tokenizer and turned into the same ``GenerateRequest``
  (``cluster.requests``), the chunks framed as the same SSE bytes (``cluster.openai_format``). This
  is what a backend's own OpenAI server (vLLM's) costs, without any gateway.
* **gateway** — the whole cluster from the same backend config, one replica: Serve's HTTP proxy →
  Ingress (FastAPI) → Router (tokenize, admission, cache-aware choice, metrics) → backend replica
  (the same SimBackend), each streamed chunk crossing three Ray streaming hops (backend → router →
  ingress → proxy) before the socket.
* two in-between layers, from this process (the Ray driver) through Serve handles, to see which
  hop costs what: **backend handle** (one Ray hop to the backend replica, no HTTP, no router) and
  **router handle** (router + backend, two hops, no HTTP).

Phases:

1. **TTFT** one request at a time (``sim-fast``: the engine model runs 1000x faster than real
   time, so TTFT is the stack's own cost plus ~µs of model time), the layers interleaved request
   by request so background load hits them alike; added TTFT = gateway - direct, p50 and p99.
2. **Relay ceiling**: 48 concurrent streams of 256 tokens on ``sim-fast`` (tokens are ready faster
   than any relay can move them) for a few seconds per layer: tokens per second reaching the
   client; CPU seconds burnt per process (proxy, ingress, router, backend, raylet …) per 1000
   tokens: where the time goes. ``--profile`` adds py-spy's top self-time frames per process.
3. **At load**: 48 streams on ``sim-rt`` (real-time H100 physics: one decode step ~ 6-7 ms for the
   whole batch) for direct and gateway: client tokens/s and inter-token gaps, i.e. whether the
   relay keeps up with a real engine's pace.
4. **Ray hop probe**: a one-replica Serve deployment that yields N chunks one per item or in
   lists of k, read through a handle: chunks/s per batch size — the gain available from
   coalescing chunks already queued at a hop.
5. **Coalescing prototype**: 48 streams paced like an engine (150 tok/s each) through the same
   hop, one chunk per item vs ``coalesce()`` (take everything already queued after each await),
   alternated: delivered tok/s, chunks per item, inter-token gaps.

Writes ``loadtest/results/overhead.json`` (``added_ttft_p50_ms``, ``added_ttft_p99_ms``,
``relay_tok_s_direct``, ``relay_tok_s_gateway`` and the details). Bounded in time (about 3-4
minutes with the cluster start; ``--quick`` halves the samples).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from fastapi import Request  # module level: FastAPI resolves the handler's annotation by name

from cluster.config import ClusterConfig, parse_config
from loadtest.runner import quantile

APP = "llmc-overhead"
RESULTS = Path(__file__).parent / "results"
PROMPT = "Write a function that reverses a string, and explain it briefly."
MODELS = {"sim-rt": 1.0, "sim-fast": 1000.0}  # model name → sim speedup


def bench_config() -> ClusterConfig:
    """One model per speed, one backend replica each; limits high enough never to queue."""
    kv = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}
    return parse_config(
        {
            "name": APP,
            "server": {"host": "127.0.0.1", "port": 8000, "default_surface": "chat"},
            "models": [
                {"name": m, "tokenizer": "@tiny", "context_window": 8192, "params_b": 8.03, "kv": kv}
                for m in MODELS
            ],
            "backends": [
                {
                    "name": m,
                    "kind": "sim",
                    "model": m,
                    "replicas": 1,
                    "resources": {"num_cpus": 0.1},
                    "sim_profile": "llama-3.1-8b-h100",
                    "sim_options": {"speedup": s, "seed": 0},
                    "max_in_flight_per_replica": 512,
                }
                for m, s in MODELS.items()
            ],
            "surfaces": [
                {"name": "chat", "ttft_slo_ms": 1000, "max_concurrency": 512, "max_queue": 512},
            ],
            "routes": [{"model": m, "candidates": [m]} for m in MODELS],
        },
        source="bench_overhead",
    )


# --- the direct server (its own process) ------------------------------------------------------------


def direct_app(cfg: ClusterConfig) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    from cluster.openai_format import SSE_DONE, ResponseMeta, sse, stream_chunk, usage_chunk
    from cluster.protocol import ChatCompletionRequest
    from cluster.requests import build_generate_request, check_context, prompt_ids, requested_max_tokens
    from cluster.sim_backend import SimBackend
    from cluster.tokens import load_tokenizer

    app = FastAPI()
    backends = {
        b.model: SimBackend.from_config(b, cfg.model(b.model), f"{b.name}-direct") for b in cfg.backends
    }
    tok = load_tokenizer("@tiny")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        api = ChatCompletionRequest.model_validate(json.loads(await request.body()))
        model = cfg.model(api.model)
        if model is None:
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
        ids, messages, text = prompt_ids(api, tok)
        max_tokens = check_context(model, len(ids), requested_max_tokens(api))
        rid = uuid.uuid4().hex
        req = build_generate_request(
            api, model, ids, messages, text, request_id=rid, surface="chat", session_id=None,
            timeout_s=600, max_tokens=max_tokens,
        )  # fmt: skip
        gen = backends[api.model].generate(req)
        first = await gen.__anext__()  # like the ingress: headers go with the first token
        meta = ResponseMeta(kind="chat", request_id=rid, model=api.model)

        async def body() -> Any:
            chunk, usage, sent_first = first, None, False
            try:
                while chunk is not None:
                    yield sse(stream_chunk(meta, chunk.text, chunk.finish_reason, first=not sent_first))
                    sent_first = True
                    usage = chunk.usage or usage
                    chunk = await anext(gen, None)
                if usage is not None:
                    yield sse(usage_chunk(meta, usage))
            finally:
                await gen.aclose()
            yield SSE_DONE

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def serve_direct(port: int) -> None:
    import uvicorn

    uvicorn.run(
        direct_app(bench_config()),
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_direct() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-direct", str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180  # imports take long on a busy 2-core machine
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(url + "/docs", timeout=1, trust_env=False)
            return proc, url
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("direct server did not start")


# --- clients ---------------------------------------------------------------------------------------

_CONTENT = re.compile(rb'"content":"[^"]')


def chat_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def http_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, list[float]]:
    """(TTFT, arrival time of every content frame). Lean parsing: counts frames, no JSON."""
    start = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for raw in r.aiter_raw():
            n = len(_CONTENT.findall(raw))
            if n:
                now = time.perf_counter()
                arrivals.extend([now] * n)
    if not arrivals:
        raise RuntimeError(f"{url}: no content")
    return arrivals[0] - start, arrivals


class HandleLayers:
    """The in-between layers, through Serve handles from this (driver) process."""

    def __init__(self, cfg: ClusterConfig) -> None:
        from ray import serve

        from cluster.tokens import load_tokenizer

        self.cfg = cfg
        self.tok = load_tokenizer("@tiny")
        self.router = serve.get_deployment_handle("Router", app_name=APP).options(stream=True)
        self.backends = {
            m: serve.get_deployment_handle(f"backend-{m}", app_name=APP).options(stream=True) for m in MODELS
        }

    def _request(self, model: str, max_tokens: int) -> Any:
        from cluster.protocol import ChatCompletionRequest
        from cluster.requests import build_generate_request, prompt_ids

        api = ChatCompletionRequest.model_validate(chat_body(model, max_tokens))
        ids, messages, text = prompt_ids(api, self.tok)
        m = self.cfg.model(model)
        return build_generate_request(
            api, m, ids, messages, text, request_id=uuid.uuid4().hex, surface="chat", session_id=None,
            timeout_s=600, max_tokens=max_tokens,
        )  # fmt: skip

    async def backend(self, model: str, max_tokens: int) -> tuple[float, list[float]]:
        req = self._request(model, max_tokens)  # built before the clock starts: no HTTP, no router
        start = time.perf_counter()
        return await _consume(self.backends[model].generate.remote(req), start)

    async def router_(self, model: str, max_tokens: int) -> tuple[float, list[float]]:
        start = time.perf_counter()
        ctx = {"kind": "chat", "request_id": uuid.uuid4().hex, "surface": "chat", "session_id": None}
        return await _consume(self.router.generate.remote(chat_body(model, max_tokens), ctx), start)


async def _consume(gen: Any, start: float) -> tuple[float, list[float]]:
    arrivals = []
    async for chunk in gen:
        if chunk.text:
            arrivals.append(time.perf_counter())
    return arrivals[0] - start, arrivals


# --- phases ----------------------------------------------------------------------------------------


def _ms(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "n": len(s),
        "p50": round(1000 * quantile(s, 0.5), 3),
        "p90": round(1000 * quantile(s, 0.9), 3),
        "p99": round(1000 * quantile(s, 0.99), 3),
    }


async def phase_ttft(layers: dict[str, Any], n: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = defaultdict(list)
    names = list(layers)
    for name in names:  # warm every path (connections, handles, first-request imports)
        for _ in range(5):
            await layers[name]("sim-fast", 2)
    for i in range(n):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate the order
            ttft, _ = await layers[name]("sim-fast", 2)
            samples[name].append(ttft)
        if (i + 1) % 25 == 0:
            print(f"[overhead] ttft {i + 1}/{n}", file=sys.stderr, flush=True)
    return {name: _ms(xs) for name, xs in samples.items()}


async def phase_streams(
    fn: Any, model: str, concurrency: int, max_tokens: int, duration_s: float
) -> dict[str, Any]:
    """``concurrency`` closed-loop streams for ``duration_s``: tokens/s, gaps, TTFTs."""
    tokens = 0
    gaps: list[float] = []
    ttfts: list[float] = []
    errors: Counter[str] = Counter()
    stop_at = time.perf_counter() + duration_s
    t0 = time.perf_counter()

    async def worker() -> None:
        nonlocal tokens
        while time.perf_counter() < stop_at:
            try:
                ttft, arr = await fn(model, max_tokens)
            except Exception as exc:
                errors[type(exc).__name__] += 1
                await asyncio.sleep(0.05)
                continue
            ttfts.append(ttft)
            tokens += len(arr)
            gaps.extend(b - a for a, b in itertools.pairwise(arr))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "wall_s": round(wall, 2),
        "tokens": tokens,
        "tok_s": round(tokens / wall, 1),
        "ttft_ms": _ms(ttfts),
        "itl_ms": _ms(gaps),
        "errors": dict(errors),
    }


# --- where the CPU goes ----------------------------------------------------------------------------


def process_labels(extra: dict[str, int]) -> dict[str, int]:
    """This Ray instance's processes (children of this driver) by role, plus ``extra``."""
    import psutil

    out = dict(extra)
    out["client+driver"] = os.getpid()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        label = None
        if m := re.search(r"ray::ServeReplica:[^:]+:(\S+)", cmd):
            label = m.group(1).split(".")[0]
        elif "ray::ProxyActor" in cmd:
            label = "serve-proxy"
        elif "ray::ServeController" in cmd:
            label = "serve-controller"
        elif "ray::StatsHub" in cmd:
            label = "stats-hub"
        elif "raylet" in cmd.split(" ")[0]:
            label = "raylet"
        elif "gcs_server" in cmd:
            label = "gcs"
        elif "dashboard" in cmd or "agent" in cmd:
            label = "ray-agents"
        if label is not None and p.pid not in out.values():
            key = label if label not in out else f"{label}-{p.pid}"
            out[key] = p.pid
    return out


def cpu_times(pids: dict[str, int]) -> dict[str, float]:
    import psutil

    out = {}
    for label, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[label] = t.user + t.system
        except psutil.Error:
            continue
    return out


SERVER_SIDE = {  # the processes that serve each layer (the client and idle neighbours left out)
    "direct_http": ("direct-server",),
    "backend_handle": ("backend-", "raylet", "gcs"),
    "router_handle": ("Router", "backend-", "raylet", "gcs"),
    "gateway_http": ("serve-proxy", "Ingress", "Router", "backend-", "raylet", "gcs"),
}


def cpu_breakdown(
    before: dict[str, float], after: dict[str, float], tokens: int, wall: float, layer: str
) -> dict[str, Any]:
    rows = {}
    for label in sorted(after, key=lambda k: -(after[k] - before.get(k, after[k]))):
        d = after[label] - before.get(label, after[label])
        if d < 0.01:
            continue
        rows[label] = {
            "cpu_s": round(d, 2),
            "cores": round(d / wall, 2),
            "us_per_token": round(1e6 * d / tokens, 1) if tokens else None,
        }
    total = sum(r["cpu_s"] for r in rows.values())
    relay = sum(r["cpu_s"] for k, r in rows.items() if k.startswith(SERVER_SIDE[layer]))
    return {
        "processes": rows,
        "total_cpu_s": round(total, 2),
        "total_cores": round(total / wall, 2),
        # Server side only (not the client): CPU per relayed token, and tokens per CPU-second —
        # a figure that holds better than tok/s when other work shares the cores.
        "server_us_per_token": round(1e6 * relay / tokens, 1) if tokens else None,
        "server_tok_per_cpu_s": round(tokens / relay) if relay else None,
    }


def start_pyspy(pids: dict[str, int], duration_s: float) -> dict[str, tuple[subprocess.Popen[bytes], str]]:
    spy = Path(sys.executable).parent / "py-spy"
    out = {}
    for label, pid in pids.items():
        path = os.path.join(tempfile.gettempdir(), f"llmc-pyspy-{label}-{pid}.txt")
        cmd = [str(spy), "record", "--nonblocking", "-r", "97", "-d", str(int(duration_s)), "-f", "raw"]
        cmd += ["-o", path, "-p", str(pid)]
        out[label] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), path)
    return out


def pyspy_top(runs: dict[str, tuple[subprocess.Popen[bytes], str]], top: int = 8) -> dict[str, Any]:
    """Top self-time frames per process, and the share in a few categories (inclusive)."""
    cats = {
        "ray_core_worker/serialization": ("_raylet", "serialization", "pickle", "cloudpickle"),
        "serve_handle/router": ("ray/serve/_private/router", "request_router", "replica_result"),
        "serve_replica/proxy": ("ray/serve/_private/replica", "proxy", "http_util"),
        "asgi/http": ("starlette", "fastapi", "uvicorn", "h11", "httptools"),
        "asyncio": ("asyncio/", "uvloop"),
        "our code": ("cluster/", "deployments/"),
        "metrics": ("metrics", "opentelemetry", "prometheus"),
    }
    out = {}
    for label, (proc, path) in runs.items():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        if not os.path.exists(path):
            out[label] = {"error": "no samples (py-spy could not attach?)"}
            continue
        self_time: Counter[str] = Counter()
        cat_time: Counter[str] = Counter()
        total = 0
        for line in Path(path).read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            self_time[frames[-1]] += n
            for cat, keys in cats.items():
                if any(k in stack for k in keys):
                    cat_time[cat] += n
        os.unlink(path)
        out[label] = {
            "samples": total,
            "top_self": [(f, round(n / total, 3)) for f, n in self_time.most_common(top)] if total else [],
            "categories_inclusive": {c: round(n / total, 3) for c, n in cat_time.most_common()}
            if total
            else {},
        }
    return out


# --- the Ray hop probe -----------------------------------------------------------------------------


def deploy_probe() -> Any:
    """A one-replica Serve app with two probes of one Ray streaming hop (replica -> this driver):

    * ``stream(n, k)``: n chunks as fast as possible, k per item (the per-item cost of a hop);
    * ``paced(n, rate, coalesced)``: a token every 1/rate s (an engine's pace), yielded one per item,
      or through :func:`coalesce` — the proposed fix: after awaiting one chunk, take every chunk
      that is already queued, so a hop that keeps up sends items of one (no added latency) and a
      hop that falls behind sends fewer, bigger items instead of falling further behind.
    """
    from ray import serve

    from cluster.protocol import Chunk

    async def coalesce(agen: Any, max_batch: int = 64) -> Any:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        end = object()

        async def pump() -> None:
            try:
                async for item in agen:
                    queue.put_nowait(item)
            except Exception as exc:  # handed to the consumer, raised there
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(end)

        task = asyncio.get_running_loop().create_task(pump())
        try:
            while True:
                batch = [await queue.get()]
                while len(batch) < max_batch and not queue.empty():
                    batch.append(queue.get_nowait())
                done = batch[-1] is end
                items = [x for x in batch if x is not end]
                for x in items:
                    if isinstance(x, Exception):
                        raise x
                if items:
                    yield items
                if done:
                    return
        finally:
            task.cancel()

    async def ticks(n: int, rate: float) -> Any:
        chunk = Chunk(text=" kalo", token_ids=[17], replica="probe", backend="probe")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + (i + 1) / rate - loop.time()))
            yield chunk

    @serve.deployment(name="RelayProbe", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.1})
    class RelayProbe:
        async def stream(self, n: int, k: int) -> Any:
            chunk = Chunk(text=" kalo", token_ids=[17], replica="probe", backend="probe")
            for _ in range(n // k):
                yield chunk if k == 1 else [chunk] * k
                await asyncio.sleep(0)

        async def paced(self, n: int, rate: float, coalesced: bool) -> Any:
            if coalesced:
                async for batch in coalesce(ticks(n, rate)):
                    yield batch
            else:
                async for chunk in ticks(n, rate):
                    yield [chunk]  # same item type, one chunk per item

    serve.run(RelayProbe.bind(), name="llmc-relay-probe", route_prefix="/relay-probe")
    return serve.get_deployment_handle("RelayProbe", app_name="llmc-relay-probe").options(stream=True)


async def _probe_one(handle: Any, n: int, k: int) -> int:
    got = 0
    async for item in handle.stream.remote(n, k):
        got += 1 if k == 1 else len(item)
    return got


async def phase_probe(handle: Any, concurrency: int, n: int, ks: list[int]) -> dict[str, Any]:
    out = {}
    for k in ks:
        await _probe_one(handle, n, k)  # warm
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_probe_one(handle, n, k) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        chunks = sum(counts)
        out[f"k={k}"] = {
            "chunks_s": round(chunks / wall),
            "items_s": round(chunks / k / wall),
            "us_per_item_wall": round(1e6 * wall / (chunks / k), 1),
        }
    return out


async def _paced_one(handle: Any, n: int, rate: float, coalesced: bool) -> tuple[list[float], int]:
    arrivals: list[float] = []
    items = 0
    async for batch in handle.paced.remote(n, rate, coalesced):
        now = time.perf_counter()
        arrivals.extend([now] * len(batch))
        items += 1
    return arrivals, items


async def phase_coalesce(handle: Any, concurrency: int, n: int, rate: float, rounds: int) -> dict[str, Any]:
    """Engine-paced streams through one hop, per-chunk vs coalesced items, alternated."""
    acc: dict[str, dict[str, Any]] = {
        m: {"tokens": 0, "items": 0, "wall": 0.0, "gaps": []} for m in ("per_chunk", "coalesced")
    }
    for r in range(rounds):
        for mode in ("per_chunk", "coalesced") if r % 2 == 0 else ("coalesced", "per_chunk"):
            t0 = time.perf_counter()
            res = await asyncio.gather(
                *(_paced_one(handle, n, rate, mode == "coalesced") for _ in range(concurrency))
            )
            a = acc[mode]
            a["wall"] += time.perf_counter() - t0
            for arr, items in res:
                a["tokens"] += len(arr)
                a["items"] += items
                a["gaps"].extend(b - x for x, b in itertools.pairwise(arr))
    ideal = concurrency * rate
    return {
        "what": f"{concurrency} streams x {n} tokens at {rate:g} tok/s each through one hop "
        f"(ideal {ideal:,.0f} tok/s), {rounds} alternating rounds",
        **{
            m: {
                "tok_s": round(a["tokens"] / a["wall"], 1),
                "chunks_per_item": round(a["tokens"] / max(1, a["items"]), 2),
                "itl_ms": _ms(a["gaps"]),
            }
            for m, a in acc.items()
        },
    }


# --- main ------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, direct_url: str, direct_pid: int) -> dict[str, Any]:
    from deployments import local

    cfg = bench_config()
    port = free_port()
    t0 = time.monotonic()
    local.start(cfg, port=port)
    startup = time.monotonic() - t0
    gw_url = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    client = httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10), limits=limits, trust_env=False)
    h = HandleLayers(cfg)

    def via(url: str) -> Any:
        return lambda model, mt: http_stream(client, url, chat_body(model, mt))

    layers = {
        "direct_http": via(direct_url),
        "backend_handle": h.backend,
        "router_handle": h.router_,
        "gateway_http": via(gw_url),
    }
    report: dict[str, Any] = {
        "cluster_startup_s": round(startup, 1),
        "ray_serve_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("RAY_SERVE_")},
    }
    try:
        report["ttft_ms"] = await phase_ttft(layers, args.ttft_n)
        pids = process_labels({"direct-server": direct_pid})
        report["relay_ceiling"] = {}
        for name in ("direct_http", "router_handle", "gateway_http"):
            spy = None
            if args.profile and name != "router_handle":
                targets = (
                    {"direct-server": direct_pid}
                    if name == "direct_http"
                    else {
                        k: v
                        for k, v in pids.items()
                        if k in ("serve-proxy", "Ingress", "Router", "backend-sim-fast")
                    }
                )
                spy = start_pyspy(targets, max(1, args.stream_s - 1))
            before = cpu_times(pids)
            res = await phase_streams(layers[name], "sim-fast", args.concurrency, 256, args.stream_s)
            res["cpu"] = cpu_breakdown(before, cpu_times(pids), res["tokens"], res["wall_s"], name)
            if spy is not None:
                res["pyspy"] = pyspy_top(spy)
            report["relay_ceiling"][name] = res
            print(f"[overhead] ceiling {name}: {res['tok_s']} tok/s", file=sys.stderr, flush=True)
        report["at_load_sim_rt"] = {}
        for name in ("direct_http", "gateway_http"):
            before = cpu_times(pids)
            res = await phase_streams(layers[name], "sim-rt", args.concurrency, 128, args.stream_s)
            res["cpu"] = cpu_breakdown(before, cpu_times(pids), res["tokens"], res["wall_s"], name)
            report["at_load_sim_rt"][name] = res
            print(f"[overhead] at load {name}: {res['tok_s']} tok/s", file=sys.stderr, flush=True)
        probe = deploy_probe()
        report["ray_hop_probe"] = {
            "what": f"{args.concurrency} streams x 512 chunks, one Serve handle hop, k chunks per item",
            **await phase_probe(probe, args.concurrency, 512, [1, 4, 16]),
        }
        report["coalescing_prototype"] = await phase_coalesce(
            probe, args.concurrency, 256, args.paced_rate, 2 if args.quick else 4
        )
        print(f"[overhead] coalescing: {report['coalescing_prototype']}", file=sys.stderr, flush=True)
    finally:
        await client.aclose()
        local.stop()
    return report


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    t = report["ttft_ms"]
    c = report["relay_ceiling"]
    return {
        "added_ttft_p50_ms": round(t["gateway_http"]["p50"] - t["direct_http"]["p50"], 3),
        "added_ttft_p99_ms": round(t["gateway_http"]["p99"] - t["direct_http"]["p99"], 3),
        "relay_tok_s_direct": c["direct_http"]["tok_s"],
        "relay_tok_s_gateway": c["gateway_http"]["tok_s"],
        "relay_tok_s_router_handle": c["router_handle"]["tok_s"],
        "ttft_ms_by_layer_p50": {k: v["p50"] for k, v in t.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve-direct", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer samples, shorter phases")
    ap.add_argument("--profile", action="store_true", help="py-spy the hot processes in phase 2")
    ap.add_argument("--ttft-n", type=int, default=None, help="TTFT samples per layer (default 200)")
    ap.add_argument("--stream-s", type=float, default=None, help="seconds per streaming phase (8)")
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--paced-rate", type=float, default=150.0, help="tok/s per stream in phase 5")
    ap.add_argument("--serve-env", action="append", default=[], metavar="K=V", help="env for Ray (knobs)")
    ap.add_argument(
        "--variant-env",
        action="append",
        default=[],
        metavar="K=V[,K=V]",
        help="run everything again with these Ray/Serve settings (a fresh process each)",
    )
    ap.add_argument("--out", default=str(RESULTS / "overhead.json"))
    args = ap.parse_args()
    if args.serve_direct:
        serve_direct(args.serve_direct)
        return
    args.ttft_n = args.ttft_n or (100 if args.quick else 200)
    args.stream_s = args.stream_s or (5.0 if args.quick else 8.0)
    for kv in args.serve_env:
        k, _, v = kv.partition("=")
        os.environ[k] = v
    started = time.monotonic()
    proc, direct_url = start_direct()
    try:
        details = asyncio.run(run(args, direct_url, proc.pid))
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    out = {
        **summarize(details),
        "machine": f"{os.cpu_count()} CPUs ({platform.machine()}), Python {platform.python_version()}",
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "serve_env": args.serve_env,
        "runtime_s": round(time.monotonic() - started, 1),
        "details": details,
    }
    if args.variant_env:
        out["variants"] = {"default": {k: v for k, v in out.items() if k != "details"}}
        out["variant_details"] = {}
    for spec in args.variant_env:
        name, sub = spec, run_variant_process(args, spec.split(","))
        if "details" in sub:
            out["variant_details"][name] = sub.pop("details")
        out["variants"][name] = sub
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out.get("variants") or {k: v for k, v in out.items() if k != "details"}, indent=1))
    print(f"[overhead] wrote {args.out}", file=sys.stderr)


def run_variant_process(args: argparse.Namespace, env: list[str]) -> dict[str, Any]:
    """The whole benchmark again in a fresh process with more Ray/Serve settings: Serve reads its
    settings when imported, in the driver as in every worker, so a variant needs its own driver."""
    out = Path(tempfile.gettempdir()) / f"llmc-overhead-variant-{os.getpid()}.json"
    cmd = [sys.executable, __file__, "--out", str(out), "--ttft-n", str(args.ttft_n)]
    cmd += ["--stream-s", str(args.stream_s), "--concurrency", str(args.concurrency)]
    cmd += ["--paced-rate", str(args.paced_rate)] + (["--profile"] if args.profile else [])
    cmd += ["--quick"] if args.quick else []
    for kv in [*args.serve_env, *env]:
        cmd += ["--serve-env", kv]
    print(f"[overhead] variant {' '.join(env)} …", file=sys.stderr, flush=True)
    try:
        subprocess.run(cmd, check=True, timeout=900)
        return json.loads(out.read_text())
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        return {"error": repr(exc)[:500]}
    finally:
        out.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
