"""Shared by the inbox tests and the consumer worker script: records, a business table, a handler.

The business table ``effects`` has one row per applied message under a unique
(topic, key, seq) constraint, so a second application of a message cannot hide:
it fails the insert. The handler also checks order itself: the key's previous
effect must be seq - 1, otherwise it fails (and on a database server also records
the violation in its own transaction, so a later replay cannot hide it).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from outbox import Alert, Inbox
from outbox.core._wire import to_record
from outbox.testing import OutboxTestHarness, Settled
from transports import Record

TOPIC = "orders"

business = sa.MetaData()
effects = sa.Table(
    "effects", business,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("topic", sa.String(249), nullable=False),
    sa.Column("key", sa.String(255)),
    sa.Column("seq", sa.BigInteger),
    sa.Column("message_id", sa.Uuid, nullable=False, unique=True),
    sa.UniqueConstraint("topic", "key", "seq", name="ux_effects_seq"),
)
order_violations = sa.Table(
    "order_violations", business,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(255)),
    sa.Column("seq", sa.BigInteger),
    sa.Column("previous", sa.BigInteger),
)


_insert_effect = effects.insert()


TEST_BUDGET = 600.0
"""``batch_budget`` of the inboxes whose tests read one transaction's whole outcome (``settle``):
the default's 1 s is wall-clock time, which a loaded CI host's MySQL or async SQLite transaction
exceeded, deferring the rest of a run the test expected applied. The budget's own tests set theirs."""

def record(topic: str, key: str | None, seq: int | None, *, payload: bytes = b'{"n":1}',
           message_id: uuid.UUID | None = None, incarnation: str | None = None,
           created_at: datetime | None = None, event_type: str | None = None) -> Record:
    """An outbox record as the relay would produce it (without ``incarnation``: as an older one did)."""
    return to_record(
        message_id=message_id or uuid.uuid4(), topic=topic, key=key, seq=seq, payload=payload,
        content_type="application/json", headers=None, created_at=created_at or datetime.now(UTC),
        incarnation=incarnation, event_type=event_type,
    )


class AlertLog(list):
    """An alert sink that keeps what it was given."""

    def __call__(self, alert: Alert) -> None:
        self.append(alert)


class OrderViolation(AssertionError):
    pass


def apply_effect(session, message) -> None:  # type: ignore[no-untyped-def]
    """The test handler: check seq = previous + 1, then insert the one business row."""
    if message.key is not None and message.seq is not None:
        previous = session.scalar(
            sa.select(sa.func.max(effects.c.seq)).where(
                effects.c.topic == message.topic, effects.c.key == message.key)
        ) or 0
        if message.seq != previous + 1 and session.get_bind().dialect.name == "sqlite":
            raise OrderViolation(f"{message.key}: seq {message.seq} after {previous}")
        if message.seq != previous + 1:
            with session.get_bind().engine.connect() as own:  # survives the rollback of this transaction
                own.execute(order_violations.insert().values(
                    key=message.key, seq=message.seq, previous=previous))
                own.commit()
            raise OrderViolation(f"{message.key}: seq {message.seq} after {previous}")
    insert_effect(session, message)


def apply_effects(session, messages) -> None:  # type: ignore[no-untyped-def]
    """The batch test handler: ``apply_effect``'s checks and rows, one query and one INSERT per call."""
    topic = messages[0].topic
    keyed = [m for m in messages if m.key is not None and m.seq is not None]
    previous = dict(session.execute(
        sa.select(effects.c.key, sa.func.max(effects.c.seq))
        .where(effects.c.topic == topic, effects.c.key.in_([m.key for m in keyed]))
        .group_by(effects.c.key)
    ).all()) if keyed else {}
    wrong = []  # a call may carry a run of one key: each message follows the one before it
    for m in keyed:
        if m.seq != previous.get(m.key, 0) + 1:
            wrong.append({"key": m.key, "seq": m.seq, "previous": previous.get(m.key, 0)})
        previous[m.key] = m.seq
    if wrong and session.get_bind().dialect.name == "postgresql":
        with session.get_bind().engine.connect() as own:  # survives the rollback of this transaction
            own.execute(order_violations.insert(), wrong)
            own.commit()
    if wrong:
        raise OrderViolation(f"{wrong[0]['key']}: seq {wrong[0]['seq']} after {wrong[0]['previous']}")
    insert_effects(session, messages)


def insert_effects(session, messages) -> None:  # type: ignore[no-untyped-def]
    """``insert_effect`` for a batch: one executemany."""
    session.execute(_insert_effect, [{"topic": m.topic, "key": m.key, "seq": m.seq,
                                      "message_id": m.message_id} for m in messages])


def insert_effect(session, message) -> None:  # type: ignore[no-untyped-def]
    """The business write alone, for tests where a key legitimately skips a seq (discard)."""
    session.execute(_insert_effect, {"topic": message.topic, "key": message.key,
                                     "seq": message.seq, "message_id": message.message_id})


