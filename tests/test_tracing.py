"""OpenTelemetry: one trace from the publishing request through the relay to the inbox's handler.

Each process records its spans with the SDK (``tests/otel_worker.py``, as
``opentelemetry-instrument`` would); the test joins the files: the record's
``traceparent`` names the relay's ``send`` span, whose parent is the request
span active at ``publish()``, and the inbox's ``process`` span is the send
span's child (a per-message handler) or links to it (a batch handler).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Inbox, Outbox, create_engine
from tests.inbox_support import async_url
from transports.testing import read_topic

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "otel_worker.py")

pytestmark = pytest.mark.any_kafka


def spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def traceparent(record) -> str | None:  # type: ignore[no-untyped-def]
    return next((v.decode() for n, v in record.headers if n == "traceparent"), None)


def relay_until(db: str, any_kafka: str, topic: str, n: int, tmp_path: Path, *, traced: bool) -> list:
    command = [sys.executable, WORKER, str(tmp_path / "relay.jsonl")] if traced else [sys.executable, "-m"]
    relay = subprocess.Popen([*command, "outbox", "relay", "--db", db, "--bootstrap-servers", any_kafka,
                              "--log-level", "WARNING"], cwd=ROOT, stdout=(tmp_path / "relay.log").open("w"),
                             stderr=subprocess.STDOUT)
    try:
        records = read_topic(any_kafka, topic, expected=n, timeout=60)
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
    assert relay.returncode == 0, (tmp_path / "relay.log").read_text()
    return records


@pytest.mark.slow
def test_the_record_carries_the_relays_send_span_whose_parent_is_the_request(
    any_kafka: str, topic: str, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'shop.db'}"
    Outbox(create_engine(db)).create_tables()
    subprocess.run([sys.executable, WORKER, str(tmp_path / "shop.jsonl"), "publish", db, topic,
                    "order-1", "3"], cwd=ROOT, check=True)
    records = relay_until(db, any_kafka, topic, 3, tmp_path, traced=True)

    requests = {s["span_id"]: s for s in spans(tmp_path / "shop.jsonl") if s["name"] == "POST /orders"}
    sends = {s["span_id"]: s for s in spans(tmp_path / "relay.jsonl") if s["name"] == f"send {topic}"}
    assert len(requests) == 3 and len(sends) == 3
    for record in records:
        _, trace_id, span_id, _ = traceparent(record).split("-")
        send = sends[span_id]
        assert send["trace_id"] == trace_id and send["kind"] == "PRODUCER"
        request = requests[send["parent_id"]]  # the send span continues the publishing request
        assert request["trace_id"] == trace_id
        attributes = send["attributes"]
        assert attributes["messaging.system"] == "kafka"
        assert attributes["messaging.destination.name"] == topic
        assert attributes["messaging.kafka.message.key"] == "order-1"
        assert attributes["messaging.destination.partition.id"] == str(record.partition)
        assert attributes["messaging.kafka.offset"] == record.offset
        message_id = next(v.decode() for n, v in record.headers if n == "outbox-message-id")
        assert attributes["messaging.message.id"] == message_id
    assert len({s["trace_id"] for s in sends.values()}) == 3  # one trace per request


@pytest.mark.slow
def test_without_an_sdk_the_relay_passes_the_stored_context_through(
    any_kafka: str, topic: str, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'shop.db'}"
    Outbox(create_engine(db)).create_tables()
    subprocess.run([sys.executable, WORKER, str(tmp_path / "shop.jsonl"), "publish", db, topic, "k", "1"],
                   cwd=ROOT, check=True)
    [record] = relay_until(db, any_kafka, topic, 1, tmp_path, traced=False)
    [request] = spans(tmp_path / "shop.jsonl")
    assert traceparent(record).split("-")[1:3] == [request["trace_id"], request["span_id"]]


def test_publish_stores_no_context_outside_a_span_and_keeps_the_callers_own(tmp_path: Path) -> None:
    outbox = Outbox(create_engine(f"sqlite:///{tmp_path / 'shop.db'}"))
    outbox.create_tables()
    mine = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with Session(outbox.engine) as session, session.begin():
        outbox.publish(session, "orders", {"n": 1}, key="a")
        outbox.publish(session, "orders", {"n": 2}, key="a", headers={"traceparent": mine})
    with outbox.engine.connect() as conn:  # type: ignore[union-attr]
        stored = [json.loads(h) if isinstance(h, str) else h for (h,) in conn.exec_driver_sql(
            "SELECT headers FROM outbox_messages ORDER BY seq")]
    assert "traceparent" not in (stored[0] or {})
    assert stored[1]["traceparent"] == mine


INBOX_APP = """
from opentelemetry import trace
from outbox import Inbox, {create}

inbox = Inbox({create}({db!r}), group={group!r}, batch_size=10)


