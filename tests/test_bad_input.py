"""Each invalid input raises the named error inside publish() and commits nothing."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa

from outbox import (
    ConfigurationError,
    InvalidContentTypeError,
    InvalidDelayError,
    InvalidHeadersError,
    InvalidKeyError,
    InvalidTopicError,
    Outbox,
    OutboxError,
    OutboxTables,
    PayloadTooLargeError,
    UnserializablePayloadError,
)
from outbox.core import _validation
from outbox.core._envelope import BYTES
from outbox.core._validation import validate_content_type
from outbox.core._wire import envelope_size

OK = {"topic": "orders", "payload": {"ok": True}, "key": "k"}

CASES = [
    ({"topic": ""}, InvalidTopicError, "invalid topic ''"),
    ({"topic": "orders/eu"}, InvalidTopicError, "orders/eu"),
    ({"topic": "x" * 250}, InvalidTopicError, "1-249 characters"),
    ({"topic": ".."}, InvalidTopicError, "'..'"),
    ({"topic": 42}, InvalidTopicError, "topic must be a str"),
    ({"key": 1.5}, InvalidKeyError, "got float"),
    ({"key": b"raw"}, InvalidKeyError, "got bytes"),
    ({"key": True}, InvalidKeyError, "got bool"),
    ({"key": ""}, InvalidKeyError, "must not be empty"),
    ({"key": "k" * 256}, InvalidKeyError, "256 characters"),
    ({"key": "a\x00b"}, InvalidKeyError, "NUL"),
    ({"payload": object()}, UnserializablePayloadError, "got object"),
    ({"payload": {"when": object()}}, UnserializablePayloadError, "not JSON-serialisable"),
    ({"payload": None}, UnserializablePayloadError, "got NoneType"),
    ({"payload": b"x" * (1024 * 1024 + 1)}, PayloadTooLargeError, "payload 1048577 bytes"),
    ({"headers": {"trace": 1}}, InvalidHeadersError, "'trace' must be a str"),
    ({"headers": {"outbox-seq": "1"}}, InvalidHeadersError, "reserved"),
    ({"headers": ["a"]}, InvalidHeadersError, "must be a mapping"),
    ({"payload": b"x", "content_type": ""}, InvalidContentTypeError, "1-100 visible ASCII"),
    ({"payload": b"x", "content_type": "a\nb"}, InvalidContentTypeError, "1-100 visible ASCII"),
    ({"payload": b"x", "content_type": 7}, InvalidContentTypeError, "got 7"),
    ({"payload": {"a": 1}, "content_type": "application/avro"}, InvalidContentTypeError,
     "a dict payload is always sent as application/json"),
    ({"delay": -1}, InvalidDelayError, "must not be negative"),
    ({"delay": "soon"}, InvalidDelayError, "timedelta or seconds"),
]


@pytest.mark.parametrize("override, error, message", CASES,
                         ids=[f"{next(iter(o))}-{e.__name__}" for o, e, _ in CASES])
def test_bad_input_raises_named_error_and_commits_nothing(engine, outbox, override, error, message):
    args = {**OK, **override}

    @outbox.transactional
    def write(*, session) -> None:
        outbox.publish(session, "orders", {"first": "valid"}, key="k")
        outbox.publish(session, args.pop("topic"), args.pop("payload"), **args)

    with pytest.raises(error, match=message):
        write()
    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(outbox.tables.messages)) == 0
        assert conn.scalar(sa.select(sa.func.count()).select_from(outbox.tables.keys)) == 0


def test_errors_resemble_builtins():
    assert issubclass(InvalidTopicError, ValueError) and issubclass(InvalidTopicError, OutboxError)
    assert issubclass(UnserializablePayloadError, TypeError)
    assert issubclass(ConfigurationError, ValueError)


@pytest.mark.parametrize("prefix", ["bad-prefix", "1abc", "a b", "x;drop table y", "é"])
def test_bad_table_prefix(prefix):
    with pytest.raises(ConfigurationError, match="invalid table prefix"):
        OutboxTables(prefix=prefix)


@pytest.mark.parametrize("kwargs, message", [
    ({"schema": "public.x"}, "invalid schema"),
    ({"shards": 0}, "shards must be an int from 1 to 4096"),
    ({"max_payload_bytes": -5}, "max_payload_bytes must be a positive int"),
    ({"notify_channel": "bad channel"}, "invalid notify channel"),
    ({"prefix": "a_", "tables": OutboxTables()}, "either tables= or prefix="),
])
def test_bad_configuration_fails_at_construction(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        Outbox(sa.create_engine("sqlite://"), **kwargs)


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """The publish-time checks run on SQLite, PostgreSQL and MySQL/MariaDB."""
    return proof_db_url


def test_unsupported_database_is_refused_at_construction():
    from outbox.producer._statements import PublishStatements

    with pytest.raises(ConfigurationError, match="unsupported database dialect 'oracle'"):
        PublishStatements(OutboxTables(), "oracle", None)


def test_a_prefix_too_long_for_an_identifier_is_refused_at_construction():
    """PostgreSQL truncates a name past 63 characters (two tables could then share one),
    MySQL refuses one past 64: the prefix is checked before any SQL runs."""
    OutboxTables(prefix="p" * 40)  # the longest that fits: ux_{prefix}inbox_parked_message is 63
    with pytest.raises(ConfigurationError, match=r"table prefix 'p{41}' is too long: .* at most 40"):
        OutboxTables(prefix="p" * 41)


def test_keys_that_differ_in_case_or_trailing_space_are_different_keys(engine, outbox):
    """MySQL's default collations compare "A" = "a" and "a" = "a ": the tables use a binary one."""
    with outbox.begin() as session:
        for key in ["a", "A", "a ", "a", "é", "e"]:
            outbox.publish(session, "orders", {"k": key}, key=key)
    m = outbox.tables.messages
    with engine.connect() as conn:
        rows = conn.execute(sa.select(m.c.key, m.c.seq).order_by(m.c.id)).all()
    assert [tuple(r) for r in rows] == [("a", 1), ("A", 1), ("a ", 1), ("a", 2), ("é", 1), ("e", 1)]


