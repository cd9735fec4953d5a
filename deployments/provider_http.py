"""The provider adapters' HTTP side: one pooled client per event loop, the key that hides itself, and
the clock that bounds every await of a request (and that ``abort`` fires early).

Kept apart from the adapters (``deployments/providers.py``) because none of it knows a provider's
wire format: it is how a request reaches the network and how it is stopped.
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import Awaitable
from typing import TypeVar

import httpx
from httpx_aiohttp import AiohttpTransport

T = TypeVar("T")
MAX_ERROR_BODY = 64 * 1024

# httpx clients are bound to the loop that first used them: one per loop.
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

    async def timed(self, deadline: float, aw: Awaitable[T]) -> T:
        """Await ``aw`` until ``deadline`` (loop time); ``abort`` fires the same timeout early."""
        if self.aborted:
            if inspect.iscoroutine(aw):
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


async def read_capped(response: httpx.Response) -> bytes:
    """An error body, at most MAX_ERROR_BODY bytes of it."""
    buf = bytearray()
    async for part in response.aiter_bytes():
        buf += part
        if len(buf) >= MAX_ERROR_BODY:
            break
    return bytes(buf[:MAX_ERROR_BODY])
