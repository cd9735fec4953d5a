"""Provider adapters: OpenAI-compatible and Anthropic Messages endpoints as :class:`cluster.backend.Backend`.

One pooled ``httpx.AsyncClient`` per process (per event loop) carries every request; each is
streamed, parsed event by event and never buffered whole. Four clocks bound a request, from the
provider config: connect, first *content* token (bytes such as pings or a role-only chunk do not
count), silence between reads once tokens flow, and the whole request (or the request's own
deadline, if sooner). The provider's reported usage is authoritative: it settles the budget and
the cost; our own count is only the reservation, and its error is exposed as a metric.

The API key is read once from the environment variable the config names, kept in an object whose
repr hides it, sent only as a header, and scrubbed from any provider message we pass on.
``abort(request_id)`` (same event loop) and cancelling the consuming task both close the upstream
connection at once, so the provider stops generating (and billing).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, ClassVar, TypeVar

import httpx
from httpx_aiohttp import AiohttpTransport

from cluster import tokens
from cluster.config import BackendConfig, ModelConfig
from cluster.errors import ClusterError, ProviderAuthError, RateLimited
from cluster.image_tokens import image_tokens
from cluster.protocol import BackendStats, Chunk, GenerateRequest, Usage
from cluster.providers import StreamDelta, anthropic_wire, openai_wire
from cluster.providers import errors as perrors
from cluster.providers.budget import Prices, cost_usd
from cluster.providers.sse import SSEDecoder, SSEEvent
from deployments.provider_budget import Budget, get_budget

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_ERROR_BODY = 64 * 1024
EWMA_ALPHA = 0.1
BIG_PROMPT_CHARS = 200_000  # count tokens of bigger prompts in a thread, off the event loop

# ------------------------------------------------------------------------------------------------
# One pooled client per process (httpx clients are bound to the loop that first used them)
# ------------------------------------------------------------------------------------------------

_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
    weakref.WeakKeyDictionary()
)


class _NoCookies(httpx.Cookies):
    """The shared client keeps no cookies: every tenant's requests go through it, so a provider's
    ``Set-Cookie`` on one answer must not ride along on everyone's next request (and reading each
    answer's cookies into a jar cost ~5 % of the gateway's CPU per request)."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


def shared_client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _CLIENTS.get(loop)
    if client is None or client.is_closed:
        limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256, keepalive_expiry=30.0)
        client = httpx.AsyncClient(
            # httpx's API over aiohttp's connection pool: httpx's own pool cost O(connections) per
            # request, the largest single cost of a Python relay (shared/notes/ray-serve-fast-path.md).
            transport=AiohttpTransport(limits=limits, trust_env=False),
            limits=limits,
            timeout=None,  # per request, from the provider config
            follow_redirects=False,
        )
        client._cookies = _NoCookies()  # httpx has no switch for it; its setter copies into a jar
        _CLIENTS[loop] = client
    return client


async def aclose_shared_client() -> None:
    """Close this loop's pooled client (tests, shutdown); the next request opens a new one."""
    client = _CLIENTS.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


class _Secret:
    """An API key that never shows itself in a repr, a log line or a traceback's locals."""

    __slots__ = ("_value",)

    def __init__(self, value: str | None) -> None:
        self._value = value or None

    def reveal(self) -> str | None:
        return self._value

    def __repr__(self) -> str:
        return "<secret>" if self._value else "<no secret>"

    __str__ = __repr__


class _Aborted(Exception):
    pass


class _Flight:
    """One request in flight: what ``abort`` needs to reach it."""

    __slots__ = ("aborted", "loop", "timeout")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.aborted = False
        self.loop = loop
        self.timeout: asyncio.Timeout | None = None

    def abort(self) -> None:
        self.aborted = True
        cm = self.timeout
        if cm is not None:  # fire the pending read's timeout now: it notices ``aborted``
            self.loop.call_soon_threadsafe(
                lambda: cm.reschedule(self.loop.time()) if not cm.expired() else None
            )


# ------------------------------------------------------------------------------------------------
# The adapter
# ------------------------------------------------------------------------------------------------


