"""Where tests find their database and broker: variable, Docker, then local.

The order is the same for each: an address from an environment variable;
testcontainers when a Docker engine answers; else something local (PostgreSQL
binaries, MariaDB's; for Kafka the local Apache Kafka from the fetched jars,
then librdkafka's mock cluster). Never a hand-written fake.

A Kafka test says what it needs (``BrokerNeed``): a test whose promise rests on
the broker's behaviour needs Apache Kafka itself and never gets the mock; a
test that only needs the Kafka protocol gets the mock, which starts in
milliseconds inside the process, rather than a JVM.
"""

from __future__ import annotations

import enum
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from ._connect import ConnectRest, LocalKafkaConnect
from ._connect import missing as local_connect_missing
from ._kafka import local_kafka
from ._kafka_libs import missing as local_kafka_missing
from ._mariadb import local_mariadb, mariadb_binaries, sync_driver
from ._postgres import FAST_SETTINGS, LOGICAL_SETTINGS, local_postgres, postgres_bindir

POSTGRES_URL_VARIABLE = "OUTBOX_TEST_POSTGRES_URL"
MYSQL_URL_VARIABLE = "OUTBOX_TEST_MYSQL_URL"
KAFKA_BOOTSTRAP_VARIABLE = "OUTBOX_TEST_KAFKA_BOOTSTRAP"
LOGICAL_POSTGRES_URL_VARIABLE = "OUTBOX_TEST_LOGICAL_POSTGRES_URL"
KAFKA_CONNECT_URL_VARIABLE = "OUTBOX_TEST_KAFKA_CONNECT_URL"
DEBEZIUM_CONNECT_IMAGE = "quay.io/debezium/connect:3.6.1.Final"
"""The Kafka Connect image of Debezium's release the local bundle pins (``scripts/jvm/debezium``)."""


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


class BrokerNeed(enum.Enum):
    """What a Kafka test needs of its broker."""

    REAL = "real"
    """Apache Kafka itself: the test proves something that rests on the broker's behaviour
    (order under errors, idempotence, fencing, transactions, groups, failover). Never the mock."""
    ANY = "any"
    """Any Kafka protocol: librdkafka's mock cluster will do, and is the fast choice."""


@contextmanager
def kafka_bootstrap(need: BrokerNeed = BrokerNeed.ANY) -> Iterator[str]:
    """Yield bootstrap servers of a Kafka broker to test against.

    ``OUTBOX_TEST_KAFKA_BOOTSTRAP`` when set (a real broker: the mock is refused for
    ``BrokerNeed.REAL``), else a testcontainers Kafka when a Docker engine answers, else
    for ``REAL`` a local Apache Kafka from the fetched jars (``LocalKafka``) and for
    ``ANY`` librdkafka's mock cluster in this process. Raises ``Unavailable`` (one line
    saying how to get one) when ``REAL`` finds no broker.
    """
    if servers := os.environ.get(KAFKA_BOOTSTRAP_VARIABLE):
        if need is BrokerNeed.REAL:
            _refuse_the_mock(servers)
        yield servers
    elif docker_engine_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer() as container:
            yield container.get_bootstrap_server()
    elif need is BrokerNeed.REAL:
        if (why := local_kafka_missing()) is not None:
            raise Unavailable(f"no Apache Kafka: {why} (or set {KAFKA_BOOTSTRAP_VARIABLE}, or start Docker)")
        with local_kafka() as servers:
            yield servers
    else:
        from transports.kafka import embedded_kafka

        with embedded_kafka() as servers:
            yield servers


