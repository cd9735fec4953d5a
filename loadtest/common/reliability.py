"""What the reliability tier (``tests/reliability``) and its hand-run scripts
(``loadtest/benchmarks/faults.py``, ``loadtest/benchmarks/soak.py``) share: the app under test, a bounded load
of mixed surfaces in a thread of its own, and probes. The look inside every Ray actor is
:mod:`loadtest.common.actor_probe`.

The app (``reliability_config``): auth on, one client key per surface; a model ``rel-mix`` served by
a loopback OpenAI server first and two simulated replicas second (self-hosted first for the agent
surface, hedged on tab), and ``rel-claude`` on a loopback Anthropic server alone (its failures are
clean errors, nothing to fail over to). Deadlines are short so that a hang shows within seconds: the
client's timeout is the surface's deadline plus a margin, and a request that reaches it is *hung*.
Everything stays on 127.0.0.1 and is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from cluster.config import ClusterConfig, parse_config
from loadtest.common.client import EventStream

SURFACE_DEADLINE_S = {"tab": 8.0, "chat": 12.0, "agent": 15.0}
CLIENT_MARGIN_S = 10.0  # past deadline + margin, a request counts as hung
OPENAI_BACKEND, SIM_BACKEND, ANTHROPIC_BACKEND = "rel-openai", "rel-sim", "rel-anthropic"
MIX, CLAUDE, STALL = "rel-mix", "rel-claude", "rel-stall"
STALL_BACKEND = "rel-sim-stall"  # a simulated replica whose streams go silent after 2 tokens
PRIMARY = {("rel-mix", "chat"): OPENAI_BACKEND, ("rel-mix", "tab"): OPENAI_BACKEND}
PRIMARY |= {("rel-mix", "agent"): SIM_BACKEND, ("rel-claude", "chat"): ANTHROPIC_BACKEND}
PROVIDER_KEY_ENV = "LLMC_REL_PROVIDER_KEY"
CANARY_ENV = "LLMC_REL_CANARY_SECRET"


def new_secret(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


def export_provider_key() -> str:
    """The provider key in this process's environment, where Ray's workers inherit it: call before
    Ray starts (the tier's conftest does at import, before any test starts Ray)."""
    import os

    if not os.environ.get(PROVIDER_KEY_ENV):
        os.environ[PROVIDER_KEY_ENV] = new_secret("sk-relprov")
    return os.environ[PROVIDER_KEY_ENV]


@dataclass
class Keys:
    """The provider key (what must never leak) and one client key per surface."""

    provider: str = field(default_factory=export_provider_key)
    clients: dict[str, str] = field(
        default_factory=lambda: {s: new_secret(f"sk-relclient-{s}") for s in SURFACE_DEADLINE_S}
    )

    def headers(self, surface: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.clients[surface]}"}


def provider_backend(
    name: str,
    api: str,
    url: str,
    model: str,
    *,
    key_env: str = PROVIDER_KEY_ENV,
    env: dict[str, str] | None = None,
    **provider: Any,
) -> dict[str, Any]:
    """A provider backend's config for a loopback server of ``api`` (upstream model named as the
    real API's), with ``provider`` fields added to its provider section."""
    backend: dict[str, Any] = {
        "name": name,
        "kind": "provider",
        "model": model,
        "replicas": 1,
        "resources": {"num_cpus": 0.1},
    }
    if env is not None:
        backend["env"] = env
    backend["provider"] = {
        "api": api,
        "base_url": url,
        "upstream_model": "gpt-4o-mini" if api == "openai" else "claude-sonnet-4-5",
        "api_key_env": key_env,
        **provider,
    }
    return backend


def _provider(name: str, api: str, url: str, model: str) -> dict[str, Any]:
    return provider_backend(
        name,
        api,
        url,
        model,
        connect_timeout_s=2,
        first_token_timeout_s=5,  # a 2-core box under load is slow to start
        between_tokens_timeout_s=2,
        total_timeout_s=20,
        cost_per_mtok_input=0.15,
        cost_per_mtok_output=0.6,
    )


def _sim(name: str, model: str, replicas: int, **extra: Any) -> dict[str, Any]:
    sim = {"name": name, "kind": "sim", "model": model, "replicas": replicas, "resources": {"num_cpus": 0.1}}
    return {**sim, "sim_profile": "llama-3.1-8b-h100", **extra}


def _surfaces() -> list[dict[str, Any]]:
    surfaces: list[dict[str, Any]] = [
        {"name": "tab", "priority": 0, "hedging": True, "max_concurrency": 32, "max_queue": 64},
        {"name": "chat", "priority": 1, "max_concurrency": 32, "max_queue": 64},
        {"name": "agent", "priority": 2, "max_concurrency": 16, "max_queue": 64},
    ]
    for s in surfaces:
        s["request_timeout_s"] = SURFACE_DEADLINE_S[s["name"]]
        s["queue_deadline_ms"] = 2000
    return surfaces


def reliability_config(
    name: str,
    openai_url: str,
    anthropic_url: str,
    keys: Keys,
    gateway_replicas: int = 2,
    canary: str | None = None,
) -> ClusterConfig:
    """Two gateway replicas by default: with one, a gateway crash stops all traffic while Serve
    notices and restarts it (about 20 s here), longer than any surface's deadline. The tier's exact
    counts are summed over both (``gateway_probes`` asks each replica actor), not read over HTTP
    (``/internal/status`` answers for whichever replica HAProxy picked).

    The provider key is *not* in the config: the replicas read ``PROVIDER_KEY_ENV`` from the process
    environment they inherit (see ``export_provider_key``), as a Kubernetes Secret gives it to a pod.
    A backend's ``env`` goes through Ray's runtime_env, which Ray logs in full; ``canary`` (a fake
    secret put there) shows it."""
    tiny = {"tokenizer": "@tiny", "default_max_tokens": 16}
    oai = _provider(OPENAI_BACKEND, "openai", openai_url, MIX)
    ant = _provider(ANTHROPIC_BACKEND, "anthropic", anthropic_url, CLAUDE)
    if canary is not None:
        oai["env"] = {CANARY_ENV: canary}
    return parse_config(
        {
            "name": name,
            "server": {
                "auth": True,
                "api_keys": [
                    {"sha256": hashlib.sha256(k.encode()).hexdigest(), "surface": s}
                    for s, k in keys.clients.items()
                ],
                "max_body_bytes": 256 * 1024,
                "gateway_replicas": gateway_replicas,
            },
            "models": [
                {"name": MIX, "context_window": 4096, **tiny},
                {"name": CLAUDE, "context_window": 4096, **tiny},
                {"name": STALL, "context_window": 4096, **tiny},
            ],
            "backends": [
                oai,
                _sim(SIM_BACKEND, MIX, 2),
                ant,
                _sim(STALL_BACKEND, STALL, 1, sim_options={"stall_after_tokens": 2}),
            ],
            "surfaces": _surfaces(),
            "routes": [
                {"model": MIX, "candidates": [OPENAI_BACKEND, SIM_BACKEND]},
                {"model": MIX, "surface": "agent", "candidates": [SIM_BACKEND, OPENAI_BACKEND]},
                {"model": CLAUDE, "candidates": [ANTHROPIC_BACKEND]},
                {"model": STALL, "candidates": [STALL_BACKEND]},
            ],
            "policies": {
                "hedging": {"quantile": None, "fixed_delay_s": 0.5, "budget_ratio": 0.1, "budget_burst": 2},
                "failover": {"breaker": {"consecutive_failures": 3, "base_ejection_s": 1.0}},
            },
        }
    )


# ------------------------------------------------------------------------------------------------
# One request: what it was, how it ended
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A kind of request in the mix."""

    name: str
    path: str  # /chat/completions or /completions
    model: str
    surface: str
    stream: bool
    max_tokens: int
    cancel_after: int | None = None  # the client leaves after this many content chunks


MIX_SHAPES: list[tuple[Shape, float]] = [
    (Shape("chat-stream", "/chat/completions", MIX, "chat", True, 12), 0.24),
    (Shape("agent-stream", "/chat/completions", MIX, "agent", True, 16), 0.18),
    (Shape("completion", "/completions", MIX, "chat", False, 8), 0.14),
    (Shape("claude", "/chat/completions", CLAUDE, "chat", False, 10), 0.1),
    (Shape("claude-stream", "/chat/completions", CLAUDE, "chat", True, 10), 0.1),
    (Shape("tab-stream", "/chat/completions", MIX, "tab", True, 6), 0.12),
    (Shape("agent-long", "/chat/completions", MIX, "agent", True, 150), 0.06),
    (Shape("cancel", "/chat/completions", MIX, "agent", True, 400, cancel_after=3), 0.08),
]


@dataclass(eq=False)
class Record:
    shape: str
    surface: str
    model: str
    stream: bool
    t0: float
    t1: float | None = None
    status: int | None = None
    outcome: str = "running"  # completed, failed_over, error_event, error_status, cancelled, hung, …
    request_id: str = ""  # our id (the body's "id" without its chatcmpl-/cmpl- prefix); "" if none came
    x_request_id: str = ""  # the x-request-id header: the client's own, echoed by Serve (never ours)
    backend: str = ""
    gateway: str = ""  # x-llmc-gateway: the gateway replica that answered ("" before headers or none)
    t_headers: float | None = None  # when the response's headers arrived
    error_code: str | None = None
    error_text: str = ""  # error messages/events as the client got them (scanned for leaks)
    shape_ok: bool = True  # every error in the OpenAI shape
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    chunks: int = 0

    @property
    def ended(self) -> bool:
        return self.t1 is not None


def body_for(shape: Shape, i: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": shape.model, "max_tokens": shape.max_tokens, "stream": shape.stream}
    text = f"request {i}: say something about the number {i % 97}"
    if shape.path == "/completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    if shape.stream:
        body["stream_options"] = {"include_usage": True}
    if shape.cancel_after is not None:
        body["ignore_eos"] = True
    return body


def is_openai_error(obj: Any) -> bool:
    err = obj.get("error") if isinstance(obj, dict) else None
    return (
        isinstance(err, dict)
        and set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and bool(err["message"])
    )


async def run_one(
    client: httpx.AsyncClient, base: str, keys: Keys, shape: Shape, i: int, rec: Record | None = None
) -> Record:
    """Send one request of ``shape`` and fill ``rec`` (a new one by default) in with how it ended."""
    rec = rec or Record(shape.name, shape.surface, shape.model, shape.stream, time.monotonic())
    timeout = SURFACE_DEADLINE_S[shape.surface] + CLIENT_MARGIN_S
    try:
        async with asyncio.timeout(timeout):
            await _exchange(client, base, keys, shape, i, rec)
    except TimeoutError:
        rec.outcome = "hung"
    except httpx.HTTPError as exc:
        rec.outcome = "conn_error"
        rec.error_text += f"{type(exc).__name__}: {exc}"
    rec.t1 = time.monotonic()
    return rec


async def _exchange(
    client: httpx.AsyncClient, base: str, keys: Keys, shape: Shape, i: int, rec: Record
) -> None:
    body = body_for(shape, i)
    async with client.stream("POST", base + shape.path, json=body, headers=keys.headers(shape.surface)) as r:
        rec.status = r.status_code
        rec.t_headers = time.monotonic()
        rec.gateway = r.headers.get("x-llmc-gateway", "")
        # Serve's middleware echoes (or makes) exactly one x-request-id; our own id is only in the body.
        rec.x_request_id = ",".join(r.headers.get_list("x-request-id"))
        rec.backend = r.headers.get("x-llmc-backend", "")
        if r.status_code != 200:
            raw = await r.aread()
            rec.error_text += raw.decode(errors="replace")
            rec.outcome = "error_status"
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = None
            rec.shape_ok = is_openai_error(obj)
            rec.error_code = obj["error"].get("code") if rec.shape_ok else None
            return
        if not shape.stream:
            obj = json.loads(await r.aread())
            rec.request_id = our_id(obj)
            _take_usage(rec, obj.get("usage"))
            rec.chunks = 1
            rec.outcome = _served(rec)
            return
        finished = False
        events = EventStream()
        async for data in events.aiter(r):
            obj = json.loads(data)
            rec.request_id = rec.request_id or our_id(obj)
            if "error" in obj:
                rec.error_text += data
                rec.shape_ok = rec.shape_ok and is_openai_error(obj)
                rec.error_code = obj["error"].get("code")
                rec.outcome = "error_event"
                continue
            _take_usage(rec, obj.get("usage"))
            for ch in obj.get("choices") or []:
                delta = ch.get("delta") or {}
                if delta.get("content") or ch.get("text"):
                    rec.chunks += 1
                finished = finished or ch.get("finish_reason") is not None
            if shape.cancel_after is not None and rec.chunks >= shape.cancel_after:
                rec.outcome = "cancelled"
                return  # leaving the block closes the connection: the cluster must cancel
        if rec.outcome == "error_event":
            return
        rec.outcome = _served(rec) if events.done and finished else "truncated"


def our_id(obj: Any) -> str:
    """Our request id from a response body or chunk (``chatcmpl-<id>`` / ``cmpl-<id>``); "" if none."""
    rid = obj.get("id") if isinstance(obj, dict) else None
    if not isinstance(rid, str):
        return ""
    for prefix in ("chatcmpl-", "cmpl-"):
        if rid.startswith(prefix):
            return rid[len(prefix) :]
    return rid


def _take_usage(rec: Record, usage: Any) -> None:
    if isinstance(usage, dict):
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.completion_tokens = usage.get("completion_tokens")


def _served(rec: Record) -> str:
    primary = PRIMARY.get((rec.model, rec.surface))
    return "completed" if not rec.backend or rec.backend == primary else "failed_over"


# ------------------------------------------------------------------------------------------------
# The load: N workers in a thread of their own, bounded in count and time
# ------------------------------------------------------------------------------------------------


class Load:
    """A closed-loop load of mixed shapes: ``workers`` clients, each sends, waits, sleeps ``think_s``.

    Runs in its own thread and event loop, so the test thread can block on Ray while it runs.
    Stops at ``stop()``, after ``max_requests`` or after ``max_s``, whichever comes first.
    """

    def __init__(
        self,
        base_url: str,
        keys: Keys,
        *,
        workers: int = 6,
        think_s: float = 0.05,
        max_requests: int = 5000,
        max_s: float = 600.0,
        shapes: list[tuple[Shape, float]] | None = None,
        seed: int = 0,
    ) -> None:
        self.base_url = base_url
        self.keys = keys
        self.workers = workers
        self.think_s = think_s
        self.max_requests = max_requests
        self.max_s = max_s
        self.shapes = shapes or MIX_SHAPES
        self.rng = random.Random(seed)
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sent = 0

    def start(self) -> Load:
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main()), name="rel-load", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, drain_s: float | None = None) -> list[Record]:
        """Stop sending; wait for what is in flight (at most the longest client timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(drain_s if drain_s is not None else max(SURFACE_DEADLINE_S.values()) + 30)
        return self.snapshot()

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)

    def in_flight(self) -> list[Record]:
        return [r for r in self.snapshot() if not r.ended]

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _pick(self) -> Shape:
        shapes, weights = zip(*self.shapes, strict=True)
        return self.rng.choices(shapes, weights)[0]

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=self.workers * 2, max_keepalive_connections=self.workers)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            await asyncio.gather(*(self._worker(client) for _ in range(self.workers)))

    async def _worker(self, client: httpx.AsyncClient) -> None:
        t_end = time.monotonic() + self.max_s
        while not self._stop.is_set() and time.monotonic() < t_end:
            with self._lock:
                if self._sent >= self.max_requests:
                    return
                self._sent += 1
                i = self._sent
            shape = self._pick()
            rec = Record(shape.name, shape.surface, shape.model, shape.stream, time.monotonic())
            with self._lock:
                self.records.append(rec)
            await run_one(client, self.base_url, self.keys, shape, i, rec)
            await asyncio.sleep(self.think_s)


