"""CloudEvents binary mode, checked against the ``cloudevents`` SDK as the independent party.

Our relay's records read by the SDK's ``from_binary``; events the SDK's ``to_binary``
writes consumed by our inbox, once per (source, id); the mapping both ways over
whole attribute domains.
"""

from __future__ import annotations

import json
import signal
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from _relay_helpers import drain, publish, rows, start_cli_relay
from cloudevents.v1.http import CloudEvent
from cloudevents.v1.kafka import KafkaMessage, from_binary, to_binary
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox import (
    CloudEvents,
    ConfigurationError,
    Disposition,
    Inbox,
    Outbox,
    Relay,
    create_engine,
    record_to_message,
)
from outbox.core._cloudevents import (
    MAX_SOURCE_BYTES,
    cloudevent_headers,
    cloudevent_message_id,
    cloudevent_to_message,
)
from outbox.inbox import Reason
from transports import Record
from transports.kafka import KafkaTransport
from transports.testing import read_topic


def sdk_message(record: Record) -> KafkaMessage:
    return KafkaMessage(headers=dict(record.headers), key=record.key, value=record.value)


def record_of(message: KafkaMessage, topic: str = "orders") -> Record:
    key = message.key.encode() if isinstance(message.key, str) else message.key
    value = message.value.encode() if isinstance(message.value, str) else message.value
    return Record(topic=topic, key=key, value=value, headers=list(message.headers.items()))


# -- our relay, read by the SDK ----------------------------------------------------------

@pytest.mark.any_kafka
def test_the_sdk_reads_what_the_relay_sends_in_cloudevents_mode(outbox: Outbox, any_kafka: str,
                                                                 topic: str) -> None:
    ids = publish(outbox, topic, ["order-1", "order-1", None])
    ids += publish(outbox, topic, ["order-1"], event_type="com.example.OrderPaid.v2")
    relay = Relay(outbox, KafkaTransport(bootstrap_servers=any_kafka), cloudevents=True)
    drain(relay)
    relay.close()
    stored = {r.message_id: r for r in rows(outbox)}
    incarnation = outbox.load_schema(outbox.engine).incarnation  # type: ignore[arg-type]
    records = read_topic(any_kafka, topic, expected=4)
    assert len(records) == 4
    for record in records:
        event = from_binary(sdk_message(record))
        row = stored[uuid.UUID(event["id"])]
        assert event["specversion"] == "1.0"
        assert event["source"] == f"outbox://{incarnation}"
        assert event["type"] == (row.event_type or topic)  # without an event type: the topic
        assert datetime.fromisoformat(event["time"]) == row.created_at.replace(
            tzinfo=row.created_at.tzinfo or UTC)
        assert event["datacontenttype"] == "application/json"
        assert event.get_data() == json.loads(row.payload)
        assert event.get("partitionkey") == (row.key.encode() if row.key else None)
        assert event.get("outboxseq") == (str(row.seq) if row.seq is not None else None)
        assert event["outboxincarnation"] == incarnation
        # The outbox envelope travels too: our inbox reads the record as before.
        assert record_to_message(record).message_id == row.message_id
    assert sorted(uuid.UUID(from_binary(sdk_message(r))["id"]) for r in records) == sorted(ids)


@pytest.mark.any_kafka
def test_without_the_option_no_ce_header_is_sent_and_a_chosen_source_is(outbox: Outbox, any_kafka: str,
                                                                          topic: str) -> None:
    publish(outbox, topic, ["a"])
    plain = Relay(outbox, KafkaTransport(bootstrap_servers=any_kafka))
    drain(plain)
    plain.close()
    publish(outbox, topic, ["a"], headers={"ce_source": "mine", "ce_team": "billing"})
    chosen = Relay(outbox, KafkaTransport(bootstrap_servers=any_kafka),
                   cloudevents=CloudEvents(source="https://shop.example/orders"))
    drain(chosen)
    chosen.close()
    first, second = read_topic(any_kafka, topic, expected=2)
    assert not any(name.startswith("ce_") for name, _ in first.headers)
    names = [name for name, _ in second.headers]
    assert names.count("ce_source") == 1  # the user's ce_source gives way to the relay's
    event = from_binary(sdk_message(second))
    assert event["source"] == "https://shop.example/orders"
    assert event["team"] == "billing"  # other ce_* headers of the user are extensions


