"""Provider adapters: OpenAI-compatible and Anthropic Messages endpoints, in the gateway's process;
the gateway reads their batches of chunks through the stream seam (:mod:`cluster.wire.stream`,
framed by :class:`cluster.wire.framing.FramedStream`).

One pooled aiohttp session per process (per event loop) carries every request; each is
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
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import ClassVar, TypeVar

import aiohttp

from cluster import tokens
from cluster.config import BackendConfig, ModelConfig
from cluster.json_types import JSONObject
from cluster.policy.context import reserved_output
from cluster.providers import StreamDelta, anthropic_wire, openai_wire
from cluster.providers import errors as perrors
from cluster.providers.budget import Prices, Refusal, Reservation, cost_usd
from cluster.providers.plain_events import joined_text
from cluster.providers.sse import SSEEvent
from cluster.tokens.images import image_tokens
from cluster.wire.errors import ClusterError, ProviderAuthError, RateLimited
from cluster.wire.openai_format import dumps
from cluster.wire.protocol import BackendStats, Chunk, GenerateRequest, Piece, Usage
from deployments.budgets.provider_budget import Budget, get_budget
from deployments.providers import provider_http as ph
from deployments.providers.provider_counters import ProviderCounters
from deployments.providers.provider_http import Aborted, Flight, Secret, aclose_shared_session, shared_session
from deployments.providers.provider_stream import ChunkReader, StreamState, as_chunk

__all__ = [
    "AnthropicProviderBackend",
    "OpenAIProviderBackend",
    "ProviderBackend",
    "aclose_shared_session",
    "build_provider_backend",
    "shared_session",
]

T = TypeVar("T")


def _as_is(batch: list[Piece]) -> list[Piece]:
    return batch


log = logging.getLogger(__name__)
Parser = Callable[[SSEEvent], StreamDelta]  # one SSE event of the provider's -> what it says

BIG_PROMPT_CHARS = 200_000  # count tokens of bigger prompts in a thread, off the event loop


# ------------------------------------------------------------------------------------------------
# The adapter
# ------------------------------------------------------------------------------------------------


class ProviderBackend:
    """The shared machinery; subclasses say how to talk to one provider API."""

    api: ClassVar[str] = ""
    plain_data: ClassVar[bool] = False  # events are plain data: lines (provider_stream's fast read)

    def __init__(
        self,
        backend: BackendConfig,
        model: ModelConfig,
        replica_name: str,
        *,
        budget: Budget | None = None,
        session: aiohttp.ClientSession | None = None,
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
        self._key = Secret(os.environ.get(self.cfg.api_key_env) if self.cfg.api_key_env else None)
        if self.cfg.api_key_env and self._key.reveal() is None:
            log.warning(
                "provider backend %s: environment variable %s is not set", backend.name, self.cfg.api_key_env
            )
        self.counter = tokens.load(model.tokenizer, self.cfg.api)
        self.budget: Budget = budget if budget is not None else get_budget(backend)
        self._session = session
        self.admission_wait_s = admission_wait_s
        self._flights: dict[str, list[Flight]] = {}
        # Connecting (a pooled connection or a new one) has its own clock; every read is bounded by
        # the first-token / between-token clocks below, the whole request by the first-token one.
        connect = self.cfg.connect_timeout_s
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect, sock_connect=connect)
        self.counts = ProviderCounters()
        self.prices = Prices.from_config(self.cfg)
        self.on_unsettled = on_unsettled  # (request, usage, cost) for streams ended without usage

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(backend={self.backend_name!r}, replica={self.replica!r}, url={self.base_url!r})"

    # -- what a subclass provides -----------------------------------------------------------------
    def _path(self, req: GenerateRequest) -> str:
        raise NotImplementedError

    def _body(self, req: GenerateRequest) -> JSONObject:
        raise NotImplementedError

    def _headers(self, req: GenerateRequest) -> dict[str, str]:
        raise NotImplementedError

    def _parser(self) -> Parser:
        """A parser fresh per request (it may hold stream state)."""
        raise NotImplementedError

    def _map_status(self, status: int, body: bytes, headers: Mapping[str, str]) -> ClusterError:
        raise NotImplementedError

    # -- the stream ------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """The stream as single chunks (see :meth:`generate_batches`)."""
        gen = self.generate_batches(req)
        try:
            async for batch in gen:
                for item in batch:
                    yield as_chunk(item, self.replica, self.backend_name)
        finally:
            await gen.aclose()

    def generate_batches(self, req: GenerateRequest) -> AsyncGenerator[list[Piece], None]:
        """The stream, one list of chunks per network read: what arrived together leaves together
        (the gateway writes each list to its client in one send), then its usage (settled)."""
        return self._stream(req, _as_is)

    def generate_framed(
        self, req: GenerateRequest, frame: Callable[[list[Piece]], bytes]
    ) -> AsyncGenerator[bytes, None]:
        """:meth:`generate_batches` with each list framed as it leaves (the gateway's
        :class:`cluster.wire.framing.ChunkFramer`): a chunk passes through no other frame."""
        return self._stream(req, frame)

    async def _stream(self, req: GenerateRequest, out: Callable[[list[Piece]], T]) -> AsyncGenerator[T, None]:
        """The stream, each network read's chunks as ``out`` makes them. One generator from the
        budget's seat to the settle: a read passes through no other frame."""
        loop = asyncio.get_running_loop()
        total_deadline = self._total_deadline(req, loop.time())
        flight = Flight(loop)
        self._flights.setdefault(req.request_id, []).append(flight)
        self.counts.started += 1
        s = StreamState(await self._estimate_input(req))
        res: Reservation | None = None
        try:
            wait = max(0.0, min(self.admission_wait_s, total_deadline - loop.time()))
            res = await self._reserve(req, s.input_est, wait)
            s.reserved = True
            sent_at = loop.time()  # the first-token clock starts now, not while we waited for budget
            first_deadline = min(total_deadline, sent_at + self.cfg.first_token_timeout_s)
            try:
                reader, content = await self._open(req, flight, s, first_deadline)
                between = self.cfg.between_tokens_timeout_s
                while not s.done:
                    deadline = min(total_deadline, s.last + between) if s.started else first_deadline
                    data = await flight.read(deadline, content)  # all that has arrived
                    if not data:
                        break
                    s.last = loop.time()
                    batch, failure = reader.read(data)
                    if batch:
                        yield out(batch)
                    if failure is not None:
                        raise failure
                if not s.done and (s.finish is None or self.api == "anthropic"):
                    raise perrors.truncated(backend=self.backend_name, started=s.started)
            except Aborted:
                yield out([self._aborted(s)])
                return
            except ClusterError:
                raise
            except (*ph.TRANSPORT_ERRORS, ValueError) as exc:
                raise self._broken(exc, s, loop.time() - (s.last if s.started else sent_at)) from exc
            yield out([await self._settle(s, res)])
        except ClusterError as err:
            self._count_error(err, req)
            raise
        finally:
            self._landed(req, flight)
            # One shielded task for both steps: a second cancellation while the connection closes
            # must not skip the release (the slot would be held until the reservation expires).
            await asyncio.shield(self._close(res, s.response, self._unsettled_release(req, s)))

    def _total_deadline(self, req: GenerateRequest, now: float) -> float:
        """The stream's end at the latest (loop time): the configured total, or the request's own."""
        total_deadline = now + self.cfg.total_timeout_s
        if req.deadline is not None:
            total_deadline = min(total_deadline, now + (req.deadline - time.time()))
        return total_deadline

    def _landed(self, req: GenerateRequest, flight: Flight) -> None:
        """The request's flight is over: ``abort`` no longer reaches it."""
        flight.stop()
        flights = self._flights.get(req.request_id, [])
        if flight in flights:
            flights.remove(flight)
        if not flights:
            self._flights.pop(req.request_id, None)

    async def _reserve(self, req: GenerateRequest, input_est: int, wait_s: float) -> Reservation:
        """The budget's seat for this request, waiting at most ``wait_s``; a 429 when there is none."""
        s = req.sampling
        out = reserved_output(s.max_tokens, input_est, self.cfg.tpm, req.max_tokens_asked, s.n)
        got = await self.budget.reserve(req.request_id, input_est, out, wait_s)
        if isinstance(got, Refusal):
            self.counts.budget_denied += 1
            raise RateLimited(
                f"provider backend '{self.backend_name}' is over its {got.reason} budget",
                retry_after_s=got.retry_after_s,
                backend=self.backend_name,
            )
        assert got is not None  # None is a tenant without a budget; a provider's budget limits every request
        return got

    async def _open(
        self, req: GenerateRequest, flight: Flight, s: StreamState, first_deadline: float
    ) -> tuple[ChunkReader, aiohttp.StreamReader]:
        """Send the request; its stream's reader, and the body to read (an error status raised)."""
        s.response = response = await self._send(req, flight, first_deadline)
        s.charged = s.input_est  # it reached the provider: it may bill the input
        if response.status != 200:
            body = await flight.timed(first_deadline, ph.read_capped(response))
            raise self._map_status(response.status, body, response.headers)
        reader = ChunkReader(
            s, self._parser(), self._stream_error, self.replica, self.backend_name, self.plain_data
        )
        s.last = asyncio.get_running_loop().time()
        return reader, response.content

    def _aborted(self, s: StreamState) -> Chunk:
        """The last chunk of a stream ``abort`` ended: what it had sent, estimated."""
        self.counts.aborted += 1
        usage = Usage(prompt_tokens=s.input_est, completion_tokens=self._count_out(s.out_parts))
        return Chunk(finish_reason="abort", usage=usage, replica=self.replica, backend=self.backend_name)

    def _broken(self, exc: BaseException, s: StreamState, waited: float) -> ClusterError:
        """A transport failure (or an unreadable stream) as the error to raise."""
        return perrors.from_transport(
            exc,
            backend=self.backend_name,
            started=s.started,
            waited_s=waited,
            connect_failed=ph.is_connect_failure(exc),
        )

    def _stream_error(self, error: JSONObject, started: bool) -> Exception:
        """A mid-stream error object from the provider, as the exception to raise."""
        secret = self._key.reveal()
        return perrors.from_stream_error(
            error, provider=self.api, backend=self.backend_name, started=started, secret=secret
        )

    async def _settle(self, s: StreamState, res: Reservation) -> Chunk:
        """Settle the budget with the provider's usage (ours where it reported none): the last chunk."""
        usage = s.usage
        if usage is None:
            self.counts.usage_estimated += 1
            usage = Usage(prompt_tokens=s.input_est, completion_tokens=self._count_out(s.out_parts))
        else:
            self.counts.observe_estimate(s.input_est, usage.prompt_tokens)
        await self.budget.settle(res, usage.total_tokens)
        cost = cost_usd(usage, self.prices)
        s.settled = True
        self.counts.settled(usage, cost)
        return Chunk(
            finish_reason=s.finish or "stop", usage=usage, replica=self.replica, backend=self.backend_name
        )

    def _unsettled_release(self, req: GenerateRequest, s: StreamState) -> int | None:
        """Tokens to charge when the budget's slot goes back without usage (None: nothing to release)."""
        if not s.reserved or s.settled:
            return None
        if not s.charged:
            return 0
        # It reached the provider: the input, and what came back, may be billed.
        out = self._count_out(s.out_parts)
        if s.response is not None and s.response.status == 200:
            self._count_unsettled(req, Usage(prompt_tokens=s.input_est, completion_tokens=out))
        return s.charged + out

    async def _close(
        self, res: Reservation | None, response: aiohttp.ClientResponse | None, release: int | None
    ) -> None:
        try:
            if response is not None:
                ph.close_response(response)
        finally:
            if release is not None and res is not None:
                await self.budget.settle(res, release)  # no usage came: charge what it spent

    def _count_unsettled(self, req: GenerateRequest, usage: Usage) -> None:
        """A stream that reached the provider and ended without its usage (cancelled by the client,
        lost a hedge, stalled, broke): the provider bills what it read and wrote, so we count it too
        (prompt tokens as sent, output tokens as received), apart from the settled totals."""
        cost = cost_usd(usage, self.prices)
        self.counts.unsettled(usage, cost)
        if self.on_unsettled is not None:
            try:
                self.on_unsettled(req, usage, cost)
            except Exception:  # metrics must never break the request's cleanup
                log.exception("provider backend %s: on_unsettled hook failed", self.backend_name)

    async def abort(self, request_id: str) -> None:
        for flight in list(self._flights.get(request_id, [])):
            flight.abort()

    def stats(self) -> BackendStats:
        budget = self.budget.snapshot_now()
        return BackendStats(
            replica=self.replica,
            backend=self.backend_name,
            kind="provider",
            running=sum(len(v) for v in self._flights.values()),
            waiting=int(budget.get("waiting", 0)),
            requests_started=self.counts.started,
            requests_finished=self.counts.finished,
            requests_aborted=self.counts.aborted,
            # Restarting a replica cannot fix a provider: failures show in the counters and breakers.
            healthy=True,
            extra=self._extra(budget),
        )

    def _extra(self, budget: JSONObject) -> JSONObject:
        """Flat numbers for metrics (plus the api and tokenizer names); absent rather than None."""
        extra: JSONObject = {
            "api": self.api,
            "tokenizer": self.counter.name,
            "tokenizer_exact": bool(self.counter.exact),
            **self.counts.extra(),
        }
        extra.update({f"budget_{k}": v for k, v in budget.items() if k != "waiting"})
        return {k: v for k, v in extra.items() if v is not None}

    def shutdown(self) -> None:
        """Nothing to free per adapter: the pooled client belongs to the process."""

    # -- internals --------------------------------------------------------------------------------
    async def _send(self, req: GenerateRequest, flight: Flight, deadline: float) -> aiohttp.ClientResponse:
        """POST the request; returns once the response headers are in (the body is still streaming)."""
        session = self._session or shared_session()
        headers = self._headers(req)
        headers["content-type"] = "application/json"
        sent = session.post(
            self.base_url + self._path(req),
            data=dumps(self._body(req)),
            headers=headers,
            timeout=self._timeout,
        )
        return await flight.timed(deadline, sent)

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

    def _count_out(self, parts: list[str | bytes]) -> int:
        return self.counter.count(joined_text(parts)) if parts else 0

    def _count_error(self, err: ClusterError, req: GenerateRequest) -> None:
        name = type(err).__name__
        auth = isinstance(err, ProviderAuthError)
        self.counts.error(name, auth=auth)
        if auth:
            log.error(
                "provider auth failed: backend=%s request=%s: %s", self.backend_name, req.request_id, err
            )
        else:
            log.warning(
                "provider error: backend=%s request=%s %s: %s", self.backend_name, req.request_id, name, err
            )


