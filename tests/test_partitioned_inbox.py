"""The inbox's core proofs (test_inbox_core: dedup, per-key order, held gaps, parking, replay and
discard) again, on a PostgreSQL ``inbox_messages`` partitioned by the day inside its message ids.

The records get UUIDv7 ids here, as ``publish()`` mints them, so their dedup rows land in day
partitions; the ids a test spells out itself (``uuid.uuid4()``) land in the untimed one. Only the
sync inbox: the async one runs the same store statements, proved once in test_inbox_core.
"""

from __future__ import annotations

import time
import types
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from test_inbox_core import *  # noqa: F403  (collects the same tests here, on the fixtures below)

import tests.inbox_support
from outbox import Disposition, Inbox, OutboxTables, create_engine, new_message_id
from outbox.housekeeping import partition_inbox
from outbox.housekeeping._partitions import is_partitioned
from tests.inbox_support import TOPIC, AlertLog, apply_effect, business, dispose, for_inbox, record

MODEL_EXAMPLES = 10


@pytest.fixture
def db_url(postgres_db: str) -> str:
    return postgres_db


@pytest.fixture(autouse=True)
def uuid7_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """``inbox_support.record`` mints its ids as ``publish()`` does (UUIDv7), not at random."""
    monkeypatch.setattr(tests.inbox_support, "uuid",
                        types.SimpleNamespace(uuid4=new_message_id, UUID=uuid.UUID))


@pytest.fixture
def inbox(engine: sa.Engine) -> Iterator[Inbox]:
    box = Inbox(engine, group="billing", retry_backoff=0.001, retry_backoff_max=0.01,
                gap_timeout=0.3, alert=AlertLog())
    box.create_tables()
    partition_inbox(engine, box.tables)
    with engine.connect() as conn:
        assert is_partitioned(conn, box.tables.inbox_messages)
    business.create_all(engine)
    box.handler(TOPIC)(for_inbox(box, apply_effect))
    yield box
    dispose(box)


@pytest.mark.slow
def test_the_inbox_model_holds_on_partitioned_tables(engine: sa.Engine) -> None:
    """test_inbox_model's state machine (dedup, order, held gaps, parking, replay, discard, rebuilt
    producers, concurrent consumers) on partitioned tables, with fewer examples than its own run."""
    import test_inbox_model  # a module, not its names: its test runs once, in its own file

    Inbox(engine, group="setup").create_tables()
    partition_inbox(engine, OutboxTables())
    test_inbox_model.model_effects.create(engine, checkfirst=True)
    machine = type("Machine", (test_inbox_model.InboxModel,),
                   {"engine": engine, "bind": engine, "_uuid": _uuid7})
    run_state_machine_as_test(machine, settings=settings(
        settings.get_profile("inbox-model"), max_examples=MODEL_EXAMPLES))
    with engine.connect() as conn:  # the records were in day partitions, not all in a catch-all one
        assert conn.execute(sa.text("SELECT count(*) FROM inbox_messages "
                                    "WHERE tableoid::regclass::text LIKE 'inbox_messages_p%'")).scalar()


def _uuid7(model) -> uuid.UUID:  # type: ignore[no-untyped-def]
    """The model's ids as UUIDv7 minted now (its own are random v4), from its seeded random bits."""
    bits = (int(time.time() * 1000) << 80) | model.ids.getrandbits(80)
    bits = (bits & ~(0xF << 76)) | (0x7 << 76)  # version 7
    return uuid.UUID(int=(bits & ~(0x3 << 62)) | (0x2 << 62))  # the RFC 4122 variant


def test_retention_keeps_duplicates_inside_the_window_on_partitioned_tables(postgres_db: str) -> None:
    """test_retention_inbox's proof of the dedup window across retention, on partitioned tables."""
    import test_retention_inbox

    engine = create_engine(postgres_db)
    box = Inbox(engine, group=f"g-{uuid.uuid4().hex[:8]}", retry_backoff=0, alert=AlertLog(),
                dedup_window=test_retention_inbox.WINDOW)
    box.create_tables()
    partition_inbox(engine, box.tables)
    applied: list[tuple[str, int]] = []
    box.handler(test_retention_inbox.TOPIC)(
        lambda session, message: applied.append((message.key, message.seq)))
    box.applied = applied  # type: ignore[attr-defined]
    try:
        test_retention_inbox.test_duplicates_inside_the_window_are_still_dropped_after_retention(box)
    finally:
        engine.dispose()


def test_a_copy_of_an_id_with_another_creation_time_is_still_a_duplicate(inbox: Inbox,
                                                                         engine: sa.Engine) -> None:
    """What makes a duplicate is the id alone: copies whose envelopes carry other creation times
    (a CloudEvent without ``time`` is stamped when it is read) meet in one partition, keyed or not,
    and the database refuses a second record of the id whatever its times."""
    now = datetime.now(UTC)
    for key, seq in ((None, None), ("k", 1)):
        message_id = new_message_id()
        first = record(TOPIC, key, seq, message_id=message_id, created_at=now - timedelta(days=6))
        later = record(TOPIC, key, seq, message_id=message_id, created_at=now + timedelta(days=3))
        assert inbox.handle(first) is Disposition.APPLIED
        assert inbox.handle(later) is Disposition.DUPLICATE
    m = inbox.tables.inbox_messages
    with engine.connect() as conn:
        row = conn.execute(sa.select(m).limit(1)).mappings().one()
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.insert(m).values({**row, "created_at": now - timedelta(days=40),
                                          "processed_at": now}))
