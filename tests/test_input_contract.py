"""publish()'s input contract: what it accepts arrives intact; the rest is refused by name, unwritten.

Regression cases of issue 23 (items 1, 4 and 5) first, then properties over
the input domain: all of Unicode for key and headers (lone surrogates and
control characters included), bytes, nested JSON with NaN, infinities and
colliding keys, and record sizes at and around the limit. The record size is
checked against librdkafka itself (a producer refuses a record over
``message.max.bytes`` at ``produce()``, before any broker is asked).
"""

from __future__ import annotations

import json
import math
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pydantic
import pytest
import sqlalchemy as sa
from confluent_kafka import KafkaError, KafkaException, Producer
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from outbox import (
    ConfigurationError,
    InvalidDelayError,
    InvalidHeadersError,
    InvalidKeyError,
    MessageValidationError,
    NonStandardJsonError,
    Outbox,
    RecordTooLargeError,
    UnserializablePayloadError,
)
from outbox.core._cloudevents import MAX_SOURCE_BYTES, MAX_TYPE_BYTES, cloudevent_headers
from outbox.core._envelope import BYTES, JSON, TEXT
from outbox.core._wire import INCARNATION_BUDGET, envelope_size, header_size, record_size, to_record

LIMIT = 4096  # the smallest stored limit: records around it are cheap to make


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """Every test here runs on SQLite, PostgreSQL and MariaDB."""
    return proof_db_url


def count(engine: sa.Engine, outbox: Outbox) -> int:
    with engine.connect() as conn:
        return conn.scalar(sa.select(sa.func.count()).select_from(outbox.tables.messages)) or 0


class Reading(pydantic.BaseModel):
    celsius: float


# (publish arguments, error, what the message must name); each was accepted, or raised a
# bare builtin, before the contract.
REGRESSIONS: list[tuple[dict[str, Any], type[MessageValidationError], str]] = [
    # item 1: a header no relay could encode
    ({"headers": {"h": "v\ud800"}}, InvalidHeadersError, "header 'h' is not valid Unicode"),
    ({"headers": {"h\udfff": "v"}}, InvalidHeadersError, "header name is not valid Unicode"),
    ({"key": "k\ud800"}, InvalidKeyError, "key is not valid Unicode"),
    ({"payload": "text \ud800"}, UnserializablePayloadError, "str payload is not valid Unicode"),
    # item 4: records the relay's producer could never send
    ({"payload": b"x" * 1_040_000}, RecordTooLargeError, "payload 1040000 bytes"),
    ({"payload": b"x" * (1024 * 1024)}, RecordTooLargeError, "payload 1048576 bytes"),
    ({"payload": b"x" * 100, "headers": {"big": "v" * 2_000_000}}, RecordTooLargeError,
     "1 header"),
    # item 5: non-standard JSON, a header name cut at NUL, delays out of range
    ({"payload": {"t": float("nan")}}, NonStandardJsonError, "NaN"),
    ({"payload": [1.5, float("inf")]}, NonStandardJsonError, "Infinity"),
    ({"payload": {"t": -math.inf}}, NonStandardJsonError, "-Infinity"),
    ({"payload": Reading(celsius=float("nan"))}, NonStandardJsonError, "JSON null"),
    ({"payload": {1: "a", "1": "b"}}, NonStandardJsonError, "JSON key '1'"),
    ({"payload": {"deep": [{2: 0, "2": 1}]}}, NonStandardJsonError, "JSON key '2'"),
    ({"headers": {"a\x00b": "v"}}, InvalidHeadersError, "contains NUL"),
    ({"delay": float("nan")}, InvalidDelayError, "finite"),
    ({"delay": float("inf")}, InvalidDelayError, "finite"),
    ({"delay": 9000 * 365 * 86400.0}, InvalidDelayError, "up to 3650 days"),
    ({"delay": 10**30}, InvalidDelayError, "up to 3650 days"),
    ({"delay": timedelta(days=999_999_999)}, InvalidDelayError, "up to 3650 days"),
    ({"delay": timedelta(days=3650, microseconds=1)}, InvalidDelayError, "up to 3650 days"),
]


@pytest.mark.parametrize("override, error, message", REGRESSIONS,
                         ids=[f"{e.__name__}-{i}" for i, (_, e, _) in enumerate(REGRESSIONS)])
