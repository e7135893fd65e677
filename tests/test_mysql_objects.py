"""The two things MySQL and MariaDB get beyond the tables (``outbox/core/_mysql.py``).

The seq trigger makes ``publish()`` one statement; the invisible ``may_block``
column holds the predicate of the partial index those servers lack. Both are
made by ``init-db``, looked for by every entry point that reads the schema, and
restored by ``--upgrade``. Seq order under concurrent writers is proved on
MariaDB by ``test_seq_order.py`` (the ``engine`` there runs on all three).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Outbox, SchemaError, create_engine
from outbox.core._mysql import json_rows

pytestmark = pytest.mark.mysql


@pytest.fixture
def shop(mysql_db: str) -> Outbox:
    outbox = Outbox(create_engine(mysql_db), prefix="shop_")
    outbox.create_tables()
    return outbox


def test_the_trigger_numbers_keyed_rows_and_leaves_the_callers_insert_id(shop: Outbox) -> None:
    m = shop.tables.messages
    with Session(shop.engine) as session, session.begin():  # type: ignore[arg-type]
        shop.publish(session, "orders", {"n": 0})
        for n in range(3):
            shop.publish(session, "orders", {"n": n}, key="o-1")
        shop.publish(session, "orders", {"n": 9}, key="o-2")
        # LAST_INSERT_ID(expr) inside the trigger is the trigger's own: the caller still
        # sees its last insert's id (row 5), not the seq the trigger set there (1).
        assert session.execute(sa.text("SELECT LAST_INSERT_ID()")).scalar_one() == 5
    with shop.engine.begin() as conn:  # type: ignore[union-attr]
        # A row that brings its own seq (a test fixture, a restore) keeps it.
        conn.execute(sa.insert(m).values(
            message_id=uuid.UUID(int=0), topic="orders", key="o-1", seq=42, shard=0, payload=b"{}",
            content_type="application/json", headers={}, created_at=sa.func.now(6),
            available_at=sa.func.now(6), attempts=0, status="pending"))
        stored = conn.execute(sa.select(m.c.key, m.c.seq).order_by(m.c.id)).all()
        counters = dict(conn.execute(sa.select(shop.tables.keys.c.key, shop.tables.keys.c.last_seq)).all())
    assert [tuple(r) for r in stored] == [(None, None), ("o-1", 1), ("o-1", 2), ("o-1", 3), ("o-2", 1),
                                          ("o-1", 42)]
    assert counters == {"o-1": 3, "o-2": 1}


@pytest.mark.parametrize("drop", [
    "DROP TRIGGER shop_outbox_seq",
    "ALTER TABLE shop_outbox_messages DROP INDEX ix_shop_outbox_key_waits, DROP COLUMN may_block",
], ids=["trigger", "column"])
def test_a_database_without_them_is_refused_by_name_and_upgrade_restores_them(
        shop: Outbox, mysql_db: str, drop: str) -> None:
    """Tables made by ``metadata.create_all`` alone (Alembic) lack them: without the
    trigger a keyed row would be stored without a seq, so nothing may publish."""
    with shop.engine.begin() as conn:  # type: ignore[union-attr]
        conn.exec_driver_sql(drop)
    fresh = Outbox(create_engine(mysql_db), prefix="shop_")
    refused = r"lack the (trigger shop_outbox_seq|column shop_outbox_messages\.may_block).*init-db --upgrade"
    with (pytest.raises(SchemaError, match=refused),
          Session(fresh.engine) as session, session.begin()):  # type: ignore[arg-type]
        fresh.publish(session, "orders", {}, key="o-1")
    cli = subprocess.run([sys.executable, "-m", "outbox", "relay", "--db", mysql_db, "--prefix", "shop_",
                          "--bootstrap-servers", "127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2 and "outbox init-db --upgrade" in cli.stderr, cli.stderr
    assert len(cli.stderr.strip().splitlines()) <= 2, cli.stderr
    done = subprocess.run([sys.executable, "-m", "outbox", "init-db", "--upgrade", "--db", mysql_db,
                           "--prefix", "shop_"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    with Session(fresh.engine) as session, session.begin():  # type: ignore[arg-type]
        fresh.publish(session, "orders", {}, key="o-1")
    with fresh.engine.connect() as conn:  # type: ignore[union-attr]
        assert conn.execute(sa.select(fresh.tables.messages.c.seq)).scalars().all() == [1]


def test_json_rows_write_what_json_table_reads() -> None:
    """Datetimes as naive UTC ``DATETIME(6)`` text whatever their zone, UUIDs as the stored hex."""
    plus_one = timezone(timedelta(hours=1))
    shared = datetime(2026, 11, 24, 7, 0, tzinfo=UTC)
    rows = [(uuid.UUID(int=1), "k", None, 7, shared), (uuid.UUID(int=2), "k", 1.5, True, shared),
            (uuid.UUID(int=3), None, "x", 0, datetime(2026, 11, 24, 8, 0, 0, 5, tzinfo=plus_one))]
    assert json.loads(json_rows(iter(rows))) == [
        ["0" * 31 + "1", "k", None, 7, "2026-11-24 07:00:00"],
        ["0" * 31 + "2", "k", 1.5, True, "2026-11-24 07:00:00"],
        ["0" * 31 + "3", None, "x", 0, "2026-11-24 07:00:00.000005"],
    ]
    with pytest.raises(TypeError, match="Decimal cannot go into a JSON_TABLE row"):
        json_rows([[Decimal("1.5")]])
