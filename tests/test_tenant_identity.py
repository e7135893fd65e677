"""Tenants are told apart by what their database servers say, not by how their URLs are spelled.

Issue 35's breaks: two relay tenants naming one schema through two spellings of
one database URL were both served (the schema's rows went out under whichever
took the leases first); an inbox tenant whose database was the default one
spelled another way took the unknown tenants' parked messages for its own, and
its replay ran its handler on another tenant's message. Each spelling here is
one a user could write: another host name for the address, a query parameter,
``dir/./file``, a symlink, a hard link, a relative path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import pending, publish, schema_outboxes, wait_for

from outbox import ConfigurationError, Outbox, create_engine
from outbox.tenants import Tenant, TenantRelay
from transports.memory import InMemoryBroker, InMemoryTransport

HEADER = "x-tenant"
ROOMY = 1_000_000 + 256
TOPIC = "orders"

POSTGRES_SPELLINGS: dict[str, Callable[[sa.URL], sa.URL]] = {
    "localhost for 127.0.0.1": lambda url: url.set(host="localhost"),
    "an added connect_timeout": lambda url: url.update_query_dict({"connect_timeout": "10"}),
    "an added application_name": lambda url: url.update_query_dict({"application_name": "relay"}),
}


def respelled(url: str, how: str) -> str:
    return POSTGRES_SPELLINGS[how](sa.make_url(url)).render_as_string(hide_password=False)


def fleet(tenants: Any, broker: InMemoryBroker, **kwargs: Any) -> TenantRelay:
    options: dict[str, Any] = dict(tenant_header=HEADER, poll_interval=0.1, lease_ttl=5.0, refresh_every=0.2)
    options.update(kwargs)
    return TenantRelay(tenants, lambda: InMemoryTransport(broker), **options)


@pytest.fixture
def pg(postgres_db: str) -> Iterator[sa.Engine]:
    engine = create_engine(postgres_db)
    yield engine
    engine.dispose()


# -- break 1: a relay's two tenants in one schema ---------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("how", sorted(POSTGRES_SPELLINGS))
def test_two_relay_tenants_in_one_schema_through_two_spellings_are_refused(
        pg: sa.Engine, postgres_db: str, topic: str, how: str) -> None:
    outboxes = schema_outboxes(pg, ["acme"], shards=2)
    publish(outboxes["acme"], topic, ["a"])
    both = [Tenant("acme", "acme", database=postgres_db),
            Tenant("impostor", "acme", database=respelled(postgres_db, how))]
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    relay = fleet(lambda: both, broker)
    try:
        with pytest.raises(ConfigurationError, match="tenants 'acme' and 'impostor' name the same schema"):
            relay.refresh()
        assert relay.tenants == []
        both.pop()
        relay.run_once()
    finally:
        relay.close()
    assert [[v for n, v in r.headers if n == HEADER] for r in broker.records(topic)] == [[b"acme"]]


@pytest.mark.postgres
def test_the_default_database_and_a_respelled_url_of_it_are_one_database(
        pg: sa.Engine, postgres_db: str) -> None:
    schema_outboxes(pg, ["acme"], shards=2)
    impostor = Tenant("impostor", "acme", database=respelled(postgres_db, "localhost for 127.0.0.1"))
    relay = fleet([Tenant("acme", "acme"), impostor], InMemoryBroker(max_record_bytes=ROOMY), database=pg)
    try:
        with pytest.raises(ConfigurationError, match="'acme' and 'impostor'"):
            relay.refresh()
    finally:
        relay.close()


@pytest.mark.postgres
def test_two_tenants_in_two_schemas_of_one_database_are_both_served(pg: sa.Engine, postgres_db: str,
                                                                     topic: str) -> None:
    outboxes = schema_outboxes(pg, ["acme", "globex"], shards=2)
    for outbox in outboxes.values():
        publish(outbox, topic, ["k"])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    relay = fleet([Tenant("acme", "acme", database=postgres_db),
                   Tenant("globex", "globex", database=respelled(postgres_db, "localhost for 127.0.0.1"))],
                  broker)
    try:
        relay.run_once()
    finally:
        relay.close()
    sent = sorted(v for r in broker.records(topic) for n, v in r.headers if n == HEADER)
    assert sent == [b"acme", b"globex"]


class Running:
    def __init__(self, relay: TenantRelay) -> None:
        self.relay = relay
        self.thread = threading.Thread(target=relay.run, kwargs={"stop_timeout": 10}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.relay.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.relay.close()


@pytest.mark.slow
@pytest.mark.postgres
def test_two_tenants_in_one_schema_whose_database_was_down_at_the_reading_are_not_both_served(
        own_postgres: Any, topic: str, caplog: pytest.LogCaptureFixture) -> None:
    """Down when the tenants were read, the database could not say who it is then: the second
    tenant to be built is refused by name when it answers, and the schema's rows go out under one."""
    url = own_postgres.url
    outbox = Outbox(create_engine(url, poolclass=sa.NullPool), shards=2)
    outbox.create_tables()
    publish(outbox, topic, ["k1", "k2", "k3"])
    own_postgres.stop()
    caplog.set_level(logging.ERROR, logger="outbox.relay")
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    running = Running(fleet([Tenant("acme", database=url),
                             Tenant("impostor", database=respelled(url, "localhost for 127.0.0.1"))], broker))
    try:
        wait_for(lambda: running.relay.problem() is not None and "unreachable" in running.relay.problem(),
                 30, "the database seen down")
        own_postgres.start()
        wait_for(lambda: pending(outbox) == 0, 30, "the rows sent")
        wait_for(lambda: any("name the same schema" in r.getMessage() for r in caplog.records), 30,
                 "the second tenant refused by name")
        assert len(running.relay.tenants) == 1
    finally:
        running.stop()
        outbox.engine.dispose()  # type: ignore[union-attr]
    names = {v for r in broker.records(topic) for n, v in r.headers if n == HEADER}
    assert len(names) == 1, names
