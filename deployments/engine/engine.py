"""The engine deployment: one Serve replica per vLLM engine (or simulated engine), serving its
token stream over HTTP itself so that no token crosses a Ray call.

Serve owns the replica (start, health checks, autoscaling, draining); the replica starts a small
aiohttp server on a free port of its node and publishes the URL, with its engine's load, through
Serve's routing stats, which reach every gateway's handle (``record_routing_stats``). The gateway
POSTs ``/generate`` (see :mod:`cluster.wire.engine_stream`) with the cluster's internal credential; a
client that goes away closes the connection, which cancels the handler, which closes the
backend's stream, which aborts the engine request. Serve counts nothing of this traffic, so the
replica reports its own ongoing requests for autoscaling (``record_autoscaling_stats``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import ray
from aiohttp import web
from ray import serve

from cluster.backend_kind import BackendKind
from cluster.config import BackendConfig, ModelConfig, TracingConfig
from cluster.engine.warmup import plan as warmup_plan
from cluster.json_types import JSONObject
from cluster.observability import gc_pauses
from cluster.observability.trace import engine_span, new_id, parse_traceparent
from cluster.policy.migration import DRAINING_CODE
from cluster.policy.ttft_window import TtftWindow
from cluster.routing.block_hash import BlockHasher
from cluster.wire.choices import ChoiceEvents
from cluster.wire.engine_stream import (
    INTERNAL_TOKEN_HEADER,
    end_frame,
    error_frame,
    event_with_ids,
    parse_flags,
    parse_request,
)
from cluster.wire.errors import ClusterError, InvalidRequest, StreamInterrupted, to_wire
from cluster.wire.logprobs import LogprobsFraming
from cluster.wire.openai_format import ResponseMeta, TextEvents, sse, stream_chunk
from cluster.wire.protocol import BackendStats, Chunk, GenerateRequest, Usage
from cluster.wire.tool_stream import ToolEvents
from deployments import haproxy_errors
from deployments.engine.engine_warmup import WarmableBackend, WarmupReport, run_warmup
from deployments.engine.kv_endpoint import KVEventEndpoint, no_events
from deployments.engine.kv_pub import KVEventPublisher
from deployments.internal import internal_token, token_ok

if TYPE_CHECKING:
    from deployments.tracing import Tracer

log = logging.getLogger("ray.serve")
METRICS_PERIOD_S = 1.0
HOST_ENV = "LLMC_ENGINE_HOST"  # the address engine servers bind and publish (default: Ray's node IP)


def build_backend(backend: BackendConfig, model: ModelConfig, replica: str) -> WarmableBackend:
    if backend.kind is BackendKind.VLLM:
        from deployments.engine.vllm_replica import VLLMBackend

        return VLLMBackend(backend, model, replica)
    if backend.kind is BackendKind.SIM:
        from cluster.engine.sim_backend import SimBackend

        return SimBackend.from_config(backend, model, replica)
    raise ValueError(f"backend '{backend.name}' of kind {backend.kind} is not an engine")


def node_host() -> str:
    host = os.environ.get(HOST_ENV)
    if host:
        return host
    ip: str = ray.util.get_node_ip_address()
    return ip


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=2, health_check_timeout_s=30)
class EngineReplica:
    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor (typing allows none)
        self,
        backend: JSONObject,
        model: JSONObject,
        tracing: JSONObject | None = None,
        gc_freeze: bool = True,
    ) -> None:
        self.cfg = BackendConfig.model_validate(backend)
        # Set here rather than through Ray's runtime_env, whose agent logs env_vars in full; before
        # the engine is built, so that its settings (OMP_NUM_THREADS …) take effect.
        os.environ.update(self.cfg.env)
        model_cfg = ModelConfig.model_validate(model)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.backend = build_backend(self.cfg, model_cfg, self.replica_id)
        # Before the replica serves (Serve routes to it once this constructor returns): its first
        # users must not pay for the engine's first-shape work (cluster/engine/warmup.py).
        self.warmup = await self._warm_up(model_cfg)
        self._token = internal_token()
        self.ongoing = 0
        self.by_cache_rank = [0, 0]  # requests the gateways sent expecting a cache hit here, and not
        self.ttft = TtftWindow()  # reported in the routing stats: the gateways' SLO guards read it
        self.draining = False  # set when Serve stops this replica: streams end with a drain error
        self.tracer: Tracer | None = None  # when the gateway traces requests
        trace_cfg = TracingConfig.model_validate(tracing or {})
        if trace_cfg.otlp_endpoint:
            from deployments.tracing import Tracer

            self.tracer = Tracer(trace_cfg, self.replica_id)
        self.kv_events: KVEventEndpoint | None = None  # the engine's KV events, for the gateways
        log = self.backend.kv_events
        if log is not None:
            block = self.cfg.engine.block_size or self.backend.kv_block_size or 16
            hasher = BlockHasher(block, self.cfg.model)
            stride = self.cfg.affinity.claim_stride_blocks  # the gateways' anchors: no more is sent
            self.kv_events = KVEventEndpoint(log, self._token, hasher, stride)
        self.kv_pub: KVEventPublisher | None = None  # the log pushed to every gateway (kv_transport)
        if self.kv_events is not None and self.cfg.affinity.kv_transport == "push":
            self.kv_pub = KVEventPublisher(self.kv_events, self.replica_id, node_host(), self._token)
        self._runner, self.url = await self._serve_http()
        # this node's HAProxy takes clients too (deployments/haproxy_errors.py): its error page ours
        self._errpage_task = haproxy_errors.start(ray.get_runtime_context().get_node_id())
        self._reporter = asyncio.get_running_loop().create_task(self._report_metrics())
        # Last: the engine, its model and tokenizer are built (cluster/observability/gc_pauses.py).
        self.gc_frozen = gc_pauses.freeze_startup_heap() if gc_freeze else 0
        self.gc = gc_pauses.GcPauses()
        gc_pauses.install(self.gc)

    async def _warm_up(self, model: ModelConfig) -> WarmupReport | None:
        w = self.cfg.engine.warmup
        if not (w.enabled if w.enabled is not None else self.cfg.kind.caps.warm_up_by_default):
            return None
        window = self.cfg.engine.max_model_len or model.context_window
        plan = warmup_plan(w, window, self.backend.vocab_size)
        return await run_warmup(self.backend, model.name, plan, f"{self.cfg.name}/{self.replica_id}")

    async def _serve_http(self) -> tuple[web.AppRunner, str]:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/stats", self._stats)
        app.router.add_get("/kv_events", self.kv_events.handle if self.kv_events is not None else no_events)
        if self.kv_events is not None:  # a rehearsed feed cut, behind the internal credential
            app.router.add_post("/kv_events/fault", self.kv_events.fault)
        # handler_cancellation: the gateway closing the connection cancels the handler (abort).
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        host = node_host()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        await web.SockSite(runner, sock, backlog=1024).start()
        url = f"http://{host}:{sock.getsockname()[1]}"
        log.info("engine %s replica %s serves its token stream on %s", self.cfg.name, self.replica_id, url)
        return runner, url

    async def _report_metrics(self) -> None:
        """The engine's own counters (prefix-cache queries and hits, requests) and gauges (KV use,
        queue), once a second from here: the dashboard's per-replica panels and ``cluster status``
        read them. A failure is logged once, not swallowed: a silent one hid these metrics before."""
        from deployments.metrics import EngineReporter

        reporter = EngineReporter(self.replica_id)
        warned = False
        while True:
            try:
                reporter.record(self.backend.stats())
            except Exception:
                if not warned:
                    log.exception("engine %s replica %s: no metrics", self.cfg.name, self.replica_id)
                    warned = True
            await asyncio.sleep(METRICS_PERIOD_S)

    # -- Serve hooks -------------------------------------------------------------------------------
    def record_routing_stats(self) -> JSONObject:
        """Pushed by Serve to every handle's request router: where to stream from, and the load."""
        s = self.backend.stats()
        return {
            "url": self.url,
            "waiting": s.waiting,
            "running": s.running,
            "kv_usage": s.kv_usage,
            "healthy": s.healthy,  # a dead engine leaves the routing view before Serve replaces it
            "kv_events": self.kv_events is not None,  # the gateways follow GET /kv_events
            "kv_pub": self.kv_pub.address if self.kv_pub is not None else None,  # ... pushed from here
            "kv_blocks": int(s.extra.get("num_kv_blocks", 0)),
            "ttft": self.ttft.report(time.monotonic()),  # every gateway's SLO guard reads them
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"running_requests": float(self.ongoing)}

    def stats(self) -> BackendStats:
        return self.backend.stats()

    def check_health(self) -> None:
        if not self.backend.stats().healthy:
            raise RuntimeError(f"engine {self.cfg.name} replica {self.replica_id} reports unhealthy")

    async def __del__(self) -> None:
        # Drained: the engine stops first, so that every open stream ends with an error frame
        # that says so (the gateway continues it elsewhere), then the server waits for them.
        self.draining = True
        if self.kv_pub is not None:
            with contextlib.suppress(Exception):
                self.kv_pub.close()
        with contextlib.suppress(Exception):
            self.backend.shutdown()
        with contextlib.suppress(Exception):
            await self._runner.cleanup()

    # -- HTTP ----------------------------------------------------------------------------------------
    async def _stats(self, request: web.Request) -> web.Response:
        if not token_ok(request.headers.get(INTERNAL_TOKEN_HEADER), self._token):
            return web.json_response({"error": "forbidden"}, status=403)
        stats = asdict(self.backend.stats())
        # The engine's own TTFT (arrival here -> first token) of its recent requests, by priority:
        # (sequence number, age in s, priority, TTFT in s), as the gateways' SLO guards read them.
        stats["extra"]["ttft"] = self.ttft.report(time.monotonic())
        stats["extra"]["by_cache_rank"] = list(self.by_cache_rank)
        stats["extra"]["warmup"] = self.warmup.as_dict() if self.warmup is not None else None
        stats["extra"]["gc"] = {"frozen": self.gc_frozen, **self.gc.summary(60.0, time.perf_counter())}
        return web.json_response(stats)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if not token_ok(request.headers.get(INTERNAL_TOKEN_HEADER), self._token):
            return web.json_response({"error": to_wire(InvalidRequest("forbidden"))}, status=403)
        try:
            body = json.loads(await request.read())
            req, meta, collect = parse_request(body)
            flags = parse_flags(body)
        except (ValueError, KeyError, TypeError) as exc:
            err = InvalidRequest(f"bad internal request: {type(exc).__name__}")
            return web.json_response({"error": to_wire(err)}, status=400)
        if self.kv_events is not None:
            self.kv_events.announce(req)
        self.by_cache_rank[1 if req.cache_rank else 0] += 1
        self.ongoing += 1
        parent = parse_traceparent(request.headers.get("traceparent")) if self.tracer is not None else None
        span = _EngineSpan(time.time_ns()) if parent is not None else None
        try:
            return await self._stream(request, req, meta, (collect, *flags), span)
        except BaseException as exc:
            if span is not None:
                span.error = type(exc).__name__
            raise
        finally:
            self.ongoing -= 1
            if span is not None and parent is not None and self.tracer is not None:
                times = (span.start, span.first, span.end or time.time_ns())
                kind, rid = self.cfg.kind, self.replica_id
                s = engine_span(
                    parent, new_id(self.tracer.rng, 64), req, rid, kind, times, span.usage, span.error
                )
                self.tracer.export_spans([s])

    async def _stream(
        self,
        request: web.Request,
        req: GenerateRequest,
        meta: ResponseMeta,
        flags: tuple[bool, bool, bool],  # collect, ids, continued
        span: _EngineSpan | None = None,
    ) -> web.StreamResponse:
        arrived = time.monotonic()
        gen = self.backend.generate(req)
        try:
            try:
                first = await anext(gen)
            except ClusterError as err:  # before the first token: a status the gateway acts on
                if span is not None:
                    span.error = err.code or type(err).__name__
                return web.json_response({"error": to_wire(err)}, status=err.status_code)
            except StopAsyncIteration:
                first = Chunk(finish_reason="stop", usage=Usage(len(req.prompt_token_ids), 0))
            if not flags[2]:  # a continued (migrated) stream's first token is not a request's
                now = time.monotonic()
                self.ttft.add(now, req.priority, now - arrived)
            if span is not None:
                span.first = time.time_ns()
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            if req.sampling.n > 1:  # choices by index, no token ids: never migrated
                usage = await self._relay_choices(
                    resp, gen, first, ChoiceEvents(meta, req.sampling.n, flags[0]), span
                )
            else:
                usage = await self._relay(resp, gen, first, meta, flags, req.tool_parse, span)
            if span is not None:
                span.usage = usage
            await resp.write_eof()
            return resp
        finally:
            await gen.aclose()  # cancelled or done: the backend aborts what is still running

    async def _relay(
        self,
        resp: web.StreamResponse,
        gen: AsyncGenerator[Chunk, None],
        first: Chunk,
        meta: ResponseMeta,
        flags: tuple[bool, bool, bool],
        tool_parse: JSONObject | None = None,
        span: _EngineSpan | None = None,
    ) -> Usage | None:
        """The engine's chunks to the gateway as the client's SSE events; returns the usage. With
        ``ids`` each event names its token ids (those of chunks with no text yet ride on the next
        event); a ``continued`` stream sends no first (role) event of its own."""
        collect, ids, continued = flags
        parts: list[str] | None = [] if collect else None
        pending: list[int] = []
        chunk: Chunk | None = first
        sent_first = continued
        finish, usage, text_events = "stop", None, TextEvents(meta)
        lp = LogprobsFraming(meta.kind, collect)  # empty unless the request asked for logprobs
        tools = ToolEvents(meta, tool_parse) if tool_parse and meta.kind == "chat" else None
        try:
            while chunk is not None:
                if ids:
                    pending.extend(chunk.token_ids)
                event = b""
                if tools is not None:  # the text goes through the request's tool-call parser
                    ended = chunk.finish_reason if chunk.finish_reason != "abort" else None
                    event = tools.event(chunk.text, ended, not sent_first)
                    if ended is not None:
                        chunk.finish_reason = tools.finish_reason(ended)
                else:
                    event = _plain_event(chunk, meta, text_events, sent_first, lp)
                    if parts is not None:
                        parts.append(chunk.text)
                if event:
                    if pending:
                        event, pending = event_with_ids(event, pending), []
                    await resp.write(event)
                    sent_first = True
                if chunk.finish_reason is not None:
                    finish = chunk.finish_reason
                if chunk.usage is not None:
                    usage = chunk.usage
                chunk = await anext(gen, None)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:  # the engine failed mid-stream (a ClusterError or anything else)
            await _last(resp, span, error_frame(self._mid_stream(exc)))
            return usage
        if finish == "abort" and self.draining:  # Serve is stopping this replica: say so
            await _last(resp, span, error_frame(self._mid_stream(None)))
            return usage
        text = (tools.text() if tools is not None else "".join(parts)) if parts is not None else None
        calls = tools.calls() if tools is not None and collect else None
        prompt_lp = first.prompt_logprobs
        frame = end_frame(finish, usage or Usage(), text, self.replica_id, calls, lp.whole(), None, prompt_lp)
        await _last(resp, span, frame)
        return usage

    async def _relay_choices(
        self,
        resp: web.StreamResponse,
        gen: AsyncGenerator[Chunk, None],
        first: Chunk,
        choices: ChoiceEvents,
        span: _EngineSpan | None,
    ) -> Usage | None:
        """``n`` > 1: each chunk's event names its choice; the end frame has each choice's whole
        answer when the gateway collects. Returns the usage (all choices' tokens)."""
        usage, aborted = None, False
        chunk: Chunk | None = first
        try:
            while chunk is not None:
                event = choices.event(chunk)
                if event:
                    await resp.write(event)
                aborted = aborted or chunk.finish_reason == "abort"
                usage = chunk.usage or usage
                chunk = await anext(gen, None)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:  # the engine failed mid-stream
            await _last(resp, span, error_frame(self._mid_stream(exc)))
            return usage
        if aborted and self.draining:  # Serve is stopping this replica: say so
            await _last(resp, span, error_frame(self._mid_stream(None)))
            return usage
        whole = choices.whole() if choices.collect else None
        frame = end_frame(
            choices.finish_reason, usage or Usage(), replica=self.replica_id, choices=whole,
            prompt_logprobs=first.prompt_logprobs,
        )  # fmt: skip
        await _last(resp, span, frame)
        return usage

    def _mid_stream(self, exc: BaseException | None) -> StreamInterrupted:
        if self.draining:
            return StreamInterrupted(f"engine replica {self.replica_id} is draining", code=DRAINING_CODE)
        if isinstance(exc, StreamInterrupted) or exc is None:
            return exc or StreamInterrupted("the engine's stream broke")
        return _broken(exc)