def test_accepted_key_types_and_max_size(outbox, engine):
    @outbox.transactional
    def write(*, session):
        return [
            outbox.publish(session, "orders", b"x", key=12),
            outbox.publish(session, "orders", b"x", key=uuid.UUID(int=1)),
            # The largest payload the default record limit leaves beside the longest key.
            outbox.publish(session, "orders", b"x" * (1_000_000 - 255 - envelope_size(BYTES)),
                           key="k" * 255, delay=timedelta(seconds=5)),
        ]

    assert len(write()) == 3


def test_content_type_labels_bytes_and_str_payloads(engine, outbox):
    @outbox.transactional
    def write(*, session) -> None:
        outbox.publish(session, "orders", b"\x00avro", key="k", content_type="application/avro")
        outbox.publish(session, "orders", "id,amount\n1,5\n", content_type="text/csv; charset=utf-8")
        outbox.publish(session, "orders", b"raw")

    write()
    m = outbox.tables.messages
    with engine.connect() as conn:
        types = conn.scalars(sa.select(m.c.content_type).order_by(m.c.id)).all()
    assert types == ["application/avro", "text/csv; charset=utf-8", "application/octet-stream"]


def test_content_types_checked_once_are_remembered_and_the_rest_still_refused() -> None:
    """The consumer checks every message's content type, so valid ones are remembered; the
    memory is bounded (a sender of endless odd types cannot grow it) and never lets a bad one by."""
    for n in range(200):
        assert validate_content_type(f"application/x-{n}") == f"application/x-{n}"
    assert len(_validation._VALID_CONTENT_TYPES) <= 64
    for bad in ["", "a\nb", " leading", "x" * 101, 7, ["application/json"]]:
        with pytest.raises(InvalidContentTypeError):
            validate_content_type(bad)
