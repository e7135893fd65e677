"""A fleet of tenants on real PostgreSQL for the operations proofs (``test_tenant_ops``,
``test_console_tenants``): two tenant schemas of one database, a second database, a
schema without tables, a database that refuses connections, a server that never answers.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox import Outbox, create_engine
from outbox.testing import fresh_database

SECRET = "tenant-db-s3cret"
"""The password of the tenant databases that cannot be reached: it must appear nowhere."""


def closed_port() -> int:
    """A port nothing listens on: connecting is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(name="frozen")
def frozen_port() -> Iterator[int]:
    """A port that accepts TCP connections and never says a word: a frozen database server."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    try:
        yield int(server.getsockname()[1])
    finally:
        server.close()


class Fleet:
    """Tenants ``a``, ``b`` (schemas of the first database), ``second`` (the second database),
    ``broken`` (a schema without tables) and ``down`` (a database that refuses connections)."""

    def __init__(self, first: str, second: str, tmp_path: Path) -> None:
        self.first, self.second = first, second
        self.engine = create_engine(first)
        self.second_engine = create_engine(second)
        with self.engine.begin() as conn:
            for schema in ("t_a", "t_b", "t_broken"):
                conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
        self.down_url = f"postgresql+psycopg://ops:{SECRET}@127.0.0.1:{closed_port()}/gone"
        self.spec_file = tmp_path / "tenants.json"
        self.write([{"name": "a", "schema": "t_a"}, {"name": "b", "schema": "t_b"},
                    {"name": "broken", "schema": "t_broken"}, {"name": "second", "database": second},
                    {"name": "down", "database": self.down_url}])

    def write(self, entries: list[dict[str, str]]) -> None:
        self.spec_file.write_text(json.dumps(entries))

    @property
    def spec(self) -> str:
        return f"file:{self.spec_file}"

    def outbox(self, name: str) -> Outbox:
        if name == "second":
            return Outbox(self.second_engine)
        return Outbox(self.engine, schema=f"t_{name}")

    def create(self, *names: str) -> None:
        for name in names:
            self.outbox(name).create_tables()

    def dispose(self) -> None:
        self.engine.dispose()
        self.second_engine.dispose()


@pytest.fixture(name="fleet")
def tenant_fleet(postgres_server: str, tmp_path: Path) -> Iterator[Fleet]:
    with fresh_database(postgres_server) as first, fresh_database(postgres_server) as second:
        fleet = Fleet(first, second, tmp_path)
        yield fleet
        fleet.dispose()