@inbox.{register}({topic!r})
{prefix}def handle(session, message):
    with trace.get_tracer("billing").start_as_current_span("bill"):  # nests under process
        pass
"""


def billing_group(topic: str) -> str:
    """The inbox's group, also its Kafka group: one per test, because librdkafka's mock cluster
    keeps a closed consumer in its group until its session times out (45 s), and a new member of
    that group waits so long for its partitions."""
    return f"billing-{topic}"


def inbox_until(db: str, any_kafka: str, topic: str, n: int, tmp_path: Path, *, batch: bool,
                asynchronous: bool) -> None:
    """Run ``outbox inbox run app:inbox`` with the SDK recording until ``n`` messages are processed."""
    name = f"app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(INBOX_APP.format(
        db=async_url(db) if asynchronous else db, topic=topic, group=billing_group(topic),
        register="batch_handler" if batch else "handler",
        create="create_async_engine" if asynchronous else "create_engine",
        prefix="async " if asynchronous else ""))
    engine = create_engine(db)
    inbox = Inbox(engine, group=billing_group(topic))
    log = tmp_path / "inbox.log"
    consumer = subprocess.Popen([sys.executable, WORKER, str(tmp_path / "inbox.jsonl"), "outbox", "inbox",
                                 "run", f"{name}:inbox", "--bootstrap-servers", any_kafka,
                                 "--log-level", "WARNING"], cwd=tmp_path, stdout=log.open("w"),
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            with engine.connect() as conn:
                done = conn.scalar(sa.select(sa.func.count()).select_from(inbox.tables.inbox_messages))
            if done == n:
                break
            assert consumer.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"{done} of {n} processed in 60 s: {log.read_text()}"
            time.sleep(0.1)
    finally:
        consumer.send_signal(signal.SIGTERM)
        consumer.wait(30)
        engine.dispose()
    assert consumer.returncode == 0, log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize(("batch", "asynchronous"), [(False, False), (True, False), (False, True)],
                         ids=["handler", "batch_handler", "async_handler"])
def test_one_trace_from_the_request_through_the_relay_to_the_inbox_handler(
    any_kafka: str, topic: str, tmp_path: Path, batch: bool, asynchronous: bool
) -> None:
    db = f"sqlite:///{tmp_path / 'shop.db'}"
    Outbox(create_engine(db)).create_tables()
    subprocess.run([sys.executable, WORKER, str(tmp_path / "shop.jsonl"), "publish", db, topic,
                    "order-1", "3"], cwd=ROOT, check=True)
    records = relay_until(db, any_kafka, topic, 3, tmp_path, traced=True)
    inbox_until(db, any_kafka, topic, 3, tmp_path, batch=batch, asynchronous=asynchronous)

    requests = {s["span_id"]: s for s in spans(tmp_path / "shop.jsonl") if s["name"] == "POST /orders"}
    sends = {s["span_id"]: s for s in spans(tmp_path / "relay.jsonl") if s["name"] == f"send {topic}"}
    processes = [s for s in spans(tmp_path / "inbox.jsonl") if s["name"] == f"process {topic}"]
    bills = [s for s in spans(tmp_path / "inbox.jsonl") if s["name"] == "bill"]
    assert len(requests) == len(sends) == 3
    # The process span is current in the handler (sync or async): the handler's own spans nest in it.
    assert sorted(b["parent_id"] for b in bills) == sorted(p["span_id"] for p in processes)
    assert {s["kind"] for s in processes} == {"CONSUMER"}
    for span in processes:
        attributes = span["attributes"]
        assert attributes["messaging.system"] == "kafka"
        assert attributes["messaging.destination.name"] == topic
        assert attributes["messaging.consumer.group.name"] == billing_group(topic)
        assert attributes["messaging.operation.type"] == "process"
    if batch:  # one span per call, linked to the send span of each message it carried
        linked = [(link["trace_id"], link["span_id"]) for s in processes for link in s["links"]]
        assert sorted(linked) == sorted((s["trace_id"], span_id) for span_id, s in sends.items())
        assert sum(s["attributes"]["messaging.batch.message_count"] for s in processes) == 3
        return
    by_parent = {s["parent_id"]: s for s in processes}
    assert len(processes) == 3 and len(by_parent) == 3
    for record in records:
        _, trace_id, send_id, _ = traceparent(record).split("-")
        process = by_parent[send_id]  # the handler's span continues the relay's send span ...
        assert process["trace_id"] == trace_id
        assert requests[sends[send_id]["parent_id"]]["trace_id"] == trace_id  # ... of the request
        attributes = process["attributes"]
        message_id = next(v.decode() for n, v in record.headers if n == "outbox-message-id")
        assert attributes["messaging.message.id"] == message_id
        assert attributes["messaging.kafka.message.key"] == "order-1"
        assert attributes["messaging.destination.partition.id"] == str(record.partition)
        assert attributes["messaging.kafka.offset"] == record.offset
