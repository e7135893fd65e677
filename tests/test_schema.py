"""Tables, indexes, prefixes and schemas on both backends; the CLI that creates them."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

import outbox
from outbox import Outbox, OutboxTables, create_engine
from outbox.cli import app

TABLES = {"outbox_messages", "outbox_keys", "outbox_leases", "outbox_relays", "outbox_meta",
          "inbox_messages", "inbox_keys", "inbox_parked", "inbox_held"}


def test_create_tables_with_prefix_and_user_metadata(engine):
    metadata = sa.MetaData()
    sa.Table("orders", metadata, sa.Column("id", sa.Integer, primary_key=True))
    tables = OutboxTables(metadata, prefix="shop_")
    Outbox(engine, tables=tables).create_tables()
    names = set(sa.inspect(engine).get_table_names())
    assert {f"shop_{t}" for t in TABLES} | {"orders"} <= names
    Outbox(engine, tables=tables).create_tables()  # idempotent


def test_pending_index_is_partial(engine, outbox):
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            sql = conn.scalar(sa.text(
                "SELECT sql FROM sqlite_master WHERE name = 'ix_outbox_pending'"))
        else:
            sql = conn.scalar(sa.text(
                "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_outbox_pending'"))
    assert "WHERE" in sql.upper() and "pending" in sql


@pytest.mark.postgres
def test_schema_on_postgresql(postgres_db):
    engine = create_engine(postgres_db)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE SCHEMA events"))
    ob = Outbox(engine, schema="events")
    ob.create_tables()
    assert set(sa.inspect(engine).get_table_names(schema="events")) >= TABLES

    @ob.transactional
    def write(*, session):
        return ob.publish(session, "orders", {"a": 1}, key="k")

    write()
    with engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT seq FROM events.outbox_messages")) == 1
    engine.dispose()


@pytest.mark.postgres
def test_publish_notifies_at_commit(postgres_db):
    import psycopg

    engine = create_engine(postgres_db)
    ob = Outbox(engine)
    ob.create_tables()
    dsn = sa.make_url(postgres_db).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN outbox")
        with sa.orm.Session(engine) as session:
            session.begin()
            ob.publish(session, "orders", {"a": 1}, key="order-1")
            assert list(listener.notifies(timeout=0.3, stop_after=1)) == []
            session.commit()
        notes = list(listener.notifies(timeout=5, stop_after=1))
    assert [n.channel for n in notes] == ["outbox"]
    shard, schema = notes[0].payload.split(":")  # the server's name for the schema written to
    assert int(shard) in range(ob.shards) and schema == "public"
    engine.dispose()


def test_init_db_cli(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    result = CliRunner().invoke(app, ["init-db", "--db", url, "--prefix", "app_"])
    assert result.exit_code == 0, result.output
    assert {f"app_{t}" for t in TABLES} <= set(sa.inspect(sa.create_engine(url)).get_table_names())


def test_init_db_cli_rejects_bad_prefix(tmp_path):
    result = CliRunner().invoke(app, ["init-db", "--db", f"sqlite:///{tmp_path}/x.db",
                                      "--prefix", "drop table"])
    assert result.exit_code == 2
    assert "invalid table prefix 'drop table'" in result.output
    assert "Traceback" not in result.output


PUBLIC_API = [
    "Alert", "AlertKind", "AlertSink", "AsyncOutbox", "BatchResult", "CloudEvents", "CommitRefusedError",
    "CommitUnansweredError", "CommitUnconfirmedError",
    "ConfigurationError",
    "DiscardRefusedError", "Disposition", "ForeignEnvelope", "ForeignRecordError", "ForeignRecords",
    "HandlerSignal", "HeldByOpenTransactionError", "Inbox", "InvalidContentTypeError", "InvalidDelayError",
    "InvalidEventTypeError",
    "InvalidHeadersError",
    "InvalidKeyError", "InvalidTopicError",
    "LoggingAlertSink", "Message", "MessageValidationError", "NonStandardJsonError", "NotParkedError",
    "Outbox",
    "OutboxError", "OutboxTables", "ParkMessage", "ParkedMessage", "ParkedReplay",
    "PayloadTooLargeError", "RecordTooLargeError", "Relay", "RelayMetrics", "RetriableTransportError",
    "RetryLater", "SchemaError", "SkipMessage", "StartPolicy", "TopicNotFoundError", "TransportError",
    "UnknownEvents",
    "UnserializablePayloadError",
    "WebhookAlertSink",
    "create_async_engine", "create_engine", "event", "event_type_of", "message_to_record",
    "new_message_id", "record_to_message", "relay_metrics", "tune_gc_for_batches", "upcaster",
]


def test_public_api_is_pinned():
    """Adding or removing a public name is a decision: change this list with it."""
    assert outbox.__all__ == PUBLIC_API
    for name in PUBLIC_API:
        getattr(outbox, name)


TESTING_API = [
    "DEBEZIUM_LIBS_VARIABLE", "FAST_SETTINGS", "JVM_OPTIONS_ENV", "KAFKA_BOOTSTRAP_VARIABLE",
    "KAFKA_CONNECT_URL_VARIABLE",
    "KAFKA_LIBS_VARIABLE", "LOGICAL_POSTGRES_URL_VARIABLE", "LOGICAL_SETTINGS", "MYSQL_URL_VARIABLE",
    "POSTGRES_URL_VARIABLE", "BrokerNeed", "ConnectRest", "ConnectStartError", "ConnectorFailed",
    "DebeziumOutbox", "InMemoryBroker", "InMemorySource", "InMemoryTransport", "KafkaNode",
    "KafkaStartError", "LocalKafka", "LocalKafkaCluster", "LocalKafkaConnect", "LocalMariaDB",
    "LocalPostgres", "OutboxTestHarness", "PortNotBound", "Settled", "Unavailable", "alter_topic",
    "create_topic", "debezium_outbox_config", "debezium_outbox_table", "debezium_over_our_outbox",
    "delete_topic", "docker_engine_answers", "free_port", "free_ports", "fresh_database",
    "fresh_mysql_database",
    "kafka_bootstrap", "kafka_connect", "local_kafka", "local_mariadb", "local_postgres",
    "local_postgres_server", "logical_postgres_url", "mariadb_binaries", "mysql_url", "postgres_bindir",
    "postgres_url", "set_producer_quota", "wait_until_bound",
]


def test_testing_api_is_pinned():
    """``outbox.testing`` is public too (docs/testing.md): its names change with this list."""
    import outbox.testing

    assert outbox.testing.__all__ == TESTING_API
    for name in TESTING_API:
        getattr(outbox.testing, name)
