"""Retention on a PostgreSQL ``inbox_messages`` partitioned by the day inside its message ids:
a day goes whole only when every record in it is out of the dedup window, whatever its ids say,
and the dedup promise holds across the drop (docs/operations.md, "Housekeeping")."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from _in_process import outbox_in_process
from _retention_rows import inbox_row, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from outbox import Disposition, Inbox, OutboxTables, ParkMessage, create_engine, new_message_id
from outbox.housekeeping import maintain_inbox_partitions, partition_inbox, run_retention
from outbox.housekeeping._inbox_partitions import _unsettled
from tests.inbox_support import AlertLog, record

pytestmark = pytest.mark.postgres
DAY, WINDOW = timedelta(days=1), timedelta(days=3)
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
TOPIC = "orders"


def id_at(moment: datetime) -> uuid.UUID:
    """A UUIDv7 minted at ``moment`` (``publish()`` mints them with the time it runs)."""
    return uuid.UUID(bytes=int(moment.timestamp() * 1000).to_bytes(6, "big") + new_message_id().bytes[6:])


def partitions(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'inbox_messages'::regclass")).scalars())


def where(engine: sa.Engine, message_id: uuid.UUID) -> str | None:
    """The partition that holds ``message_id``'s record (None: no record)."""
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT tableoid::regclass::text FROM inbox_messages "
                                    "WHERE message_id = :m"), {"m": message_id}).scalar()


@pytest.fixture
def tables(postgres_db: str) -> Iterator[tuple[sa.Engine, OutboxTables]]:
    """Empty partitioned inbox tables with days from NOW - 10 days to NOW + 2 days."""
    engine = create_engine(postgres_db)
    Inbox(engine, group="setup").create_tables()
    t = OutboxTables()
    assert partition_inbox(engine, t, now=NOW - 10 * DAY, ahead_days=12) == 0
    yield engine, t
    engine.dispose()


# (day of the id and creation time, hours the producer's clock is off, hours until processed,
#  whether the id is a UUIDv7 at all)
ROWS = st.lists(st.tuples(st.integers(-12, 1), st.integers(-3, 3), st.sampled_from([0, 1, 30, 70, 100]),
                          st.booleans() | st.just(True)), max_size=25)


@pytest.mark.slow
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=ROWS)
def test_a_day_goes_only_when_every_record_in_it_is_out_of_the_window(
        tables: tuple[sa.Engine, OutboxTables], rows: list[tuple[int, int, int, bool]]) -> None:
    """Records of messages created on random days (ids minted by a clock hours off the database's),
    processed at once or days later: exactly the settled ones go, a day is dropped only when it
    holds nothing else, held and parked rows and the keys' positions stay."""
    engine, t = tables
    with engine.begin() as conn:
        for table in (t.inbox_messages, t.inbox_keys, t.inbox_held, t.inbox_parked):
            conn.execute(sa.delete(table))
    maintain_inbox_partitions(engine, t, None, now=NOW - 10 * DAY, ahead_days=12)  # remake dropped days
    inbox = []
    for day, skew, lag, timed in rows:
        created = NOW + day * DAY - timedelta(hours=5)
        message_id = id_at(created + timedelta(hours=skew)) if timed else uuid.uuid4()
        inbox.append(inbox_row("g", created + timedelta(hours=lag), created, message_id=message_id))
    parked = {"consumer_group": "g", "message_id": id_at(NOW - 8 * DAY), "topic": "t", "key": "p",
              "seq": 1, "payload": b"x", "content_type": "application/json", "headers": {},
              "created_at": NOW - 8 * DAY, "reason": "failed", "first_failure_at": NOW - 8 * DAY,
              "last_failure_at": NOW - 8 * DAY}
    held = {k: parked[k] for k in ("consumer_group", "topic", "payload", "content_type", "headers",
                                   "created_at")}
    with engine.begin() as conn:
        if inbox:
            conn.execute(sa.insert(t.inbox_messages), inbox)
        conn.execute(sa.insert(t.inbox_parked), [parked])
        conn.execute(sa.insert(t.inbox_held), [{**held, "message_id": id_at(NOW - 8 * DAY), "key": "h",
                                                "seq": 3, "received_at": NOW - 8 * DAY}])
        conn.execute(sa.insert(t.inbox_keys), [{"consumer_group": "g", "topic": "t", "key": "h",
                                                "last_seq": 1, "parked": False}])
    before, days = snapshot(engine, t), partitions(engine)
    cutoff = NOW - WINDOW
    with engine.connect() as conn:  # which days hold a record that must stay (asked of the database)
        holding = {name for name in days if _unsettled(conn, f'"{name}"', cutoff)}

    result = run_retention(engine, tables=t, dedup_window=WINDOW, batch_size=7, now=NOW)

    settled = {r["message_id"] for r in inbox if r["processed_at"] < cutoff and r["created_at"] < cutoff}
    after = snapshot(engine, t)
    assert after["inbox"] == {("g", r["message_id"]) for r in inbox} - {("g", m) for m in settled}
    for unchanged in ("inbox_keys", "held", "parked"):
        assert after[unchanged] == before[unchanged]
    report = result.inbox_partitions
    assert report is not None
    left = partitions(engine)
    for name in days - left:  # every dropped day held only settled records, and was old enough
        assert name in report.dropped and name not in holding
        assert name.startswith(("inbox_messages_p", "inbox_messages_before"))
        assert datetime.strptime(name[-8:], "%Y%m%d").replace(tzinfo=UTC) + \
            (DAY if "_p" in name else timedelta(0)) <= cutoff
    for name in holding:
        assert name in left, f"{name} held a record inside the window and was dropped"
    # Every old enough day whose records were all settled went whole.
    old_days = {f"inbox_messages_p{NOW + n * DAY:%Y%m%d}" for n in range(-10, 1)
                if (NOW + n * DAY).replace(hour=0, minute=0) + DAY <= cutoff}
    assert not ((old_days & days) - holding) & left
    again = run_retention(engine, tables=t, dedup_window=WINDOW, now=NOW)
    assert again.total == 0 and not again.inbox_partitions.dropped  # type: ignore[union-attr]


