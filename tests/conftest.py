"""The test bed every test uses: real PostgreSQL and MariaDB/MySQL, SQLite files, Apache Kafka.

Resolution order (see ``outbox.testing``): environment variable, testcontainers
when a Docker engine answers, local binaries (the local Apache Kafka for a test
that needs a real broker, librdkafka's mock cluster for one that needs only the
protocol). With ``CI=true`` a missing PostgreSQL, MariaDB, Java or Apache Kafka
fails the run instead of skipping.
Session fixtures belong to one process: under pytest-xdist every worker starts its own
servers (temp directories, free ports), so workers share nothing but the machine.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

import _crash_report
import _loops_left
import _xdist_groups
import pytest
import sqlalchemy as sa
from _mock_faults import MockCluster
from _pg_databases import RecycledDatabases
from hypothesis import settings

from outbox import Outbox, create_engine
from outbox.testing import (
    JVM_OPTIONS_ENV,
    KAFKA_BOOTSTRAP_VARIABLE,
    BrokerNeed,
    ConnectRest,
    DebeziumOutbox,
    LocalKafka,
    LocalKafkaCluster,
    LocalKafkaConnect,
    LocalMariaDB,
    LocalPostgres,
    Unavailable,
    docker_engine_answers,
    fresh_database,
    fresh_mysql_database,
    kafka_bootstrap,
    local_postgres_server,
    logical_postgres_url,
    mysql_url,
    postgres_url,
)
from outbox.testing import kafka_connect as connect_worker

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
T = TypeVar("T")

# The suite's brokers and Connect workers live seconds to minutes: C1 only (no optimising
# compiler) starts a broker on 1.7 s of CPU instead of 3.0 and serves the tests' load on less
# (docs/testing.md). Benchmarks do not load this file: their JVMs run as in production.
os.environ.setdefault(JVM_OPTIONS_ENV, "-XX:TieredStopAtLevel=1")

# Property tests: CI runs a fixed set of examples (derandomized, so a red run is repeatable from its
# log); `HYPOTHESIS_PROFILE=release` is the longer run before a release (docs/testing.md).
# Tests leave max_examples to the profile unless a test's examples are expensive.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.register_profile("release", max_examples=2000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if IN_CI else "dev"))


SERVER_FIXTURES = {"postgres_server": "postgres", "own_postgres": "postgres", "mysql_server": "mysql",
                   "own_mariadb": "mysql", "kafka": "kafka", "own_kafka": "kafka", "module_kafka": "kafka",
                   "quick_quotas": "kafka", "module_quick_quotas": "kafka",
                   "kafka_cluster": "kafka", "any_kafka": "any_kafka", "java_home": "spark",
                   "logical_postgres": "debezium", "kafka_connect": "debezium", "own_connect": "debezium"}
"""The fixtures (of this file) that start a server, and the marker a test using one (even through
another fixture) gets, so that ``-m "not postgres and not mysql and not kafka and not any_kafka and
not spark"`` runs exactly the tests that need none (docs/testing.md, the tiers). A test class that
overrides one of these names with a fixture of its own (the in-memory transport's ``kafka``) does
not get the marker."""


def _server_markers(item: pytest.Item) -> set[str]:
    """The markers of the server fixtures of this file that ``item`` uses, directly or not."""
    # name2fixturedefs holds each name's definitions, the one in effect last: a fixture of this
    # file and not a test's own override of the name.
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    markers = set()
    for name in getattr(item, "fixturenames", ()):  # the closure: fixtures of fixtures too
        server = SERVER_FIXTURES.get(name)
        found = definitions.get(name)
        if server is not None and found and found[-1].func.__module__ == __name__:
            markers.add(server)
    return markers


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses a server's fixture gets its marker; every Spark test is ``slow`` and joins
    the ``spark`` group; every Debezium test is ``slow`` and joins the ``debezium`` group (one
    Kafka Connect JVM per worker that runs them: one worker); every test on the three-node Kafka
    cluster is ``slow`` and joins the ``kafka-cluster`` group (three JVMs: one such test at a time).

    Slow: a Spark test needs a JVM, whose start alone takes tens of seconds here; the fast
    tier (``-m "not slow"``) starts none. The group: under ``pytest -n N`` each worker is a
    process with its own servers (the session fixtures below) and its own Spark session; a JVM
    costs about a core while it starts and a gigabyte while it lives, so the Spark tests share
    one worker instead of starting one JVM per worker. (Runs before the ``-m`` selection and
    before pytest-xdist reads the groups: ``tryfirst``.)
    """
    for item in items:
        for server in _server_markers(item):
            if not item.get_closest_marker(server):
                item.add_marker(getattr(pytest.mark, server))
        if item.get_closest_marker("spark"):
            _slow_in_group(item, "spark")
        if item.get_closest_marker("debezium"):
            _slow_in_group(item, "debezium")
        if "kafka_cluster" in getattr(item, "fixturenames", ()):
            _slow_in_group(item, "kafka-cluster")


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.is_registered(_xdist_groups):  # -p _xdist_groups registered it already
        config.pluginmanager.register(_xdist_groups, "_xdist_groups")
    if not config.pluginmanager.is_registered(_crash_report):
        config.pluginmanager.register(_crash_report, "_crash_report")
    if not config.pluginmanager.is_registered(_loops_left):
        config.pluginmanager.register(_loops_left, "_loops_left")


def _slow_in_group(item: pytest.Item, group: str) -> None:
    item.add_marker(pytest.mark.slow)
    if not item.get_closest_marker("xdist_group"):
        item.add_marker(pytest.mark.xdist_group(group))


def unavailable(what: str) -> None:
    """Skip locally, fail in CI: CI must prove everything, not skip it."""
    if IN_CI:
        pytest.fail(f"{what} (CI=true: a missing dependency is a failure)", pytrace=False)
    pytest.skip(what)


def resolved(resolve: Callable[[], AbstractContextManager[T]]) -> Iterator[T]:
    """What ``resolve()`` yields (a URL, a worker), or skip (locally) / fail (in CI) without it."""
    try:
        context = resolve()
        url = context.__enter__()
    except Unavailable as exc:
        unavailable(str(exc))
    try:
        yield url
    finally:
        context.__exit__(None, None, None)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """URL of a PostgreSQL server shared by the session (its default database)."""
    yield from resolved(postgres_url)


@pytest.fixture(scope="session")
def mysql_server() -> Iterator[str]:
    """URL of a MySQL or MariaDB server shared by the session (its ``mysql`` database)."""
    yield from resolved(mysql_url)


@pytest.fixture
def own_postgres() -> Iterator[LocalPostgres]:
    """A PostgreSQL server of the test's own, that the test may stop and start (outage tests)."""
    with postgres_of_its_own() as server:
        yield server


@contextmanager
def postgres_of_its_own() -> Iterator[LocalPostgres]:
    """A PostgreSQL server started for the caller alone (``own_postgres``, or a test that needs more)."""
    try:
        context = local_postgres_server()
        server = context.__enter__()
    except FileNotFoundError as exc:
        unavailable(str(exc))
    try:
        yield server
    finally:
        context.__exit__(None, None, None)


def mariadb_of_its_own(options: tuple[str, ...] = ()) -> Iterator[LocalMariaDB]:
    """A new MariaDB server (with these server ``options``) for one test, removed after."""
    try:
        server = LocalMariaDB(options=options)
    except FileNotFoundError as exc:
        unavailable(str(exc))
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture
def own_mariadb() -> Iterator[LocalMariaDB]:
    """A MariaDB server of the test's own, that the test may stop and start (outage tests)."""
    yield from mariadb_of_its_own()


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("mariadb", marks=pytest.mark.mysql)])
def own_server(request) -> LocalPostgres | LocalMariaDB:
    """``own_postgres``, then ``own_mariadb``: a server of the test's own, on each kind."""
    return request.getfixturevalue(f"own_{request.param}")


