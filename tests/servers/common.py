"""What the loopback provider servers share: fault specs, counters, the aiohttp runner.

A fault spec is a comma-separated list of ``name[:value]`` items, e.g. ``"slow_first:2,delay:0.01"``:

=================  ==============================================================================
``429[:s]``        429 with ``retry-after: s`` (default 1) and the provider's rate-limit error body
``400`` ``401``    that HTTP status with the provider's error body (any of 400 401 403 404 408 413
``500`` ``529``    422 429 500 502 503 504 529)
``hang``           accept the request, never send a byte (until the client goes away)
``slow_first:s``   send the headers and the stream's opening event, wait s seconds before the
                   first content token
``stall:n``        n content tokens, then silence with the connection kept open
``malformed:n``    n content tokens, then a data line that is not JSON, then the end
``error_event:n``  n content tokens, then the provider's mid-stream error event, then the end
``drop:n``         n content tokens, then the TCP connection is closed mid-body
``no_done``        a complete answer without the end marker (``[DONE]`` / ``message_stop``)
``no_usage``       (OpenAI) no usage chunk even when ``stream_options.include_usage`` asks for it
``echo_key``       a 400 whose message repeats the API key the request carried (a leak test)
``tokens:n``       answer with n tokens (capped by the request's max tokens)
``delay:s``        s seconds between tokens
``linger:s``       after the last byte, the handler waits s seconds before it returns (the window
                   in which a finished client still sees the request in flight: ``wait_settled``)
=================  ==============================================================================

A request's fault is chosen, first match wins, by: the ``x-test-fault`` header; a ``+spec``
suffix on the model name (``gpt-4o+stall:3``); the next queued spec (``push_faults`` in process, or
``POST /_control/faults {"faults": [...]}``); the default (``default_fault`` or ``{"default": ...}``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

STATUSES = {400, 401, 403, 404, 408, 413, 422, 429, 500, 502, 503, 504, 529}
WORDS = [" alpha", " beta", " gamma", " delta", " epsilon", " zeta", " eta", " theta"]
FIRST_WORD = "Hello"
FOREVER_S = 3600.0


@dataclass
class Fault:
    status: int | None = None
    retry_after: float = 1.0
    hang: bool = False
    slow_first_s: float = 0.0
    stall_after: int | None = None
    malformed_after: int | None = None
    error_after: int | None = None
    drop_after: int | None = None
    no_done: bool = False
    no_usage: bool = False
    echo_key: bool = False
    tokens: int | None = None
    delay_s: float | None = None
    linger_s: float = 0.0
    spec: str = ""

    def mid_stream(self, i: int) -> str | None:
        """The mid-stream fault due before content token ``i`` (0-based), if any."""
        for name in ("stall", "malformed", "error", "drop"):
            after = getattr(self, f"{name}_after")
            if after is not None and i >= after:
                return name
        return None


def parse_fault(spec: str | None) -> Fault:
    f = Fault(spec=spec or "")
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        name, _, value = item.partition(":")
        if name.isdigit() and int(name) in STATUSES:
            f.status = int(name)
            if value:
                f.retry_after = float(value)
        elif name == "hang":
            f.hang = True
        elif name == "slow_first":
            f.slow_first_s = float(value or 1.0)
        elif name in ("stall", "malformed", "drop"):
            setattr(f, f"{name}_after", int(value or 0))
        elif name in ("error_event", "error"):
            f.error_after = int(value or 0)
        elif name in ("no_done", "no_usage", "echo_key"):
            setattr(f, name, True)
        elif name == "tokens":
            f.tokens = int(value)
        elif name == "delay":
            f.delay_s = float(value)
        elif name == "linger":
            f.linger_s = float(value or 0.2)
        else:
            raise ValueError(f"unknown fault {item!r}")
    return f


@dataclass
class RequestRecord:
    id: str
    path: str
    model: str = ""
    stream: bool = False
    fault: str = ""
    client_request_id: str | None = None  # the x-client-request-id header, when sent
    t_start: float = 0.0
    t_end: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, read from the server's prompt cache
    cache_write_tokens: int = 0  # of prompt_tokens, written to it (Anthropic's cache_creation)
    outcome: str = "running"  # ok, status:<n>, disconnect, dropped, stalled, error_event, malformed
    body: Any = None  # the request body as received (JSON), for field-by-field checks


@dataclass
class ServerStats:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    disconnects: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    auth_failures: int = 0
    records: list[RequestRecord] = field(default_factory=list)


def count_prompt_tokens(texts: list[str]) -> int:
    """The servers' own count (not any real tokenizer): ceil(chars/4) + 3 per message, + 3."""
    return sum(math.ceil(len(t) / 4) + 3 for t in texts) + 3


def answer_tokens(n: int, stop: list[str]) -> tuple[list[str], str | None]:
    """Deterministic output: n tokens, cut before a stop sequence. Returns (tokens, matched stop)."""
    out: list[str] = []
    text = ""
    for i in range(n):
        tok = FIRST_WORD if i == 0 else WORDS[(i - 1) % len(WORDS)]
        for s in stop:
            at = (text + tok).find(s)
            if s and at >= 0:
                cut = (text + tok)[len(text) : at] if at >= len(text) else ""
                if cut:
                    out.append(cut)
                return out, s
        out.append(tok)
        text += tok
    return out, None