@pytest.fixture
def inbox(postgres_db: str) -> Iterator[Inbox]:
    engine = create_engine(postgres_db)
    inbox = Inbox(engine, group="billing", retry_backoff=0, alert=AlertLog(), dedup_window=WINDOW)
    inbox.create_tables()
    partition_inbox(engine, inbox.tables, now=datetime.now(UTC) - 10 * DAY, ahead_days=12)
    applied: list[tuple[str, int]] = []
    poison: set[uuid.UUID] = set()

    @inbox.handler(TOPIC)
    def handle(session, message):  # type: ignore[no-untyped-def]
        if message.message_id in poison:
            raise ParkMessage("poison")
        applied.append((message.key, message.seq))

    inbox.applied, inbox.poison = applied, poison  # type: ignore[attr-defined]
    yield inbox
    engine.dispose()


def expired(inbox: Inbox) -> float:
    return REGISTRY.get_sample_value("outbox_inbox_seq_conflicts_total", {
        "group": inbox.group, "topic": TOPIC, "verdict": "expired"}) or 0.0


def test_a_day_with_a_record_inside_the_window_stays_and_its_redeliveries_stay_duplicates(
        inbox: Inbox) -> None:
    """A message five days old processed now keeps its day (processed inside the window), one two
    days old keeps its own (created inside it); their redeliveries are duplicates. Once time
    passes the window, the days go whole, and a redelivery of the old keyed message is an expired
    duplicate (never applied again, never a conflict) while the key carries on."""
    engine, now = inbox.engine, datetime.now(UTC)
    assert isinstance(engine, sa.Engine)
    old = [record(TOPIC, "k", seq, message_id=id_at(now - 5 * DAY), created_at=now - 5 * DAY)
           for seq in (1, 2)]
    recent = record(TOPIC, "k", 3, message_id=id_at(now - 2 * DAY), created_at=now - 2 * DAY)
    assert [inbox.handle(r) for r in [*old, recent]] == [Disposition.APPLIED] * 3
    old_day, recent_day = (f"inbox_messages_p{t:%Y%m%d}" for t in (now - 5 * DAY, now - 2 * DAY))
    assert where(engine, _id(old[0])) == old_day

    result = run_retention(engine, tables=inbox.tables, dedup_window=WINDOW)

    assert result.inbox_partitions is not None
    assert old_day in result.inbox_partitions.kept and old_day in partitions(engine)
    assert recent_day in partitions(engine)
    assert [inbox.handle(r) for r in [*old, recent]] == [Disposition.DUPLICATE] * 3

    later = run_retention(engine, tables=inbox.tables, dedup_window=WINDOW, now=now + 4 * DAY)

    assert later.inbox_partitions is not None and old_day in later.inbox_partitions.dropped
    assert old_day not in partitions(engine) and where(engine, _id(old[0])) is None
    before = expired(inbox)
    assert [inbox.handle(r) for r in old] == [Disposition.DUPLICATE] * 2  # expired redeliveries
    assert expired(inbox) == before + 2
    assert inbox.parked() == [] and list(inbox.alert) == []  # type: ignore[call-overload]
    assert inbox.handle(record(TOPIC, "k", 4, message_id=new_message_id())) is Disposition.APPLIED
    assert inbox.applied == [("k", 1), ("k", 2), ("k", 3), ("k", 4)]  # type: ignore[attr-defined]


