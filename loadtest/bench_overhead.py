"""What our gateway adds to a streamed request, side by side with the Rust ``vllm-router`` peer.

    python -m loadtest.bench_overhead [--quick] [--legs direct,peer,ours] [--vllm | --no-vllm]

Loopback only (127.0.0.1); every process is started here, in its own session, and stopped here.

**Relay phase** — a fake OpenAI-compatible upstream that answers at once (:mod:`loadtest.fake_upstream`,
32 chunks per answer), reached three ways:

* **direct**: the client straight to the fake upstream (the floor; always measured);
* **peer**: ``vllm-router --policy round_robin`` (PyPI ``vllm-router==0.1.17``) in front of it;
* **ours**: our cluster (``deployments.local.start``) with one provider backend (``kind: provider``,
  OpenAI wire) pointing at it; requests carry ``x-surface: chat``.

The same request (stream, ``include_usage``) at 1, 16 and 64 (stress) concurrent streams. A/B
interleaved: each round runs one batch per leg, the order rotating each round, so background load
hits every leg alike. Client TTFT is the time to the first content delta; requests/s is completed
requests over the batches' wall time. One aiohttp session, SSE parsed by bytes (JSON only until the
first content delta), so the load generator is not what is measured; what it does cost is recorded
(``client_cpu_ms_per_request``: on 2 cores the client and the upstream share the CPU with the relay).
*Added* = leg minus direct at the same concurrency (p50 from p50, p99 from p99).

**vLLM phase** (``--vllm`` alone, or part of the default run; ``--no-vllm`` skips it) — real vLLM-CPU
with the tiny local model (``python -m cluster.tiny_model``), 2 replicas: E2E p50 of a multi-turn chat
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
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import yaml

from cluster.config import ClusterConfig, load_config, parse_config
from deployments.local import ENGINE_ENV, free_port
from loadtest.fake_upstream import CHUNKS
from loadtest.provenance import git_state, provenance
from loadtest.stats import quantile

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "loadtest" / "results"
OUT = RESULTS / "overhead.json"
PARTIAL = RESULTS / "overhead.partial.json"
LOCAL_CONFIG = ROOT / "configs" / "local.yaml"
HOST = "127.0.0.1"
LEGS = ("direct", "peer", "ours")
MODEL = "bench-model"
TAG_VAR = "LLMC_BENCH_TAG"  # in every child's environment: finds what a leg left behind
HEADERS = {"content-type": "application/json", "x-surface": "chat"}
PROMPT = "Write a function that reverses a string, and explain it briefly."
MAX_ERROR_RATE = 0.01
GOAL_ADDED_C1_MS = 1.0
GOAL_C16_VS_PEER = 2.0
GOAL_RPS_VS_PEER = 0.8
GOAL_VLLM_VS_PEER = 1.1
# The engine environment our replicas get, for the peer's engines too (Ray Serve's own log setting aside).
VLLM_ENV = {k: v for k, v in ENGINE_ENV.items() if not k.startswith("RAY_")}


@dataclass(frozen=True)
class Level:
    """One concurrency level of the relay phase: rounds x one batch per leg."""

    concurrency: int
    rounds: int
    batch: int  # requests per leg per round
    max_s: float  # a batch starts no request after this many seconds


FULL = (Level(1, 10, 50, 10.0), Level(16, 8, 240, 15.0), Level(64, 5, 640, 15.0))
QUICK = (Level(1, 4, 25, 5.0), Level(16, 3, 120, 8.0), Level(64, 2, 320, 8.0))


class LegFailed(Exception):
    """A leg could not be started or did not answer; the run goes on without it."""


# --- statistics (pure) ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default); None if empty."""
    return quantile(values, q / 100.0) if values else None


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def summarize(values: Sequence[float]) -> dict[str, Any]:
    mean = sum(values) / len(values) if values else None
    return {
        "n": len(values),
        "p50": _r(percentile(values, 50)),
        "p90": _r(percentile(values, 90)),
        "p99": _r(percentile(values, 99)),
        "mean": _r(mean),
    }


def added_ms(leg: dict[str, Any], base: dict[str, Any], q: str) -> float | None:
    """A leg's TTFT quantile minus the direct leg's, both at the same concurrency."""
    a = (leg.get("ttft_ms") or {}).get(q)
    b = (base.get("ttft_ms") or {}).get(q)
    return None if a is None or b is None else round(a - b, 3)


