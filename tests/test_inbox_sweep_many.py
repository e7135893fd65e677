"""An inbox's sweep over many keys whose gaps are held at once (a consumer back after an outage,
a producer's topic replayed out of order) reads their states in bounded statements.

``Inbox.sweep`` → ``park_stale`` → ``warn_held`` reads the state of every key whose gap is held
(``KeysTable.states``). It read them in one ``(topic, key) IN (…)`` of every such key: with
10,000 of them PostgreSQL refused it ("stack depth limit exceeded"), so every sweep failed and no
gap was ever parked. The sweep itself parks a key a transaction (about five minutes for 10,000
under load), so the test asks for the states as it does, then sweeps a few keys whole.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from outbox import Inbox

KEYS = 10_000
STORED = ("gen_random_uuid(), 'orders', 'h' || g, 5, convert_to(repeat('x', 20), 'UTF8'), "
          "'application/json', '{}', now() - interval '1 hour', 0, g, NULL, NULL")


@pytest.mark.postgres
def test_the_states_of_ten_thousand_held_gaps_are_read_and_a_sweep_parks_them(pg: sa.Engine) -> None:
    inbox = Inbox(pg, group="billing", gap_timeout=1.0)
    inbox.handler("orders")(lambda session, message: None)
    inbox.create_tables()
    with pg.begin() as conn:  # each key applied to seq 1, its seq 5 held for an hour: a gap
        conn.execute(sa.text("INSERT INTO inbox_keys (consumer_group, topic, key, last_seq, parked) "
                             "SELECT 'billing', 'orders', 'h' || g, 1, false FROM generate_series(1, :n) g"),
                     {"n": KEYS})
        conn.execute(sa.text(
            "INSERT INTO inbox_held (consumer_group, message_id, topic, key, seq, payload, content_type, "
            "headers, created_at, kafka_partition, kafka_offset, incarnation, event_type, received_at) "
            f"SELECT 'billing', {STORED}, now() - interval '1 hour' FROM generate_series(1, :n) g"),
            {"n": KEYS})
    keys = [("orders", f"h{g}") for g in range(1, KEYS + 1)]
    with inbox.sessions() as session:
        states = inbox.storage.keys.states(session, keys)
    assert sorted(states) == sorted(keys) and {s.last_seq for s in states.values()} == {1}
    with pg.begin() as conn:  # the sweep, whole, over what is left
        conn.execute(sa.text("DELETE FROM inbox_held WHERE key NOT IN ('h1', 'h2', 'h3')"))
    inbox.sweep()
    with pg.connect() as conn:
        parked = conn.execute(sa.text("SELECT key FROM inbox_keys WHERE parked ORDER BY key")).scalars().all()
    assert parked == ["h1", "h2", "h3"]