def applied(engine: sa.Engine, key: str | None = None) -> list[tuple[str | None, int | None]]:
    """(key, seq) of every effect, in the order they were applied."""
    stmt = sa.select(effects.c.key, effects.c.seq).order_by(effects.c.id)
    if key is not None:
        stmt = stmt.where(effects.c.key == key)
    with engine.connect() as conn:
        return [(r.key, r.seq) for r in conn.execute(stmt)]


def settle(inbox: Inbox, batch: Iterable[Any]) -> Settled:
    """One batch (records, or deliveries from an earlier ``later``) through ``inbox``'s transaction
    and settle stage, as a worker of ``Inbox.run`` takes it: ``OutboxTestHarness.settle``."""
    return OutboxTestHarness(inbox=inbox).settle(batch)


def settle_all(inbox, deliveries) -> list:  # type: ignore[no-untyped-def]
    """Run ``deliveries`` (records) through the settle stage until each is done, sleeping out the
    retry delays (what the runner's timer does); returns every (delivery, disposition) reached."""
    import time

    done: list = []  # type: ignore[type-arg]
    pending = [(d, 0.0) for d in deliveries]
    first = True
    while pending:
        if first:
            batches, first = [[d for d, _ in pending]], False
        else:
            time.sleep(max(delay for _, delay in pending))
            batches = [[d] for d, _ in pending]
        pending = []
        for batch in batches:
            settled = settle(inbox, batch)
            done.extend(settled.done)
            pending.extend(settled.later)
    return done


class DatabaseOutage:
    """Makes ``engine``'s statements fail as if the database were down, while ``on``.

    The error is the driver's own ``OperationalError`` raised where the driver
    would raise it, so SQLAlchemy wraps it as it wraps a real outage. ``only``
    limits it to statements containing that text (e.g. a handler's table);
    ``times`` switches it off by itself after that many failures.
    """

    def __init__(self, engine: sa.Engine, *, only: str | None = None) -> None:
        self.on = False
        self.only = only
        self.times: int | None = None
        self.failures = 0
        dialect = engine.dialect
        error = dialect.loaded_dbapi.OperationalError
        message = "disk I/O error" if dialect.name == "sqlite" else "server closed the connection"

        def wrap(original):  # type: ignore[no-untyped-def]
            def call(cursor, statement, *args, **kwargs):  # type: ignore[no-untyped-def]
                if self.on and (self.only is None or self.only in statement):
                    self.failures += 1
                    if self.times is not None:
                        self.times -= 1
                        self.on = self.times > 0
                    raise error(message)
                return original(cursor, statement, *args, **kwargs)
            return call

        for name in ("do_execute", "do_executemany", "do_execute_no_params"):
            setattr(dialect, name, wrap(getattr(dialect, name)))

    def fail(self, times: int | None = None) -> None:
        self.times, self.on = times, True

    def end(self) -> None:
        self.on = False


# -- sync and async inboxes ------------------------------------------------------------------

INBOX_KINDS = ["sync", "async"]
"""The two ways to build an Inbox; the inbox tests run under both."""

_ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg", "mysql": "mysql+asyncmy"}


def async_url(url: str | sa.URL) -> str:
    """The same database through an asyncio driver: aiosqlite, asyncpg on PostgreSQL, asyncmy on MySQL."""
    parsed = sa.make_url(url)
    driver = _ASYNC_DRIVERS[parsed.get_backend_name()]
    return parsed.set(drivername=driver).render_as_string(hide_password=False)


def inbox_bind(engine: sa.Engine, kind: str, **kwargs):  # type: ignore[no-untyped-def]
    """What an Inbox of ``kind`` is built on: ``engine`` itself, or an AsyncEngine on its database."""
    if kind == "sync":
        return engine
    from outbox import create_async_engine

    return create_async_engine(async_url(engine.url), **kwargs)


def for_inbox(inbox, fn):  # type: ignore[no-untyped-def]
    """``fn(session, message)`` as ``inbox`` wants its handlers: as is, or as an ``async def``
    that runs it on the AsyncSession it is given (``run_sync``: the same transaction)."""
    if not inbox.is_async:
        return fn

    async def handler(session, arg):  # type: ignore[no-untyped-def]
        from sqlalchemy.ext.asyncio import AsyncSession

        assert isinstance(session, AsyncSession), session
        return await session.run_sync(fn, arg)

    handler.__qualname__ = getattr(fn, "__qualname__", "handler")
    return handler


def handles(inbox, topic: str, *, batch: bool = False):  # type: ignore[no-untyped-def]
    """``@inbox.handler(topic)`` (or ``batch_handler``) for a sync ``fn``, through ``for_inbox``."""
    def register(fn):  # type: ignore[no-untyped-def]
        (inbox.batch_handler if batch else inbox.handler)(topic)(for_inbox(inbox, fn))
        return fn
    return register


def dispose(inbox) -> None:  # type: ignore[no-untyped-def]
    """Close the pool of an async inbox's engine on the inbox's loop (a sync one: the test's job)."""
    if inbox.is_async:
        inbox.run_database(inbox.engine.dispose)