@pytest.mark.any_kafka
@pytest.mark.parametrize(("name", "key"), [
    ("ce_datacontenttype", "a"), ("CE_DataContentType", "a"), ("Ce_Id", "a"), ("CE_PARTITIONKEY", None)])
def test_a_user_header_named_like_an_attribute_the_relay_sets_gives_way_in_any_case(
        outbox: Outbox, any_kafka: str, topic: str, name: str, key: str | None) -> None:
    """The SDK reads ``ce_datacontenttype`` as the ``datacontenttype`` the relay sends as
    ``content-type``, and ``ce_partitionkey`` as the key's attribute: a user header of either
    name (in any case) made it read our JSON record as ``text/plain``."""
    [message_id] = publish(outbox, topic, [key], payload={"total": 12},
                           headers={name: "text/plain", "ce_team": "billing"})
    relay = Relay(outbox, KafkaTransport(bootstrap_servers=any_kafka), cloudevents=True)
    drain(relay)
    relay.close()
    [record] = read_topic(any_kafka, topic, expected=1)
    event = from_binary(sdk_message(record))
    assert event["datacontenttype"] == "application/json"
    assert event["id"] == str(message_id)
    assert event.get("partitionkey") == (key.encode() if key else None)
    assert event.get_data() == {"total": 12} and event["team"] == "billing"
    assert not any(n.lower() == name.lower() and n != name.lower() for n, _ in record.headers)
    assert [n.lower() for n, _ in record.headers].count(name.lower()) == (1 if name == "Ce_Id" else 0)


def test_the_inbox_reads_ce_datacontenttype_and_content_type_in_any_case_as_one_attribute() -> None:
    """A CloudEvent from another producer: ``Content-Type`` is the content type, so is a lone
    ``ce_datacontenttype``; both with two values is a broken event (readers differ)."""
    base = [("ce_specversion", b"1.0"), ("ce_id", b"1"), ("ce_source", b"s"), ("ce_type", b"t")]
    for headers in ([("Content-Type", b"application/json")], [("ce_datacontenttype", b"application/json")],
                    [("CONTENT-TYPE", b"application/json"), ("CE_DATACONTENTTYPE", b"application/json")]):
        message = cloudevent_to_message(topic="t", key=None, value=b"{}", headers=[*base, *headers])
        assert message.content_type == "application/json", headers
    clash = [("content-type", b"application/json"), ("ce_datacontenttype", b"text/plain")]
    with pytest.raises(ValueError, match="twice with different values"):
        cloudevent_to_message(topic="t", key=None, value=b"{}", headers=[*base, *clash])


@pytest.mark.any_kafka
def test_a_user_header_that_only_looks_like_an_attribute_is_sent(outbox: Outbox, any_kafka: str,
                                                                 topic: str) -> None:
    """``ce_partition\u212aey`` (the Kelvin sign, which ``str.lower`` makes ``k``) is no
    ``ce_partitionkey``: the relay dropped it as one, a user header lost."""
    look_alike = "ce_partition\u212aey"
    publish(outbox, topic, ["a"], payload={"total": 12}, headers={look_alike: "mine"})
    relay = Relay(outbox, KafkaTransport(bootstrap_servers=any_kafka), cloudevents=True)
    drain(relay)
    relay.close()
    [record] = read_topic(any_kafka, topic, expected=1)
    assert (look_alike, b"mine") in record.headers


def test_the_inbox_reads_an_extension_that_only_looks_like_another_as_its_own() -> None:
    """``ce_\u212aind`` and ``ce_kind`` are two extensions: read as one (``str.lower``), their
    two values parked the event as carrying an attribute twice."""
    headers = [("ce_specversion", b"1.0"), ("ce_id", b"1"), ("ce_source", b"s"), ("ce_type", b"t"),
               ("ce_kind", b"a"), ("ce_\u212aind", b"b")]
    message = cloudevent_to_message(topic="t", key=None, value=b"{}", headers=headers)
    assert (message.headers["ce_kind"], message.headers["ce_\u212aind"]) == ("a", "b")