def test_input_outside_the_contract_is_refused_by_name_and_commits_nothing(
    engine, outbox, override, error, message
):
    args = {"key": "k", **override}
    payload = args.pop("payload", {"ok": True})

    @outbox.transactional
    def write(*, session) -> None:
        outbox.publish(session, "orders", {"first": "valid"}, key="k")
        outbox.publish(session, "orders", payload, **args)

    with pytest.raises(error, match=message) as raised:
        write()
    assert len(str(raised.value)) < 400, "the error echoes a huge value"
    assert count(engine, outbox) == 0


async def test_publish_async_keeps_the_same_contract(tmp_path):
    from outbox import create_async_engine

    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}")
    outbox = Outbox(engine)
    await outbox.create_tables_async()
    for override, error, _ in REGRESSIONS:
        args = {"key": "k", **override}
        payload = args.pop("payload", {"ok": True})
        with pytest.raises(error):
            async with outbox.begin_async() as session:
                await outbox.publish_async(session, "orders", payload, **args)
    async with engine.connect() as conn:
        assert await conn.scalar(sa.select(sa.func.count()).select_from(outbox.tables.messages)) == 0
    await engine.dispose()


def test_the_longest_delay_and_nul_or_control_characters_in_header_values_are_accepted(engine, outbox):
    headers = {"nul": "a\x00b", "ctl": "\x01\x1b[31m\r\n\x7f", "rtl": "\u202eevil", "e": ""}
    with outbox.begin() as session:
        outbox.publish(session, "orders", b"x", key="k\n\t\x1b", headers=headers,
                       delay=timedelta(days=3650))
    with engine.connect() as conn:
        m = outbox.tables.messages
        key, stored, as_text = conn.execute(
            sa.select(m.c.key, m.c.headers, sa.cast(m.c.headers, sa.Text))).one()
    assert key == "k\n\t\x1b"
    assert stored == headers and json.loads(as_text) == headers  # as the relay reads it


# -- the record size: librdkafka's count, at and around the limit ---------------------------


def widest_record(row: dict[str, Any]) -> Any:
    """The record the relay builds from a stored row, with every envelope header at its widest."""
    created = datetime(2026, 11, 25, 9, 16, 57, 123456, tzinfo=UTC)
    record = to_record(message_id=row["message_id"], topic=row["topic"], key=row["key"],
                       seq=2**63 - 1, payload=row["payload"], content_type=row["content_type"],
                       headers=row["headers"], created_at=created,
                       available_at=created + timedelta(days=3650))
    record.headers.append((INCARNATION_BUDGET[0], str(uuid.uuid4()).encode()))
    # A relay in CloudEvents mode adds the ce_* attributes: source and type at their widest.
    record.headers.extend(cloudevent_headers(
        source="s" * MAX_SOURCE_BYTES, message_id=row["message_id"], topic=row["topic"],
        event_type="t" * MAX_TYPE_BYTES, created_at=created, seq=2**63 - 1,
        incarnation=str(uuid.uuid4())))
    return record


def librdkafka_accepts(record: Any, max_bytes: int) -> bool:
    """Whether a librdkafka producer with ``message.max.bytes=max_bytes`` takes ``record``."""
    producer = Producer({"bootstrap.servers": "127.0.0.1:9", "message.max.bytes": max_bytes,
                         "log_level": 0})
    try:
        producer.produce(record.topic, value=record.value, key=record.key, headers=record.headers)
    except KafkaException as exc:
        assert exc.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE, exc
        return False
    finally:
        producer.purge()
    return True


def test_the_record_size_is_librdkafkas_to_the_byte():
    """``record_size`` is what librdkafka checks: a producer takes the record at that limit, not one below."""
    record = widest_record({"message_id": uuid.uuid4(), "topic": "t", "key": "ключ-🔑" * 20,
                            "payload": b"p" * 1500, "content_type": TEXT,
                            "headers": {"é" * 70: "😀" * 40, "traceparent": "00-" + "a" * 52}})
    size = record_size(record)
    assert librdkafka_accepts(record, size)
    assert not librdkafka_accepts(record, size - 1)


