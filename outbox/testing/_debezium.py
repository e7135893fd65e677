"""Debezium's outbox event router in the test bed: the outbox table it reads and the connector that reads it.

``DebeziumOutbox`` creates a Debezium-layout outbox table (Debezium's docs,
"Basic outbox table": ``id uuid``, ``aggregatetype``, ``aggregateid``,
``type``, ``payload jsonb``) in a PostgreSQL with ``wal_level=logical``,
configures Debezium's PostgreSQL connector (``plugin.name=pgoutput``, its own
replication slot and publication, no snapshot) with the outbox
``EventRouter`` on a Kafka Connect worker, and returns once the connector and
its task say RUNNING *and* a first record went through: a probe row, inserted
and deleted in one transaction (the router ignores the delete), must arrive on
its topic with its id in the ``id`` header. ``close()`` removes the connector,
its replication slot (a slot left behind keeps the server's WAL forever) and
its publication.

What reaches Kafka: topic ``outbox.event.<aggregatetype>``; key = the
``aggregateid``; value = the ``payload`` column's JSON text; headers ``id``
(the event id), ``type`` (the ``type`` column: ``table.fields.additional.placement
=type:header:type``) and Debezium's ``__debezium.context.*``.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from ._connect import RUNNING_TIMEOUT, ConnectRest
from ._kafka_admin import create_topic

ROUTE = "outbox.event.${routedByValue}"
"""The router's default topic: ``outbox.event.`` and the row's ``aggregatetype``."""

def debezium_outbox_table(name: str = "outboxevent", schema: str | None = None,
                 metadata: sa.MetaData | None = None) -> sa.Table:
    """The Debezium-layout outbox table (its docs' "Basic outbox table"), as SQLAlchemy Core."""
    from sqlalchemy.dialects.postgresql import JSONB

    return sa.Table(
        name, metadata or sa.MetaData(),
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("aggregatetype", sa.String(255), nullable=False),
        sa.Column("aggregateid", sa.String(255), nullable=False),
        sa.Column("type", sa.String(255), nullable=False),
        sa.Column("payload", JSONB),
        schema=schema,
    )


def debezium_outbox_config(postgres_url: str, *, table: str = "public.outboxevent", slot: str,
                           publication: str, topic_prefix: str, route: str = ROUTE,
                           settings: Mapping[str, str] | None = None) -> dict[str, str]:
    """The connector configuration: Debezium's PostgreSQL connector with the outbox event router.

    ``table`` is ``schema.table``; ``settings`` override or add any key (``transforms.outbox.*``
    for the router's options, e.g. ``route.tombstone.on.empty.payload``).
    """
    url = sa.make_url(postgres_url)
    config = {
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "tasks.max": "1",
        "plugin.name": "pgoutput",
        "database.hostname": url.host or "127.0.0.1",
        "database.port": str(url.port or 5432),
        "database.user": url.username or "postgres",
        "database.password": url.password or "",
        "database.dbname": url.database or "postgres",
        "topic.prefix": topic_prefix,
        "table.include.list": table,
        "slot.name": slot,
        "publication.name": publication,
        "publication.autocreate.mode": "filtered",
        "snapshot.mode": "no_data",
        "tombstones.on.delete": "false",
        "transforms": "outbox",
        "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
        "transforms.outbox.route.topic.replacement": route,
        "transforms.outbox.table.fields.additional.placement": "type:header:type",
    }
    config.update({k: str(v) for k, v in (settings or {}).items()})
    return config


def debezium_over_our_outbox(table: str = "public.outbox_messages") -> dict[str, str]:
    """Connector settings that send *our* outbox table through Debezium's router, with our envelope.

    For a service moving from our relay to Debezium (docs/comparison.md, "Migration"): each
    ``outbox_messages`` row becomes the record our relay would send — topic = the ``topic``
    column, key = ``key``, value = the ``payload`` bytes (``ByteArrayConverter``), and the
    envelope headers from the columns: ``outbox-message-id``, ``outbox-seq``, ``content-type``,
    ``outbox-created-at`` (Debezium writes a ``timestamptz`` as ISO 8601 text) and
    ``outbox-event-type``. A NULL column is a header without a value, which the inbox reads as
    absent. Not carried: the user's ``headers`` (one JSON column, not headers) and the
    incarnation (it lives in ``outbox_meta``): the inbox reads such records as envelopes of a
    release before incarnations. Our relay's UPDATEs of the rows are skipped by the router
    (``table.op.invalid.behavior``, a warning each).
    """
    placement = ",".join(f"{column}:header:{header}" for column, header in (
        ("message_id", "outbox-message-id"), ("seq", "outbox-seq"), ("content_type", "content-type"),
        ("created_at", "outbox-created-at"), ("event_type", "outbox-event-type")))
    return {
        "table.include.list": table,
        "value.converter": "org.apache.kafka.connect.converters.ByteArrayConverter",
        "transforms.outbox.table.field.event.id": "message_id",
        "transforms.outbox.table.field.event.key": "key",
        "transforms.outbox.table.field.event.payload": "payload",
        "transforms.outbox.route.by.field": "topic",
        "transforms.outbox.route.topic.replacement": "${routedByValue}",
        "transforms.outbox.table.fields.additional.placement": placement,
    }


class DebeziumOutbox:
    """Debezium's outbox event router running on ``connect`` over a Debezium-layout table; a context manager.

    ``postgres_url`` names a PostgreSQL with ``wal_level=logical`` whose user may
    create replication slots and publications (a superuser, or one with
    ``REPLICATION`` that owns the table). ``bootstrap`` is the broker the worker
    writes to (the probe is read back from it). ``settings`` are connector
    settings on top of ``debezium_outbox_config``'s. Raises ``ConnectorFailed``
    when the connector does not run or the probe does not arrive within ``timeout``.
    ``probe=False`` creates no table and sends no probe (ready when RUNNING): for a
    connector over another table, ours for one (``debezium_over_our_outbox()``).
    """

    def __init__(self, connect: ConnectRest, postgres_url: str, bootstrap: str, *,
                 table: str = "outboxevent", schema: str = "public", name: str | None = None,
                 settings: Mapping[str, str] | None = None, timeout: float = RUNNING_TIMEOUT,
                 probe: bool = True) -> None:
        tag = uuid.uuid4().hex[:10]
        self.connect = connect
        self.bootstrap = bootstrap
        self.name = name or f"outbox-{tag}"
        self.slot = f"dbz_{tag}"
        self.publication = f"dbz_{tag}"
        self.table = debezium_outbox_table(table, schema)
        self.engine = sa.create_engine(postgres_url, pool_size=2, pool_pre_ping=True)
        try:
            with self.engine.begin() as conn:
                level = conn.exec_driver_sql("SHOW wal_level").scalar()
                if level != "logical":
                    raise ValueError(f"Debezium reads PostgreSQL's log through logical decoding: this "
                                     f"server has wal_level={level}, and needs wal_level=logical (a restart)")
                if probe:  # a table of Debezium's layout; without the probe it may be any table
                    self.table.create(conn, checkfirst=True)
        except BaseException:
            self.engine.dispose()
            raise
        self.config = debezium_outbox_config(
            postgres_url, table=f"{schema}.{table}", slot=self.slot, publication=self.publication,
            topic_prefix=f"dbz{tag}", settings=settings)
        try:
            connect.put_connector(self.name, self.config)
            connect.wait_running(self.name, timeout)
            if probe:
                self._probe(timeout)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"DebeziumOutbox({self.name}, {self.table.fullname}, slot {self.slot})"

    def __enter__(self) -> DebeziumOutbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def topic(aggregatetype: str) -> str:
        """The topic the router sends rows of ``aggregatetype`` to (the default route)."""
        return ROUTE.replace("${routedByValue}", aggregatetype)

    def insert(self, conn: sa.Connection, aggregatetype: str, aggregateid: str, payload: Any, *,
               type: str = "Event", event_id: uuid.UUID | None = None) -> uuid.UUID:
        """Insert one outbox row in the caller's transaction (``payload`` as JSON; None: SQL NULL,
        what the router's ``route.tombstone.on.empty.payload`` turns into a tombstone); its event id."""
        event_id = event_id or uuid.uuid4()
        conn.execute(self.table.insert().values(id=event_id, aggregatetype=aggregatetype,
                                                aggregateid=aggregateid, type=type,
                                                payload=sa.null() if payload is None else payload))
        return event_id

    def _probe(self, timeout: float) -> None:
        """A row inserted and deleted in one transaction arrives on its topic: the path works end to end."""
        from transports.testing import read_topic

        from ._connect import ConnectorFailed

        kind = f"probe-{uuid.uuid4().hex[:8]}"
        create_topic(self.bootstrap, self.topic(kind), 1)
        with self.engine.begin() as conn:
            probe = self.insert(conn, kind, "probe", {"probe": True}, type="Probe")
            conn.execute(self.table.delete().where(self.table.c.id == probe))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for record in read_topic(self.bootstrap, self.topic(kind), expected=1, timeout=5):
                if dict(record.headers).get("id") == str(probe).encode():
                    return
        raise ConnectorFailed(f"connector {self.name!r} runs, but its probe row {probe} did not reach "
                              f"topic {self.topic(kind)!r} within {timeout:.0f} s")

    def close(self) -> None:
        """Remove the connector, then its replication slot and publication; dispose of the engine."""
        with contextlib.suppress(OSError):  # the worker is gone: the slot goes all the same
            self.connect.delete_connector(self.name)
        deadline = time.monotonic() + 60
        with self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            while time.monotonic() < deadline:
                active = conn.execute(sa.text("SELECT active_pid FROM pg_replication_slots "
                                              "WHERE slot_name = :slot"), {"slot": self.slot}).first()
                if active is None:
                    break
                if active[0] is None:
                    conn.execute(sa.text("SELECT pg_drop_replication_slot(:slot)"), {"slot": self.slot})
                    break
                time.sleep(0.2)  # the connector's walsender is still attached: it ends when the task stops
            quoted = conn.dialect.identifier_preparer.quote(self.publication)
            conn.exec_driver_sql(f"DROP PUBLICATION IF EXISTS {quoted}")
        self.engine.dispose()

    def wal_position(self) -> int:
        """``pg_current_wal_lsn()`` as a byte position: the difference of two is the WAL written between."""
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar_one())

    def slot_lag(self) -> int:
        """Bytes of WAL the slot holds for the connector: ``pg_current_wal_lsn() - confirmed_flush_lsn``."""
        with self.engine.connect() as conn:
            lag = conn.execute(sa.text(
                "SELECT pg_current_wal_lsn() - confirmed_flush_lsn FROM pg_replication_slots "
                "WHERE slot_name = :slot"), {"slot": self.slot}).scalar()
        return int(lag or 0)