@pytest.fixture(scope="session")
def java_home() -> str:
    java = shutil.which("java")
    if java is None and not os.environ.get("JAVA_HOME"):
        unavailable("no Java runtime: Spark needs a JVM (install openjdk-17-jre-headless)")
    return os.environ.get("JAVA_HOME") or os.path.dirname(os.path.dirname(os.path.realpath(java)))


@pytest.fixture(scope="session")
def _postgres_databases(postgres_server: str) -> Iterator[RecycledDatabases]:
    databases = RecycledDatabases(postgres_server)
    try:
        yield databases
    finally:
        databases.close()


@pytest.fixture
def postgres_db(_postgres_databases: RecycledDatabases) -> Iterator[str]:
    """A fresh, empty database on the shared server, of the test's own until it ends: an earlier
    test's, emptied and renamed, or a new one (``tests/_pg_databases.py``)."""
    with _postgres_databases.database() as url:
        yield url


@pytest.fixture
def pg(postgres_db: str) -> Iterator[sa.Engine]:
    """An engine (``create_engine``'s settings) on a fresh PostgreSQL database, disposed after."""
    engine = create_engine(postgres_db)
    yield engine
    engine.dispose()


@pytest.fixture
def mysql_db(mysql_server: str) -> Iterator[str]:
    """A fresh, empty database on the shared MySQL/MariaDB server, dropped after the test."""
    with fresh_mysql_database(mysql_server) as url:
        yield url