def _publish(outbox: Outbox, payload: object, key: str | None, headers: dict[str, str]) -> dict[str, Any]:
    """Publish one message; return the stored row."""
    with outbox.begin() as session:
        message_id = outbox.publish(session, "orders", payload, key=key, headers=headers)
        m = outbox.tables.messages
        row = session.execute(sa.select(m).where(m.c.message_id == message_id)).mappings().one()
    return dict(row)


@pytest.fixture
def small_outbox(engine) -> Outbox:
    outbox = Outbox(engine, max_record_bytes=LIMIT)
    outbox.create_tables()
    return outbox


texts = st.text(st.characters(codec="utf-8"), max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.none() | texts.filter(lambda k: k and "\x00" not in k),
       headers=st.dictionaries(texts.filter(lambda n: n and "\x00" not in n
                                            and not n.lower().startswith(("outbox-", "content-type"))),
                               texts, max_size=4),
       delta=st.integers(-2, 2))
def test_records_at_and_around_the_limit(engine, small_outbox, key, headers, delta):
    """limit-2 … limit+2 bytes, counting multi-byte key and header text: stored iff it fits,
    and whatever is stored, librdkafka sends at that limit as the relay builds it."""
    fixed = envelope_size(BYTES) + len((key or "").encode()) + sum(
        header_size(len(n.encode()), len(v.encode())) for n, v in headers.items())
    assume(fixed + delta <= LIMIT)
    payload = b"\xff" * (LIMIT - fixed + delta)
    before = count(engine, small_outbox)
    if delta > 0:
        with pytest.raises(RecordTooLargeError, match=f"{LIMIT + delta} bytes"):
            _publish(small_outbox, payload, key, headers)
        assert count(engine, small_outbox) == before
        return
    row = _publish(small_outbox, payload, key, headers)
    assert (row["payload"], row["key"], row["headers"]) == (payload, key, headers)
    record = widest_record(row)
    assert record_size(record) == LIMIT + delta
    assert librdkafka_accepts(record, LIMIT)


# -- every text, every JSON value ----------------------------------------------------------

any_char = st.characters(codec=None, categories=None)  # surrogates and control characters too
any_text = st.text(any_char, max_size=20)


def has_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.none() | any_text, headers=st.dictionaries(any_text, any_text, max_size=3),
       payload=st.binary(max_size=64) | any_text)
def test_any_text_is_stored_intact_or_refused_by_name(engine, outbox, key, headers, payload):
    before = count(engine, outbox)
    bad_key = key is not None and (not key or "\x00" in key or not has_utf8(key))
    bad_headers = any(not n or "\x00" in n or n.lower().startswith("outbox-") or n.lower() == "content-type"
                      or not has_utf8(n) or not has_utf8(v) for n, v in headers.items())
    bad_payload = isinstance(payload, str) and not has_utf8(payload)
    try:
        row = _publish(outbox, payload, key, headers)
    except MessageValidationError as exc:
        assert isinstance(exc, InvalidKeyError | InvalidHeadersError | UnserializablePayloadError)
        assert bad_key or bad_headers or bad_payload, f"refused what the contract accepts: {exc}"
        assert count(engine, outbox) == before
        return
    assert not (bad_key or bad_headers or bad_payload), "accepted what the contract refuses"
    body = payload if isinstance(payload, bytes) else payload.encode()
    assert (row["key"], row["payload"], row["headers"]) == (key, body, headers)
    with engine.connect() as conn:  # as the relay reads headers: the column's text, decoded
        m = outbox.tables.messages
        as_text = conn.scalar(
            sa.select(sa.cast(m.c.headers, sa.Text)).where(m.c.message_id == row["message_id"]))
    assert json.loads(as_text) == headers
    record = widest_record(row)  # and the relay can encode it
    assert record.key == (key.encode() if key is not None else None)


scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | any_text)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(any_text | st.integers(-3, 3), inner, max_size=4),
    max_leaves=12,
)