@pytest.mark.any_kafka
@pytest.mark.slow
def test_the_relay_command_sends_cloudevents_from_the_chosen_source(sqlite_db: str, any_kafka: str,
                                                                   topic: str, tmp_path: Path) -> None:
    outbox = Outbox(create_engine(sqlite_db))
    outbox.create_tables()
    publish(outbox, topic, ["a"])
    relay = start_cli_relay(sqlite_db, any_kafka, tmp_path / "relay.log", "--cloudevents-source", "urn:shop")
    try:
        records = read_topic(any_kafka, topic, expected=1)
    finally:
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(30) == 0, (tmp_path / "relay.log").read_text()
    assert [from_binary(sdk_message(r))["source"] for r in records] == ["urn:shop"]


@pytest.mark.parametrize("source", ["", "has space", "é", "x" * (MAX_SOURCE_BYTES + 1), 7])
def test_a_bad_source_is_refused_when_configured(source: object) -> None:
    with pytest.raises(ConfigurationError, match="CloudEvents source"):
        CloudEvents(source=source)  # type: ignore[arg-type]


def test_relay_refuses_a_cloudevents_setting_of_another_type(outbox: Outbox) -> None:
    with pytest.raises(ConfigurationError, match="cloudevents must be"):
        Relay(outbox, KafkaTransport(bootstrap_servers="127.0.0.1:9"), cloudevents="yes")  # type: ignore[arg-type]


# -- events the SDK writes, consumed by our inbox ------------------------------------------

@pytest.fixture
def inbox(engine: sa.Engine):  # type: ignore[no-untyped-def]
    box = Inbox(engine, group="ce", retry_backoff=0.001, retry_backoff_max=0.01)
    box.create_tables()
    yield box


def test_sdk_events_reach_the_handler_once_per_source_and_id(inbox: Inbox) -> None:
    seen = []
    inbox.handler("orders")(lambda session, message: seen.append(message))
    event = CloudEvent({"type": "com.example.OrderPaid", "source": "urn:shop:eu", "id": "A234-1234",
                        "partitionkey": "order-1", "time": "2026-11-25T09:16:57.5Z",
                        "datacontenttype": "application/json"}, {"total": 12})
    record = record_of(to_binary(event))
    assert inbox.handle(record) is Disposition.APPLIED
    assert inbox.handle(record) is Disposition.DUPLICATE  # redelivered: same (source, id)
    elsewhere = CloudEvent({**event.get_attributes(), "source": "urn:shop:us"}, {"total": 12})
    assert inbox.handle(record_of(to_binary(elsewhere))) is Disposition.APPLIED  # another source
    first = seen[0]
    assert first.message_id == cloudevent_message_id("urn:shop:eu", "A234-1234")
    assert first.json() == {"total": 12}
    assert (first.key, first.seq, first.content_type) == ("order-1", None, "application/json")
    assert first.created_at == datetime(2026, 11, 25, 9, 16, 57, 500000, tzinfo=UTC)
    assert first.headers["ce_id"] == "A234-1234" and first.headers["ce_type"] == "com.example.OrderPaid"
    assert first.event_type == "com.example.OrderPaid"
    assert len(seen) == 2


def test_cloudevents_are_read_whatever_the_foreign_record_policy(engine: sa.Engine) -> None:
    """``foreign_records="park"`` parks records without an envelope, but not CloudEvents."""
    box = Inbox(engine, group="ce-park", foreign_records="park")
    box.create_tables()
    box.handler("orders")(lambda session, message: None)
    event = CloudEvent({"type": "t", "source": "s", "id": "1", "datacontenttype": "application/json"},
                       {"n": 1})
    assert box.handle(record_of(to_binary(event))) is Disposition.APPLIED
    assert box.handle(Record(topic="orders", value=b"{}")) is Disposition.PARKED  # plain foreign


