"""Locust users per product surface, streaming against the cluster's OpenAI-compatible API.

    locust -f loadtest/locustfile.py --headless -u 30 -r 5 -t 2m --host http://127.0.0.1:8000 \\
        --csv loadtest/results/locust [--llmc-scale 0.2] [TabUser ChatUser AgentUser]

Each user is one person on one surface (request shapes from :mod:`loadtest.common.surfaces`), sending
``x-surface`` and ``x-session-id`` (one id per conversation or editing session), waiting its
surface's think time between requests (closed loop). Chat and Agent users put the real reply in
their conversation's history; Tab users cancel part of their requests mid-stream (the user kept
typing): the response is closed, which the cluster must turn into an upstream abort.

Locust's own timing of a streamed request ends at the response headers, so the stream itself is
reported as custom request events, ``request_type`` "SSE":

* ``ttft`` — first token chunk (ms; a token may decode to empty text);  ``itl`` — every gap
  between token chunks (ms; with ``--llmc-itl mean``, one event per request with its mean gap);
  ``e2e`` — the whole stream (ms; ``response_length`` = output tokens);  ``output_tok_s`` — **the
  "response time" column is output tokens per second** after the first token, per request;
  ``cancel`` — a client cancel (ms from the request to the cancel).
* request_type "GOODPUT": ``<surface> ok`` / ``<surface> miss`` — a request that did / did not get
  its first token within the surface's TTFT objective without an error (response time = TTFT).
  Requests cancelled before the objective without a token are not judged.
* Errors are Locust failures on the POST row named ``<surface> <path>``, by type:
  ``http_<status>:<openai error code>``, ``stream:<code>`` (an error event inside the stream),
  ``empty_stream`` (a 200 without any token chunk), ``timeout``, or the transport exception.

At the end a per-surface summary (TTFT p50/p99, goodput, errors by type) is printed and written to
``--llmc-summary`` when given. Options (each also an environment variable, e.g. ``LLMC_SCALE``):
``--llmc-model`` (default: the first of /v1/models), ``--llmc-scale`` (prompt/output sizes),
``--llmc-think-scale``, ``--llmc-seed``, ``--llmc-slo tab=100,chat=1000,agent=3000``,
``--llmc-weights tab=6,chat=3,agent=1``, ``--llmc-itl each|mean``, ``--llmc-timeout``.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from locust import HttpUser, events, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `locust -f` from anywhere

from loadtest.common.client import EventStream
from loadtest.common.request_spec import RequestSpec
from loadtest.common.surfaces import SHAPES, Session, iter_user_requests

_OPTS: dict[str, Any] = {}
_MODEL: dict[str, Any] = {}
_MODEL_LOCK = threading.Lock()
_STATS: dict[str, dict[str, Any]] = defaultdict(
    lambda: {"ttft": [], "good": 0, "judged": 0, "errors": Counter(), "requests": 0, "cancelled": 0}
)


def _pairs(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, _, v = part.partition("=")
        out[k.strip()] = float(v)
    return out


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    g = parser.add_argument_group("llm-cluster")
    g.add_argument("--llmc-model", env_var="LLMC_MODEL", default="", help="model (default: first listed)")
    g.add_argument("--llmc-scale", env_var="LLMC_SCALE", type=float, default=1.0, help="size multiplier")
    g.add_argument("--llmc-think-scale", env_var="LLMC_THINK_SCALE", type=float, default=1.0)
    g.add_argument("--llmc-seed", env_var="LLMC_SEED", type=int, default=0)
    slo = ",".join(f"{n}={s.ttft_slo_ms:g}" for n, s in SHAPES.items())
    g.add_argument("--llmc-slo", env_var="LLMC_SLO", default=slo, help="TTFT objectives in ms")
    weights = ",".join(f"{n}={s.weight * 10:g}" for n, s in SHAPES.items())
    g.add_argument("--llmc-weights", env_var="LLMC_WEIGHTS", default=weights, help="users per surface")
    g.add_argument("--llmc-itl", env_var="LLMC_ITL", choices=("each", "mean"), default="each")
    g.add_argument("--llmc-timeout", env_var="LLMC_TIMEOUT", type=float, default=120.0)
    g.add_argument("--llmc-summary", env_var="LLMC_SUMMARY", default="", help="write the summary JSON here")


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    opts = environment.parsed_options
    if opts is None:
        return
    _OPTS.update(
        model=opts.llmc_model,
        scale=opts.llmc_scale,
        think=opts.llmc_think_scale,
        seed=opts.llmc_seed,
        slo={n: s.ttft_slo_ms for n, s in SHAPES.items()} | _pairs(opts.llmc_slo),
        itl=opts.llmc_itl,
        timeout=opts.llmc_timeout,
        summary=opts.llmc_summary,
    )
    for cls, w in ((TabUser, "tab"), (ChatUser, "chat"), (AgentUser, "agent")):
        cls.weight = max(0, round(_pairs(opts.llmc_weights).get(w, cls.weight)))


def _fire(environment: Any, rtype: str, name: str, ms: float, length: int = 0, exc: Any = None) -> None:
    environment.events.request.fire(
        request_type=rtype, name=name, response_time=ms, response_length=length, exception=exc, context={}
    )


def _error_code(raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error") or {}
    except (ValueError, AttributeError):
        return "non_json"
    return str(err.get("code") or err.get("type") or "error")


def _error_detail(err: Any) -> dict[str, Any]:
    """An error object's code, type and message (what a client is told about why)."""
    if not isinstance(err, dict):
        return {"message": str(err)[:300]}
    return {k: err.get(k) for k in ("code", "type", "message") if err.get(k) is not None}


