"""The inbox's core proofs (test_inbox_core: dedup, per-key order, held gaps, parking, replay and
discard) again, on a PostgreSQL ``inbox_messages`` partitioned by the day inside its message ids.

The records get UUIDv7 ids here, as ``publish()`` mints them, so their dedup rows land in day
partitions; the ids a test spells out itself (``uuid.uuid4()``) land in the untimed one. Only the
sync inbox: the async one runs the same store statements, proved once in test_inbox_core.
"""

from __future__ import annotations

import types
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from test_inbox_core import *  # noqa: F403  (collects the same tests here, on the fixtures below)

import tests.inbox_support
from outbox import Inbox
from outbox._envelope import new_message_id
from outbox.housekeeping import partition_inbox
from outbox.housekeeping._partitions import is_partitioned
from tests.inbox_support import TOPIC, AlertLog, apply_effect, business, dispose, for_inbox


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
