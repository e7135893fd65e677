"""The relay's core proofs (test_relay_core) again, on a PostgreSQL outbox table partitioned by day."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from test_relay_core import *  # noqa: F403  (collects the same tests here, on the fixtures below)

from outbox import Outbox
from outbox.housekeeping import partition_outbox
from outbox.housekeeping._partitions import is_partitioned


@pytest.fixture
def db_url(postgres_db: str) -> str:
    return postgres_db


@pytest.fixture
def outbox(engine: sa.Engine) -> Outbox:
    ob = Outbox(engine)
    ob.create_tables()
    partition_outbox(engine, ob.tables)
    with engine.connect() as conn:
        assert is_partitioned(conn, ob.tables.messages)
    return ob


# Not about the table: they run once, in test_relay_core.
for _name in ("test_delay_backoff_is_capped",
              "test_a_pipelined_write_holds_the_keys_it_stops_until_it_commits",
              "test_a_batch_is_sent_while_the_previous_batch_is_written",
              "test_exactly_once_keeps_one_write_in_flight"):
    del globals()[_name]
