"""Records without our envelope: an identity that survives offsets starting again, and
Debezium's outbox events read by their event id, applied per key in partition order,
parked with their key and replayed like ours (``Inbox(foreign_records=...)``)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from outbox import ConfigurationError, Disposition, ForeignEnvelope, Inbox, Message
from outbox.inbox import Reason
from tests.inbox_support import (
    INBOX_KINDS,
    TOPIC,
    AlertLog,
    applied,
    business,
    dispose,
    effects,
    for_inbox,
    inbox_bind,
    record,
    settle,
)
from transports import Record


@pytest.fixture(params=INBOX_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def apply_numbered(session, message: Message) -> None:  # type: ignore[no-untyped-def]
    """One business row per event: (key, the payload's n); a second application fails its insert."""
    session.execute(effects.insert().values(topic=message.topic, key=message.key,
                                            seq=message.json()["n"], message_id=message.message_id))


def make_inbox(engine: sa.Engine, kind: str = "sync", **kwargs) -> Inbox:  # type: ignore[no-untyped-def]
    box = Inbox(inbox_bind(engine, kind), group="g", retry_backoff=0.001, retry_backoff_max=0.01,
                alert=AlertLog(), **kwargs)
    box.create_tables()
    business.create_all(engine)
    return box


@pytest.fixture
def debezium(engine: sa.Engine, kind: str) -> Iterator[Inbox]:
    """An inbox reading Debezium's outbox events (``foreign_records="debezium"``)."""
    box = make_inbox(engine, kind, foreign_records="debezium")
    box.handler(TOPIC)(for_inbox(box, apply_numbered))
    yield box
    dispose(box)


def event(key: str | None, n: int, event_id: bytes | str | None = None, *, offset: int = 0,
          partition: int = 0, headers: list[tuple[str, bytes]] | None = None,
          payload: bytes | None = None, timestamp_ms: int | None = 1_700_000_000_000) -> Record:
    """A record as Debezium's EventRouter sends it: key = aggregate id, the event id in ``id``."""
    raw = (event_id.encode() if isinstance(event_id, str) else event_id) if event_id is not None \
        else str(uuid.uuid4()).encode()
    wire = [("__debezium.context.connectorName", b"postgresql"), ("id", raw), *(headers or [])]
    return Record(topic=TOPIC, key=key.encode() if key is not None else None,
                  value=json.dumps({"n": n}).encode() if payload is None else payload, headers=wire,
                  partition=partition, offset=offset, timestamp_ms=timestamp_ms)


# -- a record without an id: what it is, not where it sits ------------------------------------

def plain(value: bytes, *, offset: int, timestamp_ms: int = 1_700_000_000_000) -> Record:
    return Record(topic=TOPIC, value=value, key=b"legacy-key", partition=0, offset=offset,
                  timestamp_ms=timestamp_ms)


def test_accepted_a_new_record_at_an_offset_seen_before_is_a_new_message(engine: sa.Engine) -> None:
    """The topic was deleted and created again: offsets start at 0 again. The new record at
    offset 5 is not the old one; taken for it (an id derived from the position), the handler
    never saw it (DUPLICATE)."""
    box = make_inbox(engine, foreign_records="accept")
    seen: list[bytes] = []
    box.handler(TOPIC)(lambda session, message: seen.append(message.payload))
    assert box.handle(plain(b"before the topic was recreated", offset=5)) is Disposition.APPLIED
    assert box.handle(plain(b"after it was recreated", offset=5,
                            timestamp_ms=1_700_000_600_000)) is Disposition.APPLIED
    assert seen == [b"before the topic was recreated", b"after it was recreated"]


def test_parked_a_new_record_at_an_offset_seen_before_is_parked_too(engine: sa.Engine) -> None:
    """The same break under the default ``park``: the second record was PARKED with no row
    written (1 of 2 parked), so nothing told an operator it existed."""
    box = make_inbox(engine)
    box.handler(TOPIC)(lambda session, message: None)
    assert box.handle(plain(b"one", offset=5)) is Disposition.PARKED
    assert box.handle(plain(b"two", offset=5, timestamp_ms=1_700_000_600_000)) is Disposition.PARKED
    assert len(box.parked()) == 2


@pytest.mark.parametrize("policy", ["accept", "park"])
def test_the_same_record_read_again_anywhere_is_one_message(engine: sa.Engine, policy: str) -> None:
    """A redelivery (same offset) and a copy at another offset (a producer's retry, a rewound
    mirror) are the record read again: one message, one parked row."""
    box = make_inbox(engine, foreign_records=policy)
    box.handler(TOPIC)(lambda session, message: None)
    first = box.handle(plain(b"same", offset=5))
    assert box.handle(plain(b"same", offset=5)) is (
        Disposition.DUPLICATE if policy == "accept" else Disposition.PARKED)
    box.handle(plain(b"same", offset=900))
    assert first is (Disposition.APPLIED if policy == "accept" else Disposition.PARKED)
    assert len(box.parked()) == (0 if policy == "accept" else 1)


def test_two_records_equal_in_everything_but_their_offset_are_one_message(engine: sa.Engine) -> None:
    """The documented limit of an identity without an id: same topic, key, value, headers and
    timestamp (to the millisecond) cannot be told from a redelivery."""
    box = make_inbox(engine, foreign_records="accept")
    box.handler(TOPIC)(lambda session, message: None)
    assert box.handle(plain(b"tick", offset=1)) is Disposition.APPLIED
    assert box.handle(plain(b"tick", offset=2)) is Disposition.DUPLICATE
    assert box.handle(plain(b"tick", offset=3, timestamp_ms=1_700_000_000_001)) is Disposition.APPLIED


# -- Debezium's events: identified by the id they carry ---------------------------------------

def test_an_event_delivered_again_at_another_offset_is_a_duplicate(debezium: Inbox,
                                                                   engine: sa.Engine) -> None:
    """Debezium re-sends what it had not committed (its offsets rewound): same id, new offset."""
    event_id = str(uuid.uuid4())
    assert debezium.handle(event("order-1", 1, event_id, offset=10)) is Disposition.APPLIED
    assert debezium.handle(event("order-1", 1, event_id, offset=11,
                                 timestamp_ms=1_700_000_900_000)) is Disposition.DUPLICATE
    assert applied(engine) == [("order-1", 1)]


def test_a_uuid_id_is_the_message_id_whatever_its_spelling(debezium: Inbox) -> None:
    """``3E0A…`` and ``{3e0a…}`` name one event: identity, not spelling. The UUID itself is the
    message id, so an event our relay sent (its id as Debezium's ``id`` column) keeps it."""
    event_id = uuid.uuid4()
    seen: list[uuid.UUID] = []
    debezium.handler("other")(for_inbox(debezium, lambda s, m: seen.append(m.message_id)))
    first = event("k", 1, str(event_id))
    first.topic = "other"
    assert debezium.handle(first) is Disposition.APPLIED
    for spelling in (str(event_id).upper(), "{" + str(event_id) + "}", event_id.hex, event_id.urn,
                     event_id.urn.upper()):
        again = event("k", 1, spelling)
        again.topic = "other"
        assert debezium.handle(again) is Disposition.DUPLICATE, spelling
    assert seen == [event_id]


@pytest.mark.parametrize("odd_id", [
    b"order-17/event-3", "ordre-été-✓".encode(), b"\xff\xfe\x00binary\x80", b"x" * 10_000,
    b"00000000-0000-0000-0000-00000000000",  # one digit short of a UUID: a string like any other
], ids=["text", "unicode", "binary", "10-kB", "almost-a-uuid"])
def test_an_id_that_is_no_uuid_identifies_its_event_by_its_bytes(debezium: Inbox, engine: sa.Engine,
                                                                odd_id: bytes) -> None:
    assert debezium.handle(event("k", 1, odd_id, offset=1)) is Disposition.APPLIED
    assert debezium.handle(event("k", 1, odd_id, offset=2)) is Disposition.DUPLICATE
    assert debezium.handle(event("k", 2, odd_id + b"!", offset=3)) is Disposition.APPLIED
    assert debezium.handle(event("k", 3, odd_id.upper() if odd_id.upper() != odd_id else odd_id + b"?",
                                 offset=4)) is Disposition.APPLIED  # not a UUID: case is its identity
    assert applied(engine) == [("k", 1), ("k", 2), ("k", 3)]


@pytest.mark.parametrize("odd_id", [
    "----12345678123456781234567812345678",  # hyphens where no UUID has them
    "1234-5678-1234-5678-1234567812345678",
    "urn:12345678123456781234567812345678",  # urn: without uuid:, no hyphens
    "{{12345678123456781234567812345678}}",  # braces twice
], ids=["leading-hyphens", "odd-hyphens", "urn-no-uuid", "double-braces"])
def test_an_id_spelled_like_no_uuid_is_not_taken_for_the_uuid_its_hex_digits_make(
        debezium: Inbox, engine: sa.Engine, odd_id: str) -> None:
    """Python's ``uuid.UUID`` drops every hyphen, brace and ``urn:``/``uuid:`` anywhere: these
    ids, none of them a UUID's spelling, were read as 12345678-1234-5678-1234-567812345678, so
    a second producer's event so named was a DUPLICATE of the first and never applied."""
    the_uuid = "12345678-1234-5678-1234-567812345678"
    assert debezium.handle(event("k", 1, the_uuid, offset=1)) is Disposition.APPLIED
    assert debezium.handle(event("k", 2, odd_id, offset=2)) is Disposition.APPLIED
    assert debezium.handle(event("k", 2, odd_id, offset=3)) is Disposition.DUPLICATE
    assert applied(engine) == [("k", 1), ("k", 2)]


@pytest.mark.parametrize("name", ["id", "ID", "Id", "iD"])
def test_the_id_header_is_known_in_any_case(debezium: Inbox, engine: sa.Engine, name: str) -> None:
    r = event("k", 1, "e-1")
    r.headers = [(name if n == "id" else n, v) for n, v in r.headers]
    assert debezium.handle(r) is Disposition.APPLIED
    again = event("k", 1, "e-1", offset=2)
    assert debezium.handle(again) is Disposition.DUPLICATE


def test_a_header_name_is_matched_in_any_ascii_case_not_unicode_folded(engine: sa.Engine) -> None:
    """``KIND`` is ``kind``; the Kelvin sign's ``\u212aind`` only looks like it (``str.lower``
    makes it ``kind``): it was read as the type header, so a look-alike header chose the typed
    handler, and beside a real ``kind`` of another value it parked the event as carrying the
    type twice."""
    box = make_inbox(engine, foreign_records=ForeignEnvelope(id_header="id", type_header="kind"))
    seen: list[str | None] = []
    box.handler(TOPIC)(lambda session, message: seen.append(message.event_type))
    assert box.handle(event("k", 1, "e-1", headers=[("KIND", b"OrderCreated")])) is Disposition.APPLIED
    assert box.handle(event("k", 2, "e-2", headers=[("\u212aind", b"Forged")])) is Disposition.APPLIED
    assert box.handle(event("k", 3, "e-3", headers=[("kind", b"OrderPaid"), ("\u212aind", b"Forged")])
                      ) is Disposition.APPLIED
    assert seen == ["OrderCreated", None, "OrderPaid"]
    assert not box.parked()


def test_an_envelope_without_a_type_header_reads_headers_named_empty_as_any_other(engine: sa.Engine) -> None:
    """Without ``type_header`` the type's name was "": two headers of the empty name (Kafka
    allows it) with two values parked the event as carrying the type header twice."""
    box = make_inbox(engine, foreign_records=ForeignEnvelope(id_header="id"))
    box.handler(TOPIC)(apply_numbered)
    assert box.handle(event("k", 1, "e-1", headers=[("", b"a"), ("", b"b")])) is Disposition.APPLIED
    assert applied(engine) == [("k", 1)] and not box.parked()


@pytest.mark.parametrize(("headers", "why"), [
    ([("__debezium.context.connectorName", b"postgresql")], "no 'id' header"),
    ([("id", b"")], "'id' header is empty"),
    ([("id", b"e-1"), ("ID", b"e-2")], "twice with different values"),
    ([("id", b"e-1"), ("type", b"Order\x00Created")], "type header"),
    ([("id", b"e-1"), ("Type", b"A"), ("type", b"B")], "twice with different values"),
    ([("id", b"e-1"), ("content-type", b"x/" + b"y" * 120)], "content-type"),
], ids=["no-id", "empty-id", "two-ids", "bad-type", "two-types", "bad-content-type"])
def test_an_event_the_envelope_cannot_read_is_parked_as_foreign_naming_why(
        debezium: Inbox, engine: sa.Engine, headers: list[tuple[str, bytes]], why: str) -> None:
    r = Record(topic=TOPIC, key=b"k", value=b'{"n": 1}', headers=headers, partition=0, offset=1,
               timestamp_ms=1_700_000_000_000)
    assert debezium.handle(r) is Disposition.PARKED
    [parked] = debezium.parked()
    assert parked.reason is Reason.FOREIGN and why in (parked.error or ""), parked.error
    assert debezium.handle(event("k", 2)) is Disposition.APPLIED  # parked alone: the key goes on
    assert [a.kind for a in debezium.alert] == ["foreign_record"]


def test_an_id_repeated_with_the_same_value_is_read(debezium: Inbox, engine: sa.Engine) -> None:
    assert debezium.handle(event("k", 1, "e-1", headers=[("ID", b"e-1")])) is Disposition.APPLIED
    assert applied(engine) == [("k", 1)]


@pytest.mark.parametrize("key", [b"\xff\xfe", b"k" * 256, b"a\x00b", b""],
                         ids=["not-utf8", "256-chars", "nul", "empty"])
def test_a_key_no_key_column_could_hold_parks_the_event_as_foreign(debezium: Inbox, key: bytes) -> None:
    r = event("k", 1)
    r.key = key
    assert debezium.handle(r) is Disposition.PARKED
    assert "record key" in (debezium.parked()[0].error or "")


def test_an_event_without_a_key_is_an_unkeyed_message(debezium: Inbox, engine: sa.Engine) -> None:
    assert debezium.handle(event(None, 1)) is Disposition.APPLIED
    assert applied(engine) == [(None, 1)]


def test_the_type_header_chooses_the_typed_handler_and_every_header_reaches_it(engine: sa.Engine) -> None:
    box = make_inbox(engine, foreign_records="debezium")
    seen: list[Message] = []
    box.handler(TOPIC)(lambda session, message: seen.append(message))
    assert box.handle(event("k", 1, "e-1", headers=[("TYPE", b"OrderCreated")])) is Disposition.APPLIED
    [m] = seen
    assert (m.event_type, m.key, m.seq, m.content_type) == ("OrderCreated", "k", None, "application/json")
    assert m.headers["id"] == "e-1" and m.headers["TYPE"] == "OrderCreated"
    assert m.created_at.timestamp() == 1_700_000_000  # the record's timestamp


def test_a_tombstone_reaches_the_handler_as_an_empty_payload(engine: sa.Engine) -> None:
    """``route.tombstone.on.empty.payload``: the router sends the event id and key with no value."""
    box = make_inbox(engine, foreign_records="debezium")
    seen: list[Message] = []
    box.handler(TOPIC)(lambda session, message: seen.append(message))
    r = event("k", 1, "e-1")
    r.value = None  # type: ignore[assignment]  # what a consumer reads for a tombstone
    assert box.handle(r) is Disposition.APPLIED
    assert (seen[0].payload, seen[0].content_type, seen[0].key) == (b"", "application/octet-stream", "k")


def test_a_json_payload_that_is_not_json_parks_the_event_and_its_key(debezium: Inbox,
                                                                     engine: sa.Engine) -> None:
    assert debezium.handle(event("k", 1, payload=b"{not json")) is Disposition.PARKED
    assert debezium.handle(event("k", 2)) is Disposition.PARKED
    assert [(p.reason, p.seq) for p in debezium.parked()] == [(Reason.UNDECODABLE, None),
                                                               (Reason.KEY_PARKED, None)]


def test_our_envelope_and_cloudevents_are_read_as_such_whatever_the_foreign_envelope(
        debezium: Inbox, engine: sa.Engine) -> None:
    ours = record(TOPIC, "k", 1, payload=b'{"n": 7}')
    ours.headers.append(("id", b"a Debezium id on our record"))
    seen: list[Message] = []
    debezium.handler("t2")(for_inbox(debezium, lambda s, m: seen.append(m)))
    ours.topic = "t2"
    assert debezium.handle(ours) is Disposition.APPLIED
    sent_id = uuid.UUID(dict(ours.headers)["outbox-message-id"].decode())
    assert (seen[0].seq, seen[0].message_id) == (1, sent_id)


# -- per key, in partition order; parked with the key; replayed in order -----------------------

def test_a_failing_event_parks_its_key_and_what_follows_it_and_replay_applies_them_in_order(
        debezium: Inbox, engine: sa.Engine) -> None:
    broken = {"on": True}

    def handler(session, message: Message) -> None:  # type: ignore[no-untyped-def]
        if broken["on"] and message.json()["n"] == 2:
            raise RuntimeError("billing is down")
        apply_numbered(session, message)

    debezium.handler(TOPIC, replace=True)(for_inbox(debezium, handler))
    assert debezium.handle(event("k", 1, offset=1)) is Disposition.APPLIED
    assert debezium.handle(event("k", 2, offset=2)) is Disposition.PARKED  # three attempts
    assert debezium.handle(event("k", 3, offset=3)) is Disposition.PARKED  # behind it
    assert debezium.handle(event("other", 1, offset=4)) is Disposition.APPLIED
    assert debezium.handle(event("k", 4, offset=5)) is Disposition.PARKED
    parked = debezium.parked(TOPIC, "k")
    assert [(p.reason, p.offset, p.attempts) for p in parked] == [
        (Reason.FAILED, 2, 3), (Reason.KEY_PARKED, 3, 0), (Reason.KEY_PARKED, 5, 0)]
    [alert] = debezium.alert
    assert (alert.kind, alert.key) == ("key_parked", "k")
    broken["on"] = False
    result = debezium.replay(TOPIC, "k")
    assert (result.applied, result.remaining, result.unparked) == (3, 0, True)
    assert debezium.handle(event("k", 5, offset=6)) is Disposition.APPLIED
    assert applied(engine, "k") == [("k", 1), ("k", 2), ("k", 3), ("k", 4), ("k", 5)]


def test_in_one_batch_a_failed_event_holds_the_rest_of_its_key(engine: sa.Engine) -> None:
    """Several events of one key in one transaction (``batch_size``): nothing after a failed
    one applies before it, while another key in the batch does."""
    box = make_inbox(engine, foreign_records="debezium", batch_size=10)
    fails = {"left": 1}

    def handler(session, message: Message) -> None:  # type: ignore[no-untyped-def]
        if message.key == "k" and message.json()["n"] == 2 and fails["left"]:
            fails["left"] -= 1
            raise RuntimeError("once")
        apply_numbered(session, message)

    box.handler(TOPIC)(handler)
    settled = settle(box, [event("k", 1), event("k", 2), event("k", 3), event("j", 1), event("k", 4)])
    assert applied(engine) == [("k", 1), ("j", 1)]
    later = [d.message.json()["n"] for d, _ in settled.later]
    assert later == [2, 3, 4]  # the failed one first, its key's rest behind it
    settled = settle(box, [d for d, _ in settled.later])
    assert not settled.later
    assert applied(engine, "k") == [("k", 1), ("k", 2), ("k", 3), ("k", 4)]


def test_a_parked_key_without_seqs_can_have_one_event_discarded(debezium: Inbox, engine: sa.Engine) -> None:
    def handler(session, message: Message) -> None:  # type: ignore[no-untyped-def]
        if message.json()["n"] == 1:
            raise RuntimeError("poison")
        apply_numbered(session, message)

    debezium.handler(TOPIC, replace=True)(for_inbox(debezium, handler))
    assert debezium.handle(event("k", 1)) is Disposition.PARKED
    assert debezium.handle(event("k", 2)) is Disposition.PARKED
    poison = debezium.parked(TOPIC, "k")[0]
    debezium.discard(poison.message_id, by="ops", reason="known poison")
    assert debezium.replay(TOPIC, "k").unparked
    assert applied(engine, "k") == [("k", 2)]
    assert debezium.handle(event("k", 1, str(poison.message_id))) is Disposition.DUPLICATE


def test_a_parked_key_without_seqs_is_listed_page_after_page(debezium: Inbox, engine: sa.Engine) -> None:
    """The console's parked-key page went on from the last row's (seq, id): with no seq,
    ``(NULL, id) > (NULL, after)`` is no row, so the second page of a Debezium key was empty
    and the events parked behind the first 50 could not be seen."""
    from outbox.inbox.admin import parked_page

    def handler(session, message: Message) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("billing is down")

    debezium.handler(TOPIC, replace=True)(for_inbox(debezium, handler))
    for n in range(1, 6):
        assert debezium.handle(event("k", n, offset=n)) is Disposition.PARKED
    seen: list[int] = []
    after = None
    with engine.connect() as conn:
        for _ in range(5):
            rows = parked_page(conn, debezium.tables, "g", TOPIC, "k", after=after, limit=2)
            if not rows:
                break
            seen += [json.loads(r.payload)["n"] for r in rows]
            after = rows[-1].id
    assert seen == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("batch", [500, 2])
def test_a_key_of_ours_and_of_another_producer_replays_in_the_order_it_arrived(
        debezium: Inbox, engine: sa.Engine, batch: int) -> None:
    """Our seq'd messages and Debezium's events on one key string of one topic (a service
    moving from one relay to the other). Replay sorted by (seq, id), and the databases place a
    NULL seq apart: SQLite and MySQL replayed every Debezium event before our failed head
    (the events parked behind it), PostgreSQL every one after our last message."""
    broken = {"on": True}

    def handler(session, message: Message) -> None:  # type: ignore[no-untyped-def]
        if broken["on"]:
            raise RuntimeError("billing is down")
        session.execute(effects.insert().values(topic=message.topic, key=message.key,
                                                seq=message.json()["n"], message_id=message.message_id))

    debezium.handler(TOPIC, replace=True)(for_inbox(debezium, handler))
    arrivals = [record(TOPIC, "k", 1, payload=b'{"n": 1}'), event("k", 2),
                record(TOPIC, "k", 2, payload=b'{"n": 3}'), event("k", 4), event("k", 5),
                record(TOPIC, "k", 3, payload=b'{"n": 6}'), event("k", 7)]
    for r in arrivals:
        assert debezium.handle(r) is Disposition.PARKED
    broken["on"] = False
    debezium.admin.replay_batch = batch
    assert debezium.replay(TOPIC, "k").unparked
    assert applied(engine, "k") == [("k", n) for n in range(1, 8)]


# -- configuration -------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"id_header": ""}, "id_header must be a header name"),
    ({"id_header": " id"}, "id_header must be a header name"),
    ({"id_header": "a\nb"}, "id_header must be a header name"),
    ({"id_header": "h" * 201}, "id_header must be a header name"),
    ({"id_header": "Outbox-Message-Id"}, "outbox envelope header"),
    ({"id_header": "CE_SpecVersion"}, "read as CloudEvents"),  # the envelope would never read one
    ({"type_header": "ce_specversion"}, "read as CloudEvents"),
    ({"type_header": "ID"}, "one header"),
    ({"content_type": "no spaces allowed at the end "}, "content_type"),
])
def test_a_foreign_envelope_is_checked_when_made(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        ForeignEnvelope(**kwargs)


def test_debezium_is_a_name_for_its_envelope(sqlite_db: str) -> None:
    box = Inbox(sa.create_engine(sqlite_db), group="g", foreign_records="debezium")
    assert box.foreign == ForeignEnvelope(id_header="id", type_header="type",
                                          content_type="application/json")
    mine = ForeignEnvelope(id_header="event_id")
    assert Inbox(sa.create_engine(sqlite_db), group="g", foreign_records=mine).foreign is mine


# -- what else reaches an inbox topic ------------------------------------------------------------

def test_a_debezium_heartbeat_on_an_inbox_topic_parks_as_foreign_and_stops_nothing(
        debezium: Inbox, engine: sa.Engine) -> None:
    """A heartbeat (``heartbeat.interval.ms``) has a Struct key and value and no ``id``."""
    for offset in range(3):
        beat = Record(topic=TOPIC, key=b"Struct{serverName=dbz}", value=f"Struct{{ts_ms={offset}}}".encode(),
                      headers=[], partition=0, offset=offset, timestamp_ms=1_700_000_000_000 + offset)
        assert debezium.handle(beat) is Disposition.PARKED
    assert debezium.handle(event("k", 1)) is Disposition.APPLIED
    assert [p.reason for p in debezium.parked()] == [Reason.FOREIGN] * 3
    assert [a.kind for a in debezium.alert] == ["foreign_record"]


def test_a_header_without_a_value_is_an_empty_id(debezium: Inbox) -> None:
    r = event("k", 1)
    r.headers = [(n, None if n == "id" else v) for n, v in r.headers]  # type: ignore[misc]
    assert debezium.handle(r) is Disposition.PARKED
    assert "empty" in (debezium.parked()[0].error or "")


def test_a_type_or_content_type_header_without_a_value_is_one_that_is_not_there(engine: sa.Engine) -> None:
    """The router sends a NULL column placed as a header as a header without a value (what
    ``_wire`` already reads as absent for our envelope): a NULL ``type`` parked the event as
    foreign ("no event type"), a NULL ``content-type`` as a bad content type."""
    box = make_inbox(engine, foreign_records="debezium")
    seen: list[tuple[str | None, str]] = []
    box.handler(TOPIC)(lambda session, message: seen.append((message.event_type, message.content_type)))
    for n, null in enumerate(["type", "content-type", "Type"], start=1):
        r = event("k", n, headers=[(null, None)])  # type: ignore[list-item]
        assert box.handle(r) is Disposition.APPLIED, box.parked()
    twice = event("k", 4, headers=[("type", None), ("type", b"OrderPaid")])  # type: ignore[list-item]
    assert box.handle(twice) is Disposition.APPLIED
    assert seen == [(None, "application/json")] * 3 + [("OrderPaid", "application/json")]


# -- our own envelope: its headers by name, in any case ------------------------------------------

def test_our_envelope_headers_are_known_in_any_case(engine: sa.Engine) -> None:
    box = make_inbox(engine)
    seen: list[Message] = []
    box.handler(TOPIC)(lambda session, message: seen.append(message))
    r = record(TOPIC, "k", 1)
    r.headers = [(n.upper() if n.startswith("outbox-") else n.title(), v) for n, v in r.headers]
    assert box.handle(r) is Disposition.APPLIED
    assert (seen[0].seq, seen[0].key, seen[0].content_type) == (1, "k", "application/json")
    assert box.handle(record(TOPIC, "k", 2)) is Disposition.APPLIED  # the key went on from seq 1


@pytest.mark.parametrize("twice", ["outbox-seq", "OUTBOX-MESSAGE-ID", "Content-Type"])
def test_an_envelope_header_twice_with_two_values_is_a_broken_envelope(engine: sa.Engine, twice: str) -> None:
    box = make_inbox(engine)
    box.handler(TOPIC)(lambda session, message: None)
    r = record(TOPIC, "k", 1)
    r.headers.append((twice, b"7" if "seq" in twice else str(uuid.uuid4()).encode()
                      if "id" in twice.lower() else b"text/plain"))
    assert box.handle(r) is Disposition.PARKED
    [parked] = box.parked()
    assert parked.reason is Reason.FOREIGN and "twice with different values" in (parked.error or "")
    same = record(TOPIC, "j", 1)
    same.headers.append(("OUTBOX-SEQ", b"1"))  # repeated alike: read
    assert box.handle(same) is Disposition.APPLIED