def overhead_figures(legs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The headline keys from ``legs[leg]["c16"] = {"ttft_ms": summary, "rps": ...}``."""

    def at(leg: str, c: int) -> dict[str, Any]:
        return legs.get(leg, {}).get(f"c{c}", {})

    def add(leg: str, c: int, q: str) -> float | None:
        return added_ms(at(leg, c), at("direct", c), q)

    def rps(leg: str, c: int) -> float | None:
        return at(leg, c).get("rps")

    fig: dict[str, Any] = {}
    for c, into in ((1, fig), (16, fig), (64, fig.setdefault("stress", {}))):
        into[f"added_ttft_p50_ms_c{c}"] = add("ours", c, "p50")
        into[f"added_ttft_p99_ms_c{c}"] = add("ours", c, "p99")
        into[f"peer_added_ttft_p50_ms_c{c}"] = add("peer", c, "p50")
        into[f"peer_added_ttft_p99_ms_c{c}"] = add("peer", c, "p99")
        if c > 1:
            into[f"rps_c{c}"] = rps("ours", c)
            into[f"peer_rps_c{c}"] = rps("peer", c)
            into[f"direct_rps_c{c}"] = rps("direct", c)
    return fig


def _holds(a: float | None, op: str, b: float | None) -> bool | None:
    if a is None or b is None:
        return None
    return a <= b if op == "<=" else a >= b


def evaluate_goals(fig: dict[str, Any], vllm: dict[str, Any] | None = None) -> dict[str, bool | None]:
    """Each goal as a boolean; None where a figure it needs was not measured."""

    def times(k: float, x: float | None) -> float | None:
        return None if x is None else k * x

    v = vllm or {}
    return {
        f"added_ttft_p50_ms_c1 <= {GOAL_ADDED_C1_MS}": _holds(
            fig.get("added_ttft_p50_ms_c1"), "<=", GOAL_ADDED_C1_MS
        ),
        f"added_ttft_p50_ms_c16 <= {GOAL_C16_VS_PEER:g} x peer": _holds(
            fig.get("added_ttft_p50_ms_c16"),
            "<=",
            times(GOAL_C16_VS_PEER, fig.get("peer_added_ttft_p50_ms_c16")),
        ),
        f"rps_c16 >= {GOAL_RPS_VS_PEER:g} x peer": _holds(
            fig.get("rps_c16"), ">=", times(GOAL_RPS_VS_PEER, fig.get("peer_rps_c16"))
        ),
        f"vllm_e2e_p50_ms <= {GOAL_VLLM_VS_PEER:g} x peer": _holds(
            v.get("vllm_e2e_p50_ms"), "<=", times(GOAL_VLLM_VS_PEER, v.get("peer_vllm_e2e_p50_ms"))
        ),
    }


# --- SSE by bytes (pure) ----------------------------------------------------------------------------


class SSEScan:
    """An incremental SSE reader over raw bytes: the first content delta, ``[DONE]``, usage, errors.

    Events are parsed as JSON only until the first content delta; after it, complete events are
    counted by their ``data:`` lines and searched, not decoded, except the one that carries the usage
    or an error (found by a byte search, then parsed alone).
    """

    __slots__ = ("_buf", "done", "error", "events", "first_content", "usage")

    def __init__(self) -> None:
        self._buf = b""
        self.events = 0
        self.first_content = False
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None

    def feed(self, data: bytes) -> bool:
        """Take the next bytes; True when they complete the first event with content."""
        buf = self._buf + data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return False
        block, self._buf = buf[: end + 2], buf[end + 2 :]
        hit, start = False, 0
        while not self.first_content and (stop := block.find(b"\n\n", start)) >= 0:
            hit = self._event(block[start:stop]) or hit
            start = stop + 2
        rest = block[start:]
        if rest:
            self.events += rest.count(b"\ndata:") + rest.startswith(b"data:")
            self.done = self.done or b"data: [DONE]" in rest or b"data:[DONE]" in rest
            for key in (b'"completion_tokens"', b'"error"'):
                if (i := rest.find(key)) >= 0:  # parse that one event
                    first = rest.rfind(b"\n\n", 0, i)
                    self._event(rest[0 if first < 0 else first + 2 : rest.find(b"\n\n", i)], count=False)
        return hit

    def _event(self, event: bytes, count: bool = True) -> bool:
        hit = False
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments, event: and id: lines
            payload = line[5:].strip()
            self.events += count
            if payload == b"[DONE]":
                self.done = True
            else:
                hit = self._parse(payload) or hit
        return hit

    def _parse(self, payload: bytes) -> bool:
        try:
            obj = json.loads(payload)
        except ValueError:
            self.error = "malformed event"
            return False
        if not isinstance(obj, dict):
            return False
        if obj.get("error"):
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        if self.first_content:
            return False
        for choice in obj.get("choices") or ():
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                self.first_content = True
                return True
        return False


# --- the client ------------------------------------------------------------------------------------


@dataclass
class Sample:
    ok: bool
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    completion_tokens: int | None = None
    error: str | None = None


@dataclass
class Batch:
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    client_cpu_s: float = 0.0  # this process's CPU time over the batch: what the load generator costs


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


@contextlib.asynccontextmanager
async def client_session() -> AsyncIterator[aiohttp.ClientSession]:
    """The one client: keep-alive connections, no pool limit (concurrency bounds it), no cookies."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=120, sock_read=60)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=HEADERS, cookie_jar=aiohttp.DummyCookieJar()
    ) as session:
        yield session


