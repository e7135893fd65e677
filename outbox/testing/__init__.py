"""Test helpers shipped with the package: real servers, not fakes.

``postgres_url()``, ``mysql_url()`` and ``kafka_bootstrap()`` resolve databases and a broker
(environment variable, then testcontainers, then local binaries: for Kafka the
local Apache Kafka when the test needs a real broker, ``BrokerNeed.REAL``, else
librdkafka's mock cluster); ``local_postgres()`` runs a throwaway cluster
directly, and ``local_postgres_server()`` one a test can stop and start again;
``local_mariadb()`` the same for MariaDB; ``LocalKafka`` a single-node Apache
Kafka (KRaft) from the jars ``scripts/setup`` fetches, ``LocalKafkaCluster``
three nodes for failover tests. ``kafka_connect()`` resolves a Kafka Connect
worker with Debezium the same way (``LocalKafkaConnect`` locally), and
``DebeziumOutbox`` runs Debezium's outbox event router on it over a
Debezium-layout table in a PostgreSQL with ``wal_level=logical``
(``logical_postgres_url()``, ``LOGICAL_SETTINGS``). A server started on a port
picked beforehand proves it holds that port (``wait_until_bound``) before
anything talks to it.

For a service's own unit tests, without servers: ``OutboxTestHarness`` runs
the real relay and inbox on ``InMemoryBroker`` (with ``InMemoryTransport``
and ``InMemorySource``, held to the same conformance suites as the Kafka
transport and source); see docs/testing.md, "Testing your service without
servers". Its ``settle(batch)`` runs one batch through the inbox's
transaction and settle stage and returns ``Settled`` (done, and to try again
later): the finest public step of the inbox, which this project's own inbox
tests drive too.
"""

from transports.memory import InMemoryBroker, InMemorySource, InMemoryTransport

from ..inbox._settle import Settled
from ._connect import LIBS_VARIABLE as DEBEZIUM_LIBS_VARIABLE
from ._connect import ConnectorFailed, ConnectRest, ConnectStartError, LocalKafkaConnect
from ._debezium import DebeziumOutbox, debezium_outbox_config, debezium_outbox_table, debezium_over_our_outbox
from ._harness import OutboxTestHarness
from ._jvm import JVM_OPTIONS_ENV
from ._kafka import KafkaStartError, LocalKafka, local_kafka
from ._kafka_admin import alter_topic, create_topic, delete_topic, set_producer_quota
from ._kafka_cluster import LocalKafkaCluster
from ._kafka_libs import LIBS_VARIABLE as KAFKA_LIBS_VARIABLE
from ._kafka_node import KafkaNode
from ._mariadb import LocalMariaDB, fresh_mysql_database, local_mariadb, mariadb_binaries
from ._ports import PortNotBound, free_port, free_ports, wait_until_bound
from ._postgres import (
    FAST_SETTINGS,
    LOGICAL_SETTINGS,
    LocalPostgres,
    fresh_database,
    local_postgres,
    local_postgres_server,
    postgres_bindir,
)
from ._resolve import (
    KAFKA_BOOTSTRAP_VARIABLE,
    KAFKA_CONNECT_URL_VARIABLE,
    LOGICAL_POSTGRES_URL_VARIABLE,
    MYSQL_URL_VARIABLE,
    POSTGRES_URL_VARIABLE,
    BrokerNeed,
    Unavailable,
    docker_engine_answers,
    kafka_bootstrap,
    kafka_connect,
    logical_postgres_url,
    mysql_url,
    postgres_url,
)

__all__ = [
    "DEBEZIUM_LIBS_VARIABLE",
    "FAST_SETTINGS",
    "JVM_OPTIONS_ENV",
    "KAFKA_BOOTSTRAP_VARIABLE",
    "KAFKA_CONNECT_URL_VARIABLE",
    "KAFKA_LIBS_VARIABLE",
    "LOGICAL_POSTGRES_URL_VARIABLE",
    "LOGICAL_SETTINGS",
    "MYSQL_URL_VARIABLE",
    "POSTGRES_URL_VARIABLE",
    "BrokerNeed",
    "ConnectRest",
    "ConnectStartError",
    "ConnectorFailed",
    "DebeziumOutbox",
    "InMemoryBroker",
    "InMemorySource",
    "InMemoryTransport",
    "KafkaNode",
    "KafkaStartError",
    "LocalKafka",
    "LocalKafkaCluster",
    "LocalKafkaConnect",
    "LocalMariaDB",
    "LocalPostgres",
    "OutboxTestHarness",
    "PortNotBound",
    "Settled",
    "Unavailable",
    "alter_topic",
    "create_topic",
    "debezium_outbox_config",
    "debezium_outbox_table",
    "debezium_over_our_outbox",
    "delete_topic",
    "docker_engine_answers",
    "free_port",
    "free_ports",
    "fresh_database",
    "fresh_mysql_database",
    "kafka_bootstrap",
    "kafka_connect",
    "local_kafka",
    "local_mariadb",
    "local_postgres",
    "local_postgres_server",
    "logical_postgres_url",
    "mariadb_binaries",
    "mysql_url",
    "postgres_bindir",
    "postgres_url",
    "set_producer_quota",
    "wait_until_bound",
]
