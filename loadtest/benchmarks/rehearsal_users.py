"""The rehearsal's Locust users (``loadtest/benchmarks/rehearsal.py`` runs them in the lab's client
namespace): the project's per-surface users (``loadtest/locustfile.py``: Tab, Chat, Agent, their request
shapes, think times and Tab's cancels; without ``ignore_eos``, which only engines honour), each request
also written as one JSON line to ``LLMC_REHEARSAL_RECORDS`` (wall-clock start and end, surface,
TTFT, the locustfile's error type and the error's code, type and message, whether the client
cancelled, the answering gateway, backend and replica, the race's attempts and whether a hedge won,
the Server-Timing header, prompt and cached tokens), so that outcomes can be
set beside the schedule's events.

Requests are spread over the Serve addresses listed in ``LLMC_REHEARSAL_ENDPOINTS`` (a file, one
base URL a line, re-read when it changes), as a Kubernetes Service spreads them over its ready pods:
the rehearsal drops a node's address while the node is lost.

    locust -f loadtest/benchmarks/rehearsal_users.py --headless -u 10 -r 10 -t 10m --host http://10.213.0.10:8000
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from loadtest import locustfile as lf

_LOCK = threading.Lock()
_OUT = os.environ.get("LLMC_REHEARSAL_RECORDS", "")
_ENDPOINTS = Path(os.environ.get("LLMC_REHEARSAL_ENDPOINTS", "/nonexistent"))
_seen: dict[str, Any] = {"mtime": None, "urls": []}
# the gateway's answer: who served it and the race to its first token, as a record's fields
HEADERS = {
    "replica": "x-llmc-replica",
    "backend": "x-llmc-backend",
    "gateway": "x-llmc-gateway",
    "attempts": "x-llmc-attempts",
    "hedge_won": "x-llmc-hedge-won",
    "timing": "server-timing",
}


def endpoints() -> list[str]:
    """The Serve addresses to send to now (empty: the user's ``--host``)."""
    try:
        mtime = _ENDPOINTS.stat().st_mtime_ns
    except OSError:
        return []
    if mtime != _seen["mtime"]:
        _seen["urls"] = [u.strip() for u in _ENDPOINTS.read_text().splitlines() if u.strip()]
        _seen["mtime"] = mtime
    return _seen["urls"]


def _usage(raw: bytes) -> dict[str, Any]:
    """The last non-null ``usage`` of a stream's events."""
    for line in reversed(raw.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage":{' in line.replace(b" ", b""):
            try:
                return json.loads(line[6:]).get("usage") or {}
            except ValueError:
                return {}
    return {}


class _AnyBackend:
    """A request spec without ``ignore_eos``: only engines honour it, so with it every request
    would be narrowed to the self-hosted candidates and no provider event could touch the load
    (the simulated engines run to ``max_tokens`` without it too)."""

    def __init__(self, spec: Any) -> None:
        self._spec = spec

    def __getattr__(self, name: str) -> Any:
        return getattr(self._spec, name)

    def body(self, model: str, **kw: Any) -> dict[str, Any]:
        b = self._spec.body(model, **kw)
        b.pop("ignore_eos", None)
        return b


class _Recorded(lf._SurfaceUser):
    abstract = True
    _turn = 0

    def stream(self, sess: Any, spec: Any) -> None:
        urls = endpoints()
        if urls:
            self._turn += 1
            self.client.base_url = urls[self._turn % len(urls)]
        self._meta: dict[str, Any] = {"url": self.client.base_url, "t0": time.time()}
        super().stream(sess, _AnyBackend(spec))

    def _read(self, resp: Any, obs: Any) -> None:
        for key, header in HEADERS.items():
            self._meta[key] = resp.headers.get(header)
        raw: list[bytes] = []
        inner = resp.iter_content

        def tee(chunk_size: int | None = None) -> Any:
            for chunk in inner(chunk_size=chunk_size):
                raw.append(chunk)
                yield chunk

        resp.iter_content = tee
        try:
            super()._read(resp, obs)
        finally:
            usage = _usage(b"".join(raw))
            self._meta["prompt_tokens"] = usage.get("prompt_tokens")
            self._meta["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")

    def _report(self, sess: Any, obs: Any) -> None:
        super()._report(sess, obs)
        rec = {
            "surface": obs.surface,
            "t_end": time.time(),
            "ttft_s": obs.ttft,
            "error": obs.error,
            "error_detail": obs.detail,
            "cancelled": obs.cancelled,
            "tokens": obs.tokens,
            **self._meta,
        }
        if _OUT:
            with _LOCK, open(_OUT, "a") as f:
                f.write(json.dumps(rec) + "\n")


class RehearsalTab(_Recorded):
    surface = "tab"
    weight = 6


class RehearsalChat(_Recorded):
    surface = "chat"
    weight = 3


class RehearsalAgent(_Recorded):
    surface = "agent"
    weight = 1
