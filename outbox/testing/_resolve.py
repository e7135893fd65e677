"""Where tests find their database and broker: variable, Docker, then local.

The order is the same for both: an address from an environment variable;
testcontainers when a Docker engine answers; else something local (PostgreSQL
binaries, MariaDB's, librdkafka's mock cluster). Never a hand-written fake.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from ._mariadb import local_mariadb, mariadb_binaries, sync_driver
from ._postgres import FAST_SETTINGS, local_postgres, postgres_bindir

POSTGRES_URL_VARIABLE = "OUTBOX_TEST_POSTGRES_URL"
MYSQL_URL_VARIABLE = "OUTBOX_TEST_MYSQL_URL"
KAFKA_BOOTSTRAP_VARIABLE = "OUTBOX_TEST_KAFKA_BOOTSTRAP"


class Unavailable(RuntimeError):
    """Neither the variable, Docker nor local binaries can provide the service."""


def docker_engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        probe = subprocess.run(["docker", "info"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@contextmanager
def postgres_url(settings: Mapping[str, str] | None = FAST_SETTINGS) -> Iterator[str]:
    """Yield a SQLAlchemy URL of a PostgreSQL server to test against."""
    if url := os.environ.get(POSTGRES_URL_VARIABLE):
        yield url
    elif docker_engine_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16", driver="psycopg") as container:
            yield container.get_connection_url()
    elif postgres_bindir() is not None:
        with local_postgres(settings) as url:
            yield url
    else:
        raise Unavailable(
            f"no PostgreSQL: set {POSTGRES_URL_VARIABLE}, start Docker, "
            "or install the PostgreSQL server binaries"
        )


@contextmanager
def mysql_url() -> Iterator[str]:
    """Yield a SQLAlchemy URL of a MySQL or MariaDB server to test against (its ``mysql`` database).

    The URL's user must be allowed to create and drop databases: each test gets its own.
    """
    if url := os.environ.get(MYSQL_URL_VARIABLE):
        yield url
    elif docker_engine_answers():
        from testcontainers.mysql import MySqlContainer

        with MySqlContainer("mysql:8.0", dialect=sync_driver(), username="root") as container:
            yield container.get_connection_url() + "?charset=utf8mb4"
    elif mariadb_binaries() is not None:
        with local_mariadb() as url:
            yield url
    else:
        raise Unavailable(
            f"no MySQL/MariaDB: set {MYSQL_URL_VARIABLE}, start Docker, "
            "or install the MariaDB server (Debian: mariadb-server)"
        )


@contextmanager
def kafka_bootstrap() -> Iterator[str]:
    """Yield bootstrap servers of a Kafka-protocol broker to test against."""
    if servers := os.environ.get(KAFKA_BOOTSTRAP_VARIABLE):
        yield servers
    elif docker_engine_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer() as container:
            yield container.get_bootstrap_server()
    else:
        from transports.kafka import embedded_kafka

        with embedded_kafka() as servers:
            yield servers
