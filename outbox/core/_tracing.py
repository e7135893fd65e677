"""OpenTelemetry, when it is installed: one trace from ``publish()`` through the relay to the handler.

``publish()`` stores the active span's W3C context (``traceparent``,
``tracestate``) with the row's headers, unless the caller set its own; the
relay, when a tracer provider is configured, records a ``send {topic}``
PRODUCER span per record whose parent is that stored context, and sends the
*send span's* context in the record's headers; the inbox continues it with a
``process {topic}`` CONSUMER span around the handler. Names and attributes
follow OpenTelemetry's messaging semantic conventions (``messaging.system``,
``messaging.destination.name``, ``messaging.message.id``,
``messaging.kafka.message.key``, ``messaging.destination.partition.id``,
``messaging.kafka.offset``, ``messaging.consumer.group.name``).

Without the ``otel`` extra every function here is a no-op costing one
attribute check; with the API but no SDK configured (a no-op provider), the
relay passes the stored context through untouched and records nothing, so a
service that has not set tracing up pays nothing in the relay's hot path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from transports import Outcome, Record, SendResult

try:
    from opentelemetry import trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    INSTALLED = True
except ImportError:  # the otel extra is not installed: nothing below touches ``trace`` then
    INSTALLED = False

TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
SYSTEM = "kafka"
_propagator = TraceContextTextMapPropagator() if INSTALLED else None
_TRACER = "transactional-outbox"


def with_current_context(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` plus the active span's ``traceparent``/``tracestate`` (unless already given)."""
    if _propagator is None or TRACEPARENT in headers:
        return headers
    if not trace.get_current_span().get_span_context().is_valid:
        return headers
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return {**headers, **carrier} if carrier else headers


def _recording() -> bool:
    """A tracer provider that records (an SDK) is configured: spans are worth making."""
    if not INSTALLED:
        return False
    provider = trace.get_tracer_provider()
    return type(provider).__name__ not in ("ProxyTracerProvider", "NoOpTracerProvider")


class SendSpans:
    """The PRODUCER spans of one relay batch; ``finish`` ends them with each record's outcome."""

    def __init__(self, spans: list[tuple[int, Any]]) -> None:
        self._spans = spans

    def finish(self, results: Sequence[SendResult]) -> None:
        for index, span in self._spans:
            result = results[index]
            if result.outcome is Outcome.DELIVERED:
                if result.partition is not None:
                    span.set_attribute("messaging.destination.partition.id", str(result.partition))
                if result.offset is not None:
                    span.set_attribute("messaging.kafka.offset", result.offset)
            else:
                span.set_status(Status(StatusCode.ERROR, result.error or result.outcome.value))
                span.set_attribute("error.type", result.outcome.value)
            span.end()


def start_send(records: list[Record],
               message_id: Callable[[int], str]) -> tuple[list[Record], SendSpans | None]:
    """A ``send`` span per record that carries a trace context, and its context in the record.

    ``message_id(i)`` names record ``i``; it is asked only for traced records, so
    a relay without a recording SDK builds nothing per message.

    Returns the records to send (traced ones with their ``traceparent``
    replaced by the send span's) and the spans to ``finish``; ``None`` when
    nothing is traced or nothing records.
    """
    if _propagator is None or not _recording():
        return records, None
    tracer = trace.get_tracer(_TRACER)
    spans: list[tuple[int, Any]] = []
    sent = list(records)
    for i, record in enumerate(records):
        headers = dict((name, value.decode()) for name, value in record.headers if name in
                       (TRACEPARENT, TRACESTATE) and value is not None)
        if TRACEPARENT not in headers:
            continue
        parent = _propagator.extract(headers)
        attributes: dict[str, Any] = {
            "messaging.system": SYSTEM, "messaging.operation.type": "send",
            "messaging.operation.name": "send", "messaging.destination.name": record.topic,
            "messaging.message.id": message_id(i)}
        if record.key is not None:
            attributes["messaging.kafka.message.key"] = record.key.decode()
        span = tracer.start_span(f"send {record.topic}", context=parent, kind=SpanKind.PRODUCER,
                                 attributes=attributes)
        carrier: dict[str, str] = {}
        _propagator.inject(carrier, context=trace.set_span_in_context(span))
        rest = [(n, v) for n, v in record.headers if n not in (TRACEPARENT, TRACESTATE)]
        sent[i] = replace(record, headers=rest + [(n, v.encode()) for n, v in carrier.items()])
        spans.append((i, span))
    return sent, (SendSpans(spans) if spans else None)


def _processing(topic: str, group: str) -> dict[str, Any]:
    """The attributes every consumer span carries."""
    return {"messaging.system": SYSTEM, "messaging.operation.type": "process",
            "messaging.operation.name": "process", "messaging.destination.name": topic,
            "messaging.consumer.group.name": group}


@contextmanager
def process_span(topic: str, headers: Mapping[str, str], *, message_id: str, key: str | None,
                 group: str, partition: int | None, offset: int | None) -> Iterator[None]:
    """The CONSUMER span around one message's handler, continuing the trace in ``headers``."""
    if _propagator is None or TRACEPARENT not in headers or not _recording():
        yield
        return
    attributes = _processing(topic, group)
    attributes["messaging.message.id"] = message_id
    if key is not None:
        attributes["messaging.kafka.message.key"] = key
    if partition is not None:
        attributes["messaging.destination.partition.id"] = str(partition)
    if offset is not None:
        attributes["messaging.kafka.offset"] = offset
    tracer = trace.get_tracer(_TRACER)
    with tracer.start_as_current_span(f"process {topic}", context=_propagator.extract(dict(headers)),
                                      kind=SpanKind.CONSUMER, attributes=attributes):
        yield


@contextmanager
def process_batch_span(topic: str, contexts: Sequence[Mapping[str, str]], *, group: str,
                       count: int) -> Iterator[None]:
    """One CONSUMER span around a batch handler's call, linked to each traced message's context."""
    if _propagator is None or not _recording():
        yield
        return
    links = []
    for headers in contexts:
        if TRACEPARENT in headers:
            span_context = trace.get_current_span(_propagator.extract(dict(headers))).get_span_context()
            if span_context.is_valid:
                links.append(Link(span_context))
    if not links:
        yield
        return
    attributes = _processing(topic, group)
    attributes["messaging.batch.message_count"] = count
    tracer = trace.get_tracer(_TRACER)
    with tracer.start_as_current_span(f"process {topic}", kind=SpanKind.CONSUMER, links=links,
                                      attributes=attributes):
        yield