def _body_error(raw: bytes) -> dict[str, Any]:
    try:
        return _error_detail(json.loads(raw).get("error") or {})
    except (ValueError, AttributeError):
        return {"message": raw[:300].decode("utf-8", "replace")}


class _SurfaceUser(HttpUser):
    abstract = True
    surface = "chat"
    _numbers = itertools.count(1)

    def wait_time(self) -> float:
        lo, hi = SHAPES[self.surface].think_time_s
        return self._rng.uniform(lo, hi) * _OPTS.get("think", 1.0)

    def on_start(self) -> None:
        n = next(self._numbers)
        self.client.trust_env = False  # loopback benchmarks: never through an environment proxy
        self._rng = random.Random(f"{_OPTS.get('seed', 0)}-{self.surface}-{n}")
        model, window = self._model()
        self._model_name = model
        run = os.getpid()
        self._requests = iter_user_requests(
            self.surface, f"{self.surface}-{run}-{n}", self._rng, _OPTS.get("scale", 1.0), window
        )

    def _model(self) -> tuple[str, int | None]:
        with _MODEL_LOCK:
            if not _MODEL:
                r = self.client.get("/v1/models", name="/v1/models")
                data = r.json()["data"]
                want = _OPTS.get("model") or data[0]["id"]
                m = next((d for d in data if d["id"] == want), {"id": want})
                _MODEL.update(id=want, window=m.get("context_window"))
        return _MODEL["id"], _MODEL.get("window")

    @task
    def one_request(self) -> None:
        sess, spec = next(self._requests)
        self.stream(sess, spec)

    def stream(self, sess: Session, spec: RequestSpec) -> None:
        timeout = _OPTS.get("timeout", 120.0)
        cancel = spec.cancel_after_s
        obs = _Observed(spec.surface, cancel, time.perf_counter())
        # A cancel must happen even while no byte arrives: then the read timeout is the cancel.
        read_timeout = min(cancel, timeout) if cancel else timeout
        try:
            with self.client.post(
                spec.path,
                json=spec.body(self._model_name),
                headers=spec.headers(),
                name=f"{spec.surface} {spec.path}",
                stream=True,
                catch_response=True,
                timeout=(10, read_timeout),
            ) as resp:
                if resp.status_code == 0:  # no response: Locust caught the transport error
                    if not obs.cancel_due():
                        obs.error = type(resp.error).__name__ if resp.error is not None else "no_response"
                        obs.detail = _error_detail(resp.error)
                elif resp.status_code != 200:
                    obs.error = f"http_{resp.status_code}:{_error_code(resp.content or b'')}"
                    obs.detail = _body_error(resp.content or b"")
                else:
                    self._read(resp, obs)
                if obs.cancelled:
                    if resp.raw is not None:
                        resp.close()  # the disconnect is the cancel the cluster must propagate
                elif obs.error is None and obs.ttft is None:
                    obs.error = "empty_stream"
                if obs.error is not None:
                    resp.failure(obs.error)
                else:
                    resp.success()
        except requests.exceptions.RequestException as exc:
            if obs.error is None:
                obs.error, obs.detail = type(exc).__name__, _error_detail(exc)
        self._report(sess, obs)

    def _read(self, resp: Any, obs: _Observed) -> None:
        env = self.environment
        each_itl = _OPTS.get("itl", "each") == "each"
        try:
            for data in EventStream().iter(resp.iter_content(chunk_size=None)):
                if obs.cancel_due():
                    return
                obj = json.loads(data)
                if "error" in obj:
                    obs.error = f"stream:{obj['error'].get('code') or obj['error'].get('type')}"
                    obs.detail = _error_detail(obj["error"])
                    return
                now = time.perf_counter()
                for ch in obj.get("choices") or ():
                    text = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
                    if text is None:  # a role-only or finish-only chunk carries no token
                        continue
                    # A token can decode to "" (a special or partial-UTF-8 token: the tiny random
                    # model does this); it is still the engine's first token, so it counts.
                    obs.parts.append(text)
                    obs.tokens += 1
                    if obs.ttft is None:
                        obs.ttft = now - obs.start
                        _fire(env, "SSE", "ttft", 1000 * obs.ttft)
                    else:
                        obs.gaps.append(now - obs.last)
                        if each_itl:
                            _fire(env, "SSE", "itl", 1000 * (now - obs.last))
                    obs.last = now
                if obj.get("usage"):
                    obs.tokens = int(obj["usage"].get("completion_tokens") or obs.tokens)
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
            if not obs.cancel_due():  # a silent server: the read timeout was the cancel
                timed_out = isinstance(exc, requests.exceptions.Timeout) or "timed out" in str(exc)
                obs.error = "timeout" if timed_out else type(exc).__name__
                obs.detail = _error_detail(exc)

    def _report(self, sess: Session, obs: _Observed) -> None:
        env = self.environment
        st = _STATS[obs.surface]
        st["requests"] += 1
        slo_ms = _OPTS.get("slo", {}).get(obs.surface, SHAPES[obs.surface].ttft_slo_ms)
        elapsed_ms = 1000 * (time.perf_counter() - obs.start)
        if obs.cancelled:
            _fire(env, "SSE", "cancel", elapsed_ms)
        elif obs.error is None:
            _fire(env, "SSE", "e2e", elapsed_ms, obs.tokens)
            if _OPTS.get("itl") == "mean" and obs.gaps:
                _fire(env, "SSE", "itl", 1000 * sum(obs.gaps) / len(obs.gaps))
            decode_s = obs.last - obs.start - (obs.ttft or 0.0)
            if obs.tokens > 1 and decode_s > 0:
                _fire(env, "SSE", "output_tok_s", (obs.tokens - 1) / decode_s)
            sess.observe("".join(obs.parts))
        if obs.error is not None:
            st["errors"][obs.error] += 1
        if obs.cancelled:
            st["cancelled"] += 1
            if obs.ttft is None and elapsed_ms < slo_ms:
                return  # nobody was waiting any more when the objective passed
        if obs.ttft is not None:
            st["ttft"].append(1000 * obs.ttft)
        st["judged"] += 1
        ok = obs.error is None and obs.ttft is not None and 1000 * obs.ttft <= slo_ms
        st["good"] += ok
        ttft_ms = 1000 * obs.ttft if obs.ttft is not None else elapsed_ms
        _fire(env, "GOODPUT", f"{obs.surface} {'ok' if ok else 'miss'}", ttft_ms)