async def stream_once(session: aiohttp.ClientSession, url: str, body: bytes) -> Sample:
    """One streamed request, timed from just before the send."""
    scan = SSEScan()
    ttft = None
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body) as resp:
            if resp.status != 200:
                return Sample(False, error=f"HTTP {resp.status}: {(await resp.text())[:160]}")
            async for data in resp.content.iter_any():
                if scan.feed(data) and ttft is None:
                    ttft = (time.perf_counter() - t0) * 1000.0
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Sample(False, error=f"{type(exc).__name__}: {exc}"[:200])
    e2e = (time.perf_counter() - t0) * 1000.0
    error = scan.error or (None if scan.done else "no [DONE]") or (None if ttft is not None else "no content")
    tokens = (scan.usage or {}).get("completion_tokens")
    return Sample(error is None, ttft, e2e, tokens, error)


async def run_jobs(
    session: aiohttp.ClientSession, url: str, jobs: Sequence[Sequence[bytes]], concurrency: int, max_s: float
) -> Batch:
    """``concurrency`` workers take jobs (a job: bodies sent one after another, e.g. a conversation's
    turns) until none is left or ``max_s`` has passed."""
    batch = Batch()
    pending = iter(jobs)
    deadline = time.perf_counter() + max_s

    async def worker() -> None:
        for job in pending:
            for body in job:
                if time.perf_counter() > deadline:
                    return
                batch.samples.append(await stream_once(session, url, body))

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    batch.wall_s = time.perf_counter() - t0
    batch.client_cpu_s = time.process_time() - cpu0
    return batch


def leg_figures(batches: Sequence[Batch]) -> dict[str, Any]:
    samples = [s for b in batches for s in b.samples]
    ok = [s for s in samples if s.ok]
    wall = sum(b.wall_s for b in batches)
    errors = Counter(s.error for s in samples if not s.ok)
    return {
        "requests": len(samples),
        "ok": len(ok),
        "errors": dict(errors.most_common(5)),
        "rps": _r(len(ok) / wall, 1) if wall > 0 else None,
        "client_cpu_ms_per_request": _r(1000 * sum(b.client_cpu_s for b in batches) / max(1, len(samples))),
        "rps_by_round": [_r(sum(s.ok for s in b.samples) / b.wall_s, 1) for b in batches if b.wall_s > 0],
        "ttft_ms": summarize([s.ttft_ms for s in ok if s.ttft_ms is not None]),
        "ttft_p50_ms_by_round": [_r(percentile([s.ttft_ms for s in b.samples if s.ok], 50)) for b in batches],
        "e2e_ms": summarize([s.e2e_ms for s in ok if s.e2e_ms is not None]),
    }