@pytest.fixture
def sqlite_db(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'test.db'}"


SERVER_DATABASES = [pytest.param("postgres", marks=pytest.mark.postgres),
                    pytest.param("mysql", marks=pytest.mark.mysql)]
"""The database servers a proof runs on: ``server_db_url`` (SQLite is in ``db_url`` too)."""


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request) -> str:
    """Each test using it runs once on SQLite and once on PostgreSQL."""
    return request.getfixturevalue(f"{request.param}_db")


@pytest.fixture(params=["sqlite", *SERVER_DATABASES])
def proof_db_url(request) -> str:
    """Each test using it runs on SQLite, PostgreSQL and MySQL/MariaDB: the proofs that
    docs/guarantees.md says ran on all three databases."""
    return request.getfixturevalue(f"{request.param}_db")


@pytest.fixture(params=SERVER_DATABASES)
def server_db_url(request) -> str:
    """Each test using it runs on PostgreSQL and MySQL/MariaDB (proofs SQLite cannot host)."""
    return request.getfixturevalue(f"{request.param}_db")


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def outbox(engine: sa.Engine) -> Outbox:
    ob = Outbox(engine)
    ob.create_tables()
    return ob


@pytest.fixture(scope="session")
def kafka() -> Iterator[str]:
    """Bootstrap servers of Apache Kafka itself, shared by the session (by one xdist worker's tests).

    For a test whose promise rests on the broker's behaviour. Resolved as
    ``outbox.testing.kafka_bootstrap(BrokerNeed.REAL)`` does: ``OUTBOX_TEST_KAFKA_BOOTSTRAP``,
    testcontainers, then a single-node ``LocalKafka`` from the jars ``scripts/setup`` fetches
    (started once per worker, on first use). Never the mock: without a broker the test skips
    (naming ``scripts/setup``), and fails with ``CI=true``.
    """
    yield from resolved(lambda: kafka_bootstrap(BrokerNeed.REAL))


def own_local_kafka(settings: dict[str, str] | None = None) -> Iterator[LocalKafka]:
    """A fixture's body: a ``LocalKafka`` of ``settings`` for one test, closed after it; without
    the jars, the test skips (fails under ``CI=true``) naming them."""
    try:
        broker = LocalKafka(settings)
    except FileNotFoundError as exc:
        unavailable(str(exc))
    try:
        yield broker
    finally:
        broker.close()


@pytest.fixture
def own_kafka() -> Iterator[LocalKafka]:
    """A single-node Apache Kafka of the test's own, to stop, kill, freeze and start again."""
    yield from own_local_kafka()


@pytest.fixture(scope="module")
def module_kafka() -> Iterator[LocalKafka]:
    """A single-node Apache Kafka that the tests of one module fault one after another, instead of a
    broker each (about 3 s and 4 CPU-seconds a start). A module overrides ``own_kafka`` with
    ``thawed_and_running(module_kafka)`` and puts those tests in an xdist group of its own (on one
    worker, or each worker starts one); it keeps them apart on the broker: topics, transactional ids
    and groups of their own, no quota left set."""
    yield from own_local_kafka()


def thawed_and_running(broker: LocalKafka) -> LocalKafka:
    """``broker`` as the next test needs it: thawed, and started again if it is down (a test that
    failed half-way may leave it frozen, stopped or killed)."""
    if broker.frozen:
        broker.thaw()
    if not broker.nodes[0].running:
        broker.start()
    return broker


QUICK_QUOTAS = {"quota.window.num": "2", "quota.window.size.seconds": "1"}
"""Quotas measured over 2 s (1 s windows, 2 of them): a quota set or lifted takes effect within seconds."""


@pytest.fixture
def quick_quotas() -> Iterator[LocalKafka]:
    """A single-node Apache Kafka of the test's own whose quotas measure the rate over 2 s (1 s
    windows, 2 of them): a quota set or lifted takes effect within seconds (the exactly-once pace)."""
    yield from own_local_kafka(QUICK_QUOTAS)


@pytest.fixture(scope="module")
def module_quick_quotas() -> Iterator[LocalKafka]:
    """``quick_quotas`` shared by the tests of one module that throttle producers of a ``client.id`` of
    their own and fault nothing else (a quota on a client id slows only that client; its rate window
    starts empty): one JVM start instead of one each. A module overrides ``quick_quotas`` with
    ``thawed_and_running(module_quick_quotas)`` and keeps those tests in one xdist group, and each on
    a topic, progress topic and transactional ids of its own."""
    yield from own_local_kafka(QUICK_QUOTAS)