@pytest.mark.parametrize(("drop", "change", "reason"), [
    ("ce_type", {}, "no 'ce_type'"),
    ("ce_id", {}, "no 'ce_id'"),
    (None, {"ce_specversion": b"0.3"}, "specversion '0.3'"),
    (None, {"ce_time": b"yesterday"}, "not an RFC 3339"),
    (None, {"ce_time": b"2026-11-25T09:16:57"}, "no UTC offset"),
    (None, {"ce_source": b"\xff"}, "not UTF-8"),
    (None, {"ce_type": b"t" * 256}, "ce_type: event_type must be 1-255 characters"),
    (None, {"ce_type": b"Order\nPaid"}, "ce_type: event_type must not contain control characters"),
])
def test_a_broken_cloudevent_is_parked_as_foreign_naming_why(inbox: Inbox, drop: str | None,
                                                             change: dict, reason: str) -> None:
    inbox.handler("orders")(lambda session, message: pytest.fail("handler called"))
    event = CloudEvent({"type": "t", "source": "s", "id": "1", "datacontenttype": "application/json"},
                       {"n": 1})
    headers = dict(to_binary(event).headers)
    headers.pop(drop, None)  # type: ignore[arg-type]
    headers.update(change)
    record = Record(topic="orders", value=b"{}", headers=list(headers.items()))
    assert inbox.handle(record) is Disposition.PARKED
    [parked] = inbox.parked("orders")
    assert parked.reason == Reason.FOREIGN and reason in (parked.error or "")


def test_a_cloudevent_whose_json_payload_is_broken_is_undecodable(inbox: Inbox) -> None:
    inbox.handler("orders")(lambda session, message: pytest.fail("handler called"))
    message = to_binary(CloudEvent({"type": "t", "source": "s", "id": "1",
                                    "datacontenttype": "application/json"}, None),
                        data_marshaller=lambda _: b"{not json")
    assert inbox.handle(record_of(message)) is Disposition.PARKED
    [parked] = inbox.parked("orders")
    assert parked.reason == Reason.UNDECODABLE


# -- the mapping both ways, over whole attribute domains -------------------------------------

unicode_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=80)
# What publish() accepts as an event type: 1-255 characters, no control character, no
# noncharacter (U+FDD0-U+FDEF, U+xFFFE, U+xFFFF: CloudEvents forbids them in a String).
event_types = st.text(st.characters(codec="utf-8", exclude_categories=["Cc"]).filter(
    lambda c: not 0x7F <= ord(c) <= 0x9F and not 0xFDD0 <= ord(c) <= 0xFDEF
    and ord(c) & 0xFFFE != 0xFFFE), min_size=1, max_size=255)
source_text = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1,
                      max_size=MAX_SOURCE_BYTES)


@settings(max_examples=150, deadline=None)
@given(source=source_text,
       event_type=st.none() | event_types,
       created_at=st.datetimes(timezones=st.just(UTC)), seq=st.none() | st.integers(1, 2**63 - 1),
       payload=st.binary(max_size=200))
def test_our_attributes_read_the_same_by_the_sdk_and_by_us(source: str, event_type: str | None,
                                                           created_at: datetime, seq: int | None,
                                                           payload: bytes) -> None:
    message_id, incarnation = uuid.uuid4(), str(uuid.uuid4())
    headers = [("content-type", b"application/octet-stream"),
               *cloudevent_headers(source=source, message_id=message_id, topic="orders",
                                   event_type=event_type, created_at=created_at, seq=seq,
                                   incarnation=incarnation)]
    event = from_binary(KafkaMessage(dict(headers), b"k", payload), data_unmarshaller=lambda b: b)
    assert (event["id"], event["source"], event["type"]) == (str(message_id), source, event_type or "orders")
    assert datetime.fromisoformat(event["time"]) == created_at
    assert event.get_data() == payload
    ours = cloudevent_to_message(topic="orders", key=b"k", value=payload, headers=headers)
    assert ours.message_id == cloudevent_message_id(source, str(message_id))
    assert (ours.created_at, ours.payload, ours.headers["ce_type"]) == (created_at, payload,
                                                                         event_type or "orders")


@settings(max_examples=150, deadline=None)
@given(source=unicode_text, event_id=unicode_text, event_type=event_types,
       extension=st.none() | unicode_text, data=st.binary(max_size=200),
       created_at=st.datetimes(min_value=datetime(1, 1, 2), timezones=st.just(UTC)))
