"""Run an ``outbox`` command (or a publishing snippet) with OpenTelemetry's SDK recording to a file.

``python tests/otel_worker.py SPANS.jsonl outbox relay --db …`` (or ``outbox
inbox run app:inbox …``) is what ``opentelemetry-instrument outbox relay …``
does in production, minus the
OTLP exporter: every finished span is appended to SPANS.jsonl as one JSON
line (name, kind, trace and span ids, parent, attributes), written when the
span ends, so nothing is lost when the process is stopped.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


class JsonLines(SpanExporter):
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self.lock, open(self.path, "a") as out:
            for span in spans:
                context = span.get_span_context()
                out.write(json.dumps({
                    "name": span.name, "kind": span.kind.name,
                    "trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}",
                    "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
                    "links": [{"trace_id": f"{link.context.trace_id:032x}",
                               "span_id": f"{link.context.span_id:016x}"} for link in span.links],
                    "attributes": dict(span.attributes or {}),
                }) + "\n")
        return SpanExportResult.SUCCESS


def record_spans_to(path: str) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLines(path)))
    trace.set_tracer_provider(provider)


if __name__ == "__main__":
    record_spans_to(sys.argv[1])
    if sys.argv[2] == "outbox":
        from outbox.cli import main

        sys.argv = ["outbox", *sys.argv[3:]]
        main()
    else:  # publish: DB TOPIC KEY N — N rows, each inside a request span
        from sqlalchemy.orm import Session

        from outbox import Outbox, create_engine

        db, topic, key, n = sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
        outbox = Outbox(create_engine(db))
        tracer = trace.get_tracer("shop")
        for i in range(n):
            with tracer.start_as_current_span("POST /orders", kind=trace.SpanKind.SERVER), \
                    Session(outbox.engine) as session, session.begin():
                outbox.publish(session, topic, {"order": i}, key=key)