@pytest.fixture(scope="session")
def logical_postgres() -> Iterator[str]:
    """URL of a PostgreSQL with ``wal_level=logical`` (what Debezium reads), shared by the session.

    ``OUTBOX_TEST_LOGICAL_POSTGRES_URL``, testcontainers, then a local server
    (``outbox.testing.logical_postgres_url``); skips locally and fails with ``CI=true`` without one.
    """
    yield from resolved(logical_postgres_url)


@pytest.fixture(scope="session")
def kafka_connect(kafka: str) -> Iterator[ConnectRest]:
    """A Kafka Connect worker with Debezium writing to the session's Apache Kafka (one per xdist worker).

    ``OUTBOX_TEST_KAFKA_CONNECT_URL``, Debezium's image on Docker, else a ``LocalKafkaConnect``
    from the jars ``scripts/setup`` fetches; skips locally and fails with ``CI=true`` without one.
    """
    yield from resolved(lambda: connect_worker(kafka))


@pytest.fixture
def own_connect(kafka: str) -> Iterator[LocalKafkaConnect]:
    """A Kafka Connect worker of the test's own, to stop, kill and start again. Its source offsets
    reach the offsets file only on a clean stop: a kill loses them, and Debezium sends again."""
    try:
        connect = LocalKafkaConnect(kafka, settings={"offset.flush.interval.ms": "3600000"})
    except FileNotFoundError as exc:
        unavailable(str(exc))
    try:
        yield connect
    finally:
        connect.close()


@pytest.fixture
def debezium_db(logical_postgres: str) -> Iterator[str]:
    """A database of the test's own on the logical-decoding PostgreSQL: its slots, its outbox table."""
    with fresh_database(logical_postgres) as url:
        yield url


@pytest.fixture
def debezium(kafka_connect: ConnectRest, debezium_db: str, kafka: str) -> Iterator[DebeziumOutbox]:
    """Debezium's outbox event router on the session's worker, over a Debezium-layout table of the
    test's database; ready (its probe row went through), removed with its slot after the test."""
    with DebeziumOutbox(kafka_connect, debezium_db, kafka) as outbox:
        yield outbox


@pytest.fixture(scope="module")
def _module_kafka_cluster() -> Iterator[LocalKafkaCluster]:
    """The three nodes ``kafka_cluster`` hands the tests of one module (a start is 9-15 s of three JVMs)."""
    try:
        cluster = LocalKafkaCluster()
    except FileNotFoundError as exc:
        unavailable(str(exc))
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def kafka_cluster(_module_kafka_cluster: LocalKafkaCluster) -> LocalKafkaCluster:
    """Three Apache Kafka nodes (replication factor 3, ``min.insync.replicas`` 2), every one running
    at the test's start: the module's tests share them, and a node an earlier test left frozen or
    down (one that failed half-way) is thawed or started again first. A test works on topics and
    transactional ids of its own and looks up leaders, coordinators and the active controller when
    it needs them, never assuming which node is which.

    The test is ``slow`` and in the ``kafka-cluster`` group (added above). For other settings,
    build ``LocalKafkaCluster(...)`` in the test instead.
    """
    cluster = _module_kafka_cluster
    for node in cluster.nodes:
        node.thaw()
    down = [node.node_id for node in cluster.nodes if not node.running]
    if down:
        cluster.start(*down)
    return cluster


@pytest.fixture(scope="session")
def any_kafka() -> Iterator[str]:
    """Bootstrap servers of a Kafka-protocol broker shared by the session (by one xdist worker's tests).

    For a test that proves nothing about the broker: librdkafka's mock cluster (in this process,
    ready in milliseconds) unless ``OUTBOX_TEST_KAFKA_BOOTSTRAP`` or a Docker engine gives a broker.
    The mock is made here through ``MockCluster`` so that a new consumer group forms at once:
    the 3 s initial rebalance delay cost every test with a consumer 3 s.
    """
    if os.environ.get(KAFKA_BOOTSTRAP_VARIABLE) or docker_engine_answers():
        with kafka_bootstrap() as servers:
            yield servers
        return
    with MockCluster() as cluster:
        cluster.join_at_once()
        yield cluster.bootstrap


@pytest.fixture
def topic() -> str:
    """A topic name no other test uses (the broker is shared by the session)."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def progress_topic(topic: str) -> str:
    """The exactly-once relay's progress topic for ``topic``: one per test, as the broker is shared."""
    return f"{topic}-progress"