def test_what_the_sdk_writes_we_read_to_the_attribute(source: str, event_id: str, event_type: str,
                                                      extension: str | None, data: bytes,
                                                      created_at: datetime) -> None:
    attributes = {"type": event_type, "source": source, "id": event_id, "time": created_at.isoformat(),
                  "datacontenttype": "application/octet-stream"}
    if extension is not None:
        attributes["traceref"] = extension
    message = to_binary(CloudEvent(attributes, data), data_marshaller=lambda b: b)
    ours = cloudevent_to_message(topic="t", key=None, value=message.value,
                                 headers=list(message.headers.items()))
    assert ours.message_id == cloudevent_message_id(source, event_id)
    assert (ours.payload, ours.created_at, ours.seq, ours.key) == (data, created_at, None, None)
    assert (ours.headers["ce_id"], ours.headers["ce_source"], ours.headers["ce_type"]) == (
        event_id, source, event_type)
    assert ours.headers.get("ce_traceref") == extension


@given(a=st.tuples(unicode_text, unicode_text), b=st.tuples(unicode_text, unicode_text))
def test_the_message_id_tells_apart_every_two_source_and_id_pairs(a: tuple[str, str],
                                                                  b: tuple[str, str]) -> None:
    assert (cloudevent_message_id(*a) == cloudevent_message_id(*b)) == (a == b)


def test_created_at_budget_covers_the_widest_time() -> None:
    widest = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    value = dict(cloudevent_headers(source="s", message_id=uuid.uuid4(), topic="t", event_type=None,
                                    created_at=widest, seq=None, incarnation=None))["ce_time"]
    assert len(value) <= 32


@pytest.mark.any_kafka
def test_sdk_events_on_the_broker_reach_a_running_inbox_once(engine: sa.Engine, any_kafka: str,
                                                             topic: str) -> None:
    """Written by the SDK to the Kafka-protocol broker, the same event twice and another: the
    running inbox applies two, the repeat a duplicate by (source, id)."""
    from tests.test_inbox_kafka import produce, running, wait_for

    box = Inbox(engine, group="ce-run", retry_backoff=0.001, retry_backoff_max=0.01)
    box.create_tables()
    seen: list = []
    box.handler(topic)(lambda session, message: seen.append((message.event_type, message.json())))
    paid = CloudEvent({"type": "com.example.OrderPaid", "source": "urn:shop", "id": "e-1",
                       "partitionkey": "order-1", "datacontenttype": "application/json"}, {"total": 5})
    shipped = CloudEvent({"type": "com.example.OrderShipped", "source": "urn:shop", "id": "e-2",
                          "partitionkey": "order-1", "datacontenttype": "application/json"}, {"box": 1})
    produce(any_kafka, [record_of(to_binary(e), topic) for e in (paid, paid, shipped)])
    m = box.tables.inbox_messages
    with running(box, any_kafka, topic):
        wait_for(lambda: len(seen) == 2 and _deliveries(engine, m) == 3, what="two events applied")
    assert sorted(seen) == [("com.example.OrderPaid", {"total": 5}),
                            ("com.example.OrderShipped", {"box": 1})]


def _deliveries(engine: sa.Engine, m: sa.Table) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.coalesce(sa.func.sum(m.c.deliveries), 0))) or 0)


@pytest.mark.parametrize("moment", [b"9999-12-31T23:00:00-05:00", b"0001-01-01T00:00:00+05:00"])
def test_a_cloudevent_whose_time_leaves_the_calendar_in_utc_is_parked_not_a_crash(
        inbox: Inbox, moment: bytes) -> None:
    """A valid RFC 3339 time whose UTC instant is past year 9999 or before year 1 (stored in UTC)."""
    inbox.handler("orders")(lambda session, message: pytest.fail("handler called"))
    headers = {"ce_specversion": b"1.0", "ce_id": b"1", "ce_source": b"s", "ce_type": b"t",
               "ce_time": moment}
    record = Record(topic="orders", key=b"k", value=b"{}", headers=list(headers.items()))
    assert inbox.handle(record) is Disposition.PARKED
    [parked] = inbox.parked("orders")
    assert parked.reason == Reason.FOREIGN and "out of range once in UTC" in (parked.error or "")