def sse(data: Any, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


class LoopbackServer:
    """A provider server on 127.0.0.1 in a background thread (or the foreground: ``serve``)."""

    name = "loopback"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        api_key: str | None = None,
        output_tokens: int = 16,
        token_delay_s: float = 0.0,
        default_fault: str | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.api_key = api_key
        self.output_tokens = output_tokens
        self.token_delay_s = token_delay_s
        self.default_fault = default_fault
        # (spec, share, seed): a seeded draw gives that share of requests the spec (when no header,
        # queued fault or default fault applies), e.g. ("slow_first:0.5", 0.05, 7) for a slow tail.
        self.random_fault: tuple[str, float] | None = None
        self._rng = random.Random(0)
        self._queue: deque[str] = deque()
        self._lock = threading.Lock()
        # Notified whenever a request's bookkeeping ends: a client can read the last byte before
        # the server's handler has returned and run ``end`` (see ``wait_settled``).
        self._settled = threading.Condition(self._lock)
        self._stats = ServerStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> LoopbackServer:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start_site())
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup() if self._runner else asyncio.sleep(0))
            loop.close()

        self._thread = threading.Thread(target=run, name=f"{self.name}-server", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = self._thread = None

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _start_site(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        self.add_routes(app)
        app.router.add_get("/_control/stats", self._h_stats)
        app.router.add_post("/_control/reset", self._h_reset)
        app.router.add_post("/_control/faults", self._h_faults)
        # handler_cancellation: a client that goes away cancels its handler, which is how we see it.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock, backlog=1024).start()

    async def serve(self) -> None:
        """Run in the foreground until cancelled (the standalone process)."""
        await self._start_site()
        print(f"{self.name} server listening on {self.base_url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            if self._runner:
                await self._runner.cleanup()

    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    # -- faults and counters (thread-safe: tests read them from another thread) ---------------------
    def push_faults(self, *specs: str) -> None:
        for s in specs:
            parse_fault(s)  # a typo fails in the test, not in the handler
        with self._lock:
            self._queue.extend(specs)

    def reset(self) -> None:
        with self._lock:
            self._stats = ServerStats()
            self._queue.clear()

    def stats(self) -> ServerStats:
        with self._lock:
            s = self._stats
            return ServerStats(**{**asdict(s), "records": [RequestRecord(**asdict(r)) for r in s.records]})

    def wait_settled(self, timeout_s: float = 5.0) -> ServerStats:
        """The stats once no request is in flight (or after ``timeout_s``, whatever they are then).

        A streamed answer's last byte reaches the client before the handler that wrote it returns
        and runs its bookkeeping, so right after a client finishes, ``stats().in_flight`` can still
        count it. Tests that check the count after their calls end read it through this."""
        with self._settled:
            self._settled.wait_for(lambda: self._stats.in_flight == 0, timeout_s)
        return self.stats()

    def select_fault(self, request: web.Request, model: str) -> tuple[str, Fault]:
        spec = request.headers.get("x-test-fault")
        base, plus, suffix = model.partition("+")
        if spec is None and plus:
            spec = suffix
        if spec is None:
            with self._lock:
                spec = self._queue.popleft() if self._queue else self.default_fault
                if spec is None and self.random_fault is not None:
                    rare, share = self.random_fault
                    spec = rare if self._rng.random() < share else None
        return base, parse_fault(spec)

    def set_random_fault(self, spec: str | None, share: float = 0.0, seed: int = 0) -> None:
        """Give a seeded ``share`` of later requests the fault ``spec`` (None: none)."""
        if spec is not None:
            parse_fault(spec)
        with self._lock:
            self.random_fault = None if spec is None else (spec, share)
            self._rng = random.Random(seed)

    def begin(self, request: web.Request, path: str) -> RequestRecord:
        rec = RequestRecord(
            id=uuid.uuid4().hex[:16],
            path=path,
            client_request_id=request.headers.get("x-client-request-id"),
            t_start=time.monotonic(),
        )
        with self._lock:
            s = self._stats
            s.requests += 1
            s.in_flight += 1
            s.max_in_flight = max(s.max_in_flight, s.in_flight)
            s.records.append(rec)
        return rec

    def end(self, rec: RequestRecord, outcome: str | None = None) -> None:
        with self._lock:
            s = self._stats
            s.in_flight -= 1
            if outcome is not None:
                rec.outcome = outcome
            elif rec.outcome == "running":
                rec.outcome = "ok"
            if rec.outcome == "disconnect":
                s.disconnects += 1
            if rec.outcome == "status:401":
                s.auth_failures += 1
            rec.t_end = time.monotonic()
            s.prompt_tokens += rec.prompt_tokens
            s.completion_tokens += rec.completion_tokens
            self._settled.notify_all()

    async def pace(self, fault: Fault) -> None:
        delay = self.token_delay_s if fault.delay_s is None else fault.delay_s
        if delay > 0:
            await asyncio.sleep(delay)

    @staticmethod
    def drop(request: web.Request) -> None:
        if request.transport is not None:
            request.transport.close()

    # -- what every API's handler shares ----------------------------------------------------------
    def _fault_status(self, rec: RequestRecord, fault: Fault) -> web.Response:
        """The API's own error answer for a ``status`` fault."""
        raise NotImplementedError

    async def _mid_stream_fault(
        self, request: web.Request, resp: web.StreamResponse, rec: RequestRecord, kind: str
    ) -> web.StreamResponse:
        """End a started stream the way ``kind`` says: stall, a malformed or an error event, a drop."""
        if kind == "stall":
            rec.outcome = "stalled"
            await asyncio.sleep(FOREVER_S)
        elif kind == "malformed":
            rec.outcome = "malformed"
            await resp.write(self.malformed_event())
        elif kind == "error":
            rec.outcome = "error_event"
            await resp.write(self.error_event())
        elif kind == "drop":
            rec.outcome = "dropped"
            await asyncio.sleep(0.05)  # let the tokens already written reach the client first
            self.drop(request)
            return resp
        await resp.write_eof()
        return resp

    def malformed_event(self) -> bytes:
        """A stream event cut in the middle of its JSON, in the API's framing."""
        raise NotImplementedError

    def error_event(self) -> bytes:
        """A mid-stream error event, as the API sends one."""
        raise NotImplementedError

    async def early_fault(
        self, request: web.Request, rec: RequestRecord, body: dict[str, Any], echo_key: Any
    ) -> tuple[Fault, web.StreamResponse | None]:
        """The request's fault, and its answer when the fault answers before any token: a hang, an
        echoed key (``echo_key()`` makes that answer), a status. Records the model and the fault."""
        model, fault = self.select_fault(request, body["model"])
        rec.model, rec.fault, rec.stream = model, fault.spec, bool(body.get("stream"))
        if fault.hang:
            rec.outcome = "stalled"
            await asyncio.sleep(FOREVER_S)
        if fault.echo_key:
            return fault, echo_key()
        if fault.status is not None:
            return fault, self._fault_status(rec, fault)
        return fault, None

    async def stream_tokens(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        rec: RequestRecord,
        fault: Fault,
        tokens: list[str],
        event: Any,
    ) -> web.StreamResponse | None:
        """Write each token as ``event(token)`` at the fault's pace, after its slow first token; the
        response when a mid-stream fault ended the stream there, else None."""
        if fault.slow_first_s:
            await asyncio.sleep(fault.slow_first_s)
        for i, tok in enumerate(tokens):
            mid = fault.mid_stream(i)
            if mid is not None:
                return await self._mid_stream_fault(request, resp, rec, mid)
            await resp.write(event(tok))
            rec.completion_tokens += 1
            await self.pace(fault)
        end = fault.mid_stream(len(tokens))
        if end is not None:
            return await self._mid_stream_fault(request, resp, rec, end)
        return None

    async def run_handler(self, request: web.Request, path: str, body_handler: Any) -> web.StreamResponse:
        """Bookkeeping around one request: counts, in-flight, and disconnects (cancellation or a
        failed write both mean the client went away before we were done)."""
        rec = self.begin(request, path)
        try:
            response = await body_handler(request, rec)
            linger = parse_fault(rec.fault).linger_s
            if linger:  # held open even if the client has already closed the connection
                loop = asyncio.get_running_loop()
                end = loop.time() + linger
                while (left := end - loop.time()) > 0:
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.sleep(left)
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            if rec.outcome in ("running", "stalled"):
                rec.outcome = "disconnect"
            raise
        finally:
            self.end(rec)

    # -- control endpoints ------------------------------------------------------------------------
    async def _h_stats(self, request: web.Request) -> web.Response:
        return web.json_response(asdict(self.stats()))

    async def _h_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"ok": True})

    async def _h_faults(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            self.push_faults(*body.get("faults", []))
            if "default" in body:
                parse_fault(body["default"])
                self.default_fault = body["default"]
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"ok": True, "queued": len(self._queue)})


def main(server_cls: type[LoopbackServer], argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=f"A loopback {server_cls.name} provider server for tests.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback only)")
    p.add_argument("--port", type=int, default=0, help="port (0: a free one, printed on start)")
    p.add_argument("--api-key-env", default=None, help="require the key held in this environment variable")
    p.add_argument("--output-tokens", type=int, default=16, help="tokens per answer (capped by max_tokens)")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds between tokens")
    p.add_argument("--fault", default=None, help="default fault spec for every request")
    args = p.parse_args(argv)
    server = server_cls(
        args.host,
        args.port,
        api_key=os.environ.get(args.api_key_env) if args.api_key_env else None,
        output_tokens=args.output_tokens,
        token_delay_s=args.token_delay,
        default_fault=args.fault,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(server.serve())
