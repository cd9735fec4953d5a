"""Errors typed by what the caller should do about them.

Every error carries the HTTP status and OpenAI error fields it maps to at our API, and the
action the router takes. They pickle across Ray processes (``__reduce__`` rebuilds them from
their fields; the default pickling of exceptions loses keyword arguments).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from cluster.json_types import JSONObject


class Action(StrEnum):
    RETRY_ELSEWHERE = "retry_elsewhere"  # another replica/backend may serve it (before the first token)
    CLIENT = "client"  # the request itself is wrong: never retried
    FATAL = "fatal"  # our side is broken (bad config, bad provider key): alert, do not retry


class ClusterError(Exception):
    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None
    action: Action = Action.FATAL

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        code: str | None = None,
        error_type: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status_code is not None:
            self.status_code = status_code
        if code is not None:
            self.code = code
        if error_type is not None:
            self.error_type = error_type
        self.param = param
        self.retry_after_s = retry_after_s
        self.backend = backend

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {
            "status_code": self.status_code,
            "code": self.code,
            "error_type": self.error_type,
            "param": self.param,
            "retry_after_s": self.retry_after_s,
            "backend": self.backend,
        }
        return (_rebuild, (type(self), self.message, kwargs))

    def to_openai(self) -> JSONObject:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(max(1, round(self.retry_after_s + 0.499)))}


def _rebuild(cls: type[ClusterError], message: str, kwargs: JSONObject) -> ClusterError:
    return cls(message, **kwargs)


class InvalidRequest(ClusterError):
    status_code = 400
    error_type = "invalid_request_error"
    action = Action.CLIENT


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(ClusterError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"
    action = Action.CLIENT


class NotFound(ClusterError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"
    action = Action.CLIENT


class PayloadTooLarge(ClusterError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"
    action = Action.CLIENT


class RequestTimeout(ClusterError):
    """The client did not send its whole request in time (``server.body_timeout_s``)."""

    status_code = 408
    error_type = "invalid_request_error"
    code = "request_timeout"
    action = Action.CLIENT


class RateLimited(ClusterError):
    """Over a limit (ours or a provider's): try elsewhere or later, see ``retry_after_s``."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"
    action = Action.RETRY_ELSEWHERE


class Overloaded(ClusterError):
    """The whole cluster (or a provider, as Anthropic's 529) is saturated."""

    status_code = 503
    error_type = "overloaded_error"
    code = "overloaded"
    action = Action.RETRY_ELSEWHERE


class NoCapacity(Overloaded):
    """No replica of the backend can take a request (every one dead, draining, unhealthy or
    unreachable) and no other candidate could: ``retry_after_s`` estimates a replacement's start.
    Not a breaker failure: the replicas that come back are healthy."""

    code = "no_capacity"


ENGINE_DEAD_CODE = "engine_dead"  # the replica's engine died: the request never ran, pick another


class BackendUnavailable(ClusterError):
    """Connect error, 5xx, timeout or a dead replica: another candidate may serve it."""

    status_code = 502
    error_type = "server_error"
    code = "backend_unavailable"
    action = Action.RETRY_ELSEWHERE


class UpstreamTimeout(BackendUnavailable):
    status_code = 504
    code = "upstream_timeout"


class ProviderAuthError(ClusterError):
    """A provider refused our key: our configuration's fault, not the client's."""

    status_code = 502
    error_type = "server_error"
    code = "provider_auth_failed"
    action = Action.FATAL


class StreamInterrupted(ClusterError):
    """The stream broke after tokens reached the client: ends it with an error event."""

    status_code = 502
    error_type = "server_error"
    code = "stream_interrupted"
    action = Action.FATAL


def _subclasses(cls: type[ClusterError]) -> dict[str, type[ClusterError]]:
    out = {cls.__name__: cls}
    for sub in cls.__subclasses__():
        out.update(_subclasses(sub))
    return out


def to_wire(err: ClusterError) -> JSONObject:
    """The error as JSON, to cross an HTTP hop between our own processes (engine → gateway)."""
    _, (_, message, kwargs) = err.__reduce__()
    return {"class": type(err).__name__, "message": message, **kwargs}


def from_wire(d: JSONObject) -> ClusterError:
    """The typed error back from :func:`to_wire` (an unknown class name: a plain ClusterError)."""
    d = dict(d)
    cls = _subclasses(ClusterError).get(str(d.pop("class", "")), ClusterError)
    message = str(d.pop("message", "error"))
    return cls(message, **d)