@pytest.mark.parametrize("moment", ["9999-12-31T23:00:00-05:00", "0001-01-01T00:00:00+05:00"])
def test_an_envelope_whose_time_leaves_the_calendar_in_utc_is_parked_not_a_crash(
        inbox: Inbox, moment: str) -> None:
    inbox.handler("orders")(lambda session, message: pytest.fail("handler called"))
    headers = {"outbox-message-id": str(uuid.uuid4()).encode(), "outbox-created-at": moment.encode()}
    record = Record(topic="orders", key=b"k", value=b"{}", headers=list(headers.items()))
    assert inbox.handle(record) is Disposition.PARKED
    [parked] = inbox.parked("orders")
    assert parked.reason == Reason.FOREIGN and "out of range once in UTC" in (parked.error or "")


@pytest.mark.parametrize("twice", [[("ce_id", b"1"), ("ce_id", b"2")], [("ce_id", b"1"), ("CE_ID", b"2")],
                                   [("ce_source", b"s"), ("ce_source", b"elsewhere")],
                                   [("ce_type", b"t"), ("ce_type", b"u")],
                                   [("content-type", b"application/json"), ("content-type", b"text/plain")]])
def test_a_cloudevent_with_an_attribute_twice_and_two_values_is_parked_naming_it(
        inbox: Inbox, twice: list[tuple[str, bytes]]) -> None:
    """Its id (so whether a redelivery is a duplicate) would depend on which one a reader takes."""
    inbox.handler("orders")(lambda session, message: pytest.fail("handler called"))
    headers = {"ce_specversion": b"1.0", "ce_id": b"1", "ce_source": b"s", "ce_type": b"t"}
    names = {name.lower() for name, _ in twice}
    record = Record(topic="orders", key=b"k", value=b"{}",
                    headers=[*((n, v) for n, v in headers.items() if n not in names), *twice])
    assert inbox.handle(record) is Disposition.PARKED
    [parked] = inbox.parked("orders")
    assert parked.reason == Reason.FOREIGN and "twice with different values" in (parked.error or "")


def test_a_cloudevent_with_an_attribute_repeated_alike_is_read(inbox: Inbox) -> None:
    seen: list[object] = []
    inbox.handler("orders")(lambda session, message: seen.append(message.message_id))
    headers = [("ce_specversion", b"1.0"), ("ce_id", b"1"), ("ce_source", b"s"), ("ce_type", b"t"),
               ("ce_id", b"1")]
    assert inbox.handle(Record(topic="orders", key=b"k", value=b"{}", headers=headers)) \
        is Disposition.APPLIED
    assert seen == [cloudevent_message_id("s", "1")]


def test_an_async_inbox_reads_sdk_events_into_typed_handlers_once(engine: sa.Engine) -> None:
    """The CloudEvents path on an Inbox built on an AsyncEngine: typed by ce_type, deduplicated."""
    import pydantic

    from tests.inbox_support import dispose, for_inbox, inbox_bind

    class Shipped(pydantic.BaseModel):
        order_id: str

    box = Inbox(inbox_bind(engine, "async"), group="ce-async", retry_backoff=0.001, retry_backoff_max=0.01)
    box.create_tables()
    got: list[Shipped] = []

    async def on_shipped(session, event: Shipped) -> None:  # type: ignore[no-untyped-def]
        got.append(event)

    box.handler("orders", Shipped)(on_shipped)
    box.handler("orders")(for_inbox(box, lambda session, message: pytest.fail("untyped handler called")))
    event = CloudEvent({"type": "Shipped", "source": "urn:warehouse", "id": "s-1", "partitionkey": "o-1",
                        "datacontenttype": "application/json"}, {"order_id": "o-1"})
    record = record_of(to_binary(event))
    assert box.handle(record) is Disposition.APPLIED
    assert box.handle(record) is Disposition.DUPLICATE
    assert got == [Shipped(order_id="o-1")]
    dispose(box)