def endings(records: list[Record]) -> Counter[str]:
    return Counter(r.outcome for r in records)


# ------------------------------------------------------------------------------------------------
# Probes: is the cluster serving normally?
# ------------------------------------------------------------------------------------------------


def probe(base_url: str, keys: Keys, shape: Shape, timeout: float = 20.0) -> Record:
    async def once() -> Record:
        async with httpx.AsyncClient(timeout=timeout) as c:
            return await run_one(c, base_url, keys, shape, random.randrange(10**6))

    return asyncio.run(once())


def wait_until(pred: Any, timeout: float, period: float = 0.2, need: int = 3) -> float | None:
    """Seconds until ``pred()`` held ``need`` times in a row (counted from the first of them), or None."""
    t0 = time.monotonic()
    streak_from: float | None = None
    streak = 0
    while time.monotonic() - t0 < timeout:
        if pred():
            t = time.monotonic()  # when it was seen to hold: a slow success counts when it is done
            streak_from = t if streak == 0 else streak_from
            streak += 1
            if streak >= need:
                return (streak_from or t) - t0
        else:
            streak = 0
        time.sleep(period)
    return None


def as_dicts(records: list[Record]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]


@dataclass
class LoopbackApp:
    cfg: ClusterConfig
    base_url: str  # the app's /v1
    keys: Keys
    openai: Any  # fixtures.servers.openai_server.OpenAIServer
    anthropic: Any  # fixtures.servers.anthropic_server.AnthropicServer


@contextlib.contextmanager
def loopback_app(name: str, route_prefix: str) -> Iterator[LoopbackApp]:
    """The app (:func:`reliability_config`) on a local cluster, in front of loopback OpenAI and
    Anthropic servers (``fixtures/servers``); all stopped after."""
    from deployments.launcher import local
    from deployments.launcher.local import free_port
    from fixtures.servers.anthropic_server import AnthropicServer
    from fixtures.servers.openai_server import OpenAIServer

    keys = Keys()  # exports the provider key to this process's environment, before Ray starts
    port = free_port()
    with (
        OpenAIServer(api_key=keys.provider, output_tokens=12, token_delay_s=0.01) as oai,
        AnthropicServer(api_key=keys.provider, output_tokens=12, token_delay_s=0.01) as ant,
    ):
        cfg = reliability_config(name, oai.base_url, ant.base_url, keys)
        local.start(cfg, port=port, metrics_port=0, route_prefix=route_prefix)
        try:
            yield LoopbackApp(cfg, f"http://127.0.0.1:{port}{route_prefix}/v1", keys, oai, ant)
        finally:
            local.stop()