def expected(value: Any) -> Any:
    """What a consumer must read back, or the error ``publish()`` must raise instead."""
    if isinstance(value, float) and not math.isfinite(value):
        raise NonStandardJsonError
    if isinstance(value, str) and not has_utf8(value):
        raise UnserializablePayloadError
    if isinstance(value, list):
        return [expected(v) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if isinstance(k, str) and not has_utf8(k):
                raise UnserializablePayloadError
            if str(k) in out:
                raise NonStandardJsonError
            out[str(k)] = expected(v)
        return out
    return value


@pytest.fixture
def sqlite_only(tmp_path) -> tuple[sa.Engine, Outbox]:
    """The payload is a byte column on every database: JSON's rules are checked once, on SQLite."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'json.db'}")
    outbox = Outbox(engine)
    outbox.create_tables()
    return engine, outbox


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.dictionaries(any_text | st.integers(-3, 3), json_values, max_size=5)
       | st.lists(json_values))
def test_json_payloads_are_standard_json_read_back_as_sent_or_refused(sqlite_only, payload):
    engine, outbox = sqlite_only
    before = count(engine, outbox)
    try:
        want = expected(payload)
    except (NonStandardJsonError, UnserializablePayloadError):
        with pytest.raises(UnserializablePayloadError):  # NonStandardJsonError is one
            _publish(outbox, payload, "k", {})
        assert count(engine, outbox) == before
        return
    row = _publish(outbox, payload, "k", {})
    assert row["content_type"] == JSON

    def no_constant(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    def once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        assert len({k for k, _ in pairs}) == len(pairs), "a key twice"
        return dict(pairs)
    assert json.loads(row["payload"], parse_constant=no_constant, object_pairs_hook=once) == want


@settings(max_examples=100, deadline=None)
@given(value=st.floats(allow_nan=True, allow_infinity=True))
def test_a_model_float_is_sent_as_the_number_or_refused(value):
    from outbox.core._envelope import serialize_payload

    if math.isfinite(value):
        body, _ = serialize_payload(Reading(celsius=value))
        assert json.loads(body) == {"celsius": value}
    else:
        with pytest.raises(NonStandardJsonError):
            serialize_payload(Reading(celsius=value))


# -- the limit: one setting, stored with the tables, agreed with the relay's producer ------


def sqlite_outbox(tmp_path, **kwargs: Any) -> Outbox:
    return Outbox(sa.create_engine(f"sqlite:///{tmp_path / 'limit.db'}"), **kwargs)


def test_the_limit_is_stored_by_create_tables_and_read_by_every_publisher(tmp_path):
    writer = sqlite_outbox(tmp_path, max_record_bytes=LIMIT)
    writer.create_tables()
    publisher = sqlite_outbox(tmp_path)  # names no limit: uses the stored one
    with publisher.begin() as session, pytest.raises(RecordTooLargeError, match=f"max_record_bytes={LIMIT}"):
        publisher.publish(session, "orders", b"x" * LIMIT)
    assert publisher.load_schema().max_record_bytes == LIMIT
    with pytest.raises(ConfigurationError, match="max_record_bytes=5000 was asked for"):
        sqlite_outbox(tmp_path, max_record_bytes=5000).load_schema()
    with pytest.raises(ConfigurationError, match="max_record_bytes must be an int from 4096"):
        sqlite_outbox(tmp_path, max_record_bytes=100)


def test_a_database_made_before_the_limit_uses_the_default(tmp_path):
    outbox = sqlite_outbox(tmp_path)
    outbox.create_tables()
    assert isinstance(outbox.engine, sa.Engine)
    with outbox.engine.begin() as conn:
        conn.execute(sa.delete(outbox.tables.meta).where(outbox.tables.meta.c.name == "max_record_bytes"))
    assert sqlite_outbox(tmp_path).load_schema().max_record_bytes == 1_000_000


class SizedTransport:
    """A transport that only says how large a record it sends (the relay asks nothing else at start)."""

    max_record_setting = "message.max.bytes"

    def __init__(self, max_record_bytes: int) -> None:
        self.max_record_bytes = max_record_bytes

    def publish(self, records: Any) -> list[Any]:
        raise AssertionError("not sent")

    def close(self, timeout: float = 10.0) -> None:
        pass


def test_a_relay_whose_producer_sends_less_than_the_stored_limit_refuses_to_start(tmp_path):
    from outbox import Relay
    from transports.kafka import KafkaTransport
    from transports.kafka_python import KafkaPythonTransport

    outbox = sqlite_outbox(tmp_path)
    outbox.create_tables()
    with pytest.raises(ConfigurationError, match=r"at most 999999 bytes \(message.max.bytes\).*"
                                                 r"max_record_bytes=1000000"):
        Relay(outbox, SizedTransport(999_999))
    Relay(outbox, SizedTransport(1_000_000))  # equal is enough
    small = KafkaTransport(bootstrap_servers="127.0.0.1:9", max_request_size=500_000)
    try:
        assert small.max_record_bytes == 500_000
        with pytest.raises(ConfigurationError, match="raise that setting to allow 1000000"):
            Relay(outbox, small)
    finally:
        small.close(0.1)

    class KafkaProducerSettings:  # what KafkaPythonTransport reads of a kafka.KafkaProducer
        config = {"acks": "all", "max_request_size": 1_000_060}
        send = flush = partitions_for = None

    assert KafkaPythonTransport(KafkaProducerSettings()).max_record_bytes == 999_999
    with pytest.raises(ConfigurationError, match="max_request_size less 61 bytes"):
        Relay(outbox, KafkaPythonTransport(KafkaProducerSettings()))


def test_a_producer_queue_smaller_than_the_stored_limit_refuses_the_relay(tmp_path):
    """librdkafka never takes a record whose value outgrows its whole queue
    (``queue.buffering.max.kbytes``): such a row used to be found at its send, failed for good and its
    key held. A queue set smaller than the stored limit refuses the relay at start, naming it."""
    from outbox import Relay
    from transports.kafka import KafkaTransport

    outbox = sqlite_outbox(tmp_path)
    outbox.create_tables()
    small = KafkaTransport({"queue.buffering.max.kbytes": 512}, bootstrap_servers="127.0.0.1:9")
    try:
        assert (small.max_record_bytes, small.max_record_setting) == (524_288, "queue.buffering.max.kbytes")
        with pytest.raises(ConfigurationError, match=r"at most 524288 bytes \(queue.buffering.max.kbytes\)"):
            Relay(outbox, small)
    finally:
        small.close(0.1)
    roomy = KafkaTransport({"queue.buffering.max.kbytes": 977}, bootstrap_servers="127.0.0.1:9")
    try:  # 1,000,448 bytes of queue: message.max.bytes (1,000,000) decides, and the relay starts
        assert (roomy.max_record_bytes, roomy.max_record_setting) == (1_000_000, "message.max.bytes")
        Relay(outbox, roomy).close()
    finally:
        roomy.close(0.1)
    from typer.testing import CliRunner

    from outbox.cli import app

    url = f"sqlite:///{tmp_path / 'limit.db'}"
    refused = CliRunner().invoke(app, ["relay", "--db", url, "--bootstrap-servers", "127.0.0.1:9",
                                       "-X", "queue.buffering.max.kbytes=512"])
    assert refused.exit_code == 2, refused.output
    assert "at most 524288 bytes (queue.buffering.max.kbytes)" in refused.output


def test_init_db_stores_the_limit_and_a_smaller_producer_stops_the_relay_cli(tmp_path):
    from typer.testing import CliRunner

    from outbox.cli import app

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    created = CliRunner().invoke(app, ["init-db", "--db", url, "--max-record-bytes", "2000000"])
    assert created.exit_code == 0, created.output
    assert "max record bytes 2000000" in created.output
    refused = CliRunner().invoke(app, ["relay", "--db", url, "--bootstrap-servers", "127.0.0.1:9"])
    assert refused.exit_code == 2
    assert "at most 1000000 bytes (message.max.bytes)" in refused.output
    assert "max_record_bytes=2000000" in refused.output
    assert "Traceback" not in refused.output
    assert len(refused.output.strip().splitlines()) <= 2


class Inner(pydantic.BaseModel):
    x: float | None = None


class Outer(pydantic.BaseModel):
    label: str | None = None
    inner: Inner


class Ratio(pydantic.BaseModel):
    a: int

    @pydantic.computed_field
    def ratio(self) -> float:
        return self.a / 0 if self.a else math.nan


class Loose(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    name: str | None = None


@pytest.mark.parametrize("payload", [
    Outer(inner=Inner(x=math.nan)), Ratio(a=0), Loose(spare=math.inf),
    {"reading": Inner(x=-math.inf), "note": None}, [None, Inner(x=math.nan)],
], ids=["nested model", "computed field", "extra field", "model in a dict", "model in a list"])
def test_a_nan_a_model_would_write_as_null_is_refused_wherever_the_model_sits(payload):
    from outbox.core._envelope import serialize_payload

    with pytest.raises(NonStandardJsonError, match="JSON null"):
        serialize_payload(payload)
