"""Adversarial cases of the partitioned inbox's upkeep on PostgreSQL (issue 28): table prefixes at
the edge of the identifier limit, and a day whose partition was never made while the default
partition took its records (docs/operations.md, "Housekeeping")."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from _retention_rows import inbox_row, outbox_row

from outbox import ConfigurationError, Disposition, Inbox, OutboxTables, create_engine, new_message_id
from outbox.housekeeping import (
    maintain_inbox_partitions,
    maintain_partitions,
    partition_inbox,
    partition_outbox,
)
from tests.inbox_support import AlertLog, record

pytestmark = pytest.mark.postgres
DAY = timedelta(days=1)
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def id_at(moment: datetime) -> uuid.UUID:
    return uuid.UUID(bytes=int(moment.timestamp() * 1000).to_bytes(6, "big") + new_message_id().bytes[6:])


@pytest.fixture
def engine(postgres_db: str) -> Iterator[sa.Engine]:
    engine = create_engine(postgres_db)
    yield engine
    engine.dispose()


def test_every_prefix_the_conversion_accepts_can_be_maintained(engine: sa.Engine) -> None:
    """Whatever table prefix ``partition_inbox`` accepts, the passes after it can make the coming
    days (their temporary constraint's name fits too); a prefix they could not serve is refused
    by the conversion, with the table left as it was."""
    for length in range(28, 41):
        t = OutboxTables(prefix="p" * length)
        t.inbox_messages.create(engine)
        row = inbox_row("g", NOW, NOW, message_id=id_at(NOW))
        with engine.begin() as conn:
            conn.execute(sa.insert(t.inbox_messages), [row])
        try:
            partition_inbox(engine, t, now=NOW, ahead_days=1)
        except ConfigurationError as exc:
            assert "prefix" in str(exc)
            with engine.connect() as conn:
                assert conn.execute(sa.text("SELECT relkind FROM pg_class WHERE relname = :n"),
                                    {"n": t.inbox_messages.name}).scalar() == "r"
        else:
            report = maintain_inbox_partitions(engine, t, NOW - 3 * DAY, now=NOW + DAY, ahead_days=2)
            assert len(report.created) == 2 and not report.kept, (length, report)
        with engine.connect() as conn:
            kept = conn.execute(sa.select(t.inbox_messages.c.message_id)).scalars().all()
        assert kept == [row["message_id"]]
        t.inbox_messages.drop(engine)


def test_a_day_the_default_partition_took_is_not_made_under_the_tables_lock(engine: sa.Engine) -> None:
    """No pass ran for days: today has no partition, and its records went to the default one. A
    pass does not ask for the table's lock to make today (PostgreSQL would read the whole default
    partition while every consumer waits, only to refuse: it holds today's records); it says why
    today stays unmade, makes the coming days, and today's records stay deduplicated there."""
    t = OutboxTables()
    t.inbox_messages.create(engine)
    partition_inbox(engine, t, now=NOW - 3 * DAY, ahead_days=1)  # days NOW - 3 and NOW - 2 only
    today = inbox_row("g", NOW, NOW, message_id=id_at(NOW))
    with engine.begin() as conn:
        conn.execute(sa.insert(t.inbox_messages),
                     [today, inbox_row("g", NOW, NOW, message_id=id_at(NOW - DAY))])
    day = f"inbox_messages_p{NOW:%Y%m%d}"
    with engine.connect() as reader:  # a consumer's open transaction, as the inbox's are
        reader.execute(sa.text("SELECT count(*) FROM inbox_messages"))
        report = maintain_inbox_partitions(engine, t, None, now=NOW, ahead_days=0)
        reader.rollback()
    assert "default partition holds" in report.kept[day], report
    report = maintain_inbox_partitions(engine, t, None, now=NOW, ahead_days=2)
    assert "default partition holds" in report.kept[day], report
    assert report.created == [f"inbox_messages_p{NOW + n * DAY:%Y%m%d}" for n in (1, 2)]
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.insert(t.inbox_messages), [today])


