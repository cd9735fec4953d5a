"""Provider failures -> :mod:`cluster.wire.errors` types: the one mapping per adapter.

What the router should do decides the type: a 429 or Anthropic's 529 is a quota or load signal
(try elsewhere, cool down, honour ``retry-after``); 5xx, connect errors and timeouts are the
upstream's trouble (retry elsewhere); 400/404/413/422 are the client's fault and pass through with
the provider's own message; 401/403 mean our key is wrong (a 502 that names the backend, never the
provider's text, which may echo part of the key). Once content has reached the client any failure
is a :class:`StreamInterrupted`: switching backends mid-answer would garble it.

Callers ``raise mapped from exc`` so the original stays on ``__cause__`` for debugging.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping

import httpx

from cluster.json_types import JSONObject
from cluster.providers import anthropic_wire, openai_wire
from cluster.providers.sse import SSEError
from cluster.wire.errors import (
    BackendUnavailable,
    ClusterError,
    ContextLengthExceeded,
    InvalidRequest,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    ProviderAuthError,
    RateLimited,
    StreamInterrupted,
    UpstreamTimeout,
)

MAX_MESSAGE_CHARS = 2000

# Anthropic error types, as its docs list them, and the HTTP status each comes with.
ANTHROPIC_ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


def retry_after_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds from ``retry-after-ms`` or ``retry-after`` (seconds or an HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def scrub(text: str, secret: str | None) -> str:
    """Never let a key travel in a message, whatever the provider echoed."""
    if secret and secret in text:
        text = text.replace(secret, "[redacted]")
    return text[:MAX_MESSAGE_CHARS]


def _from_status(
    status: int,
    err: JSONObject,
    headers: Mapping[str, str],
    *,
    backend: str,
    provider: str,
    secret: str | None,
) -> ClusterError:
    raw_message = str(err.get("message") or "")
    message = scrub(raw_message, secret) or f"HTTP {status} from the provider"
    param = err.get("param") if isinstance(err.get("param"), str) else None
    code = err.get("code") if isinstance(err.get("code"), str) else None
    kind = str(err.get("type") or code or "")
    if status in (401, 403) or code == "insufficient_quota" or status == 402:
        what = "has no quota left" if status in (402, 429) else "rejected its API key"
        return ProviderAuthError(
            f"provider backend '{backend}' ({provider}) {what} (HTTP {status}); "
            "check the key and the account configured for it",
            backend=backend,
        )
    if status == 429:
        return RateLimited(
            f"provider backend '{backend}' is rate limited ({kind or 'rate limit'})",
            retry_after_s=retry_after_s(headers),
            backend=backend,
        )
    if status == 529:
        return Overloaded(
            f"provider backend '{backend}' is overloaded",
            retry_after_s=retry_after_s(headers),
            backend=backend,
        )
    if status in (408, 504):
        return UpstreamTimeout(f"provider backend '{backend}' timed out (HTTP {status})", backend=backend)
    if status >= 500:
        return BackendUnavailable(
            f"provider backend '{backend}' failed (HTTP {status}{', ' + kind if kind else ''})",
            retry_after_s=retry_after_s(headers),
            backend=backend,
        )
    if status == 404:
        return NotFound(message, backend=backend)
    if status == 413:
        return PayloadTooLarge(message, backend=backend)
    if code == "context_length_exceeded" or "prompt is too long" in raw_message:
        return ContextLengthExceeded(message, param=param, backend=backend)
    return InvalidRequest(
        message, status_code=422 if status == 422 else 400, param=param, code=code, backend=backend
    )


def from_openai_status(
    status: int, body: bytes, headers: Mapping[str, str], *, backend: str, secret: str | None = None
) -> ClusterError:
    return _from_status(
        status, openai_wire.error_fields(body), headers, backend=backend, provider="openai", secret=secret
    )


def from_anthropic_status(
    status: int, body: bytes, headers: Mapping[str, str], *, backend: str, secret: str | None = None
) -> ClusterError:
    err = anthropic_wire.error_fields(body)
    return _from_status(status, err, headers, backend=backend, provider="anthropic", secret=secret)


def from_stream_error(
    err: JSONObject, *, provider: str, backend: str, started: bool, secret: str | None = None
) -> ClusterError:
    """An error event inside a 200 stream: before content it is mapped like the HTTP status its type
    stands for; after content it ends the stream."""
    kind = str(err.get("type") or err.get("code") or "error")
    if started:
        return StreamInterrupted(
            f"provider backend '{backend}' ended the stream with an error ({kind})", backend=backend
        )
    if provider == "anthropic":
        status = ANTHROPIC_ERROR_STATUS.get(kind, 500)
    elif kind in ("rate_limit_exceeded", "requests", "tokens", "rate_limit_error"):
        status = 429
    elif kind == "invalid_request_error":
        status = 400
    else:
        status = 500
    return _from_status(status, err, {}, backend=backend, provider=provider, secret=secret)


def from_transport(
    exc: BaseException,
    *,
    backend: str,
    started: bool,
    waited_s: float | None = None,
    connect_failed: bool = False,
) -> ClusterError:
    """Transport failures (aiohttp's, httpx's, asyncio's): connect errors, timeouts, dropped
    connections, malformed streams. ``connect_failed``: the HTTP client says no connection was opened
    (the caller knows its client's exception types; httpx's are recognised here)."""
    name = type(exc).__name__
    timed_out = isinstance(exc, TimeoutError | httpx.TimeoutException)
    if started:
        why = f"stalled for {waited_s:.1f}s" if timed_out and waited_s is not None else f"broke off ({name})"
        return StreamInterrupted(f"provider backend '{backend}' stream {why}", backend=backend)
    connecting = connect_failed or isinstance(
        exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout
    )
    if connecting and timed_out:
        return UpstreamTimeout(f"provider backend '{backend}': connect timed out ({name})", backend=backend)
    if timed_out:
        after = f" after {waited_s:.1f}s" if waited_s is not None else ""
        return UpstreamTimeout(f"provider backend '{backend}': no first token{after}", backend=backend)
    if connecting:
        return BackendUnavailable(f"provider backend '{backend}': cannot connect ({name})", backend=backend)
    if isinstance(exc, SSEError | ValueError):
        return BackendUnavailable(f"provider backend '{backend}': malformed stream ({name})", backend=backend)
    return BackendUnavailable(f"provider backend '{backend}': connection failed ({name})", backend=backend)


def truncated(*, backend: str, started: bool) -> ClusterError:
    """The stream ended without the provider's end marker."""
    if started:
        return StreamInterrupted(f"provider backend '{backend}' stream ended early", backend=backend)
    return BackendUnavailable(
        f"provider backend '{backend}' closed the stream before any content", backend=backend
    )
