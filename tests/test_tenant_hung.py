"""A relay fleet whose tenants span two PostgreSQL servers, one of them hung (SIGSTOP): the other's
tenants keep being published; once the hung one answers again, its tenants' rows are published too,
nothing lost, each key in seq order.

A hung server accepts connections and answers nothing: a fetch or a write on a connection it
holds waits as long as the driver does (for ever). Without a bound per database its tenants'
steps took every worker, or their pipelined writes every shared writer, and the fleet published
nothing for anybody (docs/tenants.md, "Hung").
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import Running, pending, rows, schema_outboxes, wait_for

from outbox import Outbox, create_engine
from outbox.tenants import Tenant, TenantRelay
from transports.memory import InMemoryBroker, InMemoryTransport

pytestmark = pytest.mark.postgres

HEADER = "x-tenant"
ROOMY = 1_000_000 + 256
"""A producer limit with room for the tenant header above the stored limit (1,000,000)."""
SEQ = "outbox-seq"
"""The envelope's seq header (docs/guarantees.md, the wire format)."""
KEYS = [f"k{i}" for i in range(10)]


def publish(outbox: Outbox, topic: str, count: int) -> None:
    with outbox.begin() as session:
        for i in range(count):
            outbox.publish(session, topic, {"i": i}, key=KEYS[i % len(KEYS)])


def check_sent(broker: InMemoryBroker, topic: str, outboxes: dict[str, Outbox]) -> None:
    """Every row published and on the topic under its tenant's name; per tenant and key, the first
    sending of each seq in seq order (a row sent again after its lease lapsed is the same message)."""
    firsts: dict[tuple[str, str], list[int]] = {}
    seen: set[str] = set()
    for record in broker.records(topic):
        headers = dict(record.headers)
        message_id = headers["outbox-message-id"].decode()
        if message_id in seen:
            continue
        seen.add(message_id)
        assert record.key is not None
        firsts.setdefault((headers[HEADER].decode(), record.key.decode()), []).append(int(headers[SEQ]))
    expected: dict[tuple[str, str], list[int]] = {}
    stored: set[str] = set()
    for name, outbox in outboxes.items():
        for row in rows(outbox):
            assert row.status == "published", (name, row.id, row.status)
            stored.add(str(row.message_id))
            expected.setdefault((name, row.key), []).append(row.seq)
    assert seen == stored
    assert firsts == {place: list(range(1, len(seqs) + 1)) for place, seqs in expected.items()}


@pytest.mark.slow
def test_a_hung_database_holds_up_no_other_databases_tenants_and_loses_nothing(
        pg: sa.Engine, own_postgres: Any, topic: str) -> None:
    healthy = schema_outboxes(pg, ["h1", "h2", "h3", "h4"])
    hung_engine = create_engine(own_postgres.url)
    hung = schema_outboxes(hung_engine, ["f1", "f2", "f3", "f4"])
    # The fleet's pool on the hung server, as a busy fleet's is: every connection open. A thread that
    # needs a new one gives up at the connect timeout (an outage, which closes its gate); on an open
    # one it waits for good.
    fleet_engine = create_engine(own_postgres.url, pool_size=10, max_overflow=0)
    opened = [fleet_engine.connect() for _ in range(10)]
    for conn in opened:
        conn.close()
    tenants = ([Tenant(name, name) for name in healthy]
               + [Tenant(name, name, database=fleet_engine) for name in hung])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    # Small batches: the hung server's tenants always have a fetch or a pipelined write going.
    relay = TenantRelay(tenants, lambda: InMemoryTransport(broker), database=pg, workers=4,
                        tenant_header=HEADER, poll_interval=0.1, lease_ttl=10.0, refresh_every=0.5,
                        batch_size=20)
    running = Running(relay)
    feeding = threading.Event()

    def feed() -> None:
        """Commits to the hung server's tenants, one row at a time: notifications waking them."""
        n = 0
        while not feeding.is_set():
            publish(list(hung.values())[n % len(hung)], topic, 1)
            n += 1
            time.sleep(0.01)

    feeder = threading.Thread(target=feed, daemon=True)
    frozen = False
    try:
        for outbox in [*healthy.values(), *hung.values()]:
            publish(outbox, topic, 20)
        wait_for(lambda: sorted(relay.tenants) == sorted([*healthy, *hung]), 30, "every tenant served")
        wait_for(lambda: all(pending(o) == 0 for o in [*healthy.values(), *hung.values()]), 30,
                 "the first rows of every tenant")
        for outbox in hung.values():
            publish(outbox, topic, 3000)
        feeder.start()
        wait_for(lambda: len(broker.records(topic)) > 8 * 20 + 400, 30,
                 "the hung server's backlog being sent")
        own_postgres.freeze()
        frozen = True
        for round_ in range(3):
            started = time.monotonic()
            for outbox in healthy.values():
                publish(outbox, topic, 10)
            wait_for(lambda: all(pending(o) == 0 for o in healthy.values()), 20,
                     f"the healthy server's tenants published while the other hangs (round {round_})")
            print(f"round {round_}: the healthy tenants published in {time.monotonic() - started:.2f} s")
        own_postgres.thaw()
        frozen = False
        feeding.set()
        feeder.join(60)
        assert not feeder.is_alive()
        started = time.monotonic()
        wait_for(lambda: all(pending(o) == 0 for o in hung.values()), 120,
                 "the hung server's tenants published once it answers")
        print(f"the hung server's backlog published {time.monotonic() - started:.1f} s after it answered")
    finally:
        if frozen:
            own_postgres.thaw()
        feeding.set()
        running.stop()
        hung_engine.dispose()
        fleet_engine.dispose()
    check_sent(broker, topic, {**healthy, **hung})