class OpenAIProviderBackend(ProviderBackend):
    """OpenAI and OpenAI-compatible servers: /chat/completions and /completions, SSE streams."""

    api = "openai"
    plain_data = True

    def _path(self, req: GenerateRequest) -> str:
        return openai_wire.endpoint(req)

    def _body(self, req: GenerateRequest) -> JSONObject:
        return openai_wire.request_body(req, self.upstream_model)

    def _headers(self, req: GenerateRequest) -> dict[str, str]:
        # OpenAI keeps X-Client-Request-Id with its logs: our id finds a request on their side too.
        h = {"accept": "text/event-stream", "x-client-request-id": req.request_id[:512]}
        key = self._key.reveal()
        if key:
            h["authorization"] = f"Bearer {key}"
        return h

    def _parser(self) -> Parser:
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

    def _body(self, req: GenerateRequest) -> JSONObject:
        return anthropic_wire.request_body(req, self.upstream_model)

    def _headers(self, req: GenerateRequest) -> dict[str, str]:
        h = {"accept": "text/event-stream", "anthropic-version": anthropic_wire.API_VERSION}
        key = self._key.reveal()
        if key:
            h["x-api-key"] = key
        return h

    def _parser(self) -> Parser:
        state = anthropic_wire.StreamState()

        def parse(ev: SSEEvent) -> StreamDelta:
            return state.on_event(ev.event, ev.data)

        return parse

    def _map_status(self, status: int, body: bytes, headers: Mapping[str, str]) -> ClusterError:
        return perrors.from_anthropic_status(
            status, body, headers, backend=self.backend_name, secret=self._key.reveal()
        )


def build_provider_backend(
    backend: BackendConfig,
    model: ModelConfig,
    replica_name: str,
    *,
    budget: Budget | None = None,
    session: aiohttp.ClientSession | None = None,
    admission_wait_s: float = 0.0,
    on_unsettled: Callable[[GenerateRequest, Usage, float], None] | None = None,
) -> OpenAIProviderBackend | AnthropicProviderBackend:
    """The adapter for ``backend.provider.api`` (the keywords: :class:`ProviderBackend`'s)."""
    if backend.provider is None:
        raise ValueError(f"backend '{backend.name}' has no provider section")
    cls = AnthropicProviderBackend if backend.provider.api == "anthropic" else OpenAIProviderBackend
    return cls(
        backend,
        model,
        replica_name,
        budget=budget,
        session=session,
        admission_wait_s=admission_wait_s,
        on_unsettled=on_unsettled,
    )