def test_a_coming_day_whose_fence_another_pass_took_down_is_not_made_by_reading_the_default(
        engine: sa.Engine, postgres_db: str) -> None:
    """Two passes at once (two hosts): one takes down the other's fence (its leftover sweep) after
    the fence was validated and before the day is made. The day is then not made in that pass:
    making it without the fence would read the whole default partition under the table's lock."""
    t = OutboxTables()
    t.inbox_messages.create(engine)
    partition_inbox(engine, t, now=NOW, ahead_days=1)
    with engine.begin() as conn:  # the default holds records (ids that are not UUIDv7, say)
        conn.execute(sa.insert(t.inbox_messages),
                     [inbox_row("g", NOW, NOW, message_id=id_at(NOW + 30 * DAY))])
    other = create_engine(postgres_db)
    watched = create_engine(postgres_db)
    validated: list[str] = []
    late_creates: list[str] = []

    @sa.event.listens_for(watched, "before_cursor_execute")
    def meddle(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if validated and validated[-1] == "pending" and statement.startswith("SET LOCAL"):
            validated[-1] = "dropped"
            with other.begin() as sweep:  # the other pass's sweep of fences it takes for leftovers
                sweep.execute(sa.text("ALTER TABLE inbox_messages_default DROP CONSTRAINT "
                                      f"ck_inbox_messages_not_p{NOW + 2 * DAY:%Y%m%d}"))
        if "VALIDATE CONSTRAINT" in statement:
            validated.append("pending")
        if validated and validated[-1] == "dropped" and "PARTITION OF" in statement:
            late_creates.append(statement)

    report = maintain_inbox_partitions(watched, t, None, now=NOW, ahead_days=2)
    watched.dispose()
    other.dispose()

    assert validated == ["dropped"]
    assert late_creates == [], "the day was made without its fence: the default was read under the lock"
    day = f"inbox_messages_p{NOW + 2 * DAY:%Y%m%d}"
    assert day in report.kept, report
    report = maintain_inbox_partitions(engine, t, None, now=NOW, ahead_days=2)
    assert report.created == [day]



@pytest.fixture
def roles(engine: sa.Engine) -> Iterator[tuple[str, str]]:
    """The roles production runs with: one owns the tables, the application's is granted them
    (roles are the server's, so their names are unique and they are dropped after)."""
    tag = uuid.uuid4().hex[:12]
    owner, app = f"inbox_owner_{tag}", f"inbox_app_{tag}"
    with engine.begin() as conn:
        for role in (owner, app):
            conn.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
    yield owner, app
    with engine.begin() as conn:
        for role in (app, owner):
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))


def test_the_tables_owner_and_grants_survive_the_conversion(
        engine: sa.Engine, postgres_db: str, roles: tuple[str, str]) -> None:
    """Converted by an administrator, the inbox table keeps its owner, whose retention passes
    still make and drop days, and its grants, so the inbox running as its own role still reads
    and writes its records (it would otherwise fail every message, "permission denied")."""
    owner, app = roles
    t = OutboxTables()
    t.inbox_messages.create(engine)
    old = inbox_row("g", NOW - 5 * DAY, NOW - 5 * DAY, message_id=id_at(NOW - 5 * DAY))
    with engine.begin() as conn:
        conn.execute(sa.insert(t.inbox_messages), [old])
        conn.execute(sa.text(f"ALTER TABLE inbox_messages OWNER TO {owner}"))
        conn.execute(sa.text(f"GRANT CREATE ON SCHEMA public TO {owner}"))  # it made the table
        conn.execute(sa.text(f"GRANT SELECT, INSERT, UPDATE ON inbox_messages TO {app}"))
        grants = conn.execute(sa.text(
            "SELECT relacl::text FROM pg_class WHERE relname = 'inbox_messages'")).scalar()

    partition_inbox(engine, t, now=NOW - 5 * DAY, ahead_days=1)

    with engine.connect() as conn:
        assert conn.execute(sa.text(
            "SELECT relacl::text FROM pg_class WHERE relname = 'inbox_messages'")).scalar() == grants
    as_app, as_owner = (create_engine(sa.make_url(postgres_db).set(username=role)
                                      .render_as_string(hide_password=False)) for role in (app, owner))
    try:
        with as_app.begin() as conn:
            records = conn.execute(sa.select(t.inbox_messages.c.message_id)).scalars().all()
            assert records == [old["message_id"]]
            conn.execute(sa.insert(t.inbox_messages), [inbox_row("g", NOW, NOW, message_id=id_at(NOW))])
            conn.execute(sa.update(t.inbox_messages).values(deliveries=2))
        report = maintain_inbox_partitions(as_owner, t, NOW - DAY, now=NOW - 3 * DAY, ahead_days=1)
    finally:
        as_app.dispose()
        as_owner.dispose()
    assert report.created == [f"inbox_messages_p{NOW - n * DAY:%Y%m%d}" for n in (3, 2)], report
    assert f"inbox_messages_p{NOW - 5 * DAY:%Y%m%d}" in report.dropped, report