@dataclass
class _Observed:
    """What one streamed request showed the client."""

    surface: str
    cancel_after_s: float | None
    start: float
    ttft: float | None = None
    last: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    error: str | None = None
    detail: dict[str, Any] | None = None  # the error object's code, type and message (or the exception)
    cancelled: bool = False

    def cancel_due(self) -> bool:
        """True (and remembered) once the user has moved on; a little slack for timer granularity."""
        c = self.cancel_after_s
        if c is not None and time.perf_counter() - self.start >= 0.99 * c:
            self.cancelled = True
        return self.cancelled


class TabUser(_SurfaceUser):
    """Code completion while typing: short prompts, short answers, many cancels, TTFT ≤ 100 ms."""

    surface = "tab"
    weight = 6


class ChatUser(_SurfaceUser):
    """A conversation: shared system prompt, growing history, medium answers, reading time."""

    surface = "chat"
    weight = 3


class AgentUser(_SurfaceUser):
    """A coding agent: large shared repository context, growing tool results, long answers."""

    surface = "agent"
    weight = 1


def surface_summary() -> dict[str, Any]:
    out = {}
    for name, st in sorted(_STATS.items()):
        t = sorted(st["ttft"])
        out[name] = {
            "requests": st["requests"],
            "cancelled": st["cancelled"],
            "errors_by_type": dict(st["errors"]),
            "ttft_ms_p50": round(t[len(t) // 2], 1) if t else None,
            "ttft_ms_p99": round(t[min(len(t) - 1, int(0.99 * len(t)))], 1) if t else None,
            "slo_ttft_ms": _OPTS.get("slo", {}).get(name),
            "goodput": round(st["good"] / st["judged"], 4) if st["judged"] else None,
        }
    return out


@events.test_stop.add_listener
def _on_stop(**_: Any) -> None:
    summary = surface_summary()
    print("[llmc] per-surface summary: " + json.dumps(summary, sort_keys=True), flush=True)
    if _OPTS.get("summary"):
        Path(_OPTS["summary"]).write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
