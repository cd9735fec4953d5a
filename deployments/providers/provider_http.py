"""The provider adapters' HTTP side: one pooled aiohttp session per event loop, the key that hides
itself, and the clock that bounds every await of a request (and that ``abort`` fires early).

Kept apart from the adapters (``deployments/providers/providers.py``) because none of it knows a provider's
wire format: it is how a request reaches the network and how it is stopped.

aiohttp is called directly: httpx's own pool cost O(connections) per request, and its API over
aiohttp's pool (``httpx-aiohttp``) still cost a fifth of the gateway's CPU per streamed request on
the relay benchmark (building the request, URL parsing, header merging, two stream wrappers).
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import Awaitable
from typing import TypeVar

import aiohttp

T = TypeVar("T")
MAX_ERROR_BODY = 64 * 1024

# aiohttp sessions are bound to the loop that made them: one per loop.
_SESSIONS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
    weakref.WeakKeyDictionary()
)

# What a failure of the network (not of the provider's answer) looks like from aiohttp.
TRANSPORT_ERRORS = (aiohttp.ClientError, OSError, TimeoutError)


def shared_session() -> aiohttp.ClientSession:
    """This loop's pooled session. It keeps no cookies: every tenant's requests go through it, so a
    provider's ``Set-Cookie`` on one answer must not ride along on everyone's next request."""
    loop = asyncio.get_running_loop()
    session = _SESSIONS.get(loop)
    if session is None or session.closed:
        connector = aiohttp.TCPConnector(
            limit=2048, limit_per_host=0, keepalive_timeout=30.0, enable_cleanup_closed=True
        )
        session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None),  # per request, from the provider config
            trust_env=False,
            auto_decompress=True,
        )
        _SESSIONS[loop] = session
    return session


async def aclose_shared_session() -> None:
    """Close this loop's pooled session (tests, shutdown); the next request opens a new one."""
    session = _SESSIONS.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


def is_connect_failure(exc: BaseException) -> bool:
    """The request never reached the provider: no connection could be opened (refused, timed out)."""
    return isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)


def close_response(response: aiohttp.ClientResponse) -> None:
    """A whole answer gives its connection back to the pool; one cut short closes it, which is how
    the provider learns to stop generating (and billing)."""
    if response.content.at_eof():
        response.release()
    else:
        response.close()


class Secret:
    """An API key that never shows itself in a repr, a log line or a traceback's locals."""

    __slots__ = ("_value",)

    def __init__(self, value: str | None) -> None:
        self._value = value or None

    def reveal(self) -> str | None:
        return self._value

    def __repr__(self) -> str:
        return "<secret>" if self._value else "<no secret>"

    __str__ = __repr__


class Aborted(Exception):
    pass


class Flight:
    """One request in flight: what ``abort`` needs to reach it, and the clock of its stream's reads.

    Before the stream, each await has its own ``asyncio.timeout`` (:meth:`timed`). The stream's
    reads, one per chunk, share one timer (:meth:`read`): a read only stamps its deadline; the
    timer, armed at the first, is re-armed when it comes due early, and when a deadline has passed
    (or on ``abort``) it ends the stream by setting the error on the response's reader, which the
    pending or next read raises (no task is cancelled). A timer per read (``asyncio.timeout_at``:
    a handle pushed on the loop's heap then cancelled, the task looked up, a context entered) was
    a tenth of a gateway's CPU relaying 256 provider streams (py-spy, issue 44).
    """

    __slots__ = ("_at", "_content", "_timer", "aborted", "due", "loop", "timeout")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.aborted = False
        self.loop = loop
        self.timeout: asyncio.Timeout | None = None
        self.due = 0.0  # loop time by which the stream's pending (or next) read must end
        self._content: aiohttp.StreamReader | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0  # when the timer fires

    def abort(self) -> None:
        self.aborted = True
        cm = self.timeout
        if cm is not None:  # fire the pending read's timeout now: it notices ``aborted``
            self.loop.call_soon_threadsafe(
                lambda: cm.reschedule(self.loop.time()) if not cm.expired() else None
            )
        elif self._content is not None:  # the stream's reads: the pending one raises Aborted
            self.loop.call_soon_threadsafe(self._end)

    def read(self, deadline: float, content: aiohttp.StreamReader) -> Awaitable[bytes]:
        """``content.readany()`` by ``deadline`` (loop time; TimeoutError past it); ``abort``
        ends it early (Aborted). A plain call returning the read's awaitable: no frame of its own
        on the token path."""
        if self.aborted:
            raise Aborted
        self.due = deadline
        if self._timer is None or self._at > deadline:
            self._content = content
            self._arm(deadline)
        return content.readany()

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = at
        self._timer = self.loop.call_at(at, self._check)

    def _check(self) -> None:
        self._timer = None
        if self.loop.time() < self.due:
            self._arm(self.due)
        else:
            self._end()

    def _end(self) -> None:
        if self._content is not None:
            self._content.set_exception(Aborted() if self.aborted else TimeoutError())

    def stop(self) -> None:
        """The stream is over: its timer goes."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._content = None

    async def timed(self, deadline: float, aw: Awaitable[T]) -> T:
        """Await ``aw`` until ``deadline`` (loop time); ``abort`` fires the same timeout early."""
        if self.aborted:
            if inspect.iscoroutine(aw) or hasattr(aw, "close"):  # a coroutine, or aiohttp's request
                aw.close()
            raise Aborted
        try:
            async with asyncio.timeout_at(deadline) as cm:
                self.timeout = cm
                return await aw
        except TimeoutError:
            if self.aborted:
                raise Aborted from None
            raise
        finally:
            self.timeout = None


async def read_capped(response: aiohttp.ClientResponse) -> bytes:
    """An error body, at most MAX_ERROR_BODY bytes of it."""
    buf = bytearray()
    while len(buf) < MAX_ERROR_BODY and (part := await response.content.readany()):
        buf += part
    return bytes(buf[:MAX_ERROR_BODY])