@dataclass
class _EngineSpan:
    """What a traced request's engine span needs, filled as it runs (times in ns)."""

    start: int
    first: int | None = None
    # Stamped as the last frame is handed to the gateway, not when the handler returns: the
    # gateway's span may end as soon as that frame arrives, and a child must not end after it.
    end: int | None = None
    usage: Usage | None = None
    error: str | None = None


async def _last(resp: web.StreamResponse, span: _EngineSpan | None, frame: bytes) -> None:
    """The stream's last frame, the engine span's end stamped just before it goes."""
    if span is not None:
        span.end = time.time_ns()
    await resp.write(frame)


def _plain_event(
    chunk: Chunk, meta: ResponseMeta, text_events: TextEvents, sent_first: bool, lp: LogprobsFraming
) -> bytes:
    """A chunk's event without tools (``b""``: nothing to say yet; its logprobs wait, as its ids)."""
    lp.add(chunk.logprobs)
    if not (chunk.text or not sent_first or (chunk.finish_reason and chunk.finish_reason != "abort")):
        return b""
    if sent_first and chunk.finish_reason is None and not lp.pending:  # the common case: text only
        return text_events.event(chunk.text)
    return sse(stream_chunk(meta, chunk.text, chunk.finish_reason, not sent_first, logprobs=lp.take()))


def _broken(exc: BaseException) -> StreamInterrupted:
    return StreamInterrupted(f"the engine's stream broke: {type(exc).__name__}: {exc}")
