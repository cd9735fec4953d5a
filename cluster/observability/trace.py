"""One request's trace, recorded as plain data while it runs and turned into spans once it ends.

Nothing here touches OpenTelemetry or the network: the gateway fills a :class:`RequestTrace` at a
handful of points per request (admission, each attempt and its routing decision, first token, end;
never per chunk) and, when tracing is configured, hands it to ``deployments.tracing`` which
exports the :func:`spans` over OTLP. With tracing off no trace object exists at all.

Span names and attributes follow OpenTelemetry's GenAI semantic conventions (``gen_ai.*``:
operation, provider, request and response model, sampling parameters, token usage, finish
reasons); what they do not cover is under ``llmc.*`` (surface, admission wait, routing reason,
attempt outcome, time to first token).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from cluster.json_types import JSONObject
from cluster.wire.protocol import GenerateRequest, Usage

OPERATION = {"chat": "chat", "completion": "text_completion"}
Attrs = JSONObject
SpanEvents = tuple[tuple[str, int, Attrs], ...]  # (name, time in ns, attributes)


def new_id(rng: random.Random, bits: int) -> int:
    """A non-zero random id (128 bits for traces, 64 for spans)."""
    return rng.getrandbits(bits) or 1


def traceparent(trace_id: int, span_id: int) -> str:
    """W3C Trace Context header value for a sampled span."""
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def parse_traceparent(value: str | None) -> tuple[int, int] | None:
    """(trace id, parent span id) from a W3C ``traceparent``; None when absent or malformed."""
    parts = (value or "").strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id = int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None
    return (trace_id, span_id) if trace_id and span_id else None


@dataclass
class AttemptTrace:
    span_id: int
    backend: str
    provider: str  # gen_ai.provider.name: vllm, sim, openai, anthropic
    attempt: int
    hedge: bool
    start_ns: int
    replica: str | None = None
    reason: str | None = None  # the routing decision's reason (engines)
    end_ns: int | None = None
    verdict: str | None = None  # won, lost, failed … (cluster.policy.race.Verdict)
    error: str | None = None


@dataclass
class RequestTrace:
    trace_id: int
    span_id: int
    start_ns: int
    req: GenerateRequest
    parent_span_id: int | None = None  # from the client's traceparent
    admitted_ns: int | None = None
    admission_error: str | None = None
    attempts: list[AttemptTrace] = field(default_factory=list)
    first_token_ns: int | None = None
    end_ns: int | None = None
    outcome: str | None = None
    backend: str | None = None
    usage: Usage | None = None
    finish: str | None = None

    def attempt(
        self, rng: random.Random, backend: str, provider: str, n: int, hedge: bool, now_ns: int
    ) -> AttemptTrace:
        a = AttemptTrace(new_id(rng, 64), backend, provider, n, hedge, now_ns)
        self.attempts.append(a)
        return a


class AttemptSpans:
    """A request's attempts as the race starts and settles them, keyed by the planned attempt;
    without a trace every method is a no-op (tracing off costs a None check per attempt)."""

    def __init__(self, trace: RequestTrace | None, rng: random.Random) -> None:
        self.trace, self.rng = trace, rng
        self._by_key: dict[int, AttemptTrace] = {}

    def start(
        self, key: int, backend: str, provider: str, n: int, hedge: bool, now_ns: int
    ) -> AttemptTrace | None:
        if self.trace is None:
            return None
        at = self.trace.attempt(self.rng, backend, provider, n, hedge, now_ns)
        self._by_key[key] = at
        return at

    @staticmethod
    def routed(at: AttemptTrace | None, replica: str, reason: str) -> None:
        if at is not None:
            at.replica, at.reason = replica, reason

    def traceparent(self, at: AttemptTrace | None) -> str | None:
        """The header that makes the engine's span a child of this attempt's."""
        return None if at is None or self.trace is None else traceparent(self.trace.trace_id, at.span_id)

    def ended(self, key: int, verdict: str, error: str | None, now_ns: int) -> None:
        at = self._by_key.get(key)
        if at is None:
            return
        at.verdict, at.error = verdict, error
        if verdict != "won":  # the winner's span lasts until the request ends
            at.end_ns = now_ns


@dataclass(frozen=True)
class SpanData:
    name: str
    trace_id: int
    span_id: int
    parent_span_id: int | None
    kind: str  # server | client | internal
    start_ns: int
    end_ns: int
    attributes: Attrs
    events: SpanEvents = ()
    error: str | None = None


def engine_span(
    parent: tuple[int, int], span_id: int, req: GenerateRequest, replica: str, kind: str,
    times: tuple[int, int | None, int], usage: Usage | None, error: str | None,
) -> SpanData:  # fmt: skip
    """The engine replica's own span, a child of the gateway's attempt span (its traceparent):
    times are (received, first token or None, end)."""
    start, first, end = times
    attrs: Attrs = {
        "gen_ai.operation.name": OPERATION[req.kind],
        "gen_ai.request.model": req.model,
        "gen_ai.provider.name": kind,
        "llmc.replica": replica,
        "llmc.attempt": req.attempt,
    }
    if usage is not None:
        attrs["gen_ai.usage.input_tokens"] = usage.prompt_tokens
        attrs["gen_ai.usage.output_tokens"] = usage.completion_tokens
        attrs["llmc.usage.cached_tokens"] = usage.cached_tokens
    events: SpanEvents = () if first is None else (("gen_ai.first_token", first, {}),)
    name = f"{OPERATION[req.kind]} {req.model}"
    return SpanData(name, parent[0], span_id, parent[1], "server", start, end, attrs, events, error)


def _request_attrs(t: RequestTrace) -> Attrs:
    r, s = t.req, t.req.sampling
    a: Attrs = {
        "gen_ai.operation.name": OPERATION[r.kind],
        "gen_ai.request.model": r.model,
        "gen_ai.request.max_tokens": s.max_tokens,
        "gen_ai.request.temperature": s.temperature,
        "gen_ai.request.top_p": s.top_p,
        "gen_ai.response.id": r.request_id,
        "llmc.surface": r.surface,
        "llmc.prompt_tokens": len(r.prompt_token_ids),
    }
    if s.seed is not None:
        a["gen_ai.request.seed"] = s.seed
    if t.usage is not None:
        a["gen_ai.usage.input_tokens"] = t.usage.prompt_tokens
        a["gen_ai.usage.output_tokens"] = t.usage.completion_tokens
        a["llmc.usage.cached_tokens"] = t.usage.cached_tokens
    if t.finish is not None:
        a["gen_ai.response.finish_reasons"] = [t.finish]
    if t.backend:
        a["llmc.backend"] = t.backend
        a["gen_ai.response.model"] = r.model
    if t.outcome:
        a["llmc.outcome"] = t.outcome
    if t.first_token_ns is not None:
        a["llmc.ttft_s"] = (t.first_token_ns - t.start_ns) / 1e9
    return a


def spans(t: RequestTrace, now_ns: int) -> list[SpanData]:
    """The request's span (server), its admission wait, and one client span per attempt."""
    end = t.end_ns or now_ns
    op, model = OPERATION[t.req.kind], t.req.model
    first = t.first_token_ns
    events: SpanEvents = () if first is None else (("gen_ai.first_token", first, {}),)
    error = t.outcome if t.outcome in ("errored", "rejected") else None
    out = [
        SpanData(f"{op} {model}", t.trace_id, t.span_id, t.parent_span_id, "server", t.start_ns, end,
                 _request_attrs(t), events, error)
    ]  # fmt: skip
    admitted = t.admitted_ns or end
    wait = {"llmc.surface": t.req.surface, "llmc.admission.wait_s": (admitted - t.start_ns) / 1e9}
    out.append(
        SpanData("admission", t.trace_id, new_id(random.Random(t.span_id), 64), t.span_id, "internal",
                 t.start_ns, admitted, wait, (), t.admission_error)
    )  # fmt: skip
    for a in t.attempts:
        attrs: Attrs = {
            "gen_ai.operation.name": op,
            "gen_ai.request.model": model,
            "gen_ai.provider.name": a.provider,
            "llmc.backend": a.backend,
            "llmc.attempt": a.attempt,
            "llmc.hedge": a.hedge,
        }
        for key, value in (("llmc.replica", a.replica), ("llmc.routing.reason", a.reason),
                           ("llmc.attempt.verdict", a.verdict)):  # fmt: skip
            if value is not None:
                attrs[key] = value
        out.append(
            SpanData(f"{op} {model}", t.trace_id, a.span_id, t.span_id, "client", a.start_ns,
                     a.end_ns or end, attrs, (), a.error)
        )  # fmt: skip
    return out