class ProviderBackend:
    """The shared machinery; subclasses say how to talk to one provider API."""

    api: ClassVar[str] = ""

    def __init__(
        self,
        backend: BackendConfig,
        model: ModelConfig,
        replica_name: str,
        *,
        budget: Budget | None = None,
        client: httpx.AsyncClient | None = None,
        admission_wait_s: float = 0.0,
        on_unsettled: Callable[[GenerateRequest, Usage, float], None] | None = None,
    ) -> None:
        if backend.provider is None:
            raise ValueError(f"backend '{backend.name}' has no provider section")
        self.cfg = backend.provider
        self.backend_name = backend.name
        self.replica = replica_name
        self.model = model.name
        self.upstream_model = self.cfg.upstream_model or model.name
        self.base_url = self.cfg.base_url.rstrip("/")
        self._key = _Secret(os.environ.get(self.cfg.api_key_env) if self.cfg.api_key_env else None)
        if self.cfg.api_key_env and self._key.reveal() is None:
            log.warning(
                "provider backend %s: environment variable %s is not set", backend.name, self.cfg.api_key_env
            )
        self.counter = tokens.load(model.tokenizer, self.cfg.api)
        self.budget: Budget = budget if budget is not None else get_budget(backend)
        self._client = client
        self.admission_wait_s = admission_wait_s
        self._flights: dict[str, list[_Flight]] = {}
        self._timeout = httpx.Timeout(
            connect=self.cfg.connect_timeout_s,
            read=None,  # reads are bounded by the first-token / between-token clocks below
            write=self.cfg.between_tokens_timeout_s,
            pool=self.cfg.connect_timeout_s,
        )
        # counters for stats()
        self.started = self.finished = self.aborted = 0
        self.errors: dict[str, int] = {}
        self.auth_failures = 0
        self.budget_denied = 0
        self.usage_estimated = 0
        self.cost_usd_total = 0.0
        self.prompt_tokens_total = self.completion_tokens_total = 0
        self.prices = Prices.from_config(self.cfg)
        self.on_unsettled = on_unsettled  # (request, usage, cost) for streams ended without usage
        self.cancelled_requests = 0
        self.cancelled_prompt_tokens_total = self.cancelled_completion_tokens_total = 0
        self.cancelled_cost_usd_total = 0.0
        self._est_err_last: float | None = None
        self._est_err_ewma: float | None = None
        self._est_abs_err_sum = 0.0
        self._est_samples = 0

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(backend={self.backend_name!r}, replica={self.replica!r}, url={self.base_url!r})"

    # -- what a subclass provides -----------------------------------------------------------------
    def _path(self, req: GenerateRequest) -> str:
        raise NotImplementedError

    def _body(self, req: GenerateRequest) -> dict[str, Any]:
        raise NotImplementedError

    def _headers(self, req: GenerateRequest) -> dict[str, str]:
        raise NotImplementedError

    def _parser(self) -> Any:
        """A callable SSEEvent -> StreamDelta, fresh per request (it may hold stream state)."""
        raise NotImplementedError

    def _map_status(self, status: int, body: bytes, headers: Mapping[str, str]) -> ClusterError:
        raise NotImplementedError

    # -- Backend ----------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """The stream as single chunks (see :meth:`generate_batches`)."""
        gen = self.generate_batches(req)
        try:
            async for batch in gen:
                for chunk in batch:
                    yield chunk
        finally:
            await gen.aclose()

    async def generate_batches(self, req: GenerateRequest) -> AsyncIterator[list[Chunk]]:
        """The stream, one list of chunks per network read: what arrived together leaves together
        (the gateway writes each list to its client in one send)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        total_deadline = t0 + self.cfg.total_timeout_s
        if req.deadline is not None:
            total_deadline = min(total_deadline, t0 + (req.deadline - time.time()))
        flight = _Flight(loop)
        self._flights.setdefault(req.request_id, []).append(flight)
        self.started += 1
        input_est = await self._estimate_input(req)
        charged = 0  # tokens to charge the budget if the provider never reports usage
        out_parts: list[str] = []  # what came back, counted once, only where no usage is reported
        settled = reserved = False
        response: httpx.Response | None = None
        try:
            wait = max(0.0, min(self.admission_wait_s, total_deadline - loop.time()))
            adm = await self.budget.reserve(req.request_id, input_est, req.sampling.max_tokens, wait)
            if not adm.ok:
                self.budget_denied += 1
                raise RateLimited(
                    f"provider backend '{self.backend_name}' is over its {adm.reason} budget",
                    retry_after_s=adm.retry_after_s,
                    backend=self.backend_name,
                )
            reserved = True
            started = False  # content has been yielded
            usage: Usage | None = None
            finish: str | None = None
            sent_at = loop.time()  # the first-token clock starts now, not while we waited for budget
            first_deadline = min(total_deadline, sent_at + self.cfg.first_token_timeout_s)
            try:
                response = await self._send(req, flight, first_deadline)
                charged = input_est  # it reached the provider: it may bill the input
                if response.status_code != 200:
                    body = await self._timed(flight, first_deadline, _read_capped(response))
                    raise self._map_status(response.status_code, body, response.headers)
                decoder, parse = SSEDecoder(), self._parser()
                chunks = response.aiter_bytes()
                last = loop.time()
                done = False
                while not done:
                    deadline = (
                        min(total_deadline, last + self.cfg.between_tokens_timeout_s)
                        if started
                        else first_deadline
                    )
                    try:
                        data = await self._timed(flight, deadline, anext(chunks))
                    except StopAsyncIteration:
                        break
                    last = loop.time()
                    batch: list[Chunk] = []
                    failure: Exception | None = None  # raised once what came before it is out
                    for ev in decoder.feed(data):
                        try:
                            delta: StreamDelta = parse(ev)
                        except ValueError as exc:
                            failure = exc
                            break
                        if delta.error is not None:
                            failure = perrors.from_stream_error(
                                delta.error,
                                provider=self.api,
                                backend=self.backend_name,
                                started=started,
                                secret=self._key.reveal(),
                            )
                            break
                        usage = delta.usage or usage
                        finish = delta.finish_reason or finish
                        if delta.text or delta.tool_calls or delta.thinking:  # all content
                            started = True
                            out_parts.append(delta.text)
                            batch.append(
                                self._chunk(
                                    text=delta.text, tool_calls=delta.tool_calls, thinking=delta.thinking
                                )
                            )
                        if delta.done:
                            done = True
                            break
                    if batch:
                        yield batch
                    if failure is not None:
                        raise failure
                if not done and (finish is None or self.api == "anthropic"):
                    raise perrors.truncated(backend=self.backend_name, started=started)
            except _Aborted:
                self.aborted += 1
                usage = Usage(prompt_tokens=input_est, completion_tokens=self._count_out(out_parts))
                yield [
                    Chunk(finish_reason="abort", usage=usage, replica=self.replica, backend=self.backend_name)
                ]
                return
            except ClusterError:
                raise
            except (TimeoutError, httpx.HTTPError, OSError, ValueError) as exc:
                waited = loop.time() - (last if started else sent_at)
                raise perrors.from_transport(
                    exc, backend=self.backend_name, started=started, waited_s=waited
                ) from exc
            if usage is None:
                self.usage_estimated += 1
                usage = Usage(prompt_tokens=input_est, completion_tokens=self._count_out(out_parts))
            else:
                self._observe_estimate(input_est, usage.prompt_tokens)
            cost = await self.budget.settle(req.request_id, usage)
            settled = True
            self.cost_usd_total += cost
            self.prompt_tokens_total += usage.prompt_tokens
            self.completion_tokens_total += usage.completion_tokens
            self.finished += 1
            yield [
                Chunk(
                    finish_reason=finish or "stop",
                    usage=usage,
                    replica=self.replica,
                    backend=self.backend_name,
                )
            ]
        except ClusterError as err:
            self._count_error(err, req)
            raise
        finally:
            flights = self._flights.get(req.request_id, [])
            if flight in flights:
                flights.remove(flight)
            if not flights:
                self._flights.pop(req.request_id, None)
            release: int | None = None  # tokens to charge when the slot goes back without usage
            if reserved and not settled:
                release = 0
                if charged:  # it reached the provider: the input, and what came back, may be billed
                    out = self._count_out(out_parts)
                    release = charged + out
                    if response is not None and response.status_code == 200:
                        self._count_unsettled(req, Usage(prompt_tokens=input_est, completion_tokens=out))
            # One shielded task for both steps: a second cancellation while the connection closes
            # must not skip the release (the slot would be held until the reservation expires).
            await asyncio.shield(self._close(req.request_id, response, release))

    async def _close(self, request_id: str, response: httpx.Response | None, release: int | None) -> None:
        try:
            if response is not None:
                await response.aclose()
        finally:
            if release is not None:
                await self.budget.release(request_id, release)

    def _count_unsettled(self, req: GenerateRequest, usage: Usage) -> None:
        """A stream that reached the provider and ended without its usage (cancelled by the client,
        lost a hedge, stalled, broke): the provider bills what it read and wrote, so we count it too
        (prompt tokens as sent, output tokens as received), apart from the settled totals."""
        cost = cost_usd(usage, self.prices)
        self.cancelled_requests += 1
        self.cancelled_prompt_tokens_total += usage.prompt_tokens
        self.cancelled_completion_tokens_total += usage.completion_tokens
        self.cancelled_cost_usd_total += cost
        if self.on_unsettled is not None:
            try:
                self.on_unsettled(req, usage, cost)
            except Exception:  # metrics must never break the request's cleanup
                log.exception("provider backend %s: on_unsettled hook failed", self.backend_name)

    async def abort(self, request_id: str) -> None:
        for flight in list(self._flights.get(request_id, [])):
            flight.abort()

    def stats(self) -> BackendStats:
        snapshot = getattr(self.budget, "snapshot", None)
        budget = snapshot() if snapshot is not None and not inspect.iscoroutinefunction(snapshot) else {}
        return BackendStats(
            replica=self.replica,
            backend=self.backend_name,
            kind="provider",
            running=sum(len(v) for v in self._flights.values()),
            waiting=int(budget.get("waiting", 0)),
            requests_started=self.started,
            requests_finished=self.finished,
            requests_aborted=self.aborted,
            # Restarting a replica cannot fix a provider: failures show in the counters and breakers.
            healthy=True,
            extra=self._extra(budget),
        )

    def _extra(self, budget: dict[str, Any]) -> dict[str, Any]:
        """Flat numbers for metrics (plus the api and tokenizer names); absent rather than None."""
        extra: dict[str, Any] = {
            "api": self.api,
            "tokenizer": getattr(self.counter, "name", type(self.counter).__name__),
            "tokenizer_exact": bool(self.counter.exact),
            # (our input estimate - the provider's prompt_tokens) / the provider's: > 0 over-reserves
            "prompt_estimate_error": self._est_err_ewma,
            "prompt_estimate_error_last": self._est_err_last,
            "prompt_estimate_abs_error_mean": self._est_abs_err_sum / self._est_samples
            if self._est_samples
            else None,
            "prompt_estimate_samples": self._est_samples,
            "usage_estimated": self.usage_estimated,
            "cost_usd_total": self.cost_usd_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "completion_tokens_total": self.completion_tokens_total,
            # streams that reached the provider and ended without usage (cancels, stalls, breaks)
            "cancelled_requests": self.cancelled_requests,
            "cancelled_prompt_tokens_total": self.cancelled_prompt_tokens_total,
            "cancelled_completion_tokens_total": self.cancelled_completion_tokens_total,
            "cancelled_cost_usd_total": self.cancelled_cost_usd_total,
            "auth_failures": self.auth_failures,
            "budget_denied": self.budget_denied,
        }
        extra.update({f"errors_{name}": n for name, n in self.errors.items()})
        extra.update({f"budget_{k}": v for k, v in budget.items() if k != "waiting"})
        return {k: v for k, v in extra.items() if v is not None}

    def shutdown(self) -> None:
        """Nothing to free per adapter: the pooled client belongs to the process."""

    # -- internals --------------------------------------------------------------------------------
    async def _send(self, req: GenerateRequest, flight: _Flight, deadline: float) -> httpx.Response:
        """POST the request; returns once the response headers are in (the body is still streaming)."""
        client = self._client or shared_client()
        request = client.build_request(
            "POST",
            self.base_url + self._path(req),
            json=self._body(req),
            headers=self._headers(req),
            timeout=self._timeout,
        )
        return await self._timed(flight, deadline, client.send(request, stream=True))

    async def _timed(self, flight: _Flight, deadline: float, aw: Awaitable[T]) -> T:
        """Await ``aw`` until ``deadline`` (loop time); ``abort`` fires the same timeout early."""
        if flight.aborted:
            if inspect.iscoroutine(aw):
                aw.close()
            raise _Aborted
        try:
            async with asyncio.timeout_at(deadline) as cm:
                flight.timeout = cm
                return await aw
        except TimeoutError:
            if flight.aborted:
                raise _Aborted from None
            raise
        finally:
            flight.timeout = None

    async def _estimate_input(self, req: GenerateRequest) -> int:
        if req.prompt_token_ids:  # the router counted with this model's tokenizer; images our way
            return len(req.prompt_token_ids) + image_tokens(req.messages or [], self.api)
        if req.kind == "chat" and req.messages is not None:
            size = sum(len(str(m.get("content") or "")) for m in req.messages)
            images = image_tokens(req.messages, self.api)
            if size > BIG_PROMPT_CHARS:
                return await asyncio.to_thread(self.counter.count_chat, req.messages) + images
            return self.counter.count_chat(req.messages) + images
        text = req.prompt_text or ""
        if len(text) > BIG_PROMPT_CHARS:
            return await asyncio.to_thread(self.counter.count, text)
        return self.counter.count(text)

    def _chunk(self, **fields: Any) -> Chunk:
        return Chunk(replica=self.replica, backend=self.backend_name, **fields)

    def _count_out(self, parts: list[str]) -> int:
        return self.counter.count("".join(parts)) if parts else 0

    def _observe_estimate(self, estimate: int, reported: int) -> None:
        if reported <= 0:
            return
        err = (estimate - reported) / reported
        self._est_err_last = err
        self._est_err_ewma = (
            err if self._est_err_ewma is None else (1 - EWMA_ALPHA) * self._est_err_ewma + EWMA_ALPHA * err
        )
        self._est_abs_err_sum += abs(err)
        self._est_samples += 1

    def _count_error(self, err: ClusterError, req: GenerateRequest) -> None:
        name = type(err).__name__
        self.errors[name] = self.errors.get(name, 0) + 1
        if isinstance(err, ProviderAuthError):
            self.auth_failures += 1
            log.error(
                "provider auth failed: backend=%s request=%s: %s", self.backend_name, req.request_id, err
            )
        else:
            log.warning(
                "provider error: backend=%s request=%s %s: %s", self.backend_name, req.request_id, name, err
            )


async def _read_capped(response: httpx.Response) -> bytes:
    """An error body, at most MAX_ERROR_BODY bytes of it."""
    buf = bytearray()
    async for part in response.aiter_bytes():
        buf += part
        if len(buf) >= MAX_ERROR_BODY:
            break
    return bytes(buf[:MAX_ERROR_BODY])


class OpenAIProviderBackend(ProviderBackend):
    """OpenAI and OpenAI-compatible servers: /chat/completions and /completions, SSE streams."""

    api = "openai"

    def _path(self, req: GenerateRequest) -> str:
        return openai_wire.endpoint(req)

    def _body(self, req: GenerateRequest) -> dict[str, Any]:
        return openai_wire.request_body(req, self.upstream_model)

    def _headers(self, req: GenerateRequest) -> dict[str, str]:
        # OpenAI keeps X-Client-Request-Id with its logs: our id finds a request on their side too.
        h = {"accept": "text/event-stream", "x-client-request-id": req.request_id[:512]}
        key = self._key.reveal()
        if key:
            h["authorization"] = f"Bearer {key}"
        return h

    def _parser(self) -> Any:
        return lambda ev: openai_wire.parse_stream_data(ev.data)

    def _map_status(self, status: int, body: bytes, headers: Mapping[str, str]) -> ClusterError:
        return perrors.from_openai_status(
            status, body, headers, backend=self.backend_name, secret=self._key.reveal()
        )


class AnthropicProviderBackend(ProviderBackend):
    """Anthropic's Messages API, translated from and to our OpenAI-shaped requests and chunks."""

    api = "anthropic"

    def _path(self, req: GenerateRequest) -> str:
        return "/messages"

    def _body(self, req: GenerateRequest) -> dict[str, Any]:
        return anthropic_wire.request_body(req, self.upstream_model)

    def _headers(self, req: GenerateRequest) -> dict[str, str]:
        h = {"accept": "text/event-stream", "anthropic-version": anthropic_wire.API_VERSION}
        key = self._key.reveal()
        if key:
            h["x-api-key"] = key
        return h

    def _parser(self) -> Any:
        state = anthropic_wire.StreamState()

        def parse(ev: SSEEvent) -> StreamDelta:
            return state.on_event(ev.event, ev.data)

        return parse

    def _map_status(self, status: int, body: bytes, headers: Mapping[str, str]) -> ClusterError:
        return perrors.from_anthropic_status(
            status, body, headers, backend=self.backend_name, secret=self._key.reveal()
        )


def build_provider_backend(
    backend: BackendConfig, model: ModelConfig, replica_name: str, **kwargs: Any
) -> OpenAIProviderBackend | AnthropicProviderBackend:
    """The adapter for ``backend.provider.api``."""
    if backend.provider is None:
        raise ValueError(f"backend '{backend.name}' has no provider section")
    cls = AnthropicProviderBackend if backend.provider.api == "anthropic" else OpenAIProviderBackend
    return cls(backend, model, replica_name, **kwargs)
