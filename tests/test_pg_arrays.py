"""Array literals built by hand (the bulk statements' parameters) read back exactly on PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from outbox import create_engine
from outbox.core._pg_arrays import array_params, rows_of

pytestmark = pytest.mark.postgres

COLUMNS = {"n": sa.BigInteger(), "id": sa.Uuid(), "at": sa.DateTime(timezone=True), "s": sa.Text()}

AWKWARD = ['plain', '', 'NULL', 'a,b', '{braces}', 'say "hi"', 'back\\slash', '\\"', ' padded ',
           'new\nline', 'tab\tend', 'ünïcødé ✓', "it's"]


def test_every_value_round_trips(postgres_db: str) -> None:
    n = len(AWKWARD) + 1
    values = {
        "n": [*range(-3, n - 4), None],
        "id": [*(uuid.uuid4() for _ in range(n - 1)), None],
        "at": [*(datetime(2026, 1, 1, 12, 30, 15, 123456, tzinfo=UTC) + timedelta(hours=i)
                 for i in range(n - 2)),
               datetime(2026, 5, 1, 9, tzinfo=timezone(timedelta(hours=-7))), None],
        "s": [*AWKWARD, None],
    }
    engine = create_engine(postgres_db)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(rows_of(COLUMNS)), array_params(COLUMNS, values)).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == list(zip(*values.values(), strict=True))


def test_a_naive_timestamp_is_refused() -> None:
    with pytest.raises(ValueError, match="naive datetime"):
        array_params({"at": sa.DateTime(timezone=True)}, {"at": [datetime(2026, 1, 1)]})