def test_held_and_parked_messages_outlive_their_day_and_stay_deduplicated(inbox: Inbox) -> None:
    """A message held behind a gap and one parked, both of a day retention drops: neither is
    touched; the held one applies when its gap fills, the parked one replays, their records land
    in the default partition (their day is gone), and their redeliveries are duplicates."""
    engine, now = inbox.engine, datetime.now(UTC)
    assert isinstance(engine, sa.Engine)
    made = now - 5 * DAY
    gap, held = (record(TOPIC, "h", seq, message_id=id_at(made), created_at=made) for seq in (1, 2))
    poisoned = record(TOPIC, "p", 1, message_id=id_at(made), created_at=made)
    inbox.poison.add(_id(poisoned))  # type: ignore[attr-defined]
    settled = record(TOPIC, "s", 1, message_id=id_at(made), created_at=made)
    assert inbox.handle(held) is Disposition.HELD
    assert inbox.handle(poisoned) is Disposition.PARKED
    assert inbox.handle(settled) is Disposition.APPLIED
    day = f"inbox_messages_p{made:%Y%m%d}"

    result = run_retention(engine, tables=inbox.tables, dedup_window=WINDOW, now=now + 4 * DAY)

    assert result.inbox_partitions is not None and day in result.inbox_partitions.dropped
    inbox.poison.clear()  # type: ignore[attr-defined]
    assert inbox.handle(gap) is Disposition.APPLIED  # and the held one after it, same transaction
    assert inbox.replay(TOPIC, "p").applied == 1
    assert inbox.applied == [("s", 1), ("h", 1), ("h", 2), ("p", 1)]  # type: ignore[attr-defined]
    for message in (gap, held, poisoned):
        assert where(engine, _id(message)) == "inbox_messages_default"
    assert [inbox.handle(r) for r in (gap, held, poisoned)] == [Disposition.DUPLICATE] * 3
    assert len(inbox.applied) == 4  # type: ignore[attr-defined]


def _id(r) -> uuid.UUID:  # type: ignore[no-untyped-def]
    return uuid.UUID(dict(r.headers)["outbox-message-id"].decode())