def _refuse_the_mock(servers: str) -> None:
    """A test that needs Apache Kafka must not run on librdkafka's mock cluster under the variable.

    Asked of the broker itself: the mock names its cluster ``mockCluster…``. A broker that does
    not answer is left to the test (it may be starting).
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        admin = AdminClient({"bootstrap.servers": servers, "log_level": 0})
        cluster = admin.list_topics(timeout=10).cluster_id
    except KafkaException:
        return
    if cluster and cluster.startswith("mockCluster"):
        raise Unavailable(f"{KAFKA_BOOTSTRAP_VARIABLE}={servers} is librdkafka's mock cluster, "
                          "and this test needs Apache Kafka")


@contextmanager
def logical_postgres_url(settings: Mapping[str, str] | None = LOGICAL_SETTINGS) -> Iterator[str]:
    """Yield a SQLAlchemy URL of a PostgreSQL with ``wal_level=logical`` (what Debezium reads).

    ``OUTBOX_TEST_LOGICAL_POSTGRES_URL`` when set (its server is asked: another
    ``wal_level`` is refused, naming it), else a testcontainers PostgreSQL started with
    logical decoding when a Docker engine answers, else a local server with ``settings``.
    Its user must be allowed to create replication slots and publications.
    """
    if url := os.environ.get(LOGICAL_POSTGRES_URL_VARIABLE):
        _require_logical(url)
        yield url
    elif docker_engine_answers():
        from testcontainers.postgres import PostgresContainer

        options = " ".join(f"-c {k}={v}" for k, v in (settings or {}).items())
        container = PostgresContainer("postgres:16", driver="psycopg").with_command(f"postgres {options}")
        with container:
            yield container.get_connection_url()
    elif postgres_bindir() is not None:
        with local_postgres(settings) as url:
            yield url
    else:
        raise Unavailable(f"no PostgreSQL with logical decoding: set {LOGICAL_POSTGRES_URL_VARIABLE}, start "
                          "Docker, or install the PostgreSQL server binaries")


def _require_logical(url: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            level = conn.exec_driver_sql("SHOW wal_level").scalar()
    finally:
        engine.dispose()
    if level != "logical":
        raise Unavailable(f"{LOGICAL_POSTGRES_URL_VARIABLE} names a server with wal_level={level}: Debezium "
                          "needs wal_level=logical")


@contextmanager
def kafka_connect(bootstrap: str) -> Iterator[ConnectRest]:
    """Yield the REST API of a Kafka Connect worker with Debezium that writes to the broker at ``bootstrap``.

    ``OUTBOX_TEST_KAFKA_CONNECT_URL`` when set (a worker of yours: it must answer for that
    broker's cluster, or it is refused), else Debezium's Connect image when a Docker
    engine answers (host network: the broker and databases the tests reach on
    127.0.0.1 are its too), else a ``LocalKafkaConnect`` from the jars ``scripts/setup``
    fetches. Raises ``Unavailable`` (one line saying how to get one) when there is none.
    """
    from ._connect import _cluster_id

    if url := os.environ.get(KAFKA_CONNECT_URL_VARIABLE):
        rest = ConnectRest(url)
        cluster = rest.info().get("kafka_cluster_id")
        if cluster != _cluster_id(bootstrap):
            raise Unavailable(f"{KAFKA_CONNECT_URL_VARIABLE}={url} works for Kafka cluster {cluster!r}, "
                              f"not the tests' broker at {bootstrap}")
        yield rest
    elif docker_engine_answers():
        with _connect_container(bootstrap) as rest:
            yield rest
    else:
        if (why := local_connect_missing()) is not None:
            raise Unavailable(f"no Kafka Connect with Debezium: {why} (or set {KAFKA_CONNECT_URL_VARIABLE}, "
                              "or start Docker)")
        with LocalKafkaConnect(bootstrap) as connect:
            yield connect


@contextmanager
def _connect_container(bootstrap: str) -> Iterator[ConnectRest]:
    """Debezium's Connect image in distributed mode on the host's network, its REST API on a free port."""
    import uuid

    from testcontainers.core.container import DockerContainer

    from ._ports import free_port

    port, group = free_port(), f"outbox-tests-{uuid.uuid4().hex[:8]}"
    container = (DockerContainer(DEBEZIUM_CONNECT_IMAGE)
                 .with_kwargs(network_mode="host")
                 .with_env("BOOTSTRAP_SERVERS", bootstrap).with_env("GROUP_ID", group)
                 .with_env("CONFIG_STORAGE_TOPIC", f"{group}-configs")
                 .with_env("OFFSET_STORAGE_TOPIC", f"{group}-offsets")
                 .with_env("STATUS_STORAGE_TOPIC", f"{group}-status")
                 .with_env("KEY_CONVERTER", "org.apache.kafka.connect.storage.StringConverter")
                 .with_env("VALUE_CONVERTER", "org.apache.kafka.connect.storage.StringConverter")
                 .with_env("CONNECT_LISTENERS", f"http://127.0.0.1:{port}")
                 .with_env("CONNECT_REST_ADVERTISED_HOST_NAME", "127.0.0.1")
                 .with_env("CONNECT_REST_ADVERTISED_PORT", str(port)))
    with container:
        rest = ConnectRest(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 180
        while True:
            try:
                rest.info()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise Unavailable(f"{DEBEZIUM_CONNECT_IMAGE} did not answer on port {port} "
                                      "within 180 s") from None
                time.sleep(1)
        yield rest