@pytest.mark.parametrize("ahead", [-1, True, 1.5, "7", 400])
def test_a_bad_count_of_days_ahead_is_refused_before_anything_changes(engine: sa.Engine,
                                                                      ahead: object) -> None:
    """A negative count would make no day at all (not even today's: every record to the default
    partition), a huge one thousands of partitions: both are refused, naming the option."""
    t = OutboxTables()
    t.inbox_messages.create(engine)
    with pytest.raises(ConfigurationError, match="ahead_days"):
        partition_inbox(engine, t, now=NOW, ahead_days=ahead)  # type: ignore[arg-type]
    with engine.connect() as conn:
        kind = conn.execute(sa.text("SELECT relkind FROM pg_class WHERE relname = 'inbox_messages'")).scalar()
    assert kind == "r"
    partition_inbox(engine, t, now=NOW, ahead_days=0)
    with pytest.raises(ConfigurationError, match="ahead_days"):
        maintain_inbox_partitions(engine, t, None, now=NOW, ahead_days=ahead)  # type: ignore[arg-type]


def test_a_fence_left_by_a_killed_pass_is_waited_out_not_counted_against_the_message(
        engine: sa.Engine) -> None:
    """A pass killed while it made a coming day leaves that day's fence on the default partition,
    and no pass ran since: the day came without its partition, and the fence refuses its ids
    there. That refusal is the database's state, not the message's fault: the inbox waits it out
    as an outage (never an attempt, never parked, with one attempt allowed here), and the
    message applies once the next pass takes the fence down and makes the day."""
    now = datetime.now(UTC)
    inbox = Inbox(engine, group="billing", retry_backoff=0, max_attempts=1, alert=AlertLog())
    inbox.create_tables()
    partition_inbox(engine, inbox.tables, now=now - 2 * DAY, ahead_days=1)  # days now-2, now-1
    applied: list[int | None] = []
    inbox.handler("orders")(lambda session, message: applied.append(message.seq))
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    with engine.begin() as conn:  # the killed pass's fence, for the day that has come since
        conn.execute(sa.text(f"ALTER TABLE inbox_messages_default ADD CONSTRAINT ck_inbox_messages_not_p"
                             f"{today:%Y%m%d} CHECK (message_id < '{id_at(today)}' "
                             f"OR message_id >= '{id_at(today + DAY)}') NOT VALID"))
    refused = threading.Event()
    sa.event.listen(engine, "handle_error", lambda context: refused.set())
    passes: list[object] = []

    def next_pass() -> None:
        if refused.wait(30):
            passes.append(maintain_inbox_partitions(engine, inbox.tables, None, ahead_days=1))

    helper = threading.Thread(target=next_pass)
    helper.start()
    try:
        assert inbox.handle(record("orders", "k", 1, message_id=id_at(now))) is Disposition.APPLIED
    finally:
        refused.set()
        helper.join()
    assert applied == [1] and inbox.parked() == []
    assert passes and f"inbox_messages_p{now:%Y%m%d}" in passes[0].created  # type: ignore[attr-defined]


def test_the_outbox_tables_owner_and_grants_survive_its_conversion(
        engine: sa.Engine, postgres_db: str, roles: tuple[str, str]) -> None:
    """The same for ``outbox_messages``: the publishers' role still writes rows (its id sequence
    moves to the new table and keeps its grants), the owner's passes still make days."""
    owner, app = roles
    t = OutboxTables()
    t.messages.create(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(t.messages), [outbox_row("published", NOW - 5 * DAY)])
        conn.execute(sa.text(f"ALTER TABLE outbox_messages OWNER TO {owner}"))
        conn.execute(sa.text(f"GRANT CREATE ON SCHEMA public TO {owner}"))
        conn.execute(sa.text(f"GRANT SELECT, INSERT, UPDATE ON outbox_messages TO {app}"))
        conn.execute(sa.text(f"GRANT USAGE ON SEQUENCE outbox_messages_id_seq TO {app}"))
        grants = conn.execute(sa.text(
            "SELECT relacl::text FROM pg_class WHERE relname = 'outbox_messages'")).scalar()

    assert partition_outbox(engine, t, now=NOW - 5 * DAY, ahead_days=1) == 1

    with engine.connect() as conn:
        assert conn.execute(sa.text(
            "SELECT relacl::text FROM pg_class WHERE relname = 'outbox_messages'")).scalar() == grants
    as_app, as_owner = (create_engine(sa.make_url(postgres_db).set(username=role)
                                      .render_as_string(hide_password=False)) for role in (app, owner))
    try:
        with as_app.begin() as conn:
            conn.execute(sa.insert(t.messages), [outbox_row("pending", NOW)])
            assert len(conn.execute(sa.select(t.messages.c.id)).all()) == 2
        report = maintain_partitions(as_owner, t, NOW - DAY, now=NOW - 3 * DAY, ahead_days=1)
    finally:
        as_app.dispose()
        as_owner.dispose()
    assert f"outbox_messages_p{NOW - 3 * DAY:%Y%m%d}" in report.created, report
    assert f"outbox_messages_p{NOW - 5 * DAY:%Y%m%d}" in report.dropped, report