def test_the_check_under_the_tables_lock_reads_the_brin_index_not_the_day(
        tables: tuple[sa.Engine, OutboxTables]) -> None:
    """The check that runs while DETACH holds the table's lock (stalling every consumer) is planned
    on the day's BRIN index of (processed_at, created_at), whatever the day's size."""
    engine, _ = tables
    day = f"inbox_messages_p{NOW - 5 * DAY:%Y%m%d}"
    with engine.begin() as conn:
        conn.execute(sa.text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join(conn.execute(sa.text(
            f"EXPLAIN SELECT 1 FROM {day} WHERE processed_at >= :c OR created_at >= :c LIMIT 1000"),
            {"c": NOW}).scalars())
    assert "Bitmap Index Scan" in plan and "Seq Scan" not in plan, plan


@pytest.mark.slow
def test_converting_keeps_every_record_then_the_command_line_retires_settled_days(
        postgres_db: str, capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``partition_inbox`` moves every record (ids of any kind, a record without a creation time)
    and the database still refuses a second record of an id; ``outbox housekeeping run
    --dedup-window`` then drops the settled days (a dry run says so first) and deletes the settled
    rows elsewhere one by one; ``init-db --partitioned`` on it changes nothing."""
    def cli(*args: str) -> subprocess.CompletedProcess[str]:  # python -m outbox, in this process
        return outbox_in_process(capfd, *args, "--db", postgres_db, cwd=tmp_path)

    engine = create_engine(postgres_db)
    Inbox(engine, group="setup").create_tables()
    t, now = OutboxTables(), datetime.now(UTC)
    old, recent = now - 10 * DAY, now - DAY
    rows = [inbox_row("g", old, old, message_id=id_at(old)), inbox_row("G ", old, old, message_id=id_at(old)),
            inbox_row("g", now, old, message_id=id_at(old)),  # processed late: keeps nothing of its day
            inbox_row("g", recent, recent, message_id=id_at(recent)),
            inbox_row("g", old, old), inbox_row("g", old, None), inbox_row("g", recent, None)]
    with engine.begin() as conn:
        conn.execute(sa.insert(t.inbox_messages), rows)
    before = snapshot(engine, t)["inbox"]

    assert partition_inbox(engine, t, now=now - 12 * DAY, ahead_days=14) == len(rows)
    assert partition_inbox(engine, t) is None
    assert snapshot(engine, t)["inbox"] == before
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.insert(t.inbox_messages), [{**rows[0], "processed_at": now}])
    late_day = f"inbox_messages_p{old:%Y%m%d}"

    dry = cli("housekeeping", "run", "--dedup-window", "3d", "--dry-run")
    assert dry.returncode == 0 and "would be deleted" in dry.stdout, dry.stdout + dry.stderr
    assert f"{late_day}: kept, 1 record(s) created or processed inside the dedup window" in dry.stdout
    assert snapshot(engine, t)["inbox"] == before
    with engine.begin() as conn:  # the late one is settled too now: its day can go whole
        conn.execute(sa.update(t.inbox_messages).values(processed_at=old)
                     .where(t.inbox_messages.c.processed_at == now))
    done = cli("housekeeping", "run", "--dedup-window", "3d")
    assert done.returncode == 0 and f"{late_day}: dropped" in done.stdout, done.stdout + done.stderr
    assert late_day not in partitions(engine)
    assert snapshot(engine, t)["inbox"] == {("g", rows[3]["message_id"]), ("g", rows[6]["message_id"])}
    with engine.begin() as conn:  # as if the last pass with --dedup-window was a day ago
        conn.execute(sa.text(f"DROP TABLE inbox_messages_p{now + 7 * DAY:%Y%m%d}"))
    relay_only = cli("housekeeping", "run", "--older-than", "7d")  # a relay's pass makes the inbox's days
    assert f"inbox_messages_p{now + 7 * DAY:%Y%m%d}" in relay_only.stdout, relay_only.stdout
    assert f"inbox_messages_p{now + 7 * DAY:%Y%m%d}" in partitions(engine)
    again = cli("init-db", "--partitioned")
    assert again.returncode == 0 and "inbox_messages is partitioned already" in again.stdout
    engine.dispose()


def test_coming_days_are_made_without_reading_the_default_partition_under_the_lock(
        tables: tuple[sa.Engine, OutboxTables], postgres_db: str) -> None:
    """Records of ids that are not UUIDv7 fill the default partition; making a coming day beside
    it is proved by a validated constraint (PostgreSQL says the default's check "is implied"), not
    by reading the default while every consumer waits. A day the default already holds a record
    of is not made, and no constraint is left behind (nor one an earlier pass left) to refuse the
    next such record."""
    engine, t = tables
    start = NOW - 10 * DAY  # the days made by the fixture end at NOW + 2 days
    later = [inbox_row("g", NOW, NOW, message_id=uuid.UUID(int=id_at(NOW + n * DAY).int | 1))
             for n in (20, 40)]
    stray = inbox_row("g", NOW, NOW, message_id=id_at(NOW + 4 * DAY))
    with engine.begin() as conn:
        conn.execute(sa.insert(t.inbox_messages), [*later, stray])
        # A fence an earlier pass could not take down (its lock was not granted in time).
        conn.execute(sa.text("ALTER TABLE inbox_messages_default ADD CONSTRAINT "
                             "ck_inbox_messages_not_p20260609 CHECK (message_id < "
                             f"'{id_at(NOW + 8 * DAY)}') NOT VALID"))
    assert {where(engine, r["message_id"]) for r in [*later, stray]} == {"inbox_messages_default"}
    notices: list[str] = []
    watched = create_engine(postgres_db)

    @sa.event.listens_for(watched, "connect")
    def debug(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        dbapi_connection.add_notice_handler(lambda notice: notices.append(notice.message_primary))
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SET client_min_messages = debug1")
        dbapi_connection.commit()  # a SET in a transaction rolled back would be undone

    report = maintain_inbox_partitions(watched, t, None, now=start + 11 * DAY, ahead_days=4)
    watched.dispose()

    made = [f"inbox_messages_p{NOW + n * DAY:%Y%m%d}" for n in (3, 5)]
    assert report.created == made and set(made) <= partitions(engine)
    assert f"inbox_messages_p{NOW + 4 * DAY:%Y%m%d}" in report.kept  # the stray record's day
    implied = [n for n in notices if "default partition" in n and "implied by existing constraints" in n]
    assert len(implied) == len(made), notices
    with engine.connect() as conn:
        assert not conn.execute(sa.text("SELECT conname FROM pg_constraint "
                                        "WHERE conrelid = 'inbox_messages_default'::regclass "
                                        "AND contype = 'c'")).all()
    with engine.begin() as conn:  # another record of the unmade day still lands in the default
        conn.execute(sa.insert(t.inbox_messages),
                     [inbox_row("g", NOW, NOW, message_id=id_at(NOW + 9 * DAY))])


def test_one_groups_pass_never_drops_a_day_holding_another_groups_records(
        tables: tuple[sa.Engine, OutboxTables]) -> None:
    """A pass limited to one group (``outbox inbox run --retention``) deletes that group's settled
    records row by row and leaves every other group's, whose window it does not know; the pass
    over every group then drops the day."""
    engine, t = tables
    old = NOW - 6 * DAY
    mine, theirs = (inbox_row(group, old, old, message_id=id_at(old)) for group in ("g", "other"))
    with engine.begin() as conn:
        conn.execute(sa.insert(t.inbox_messages), [mine, theirs])
    day = f"inbox_messages_p{old:%Y%m%d}"

    result = run_retention(engine, tables=t, dedup_window=WINDOW, group="g", now=NOW)

    assert result.deleted == {"inbox_messages": 1} and day in partitions(engine)
    assert snapshot(engine, t)["inbox"] == {("other", theirs["message_id"])}
    result = run_retention(engine, tables=t, dedup_window=WINDOW, now=NOW)
    assert result.inbox_partitions is not None and day in result.inbox_partitions.dropped
    assert snapshot(engine, t)["inbox"] == set()


def test_an_inbox_converted_while_it_runs_keeps_deduplicating(postgres_db: str) -> None:
    """An inbox that applied messages (its statements prepared by the driver by then) goes on
    after its table is converted under it: redeliveries of what it applied before are duplicates,
    new messages apply, every record is kept."""
    engine = create_engine(postgres_db)
    inbox = Inbox(engine, group="billing", retry_backoff=0, alert=AlertLog())
    inbox.create_tables()
    applied: list[tuple[str | None, int | None]] = []
    inbox.handler(TOPIC)(lambda session, message: applied.append((message.key, message.seq)))
    before = [record(TOPIC, key, seq if key else None, message_id=new_message_id())
              for seq in (1, 2, 3, 4) for key in ("a", "b", None)]
    assert {inbox.handle(r) for r in before} == {Disposition.APPLIED}

    assert partition_inbox(engine, inbox.tables) == len(before)

    assert {inbox.handle(r) for r in before} == {Disposition.DUPLICATE}
    after = [record(TOPIC, key, 5 if key else None, message_id=new_message_id())
             for key in ("a", "b", None)]
    assert {inbox.handle(r) for r in after} == {Disposition.APPLIED}
    assert len(applied) == len(before) + len(after)
    assert len(snapshot(engine, inbox.tables)["inbox"]) == len(before) + len(after)
    engine.dispose()
