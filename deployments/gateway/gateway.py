"""The gateway: one Serve deployment that serves the OpenAI-compatible HTTP API itself (Serve's
direct ingress, behind HAProxy on the Serve port) and does, in its own process, everything a
request needs: auth → surface, parse and validate once, tokenize once, fit the context window,
admission, the backend and replica choice, the first-token race (hedge, fail over, breakers),
the relay and the accounting. Tokens cross no Ray call: engine replicas stream to it over HTTP,
provider adapters run here.

Per chunk the relay does one read and one write; metrics are recorded once per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sys
import time
from dataclasses import asdict, fields, replace
from typing import TYPE_CHECKING

import ray
from ray import serve

from cluster import tokens
from cluster.config import ClusterConfig
from cluster.json_types import JSONObject
from cluster.observability import gc_pauses
from cluster.observability.loop_lag import LoopLagWindow, SampleWindow
from cluster.observability.trace import RequestTrace, new_id, parse_traceparent
from cluster.policy.admission import AdmissionController
from cluster.policy.admission_async import AsyncAdmission
from cluster.policy.admission_types import Outcome
from cluster.policy.attempts import by_capacity
from cluster.policy.context import reserved_output
from cluster.policy.failover import BreakerBoard
from cluster.policy.slo_guard import SloGuard, guarded_backends
from cluster.policy.tenants import TenantReservation
from cluster.providers.budget import Prices
from cluster.routing.affinity import AffinityParams, AffinityRouter
from cluster.routing.cache_salt import CacheSalts
from cluster.routing.view import BackendView
from cluster.wire.errors import ClusterError, Overloaded
from cluster.wire.protocol import (
    BackendStats,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    Usage,
)
from deployments import cpu_sched, haproxy_errors, metrics
from deployments.budgets.tenant_budget import tenant_budgets as shared_tenant_budgets
from deployments.gateway import http_api as h
from deployments.gateway import native_api
from deployments.gateway.attempts import AttemptRunner
from deployments.gateway.callers import Callers
from deployments.gateway.context import RequestContext
from deployments.gateway.engine_client import TYPICAL_START_S, ReplicaPicker, block_size
from deployments.gateway.index_sub import start_followers
from deployments.gateway.kv_feed import kv_index_status, start_feeds
from deployments.gateway.prepare import (
    INLINE_PREPARE_BYTES,
    Prepared,
    RouteKind,
    count_prompt,
    prepare_off_loop,
)
from deployments.gateway.relay import Relay
from deployments.internal import internal_token, token_ok

if TYPE_CHECKING:
    import aiohttp
    from ray.serve.handle import DeploymentHandle

    from deployments.providers.providers import ProviderBackend
    from deployments.tracing import Tracer

log = logging.getLogger("ray.serve")


@serve.deployment(max_ongoing_requests=4096)
@serve.ingress()
class Gateway:
    def __init__(
        self,
        config: JSONObject,
        engines: dict[str, DeploymentHandle],
        budgets: dict[str, DeploymentHandle] | None = None,
        tenant_budgets: DeploymentHandle | None = None,
        indexers: dict[str, list[DeploymentHandle]] | None = None,
    ) -> None:
        self.cfg = cfg = ClusterConfig.model_validate(config)
        self._token = internal_token()
        self.callers = Callers(cfg, self._token)  # who each request is from (API keys, headers)
        self.cache_salts = CacheSalts(cfg.tenants, self._token)  # one cache group's never answers another's
        self.admission = AsyncAdmission(AdmissionController.from_config(cfg))
        self.tenants = shared_tenant_budgets(cfg.tenants, tenant_budgets)
        backends = guarded_backends(cfg.backends)  # engines only: a provider's TTFT is not ours to defer
        self.guard = SloGuard.for_surfaces(cfg.policies.slo_guard, cfg.surfaces, backends)
        self.board = BreakerBoard(cfg.policies.failover.breaker)
        self.replica_id = replica = serve.get_replica_context().replica_id.unique_id
        self.views, pickers, providers = self._backends(engines, budgets or {})
        self.providers = providers
        self._session: aiohttp.ClientSession | None = None
        self.attempts = AttemptRunner(cfg, pickers, providers, self._client_session, self._token, self.board)
        indexers = indexers or {}  # backends whose events their indexers apply (index_sub.py)
        kv_wanted = {
            b.name: b.routing == "cache_aware" and b.affinity.kv_events and b.name not in indexers
            for b in cfg.backends
        }
        self.kv_feeds, self._kv_tasks = start_feeds(
            self.views, pickers, self._client_session, self._token, kv_wanted
        )
        self.index_feeds, self._index_tasks = start_followers(self.views, indexers, self._token)
        self.prices = {b.name: Prices.from_config(b.provider) for b in cfg.backends if b.provider is not None}
        self.relay = Relay.build(cfg, self.attempts, self.guard, self.prices, self.views, replica)
        self.tracer: Tracer | None = None  # when an OTLP endpoint is configured
        if cfg.tracing.otlp_endpoint:
            from deployments.tracing import Tracer

            self.tracer = Tracer(cfg.tracing, replica)
        for m in cfg.models:  # load tokenizers now, not on the first request
            tokens.load(m.tokenizer)
        self._openapi = h.openapi_document()
        self.loop_lag = LoopLagWindow()
        self.refusals = SampleWindow(4096)  # each refusal's time in this replica (status, metrics)
        self._lag_task = asyncio.get_event_loop().create_task(self._watch_loop())
        self._gauges_task = asyncio.get_event_loop().create_task(self._report_gauges())
        self._guard_task = asyncio.get_event_loop().create_task(self._drive_guard(backends))
        # HAProxy's own error page on this node in the OpenAI shape, before this replica serves
        self._errpage_task = haproxy_errors.start(ray.get_runtime_context().get_node_id())
        nice = cfg.server.gateway_nice  # this replica and its node's HAProxy, ahead of Ray's 15
        self.niceness = None if nice is None else cpu_sched.renice_gateway(nice)
        self._routes = self._route_table()
        # Last, so that the heap startup built is frozen whole (cluster/observability/gc_pauses.py);
        # the pauses are timed from then on: those of serving, not the startup's own collection.
        self.gc_frozen = gc_pauses.freeze_startup_heap() if cfg.server.gc_freeze else 0
        self.gc = gc_pauses.GcPauses()
        gc_pauses.install(self.gc)

    def _route_table(self) -> dict[tuple[str, str], h.App]:
        """(method, path) -> handler(scope, receive, send)."""
        return {
            ("POST", "/v1/chat/completions"): lambda s, r, d: self._complete(s, r, d, "chat"),
            ("POST", "/v1/completions"): lambda s, r, d: self._complete(s, r, d, "completion"),
            ("POST", "/v1/messages"): functools.partial(self._native, native_api.MESSAGES),
            ("POST", "/v1/messages/count_tokens"): self._count_tokens,
            ("POST", "/v1/responses"): functools.partial(self._native, native_api.RESPONSES),
            ("GET", "/v1/models"): self._models,
            ("GET", "/healthz"): self._healthz,
            ("GET", "/openapi.json"): self._openapi_json,
            ("GET", "/internal/status"): self._status,
        }

    def _backends(
        self, engines: dict[str, DeploymentHandle], budgets: dict[str, DeploymentHandle]
    ) -> tuple[dict[str, BackendView], dict[str, ReplicaPicker], dict[str, ProviderBackend]]:
        """Each engine backend's routing view and replica picker, each provider's adapter (it runs
        in this process, with the app's shared budget when the provider has limits)."""
        cfg = self.cfg
        views: dict[str, BackendView] = {}
        pickers: dict[str, ReplicaPicker] = {}
        providers: dict[str, ProviderBackend] = {}
        for b in cfg.backends:
            model = cfg.model(b.model)
            assert model is not None  # validated
            if not b.kind.caps.engine_replicas:
                from deployments.budgets.provider_budget import get_budget
                from deployments.providers.providers import build_provider_backend

                os.environ.update(b.env)  # the adapter runs here: its key's variable, for one

                providers[b.name] = build_provider_backend(
                    b,
                    model,
                    f"{self.replica_id}/{b.name}",
                    budget=get_budget(b, budgets.get(b.name)),
                    on_unsettled=functools.partial(_count_unsettled, b.name),
                )
                continue
            policy = AffinityRouter(block_size(b), b.model, AffinityParams(**b.affinity.params()))
            cap = b.max_in_flight_per_replica
            views[b.name] = view = BackendView(b.name, policy, self.board.replicas(b.name), cap, b.routing)
            pickers[b.name] = ReplicaPicker(engines[b.name], view, TYPICAL_START_S.get(b.kind, 30.0))
        return views, pickers, providers

    async def _native(
        self, api: native_api.NativeApi, scope: h.Scope, receive: h.Receive, send: h.Send
    ) -> None:
        """/v1/messages and /v1/responses: translated into the chat route and back."""

        async def chat(s: h.Scope, r: h.Receive, d: h.Send) -> None:
            await self._complete(s, r, d, "chat", translated=True)

        srv = self.cfg.server
        await native_api.serve(
            api, chat, srv.max_body_bytes, self.callers.identify, scope, receive, send, srv.body_timeout_s
        )

    async def _count_tokens(self, scope: h.Scope, receive: h.Receive, send: h.Send) -> None:
        """/v1/messages/count_tokens: the prompt counted as admission counts it, nothing admitted."""

        async def count(chat: bytes) -> int:
            if len(chat) > INLINE_PREPARE_BYTES:  # a long context is tokenized off the loop
                return await asyncio.to_thread(count_prompt, self.cfg, chat)
            return count_prompt(self.cfg, chat)

        srv = self.cfg.server
        await native_api.count_tokens(
            count, srv.max_body_bytes, self.callers.identify, scope, receive, send, srv.body_timeout_s
        )

    async def _report_gauges(self) -> None:
        """Breaker states and this replica's admission load as gauges once a second (never per
        request or chunk)."""
        while True:
            with contextlib.suppress(Exception):
                metrics.record_breakers(self.board.metrics(time.monotonic()))
                c = self.admission.controller.counters()
                metrics.record_gateway(
                    self.replica_id, c.in_flight, c.waiting, self.loop_lag.summary()["p99_ms"]
                )
            await asyncio.sleep(1.0)

    async def _watch_loop(self) -> None:
        """This replica's event-loop lag (cluster/observability/loop_lag.py): one timer, every 0.25 s."""
        w, clock = self.loop_lag, time.perf_counter
        while True:
            t = clock()
            await asyncio.sleep(w.interval_s)
            w.woke(t, clock())

    async def _drive_guard(self, backends: list[str]) -> None:
        """The SLO guard's caps on lower-priority work, revised every interval (never per chunk)."""
        ctl = self.admission.controller
        period = self.cfg.policies.slo_guard.interval_s
        while True:
            try:
                self._absorb_engine_ttft()
                ceilings = {b: ctl.backend_cap(b) for b in backends}
                caps = self.guard.update(time.monotonic(), ctl.deferred_in_flight(), ceilings)
                self.admission.set_guard_caps(caps)
            except Exception:  # a bug here must not stop admission; the caps hold as they were
                log.exception("gateway: SLO guard update failed")
            await asyncio.sleep(period)

    def _absorb_engine_ttft(self) -> None:
        """The engines' own TTFT samples (every gateway's requests) into this gateway's guard, from
        the routing stats the last replica choice saw (Serve pushes them every half second)."""
        now = time.monotonic()
        for name, view in self.views.items():
            for r in (live := view.snapshot().replicas).values():
                self.guard.absorb(name, r.replica, r.ttft, now)
            self.guard.forget_replicas(name, live)

    def __serve_build_asgi_app__(self) -> _Asgi:
        return _Asgi(self._asgi)

    def _client_session(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
            )
        return self._session

    # -- ASGI -------------------------------------------------------------------------------------
    async def _asgi(self, scope: h.Scope, receive: h.Receive, send: h.Send) -> None:
        if scope["type"] == "lifespan":
            return
        if scope["type"] != "http":
            return
        path = scope.get("path", "/")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        route = self._routes.get((scope["method"], path))
        if route is None:
            await h.send_error(send, h.no_route(scope["method"], path, self._routes))
            return
        try:
            await route(scope, receive, send)
        except ClusterError as err:
            await h.send_error(send, err)
        except Exception as exc:  # ours: an OpenAI error object, never the server's plain-text 500
            log.exception("gateway: unexpected error on %s %s", scope["method"], path)
            with contextlib.suppress(RuntimeError):  # the response may have started already
                await h.send_error(send, ClusterError(f"internal error: {type(exc).__name__}"))
        except BaseException as exc:  # cancelled (the replica is going away, or the client), or the
            # process exiting (SystemExit & co.: uvicorn would answer a response not yet started with
            # its plain-text 500, as a killed gateway's waiter once got in CI): the OpenAI 503 if we
            # can; an exit is rare enough to say what it was
            if not isinstance(exc, asyncio.CancelledError):
                log.warning("gateway: %s on %s %s; answering 503", type(exc).__name__, scope["method"], path)
            with contextlib.suppress(Exception):
                await h.send_error(
                    send, Overloaded("The gateway replica is shutting down; retry.", retry_after_s=1)
                )
            raise

    # -- the completion routes ------------------------------------------------------------------
    async def _complete(
        self, scope: h.Scope, receive: h.Receive, send: h.Send, kind: RouteKind, translated: bool = False
    ) -> None:
        t0 = time.perf_counter()
        rid = h.new_request_id()
        try:
            surface, tenant = self.callers.identify(scope)
            h.check_json_content_type(scope)
            # the limit is on the client's bytes: native_api's translation of them is not measured
            limit = sys.maxsize if translated else self.cfg.server.max_body_bytes
            raw = await h.read_body(scope, receive, limit, self.cfg.server.body_timeout_s)
            refusal = self._precheck(surface, tenant)
            if refusal is not None:
                await self._refuse(send, refusal, surface, t0)
                return
            schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
            session = h.header(scope, b"x-session-id")
            salt = self.cache_salts.salt(tenant)
            prepared = await prepare_off_loop(
                self.cfg, raw, schema, kind, rid, surface, session, self.views, salt
            )
            prepared = replace(prepared, prep_s=time.perf_counter() - t0)
            prepared.meta.show_ids = self.callers.shows_ids(scope)
        except ClusterError as err:
            await h.send_error(send, err)
            return
        except ConnectionResetError:  # the client left while sending its body: nobody to answer
            return
        # A client that leaves from here on cancels this task (Serve's direct ingress watches the
        # connection): admission, the routing view and the attempts clean up on CancelledError.
        trace = None
        if self.tracer is not None and self.tracer.sampled():
            trace = self._trace(prepared, t0, h.header(scope, b"traceparent"))
        await self._run(prepared, send, t0, tenant, trace)

    def _trace(self, prepared: Prepared, t0: float, parent: str | None) -> RequestTrace:
        """A request's trace, joined to the client's (its ``traceparent``) when it sent one."""
        rng = self.attempts.rng
        start_ns = time.time_ns() - int((time.perf_counter() - t0) * 1e9)
        ids = parse_traceparent(parent)
        trace_id, parent_id = ids if ids else (new_id(rng, 128), None)
        return RequestTrace(trace_id, new_id(rng, 64), start_ns, prepared.req, parent_span_id=parent_id)

    def _precheck(self, surface: str, tenant: str | None = None) -> ClusterError | None:
        """A request admission or its tenant's spent budget would refuse whatever it asks for is
        refused before it is parsed and tokenized (a long Agent prompt costs milliseconds to
        tokenize, and the budget a call to its deployment; the 429 should not)."""
        self.guard.arrived(surface, time.monotonic())
        spent = self.tenants.refusal(tenant)
        if spent is not None:
            return spent
        try:
            self.admission.precheck(surface, tenant)
        except ClusterError as err:
            return err
        return None

    async def _refuse(self, send: h.Send, err: ClusterError, surface: str, t0: float) -> None:
        """Answer a refusal (429/503) and count it with its time in this replica, which admission
        promises is a few ms (``llmc_refusal_seconds``, ``refusals`` in /internal/status)."""
        await h.send_error(send, err)
        took = time.perf_counter() - t0
        self.refusals.add(time.monotonic(), took)
        metrics.REJECTIONS.inc(tags={"surface": surface, "code": err.code or ""})
        metrics.REFUSAL_TIME.observe(took, tags={"surface": surface})

    async def _run(
        self,
        prepared: Prepared,
        send: h.Send,
        t0: float,
        tenant: str | None = None,
        trace: RequestTrace | None = None,
    ) -> None:
        req = prepared.req
        surface = req.surface
        n_in, t = len(req.prompt_token_ids), self.cfg.tenant(tenant) if tenant is not None else None
        tpm, n = t.tpm if t else None, req.sampling.n
        out = reserved_output(req.sampling.max_tokens, n_in, tpm, req.max_tokens_asked, n)
        budget = await self.tenants.reserve(tenant, n_in, out)
        try:
            if isinstance(budget, ClusterError):  # the tenant is over its budget: at once
                raise budget
            # a backend far slower than its usual goes behind the others (cluster/policy/brownout.py)
            ordered = self.attempts.brownout.order(prepared.candidates, time.monotonic())
            ticket = await self.admission.acquire(surface, ordered, tenant)
        except BaseException as err:
            if isinstance(budget, TenantReservation):  # never served: the budget gets it back
                self.tenants.cancel(budget)
            if not isinstance(err, ClusterError):
                raise
            await self._refuse(send, err, surface, t0)
            if trace is not None:
                trace.admission_error, trace.outcome, trace.end_ns = err.code, "rejected", time.time_ns()
                self._export(trace)
            return
        if trace is not None:
            trace.admitted_ns = time.time_ns()
        candidates = ordered
        if ticket.backend in candidates:  # admission picked the first candidate with room
            candidates = candidates[candidates.index(ticket.backend) :]
        candidates = by_capacity(candidates, self._serving)  # a provider at once, not a dead backend
        # the relay settles a reservation, however it ends
        settle = (
            functools.partial(self.tenants.settle, budget) if isinstance(budget, TenantReservation) else None
        )
        ctx = RequestContext(prepared, candidates, t0, ticket.waited_s, trace, settle)
        outcome = Outcome.CANCELLED
        try:
            outcome = (await self.relay.serve(ctx, send)).outcome
        except Exception:
            outcome = Outcome.ERRORED
            raise
        finally:
            self.admission.release(ticket, outcome)
            metrics.ENDINGS.inc(tags={"surface": surface, "outcome": outcome.value})
            if trace is not None:
                trace.outcome, trace.end_ns = outcome.value, time.time_ns()
                self._export(trace)

    def _export(self, trace: RequestTrace) -> None:
        if self.tracer is not None:  # always, when there is a trace: only a tracer makes one
            self.tracer.export(trace)

    def _serving(self, backend: str) -> bool:
        """Whether ``backend`` can take a request now (a provider: always; an engine backend:
        :meth:`ReplicaPicker.serving`)."""
        picker = self.attempts.pickers.get(backend)
        return picker is None or picker.serving(time.monotonic())

    # -- other routes ---------------------------------------------------------------------------
    async def _models(self, scope: h.Scope, receive: h.Receive, send: h.Send) -> None:
        self.callers.identify(scope)  # with auth on, listing models needs a key too
        data = []
        for m in self.cfg.models:
            kinds = sorted({b.kind for b in self.cfg.backends if b.model == m.name})
            data.append(
                {
                    "id": m.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "llm-cluster",
                    "context_window": m.context_window,
                    "backend_kinds": kinds,
                    "simulated": "sim" in kinds,
                }
            )
        await h.send_json(send, 200, {"object": "list", "data": data})

    async def _healthz(self, scope: h.Scope, receive: h.Receive, send: h.Send) -> None:
        await h.send_json(send, 200, {"status": "ok"})

    async def _openapi_json(self, scope: h.Scope, receive: h.Receive, send: h.Send) -> None:
        await h.send_json(send, 200, self._openapi)

    async def _status(self, scope: h.Scope, receive: h.Receive, send: h.Send) -> None:
        """For operators and tests, with the internal credential: this gateway replica's view."""
        if not token_ok(h.header(scope, b"x-llmc-internal"), self._token):
            raise h.no_route("GET", "/internal/status", ())  # as if there were no such path
        for picker in self.attempts.pickers.values():
            await picker.refresh()
        await h.send_json(send, 200, self.status())

    def status(self) -> JSONObject:
        c = self.admission.controller.counters()
        return {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "admission": {"balanced": c.balanced(), **{f.name: getattr(c, f.name) for f in fields(c)}},
            "policy": self.attempts.snapshot(),
            "slo_guard": {b: asdict(st) for b, st in self.guard.last.items()},
            "slo_guard_samples": self.guard.sample_counts(),
            "slo_guard_changes": self.guard.recent_changes(time.monotonic()),
            "loop_lag": {f"last_{n}s": self.loop_lag.summary(float(n)) for n in (10, 30, 60)},
            "gc": {"frozen": self.gc_frozen, **self.gc.summary(60.0, time.perf_counter())},
            "niceness": self.niceness,
            "refusals": {
                "total": self.refusals.count,
                **{f"last_{n}s": self.refusals.summary(float(n), time.monotonic()) for n in (10, 30, 60)},
            },
            "routing": {
                name: {
                    "replicas": {r: i.url for r, i in s.replicas.items()},
                    "serve_lists": p.serve_lists() if (p := self.attempts.pickers.get(name)) else None,
                    "in_flight": dict(s.in_flight),
                    "decisions": dict(s.decisions),
                    "prefilling_tokens": dict(s.prefilling),
                    "avoided_prefill": s.avoided_prefill,
                    "kv_index": kv_index_status(v, self.kv_feeds.get(name) or self.index_feeds.get(name)),
                }
                for name, v in self.views.items()
                for s in (v.snapshot(),)
            },
            "providers": {name: _stats_dict(p.stats()) for name, p in self.providers.items()},
        }


class _Asgi:
    """An ASGI 3 callable around a bound method (uvicorn tells ASGI 2 from 3 by ``__call__``)."""

    def __init__(self, handler: h.App) -> None:
        self.handler = handler

    async def __call__(self, scope: h.Scope, receive: h.Receive, send: h.Send) -> None:
        await self.handler(scope, receive, send)


def _count_unsettled(backend: str, req: GenerateRequest, usage: Usage, cost: float) -> None:
    """A provider stream that ended without usage (cancelled, lost, stalled): billed all the same."""
    metrics.record_usage(req.surface, backend, usage, outcome="cancelled")
    if cost > 0:
        metrics.COST.inc(cost, tags={"surface": req.surface, "backend": backend, "outcome": "cancelled"})


def _stats_dict(s: BackendStats) -> JSONObject:
    return {f.name: getattr(s, f.name) for f in fields(s)}
