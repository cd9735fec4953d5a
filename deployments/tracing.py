"""Export finished request traces (:mod:`cluster.observability.trace`) over OTLP/HTTP, from a
background thread.

Built only when ``tracing.otlp_endpoint`` is set: the gateway then makes one
:class:`~cluster.observability.trace.RequestTrace` per request and calls :meth:`Tracer.export` once
when it ends.
Spans are created with the times the trace recorded (OpenTelemetry's SDK takes explicit start and
end times), queued to a ``BatchSpanProcessor``; nothing waits on the collector, and a collector
that is down costs a dropped batch, not a request.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from cluster.config import TracingConfig
from cluster.observability.trace import RequestTrace, SpanData, spans

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

_KINDS = {"server": "SERVER", "client": "CLIENT", "internal": "INTERNAL"}
log = logging.getLogger("ray.serve")


class Tracer:
    def __init__(self, cfg: TracingConfig, replica: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.cfg = cfg
        self.rng = random.Random()
        self._warned = False
        self.resource = Resource.create({"service.name": cfg.service_name, "service.instance.id": replica})
        self.processor = BatchSpanProcessor(
            OTLPSpanExporter(endpoint=cfg.otlp_endpoint, timeout=cfg.export_timeout_s),
            schedule_delay_millis=cfg.export_delay_ms,
        )

    def sampled(self) -> bool:
        return self.cfg.sample_ratio >= 1.0 or self.rng.random() < self.cfg.sample_ratio

    def export(self, trace: RequestTrace) -> None:
        self.export_spans(spans(trace, time.time_ns()))

    def export_spans(self, batch: list[SpanData]) -> None:
        """Queue spans for the exporter thread; a failure is logged once, never raised."""
        try:
            for s in batch:
                self.processor.on_end(self._readable(s))
        except Exception:
            if not self._warned:
                log.exception("tracing: spans not exported")
                self._warned = True

    def _readable(self, s: SpanData) -> ReadableSpan:
        from opentelemetry import trace as api
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace.status import Status, StatusCode

        flags = api.TraceFlags(api.TraceFlags.SAMPLED)
        ctx = api.SpanContext(s.trace_id, s.span_id, is_remote=False, trace_flags=flags)
        parent = None
        if s.parent_span_id is not None:
            parent = api.SpanContext(s.trace_id, s.parent_span_id, is_remote=False, trace_flags=flags)
        status = Status(StatusCode.ERROR, s.error) if s.error else Status(StatusCode.UNSET)
        return ReadableSpan(
            name=s.name,
            context=ctx,
            parent=parent,
            resource=self.resource,
            attributes=s.attributes,
            events=[Event(name, attrs, ts) for name, ts, attrs in s.events],
            kind=api.SpanKind[_KINDS[s.kind]],
            status=status,
            start_time=s.start_ns,
            end_time=s.end_ns,
        )

    def shutdown(self) -> None:
        self.processor.shutdown()  # type: ignore[no-untyped-call]  # the OTel SDK leaves it unannotated