async def ab_level(
    session: aiohttp.ClientSession, urls: dict[str, str], body: bytes, level: Level
) -> dict[str, dict[str, Any]]:
    """Rounds of one batch per leg, the leg order rotating each round; each leg's figures over all."""
    names = list(urls)
    got: dict[str, list[Batch]] = {n: [] for n in names}
    warmup = [[body]] * max(2 * level.concurrency, 16)
    for n in names:  # not recorded: connections opened, caches filled
        await run_jobs(session, urls[n], warmup, level.concurrency, 10.0)
    for r in range(level.rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            jobs = [[body]] * level.batch
            got[n].append(await run_jobs(session, urls[n], jobs, level.concurrency, level.max_s))
    return {n: {"concurrency": level.concurrency, **leg_figures(b)} for n, b in got.items()}


async def measure_relay(
    urls: dict[str, str], body: bytes, levels: Sequence[Level]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Every level through one client session: ``legs[leg]["c16"]`` = that leg's figures."""
    legs: dict[str, dict[str, dict[str, Any]]] = {}
    async with client_session() as session:
        for level in levels:
            print(f"[relay] c{level.concurrency}: {level.rounds} rounds x {level.batch} requests per leg ...")
            for leg, fig in (await ab_level(session, urls, body, level)).items():
                legs.setdefault(leg, {})[f"c{level.concurrency}"] = fig
    return legs


async def smoke(url: str, body: bytes) -> Sample:
    async with client_session() as session:
        return await stream_once(session, url, body)


def relay_body() -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body).encode()


# --- processes -------------------------------------------------------------------------------------


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine, a listener is not
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def tagged_processes(tag: str) -> dict[int, str]:
    """PID -> command name of every live process whose environment carries ``TAG_VAR=tag``."""
    needle = f"{TAG_VAR}={tag}".encode()
    found: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (d / "environ").read_bytes().split(b"\0"):
                found[int(d.name)] = (d / "comm").read_text().strip()
    return found


def _wait_gone(tag: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and tagged_processes(tag):
        time.sleep(0.1)


def sweep(tag: str, settle_s: float = 3.0, grace_s: float = 5.0) -> dict[int, str]:
    """End, by PID, what a leg left running (e.g. a ``haproxy`` that outlived ``serve.shutdown()``):
    what has not exited by itself ``settle_s`` after the stop (a resource tracker may take a moment)
    gets SIGTERM, then SIGKILL after ``grace_s``. Returns what had to be signalled."""
    _wait_gone(tag, settle_s)
    left = tagged_processes(tag)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    _wait_gone(tag, grace_s if left else 0.0)
    for pid in tagged_processes(tag):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when this benchmark's process dies, however it dies."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Proc:
    """A child in its own session (process group), its output in a log file, tagged for :func:`sweep`,
    sent SIGTERM if this process dies first."""

    settle_s = 3.0  # after the stop, how long its children may take to exit by themselves

    def __init__(
        self, name: str, cmd: list[str], logdir: Path, env: dict[str, str] | None = None, stdin: bool = False
    ) -> None:
        self.name = name
        self.tag = f"{uuid.uuid4().hex[:12]}-{name}"
        self.log = logdir / f"{name}.log"
        self.leftovers: dict[int, str] = {}
        self.stopped = False
        full_env = {**os.environ, **(env or {}), TAG_VAR: self.tag}
        with self.log.open("wb") as log:
            self.p = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the child's process group, SIGKILL after ``grace_s``, then the leftover sweep."""
        if self.stopped:
            return
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(5)
        self.leftovers = sweep(self.tag, self.settle_s)
        self.stopped = True

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


def wait_http(url: str, proc: Proc, timeout_s: float) -> float:
    """Poll ``GET url`` until 200; seconds waited. Raises LegFailed if the process dies or time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not proc.alive():
            raise LegFailed(f"{proc.name} exited ({proc.p.returncode}):\n{proc.tail()}")
        with contextlib.suppress(OSError), _NO_PROXY.open(url, timeout=2) as resp:
            if resp.status == 200:
                return time.monotonic() - t0
        time.sleep(0.2)
    raise LegFailed(f"{proc.name}: {url} not ready after {timeout_s:.0f} s:\n{proc.tail()}")


def start_fake_upstream(logdir: Path) -> tuple[Proc, int]:
    port = free_port()
    proc = Proc(
        "fake-upstream", [sys.executable, "-m", "loadtest.fake_upstream", "--port", str(port)], logdir
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


# --- our cluster, in a child process ---------------------------------------------------------------


def provider_config(upstream_port: int, port: int) -> ClusterConfig:
    """Our cluster for the relay phase: one OpenAI-wire provider backend in front of the fake upstream,
    admission limits high enough never to queue or shed at 64 streams, and no provider RPM/TPM or
    in-flight budget (a budget adds one call to its shared actor per request: measured apart)."""
    return parse_config(
        {
            "name": "llmc-bench-overhead",
            "server": {"host": HOST, "port": port, "default_surface": "chat"},
            "models": [
                {
                    "name": MODEL,
                    "tokenizer": "tiktoken:gpt-4o-mini",
                    "context_window": 8192,
                    "default_max_tokens": 64,
                }
            ],
            "backends": [
                {
                    "name": "fake-openai",
                    "kind": "provider",
                    "model": MODEL,
                    "replicas": 1,
                    "resources": {"num_cpus": 0.1},
                    "max_in_flight_per_replica": 1024,
                    "provider": {
                        "api": "openai",
                        "base_url": f"http://{HOST}:{upstream_port}/v1",
                        "first_token_timeout_s": 30,
                        "total_timeout_s": 120,
                    },
                }
            ],
            "surfaces": [
                {
                    "name": "chat",
                    "ttft_slo_ms": 1000,
                    "max_concurrency": 256,
                    "max_queue": 512,
                    "queue_deadline_ms": 10000,
                },
            ],
            "routes": [{"model": MODEL, "candidates": ["fake-openai"]}],
        },
        source="bench_overhead",
    )


def serve_cluster(config_path: Path, port: int, ready_file: Path) -> int:
    """The child side of :class:`OursCluster`: start, say so in ``ready_file``, stop when stdin closes."""
    import traceback

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that local.stop() still runs
    try:
        from deployments import local

        local.start(load_config(config_path), port=port, metrics_port=0)
    except BaseException as exc:
        traceback.print_exc()
        ready_file.write_text(f"error: local.start failed: {type(exc).__name__}: {exc}"[:2000])
        with contextlib.suppress(BaseException):
            local.stop()
        return 1
    ready_file.write_text("ok")
    try:
        sys.stdin.read()  # until the parent closes our stdin (or dies)
    finally:
        local.stop()
    return 0


class OursCluster(Proc):
    """Our cluster in a child process (``local.start(cfg, port=...)`` there, ``local.stop()`` when its
    stdin closes); afterwards the port must be free and nothing of it left running (the shared
    notes: HAProxy can outlive a shutdown)."""

    settle_s = 10.0  # Ray's workers and actors exit a few seconds after ray.shutdown()

    def __init__(self, name: str, cfg: ClusterConfig, port: int, logdir: Path) -> None:
        self.port = port
        self.ready_file = logdir / f"{name}.ready"
        config_path = logdir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        cmd = [sys.executable, "-m", "loadtest.bench_overhead", "--serve-cluster", str(config_path)]
        cmd += ["--serve-port", str(port), "--ready-file", str(self.ready_file)]
        self.stop_info: dict[str, Any] = {}
        super().__init__(name, cmd, logdir, stdin=True)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/v1/chat/completions"

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            text = self.ready_file.read_text().strip() if self.ready_file.exists() else ""
            if text == "ok":
                return time.monotonic() - t0
            if text or not self.alive():
                raise LegFailed(f"{self.name}: {text or f'exited ({self.p.returncode})'}\n{self.tail()}")
            time.sleep(0.5)
        raise LegFailed(f"{self.name}: not ready after {timeout_s:.0f} s\n{self.tail()}")

    def stop(self, grace_s: float = 90.0) -> None:
        if self.stopped:
            return
        t0 = time.monotonic()
        if self.alive() and self.p.stdin is not None:
            with contextlib.suppress(OSError):
                self.p.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.p.wait(grace_s)
        exited = not self.alive()
        deadline = time.monotonic() + 5.0
        while not port_free(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        free_after_stop = port_free(self.port)
        super().stop()  # the process group if still alive, then every tagged leftover (haproxy …)
        self.stop_info = {
            "stop_s": _r(time.monotonic() - t0, 1),
            "exited_by_itself": exited,
            "exit_code": self.p.returncode,
            "port_free_after_stop": free_after_stop,
            "leftovers_killed": {str(pid): comm for pid, comm in self.leftovers.items()},
            "port_free": port_free(self.port),
        }

    def problems(self) -> list[str]:
        s = self.stop_info
        out = [] if s.get("port_free") else [f"{self.name}: port {self.port} still taken after stop"]
        if s.get("leftovers_killed"):
            out.append(f"{self.name}: killed leftovers after stop: {s['leftovers_killed']}")
        return out


# --- relay phase -----------------------------------------------------------------------------------


def _start_leg(leg: str, stack: contextlib.ExitStack, up_port: int, logdir: Path, procs: list[Proc]) -> str:
    if leg == "peer":
        router, port = start_vllm_router("peer-router", [f"http://{HOST}:{up_port}"], "round_robin", logdir)
        procs.append(stack.enter_context(router))
        return f"http://{HOST}:{port}/v1/chat/completions"
    port = free_port()
    ours = stack.enter_context(OursCluster("ours", provider_config(up_port, port), port, logdir))
    procs.append(ours)
    ours.wait_ready(300)
    return ours.url


def relay_phase(legs: Sequence[str], levels: Sequence[Level], logdir: Path, runner: asyncio.Runner) -> dict:
    """Start the fake upstream and each leg in front of it, check one answer each, run every level."""
    out: dict[str, Any] = {"legs": {}, "startup_s": {}, "stop": {}, "problems": []}
    body = relay_body()
    procs: list[Proc] = []
    with contextlib.ExitStack() as stack:
        upstream, up_port = start_fake_upstream(logdir)
        procs.append(stack.enter_context(upstream))
        urls = {"direct": f"http://{HOST}:{up_port}/v1/chat/completions"}
        for leg in legs:
            t0, started = time.monotonic(), len(procs)
            try:
                url = urls["direct"] if leg == "direct" else _start_leg(leg, stack, up_port, logdir, procs)
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
        out["legs"] = runner.run(measure_relay(urls, body, levels))
    for p in procs:
        if isinstance(p, OursCluster):
            out["stop"][p.name] = p.stop_info
            out["problems"] += p.problems()
        elif p.leftovers:
            out["problems"].append(f"{p.name}: killed leftovers after stop: {p.leftovers}")
    out["problems"] += error_rate_problems(out["legs"])
    return out


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
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
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


def vllm_peer(
    cfg: ClusterConfig, work: dict[str, Any], policy: str, logdir: Path, runner: asyncio.Runner
) -> dict:
    replicas = next(b for b in cfg.backends if b.kind == "vllm").replicas
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:  # closes in reverse: the router first, then the servers
        servers = []
        for i in range(replicas):
            port, scratch = free_port(), logdir / f"peer-vllm-{i}-scratch"
            proc = Proc(f"peer-vllm-{i}", vllm_server_cmd(cfg, port), logdir, env=vllm_env(cfg, scratch))
            servers.append((stack.enter_context(proc), port))
        for proc, port in servers:
            wait_http(f"http://{HOST}:{port}/health", proc, 420)
        workers = [f"http://{HOST}:{port}" for _, port in servers]
        router, rport = start_vllm_router("peer-vllm-router", workers, policy, logdir)
        stack.enter_context(router)
        startup = time.monotonic() - t0
        url = f"http://{HOST}:{rport}/v1/chat/completions"
        fig = runner.run(e2e_leg(url, work["jobs"], work["warmup"], work["concurrency"]))
    left = {p.name: p.leftovers for p in [router, *(p for p, _ in servers)] if p.leftovers}
    problems = [f"peer vLLM: killed leftovers after stop: {left}"] if left else []
    return {**fig, "startup_s": _r(startup, 1), "policy": policy, "problems": problems}


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
    out.update(stress=fig["stress"], **v, goals=evaluate_goals(fig, v), problems=problems)
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
    for p in result["problems"]:
        print(f"problem: {p.splitlines()[0]}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples (about a quarter)")
    ap.add_argument(
        "--legs", default=",".join(LEGS), help="comma list of direct,peer,ours (direct always runs)"
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
    for hidden in ("--serve-cluster", "--serve-port", "--ready-file"):  # the child of OursCluster
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    legs = [g.strip() for g in args.legs.split(",") if g.strip()]
    if unknown := set(legs) - set(LEGS):
        ap.error(f"unknown legs: {sorted(unknown)}")
    args.legs = [g for g in LEGS if g in legs or g == "direct"]
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
        return serve_cluster(Path(args.serve_cluster), int(args.serve_port), Path(args.ready_file))
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
