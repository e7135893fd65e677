"""A rolling restart of three Apache Kafka nodes under exactly-once relays and the inbox.

The most common operation on a real cluster: each node in turn stopped with SIGTERM
(a controlled shutdown: the leadership of its partitions and the group and transaction
coordinators it held move away before it exits), then started again, the next one only
once every replica (the topic's, the progress topic's, the offsets' and the transaction
log's) is back in sync and the pipeline moved on. The load and the workers are the
failover campaign's (``tests/_failover.py``: writers over many keys and a few hot ones, two
``outbox relay`` and two ``outbox inbox run`` processes), the relays with ``--exactly-once``
(one Kafka transaction per shard's batch; the inbox reads read_committed).

Through it: every committed outbox row took effect exactly once in the inbox, per key in
seq order; the topic read read_committed holds each message once (no record of an aborted
or doubled transaction), each key's in seq order; no row counted an attempt beyond its one
delivery; nothing parked or alerted; each worker logged at most one outage per restart,
ended by itself; every process exits 0 on SIGTERM.

``ROLLING_ROUNDS`` (default 1) rolling restarts in a row within the campaign;
``ROLLING_SEED`` (default 1) orders the nodes; ``ROLLING_FAULT`` says which restart: ``hurried``
(the default: each node stopped as soon as the last started, before it is back in sync; the one
variant whose faults reach the relays' error paths, so the one the sabotage below fails),
``rolling`` (the next node only once all are in sync, the textbook procedure) or ``coordinator``
(only the node coordinating most of the relays' transactional ids).

On this machine (2 cores, 2026-12-06): the default 97-104 s (about 17,000 messages; no worker
logged an outage); ``hurried`` 83 s (nodes stopped with replicas out of sync); ``coordinator``
51 s; two rounds (``ROLLING_ROUNDS=2 ROLLING_SEED=2``) 191 s, 34,575 messages, one inbox outage of
2.2 s (its offset commit answered "Coordinator load in progress" once the group's coordinator moved),
one line each way. A graceful restart makes no transaction fail: librdkafka absorbs every leader and
coordinator move, so the relays' error paths run only in ``hurried`` (connections refused to a node
a transaction needs). There, counting an attempt for a transaction during which a connection was
lost (a sabotage of ``KafkaTransactionalProducer.send``) fails the test: 20 rows at attempts 2.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sqlalchemy as sa
from _failover import Campaign
from test_failover_campaign import assert_nothing_lost_doubled_or_reordered, inbox_db, outbox_engine

from outbox.testing import LocalKafkaCluster

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow,
              pytest.mark.xdist_group("kafka-cluster")]

__all__ = ["inbox_db", "outbox_engine"]  # the failover campaign's fixtures

ROUNDS = int(os.environ.get("ROLLING_ROUNDS", "1"))
SEED = int(os.environ.get("ROLLING_SEED", "1"))
EXACTLY_ONCE = ("--exactly-once",)


FAULTS = {
    "rolling": Campaign.restart_each_node_in_turn,
    "hurried": Campaign.restart_each_node_while_the_last_catches_up,
    "coordinator": Campaign.restart_the_transaction_coordinator,
}
"""``ROLLING_FAULT``: each node in turn, the next once all are in sync; each as soon as the last
started (default); the node coordinating most of the relays' transactional ids, alone."""
FAULT = os.environ.get("ROLLING_FAULT", "hurried")


def test_a_rolling_restart_under_exactly_once_relays_loses_doubles_and_reorders_nothing(
    kafka_cluster: LocalKafkaCluster, outbox_engine: sa.Engine, postgres_db: str, inbox_db: str,
    topic: str, tmp_path: Path,
) -> None:
    campaign = Campaign(kafka_cluster, outbox_url=postgres_db, outbox_engine=outbox_engine,
                        inbox_url=inbox_db, topic=topic, workdir=tmp_path, seed=SEED,
                        relay_args=EXACTLY_ONCE)
    with campaign:
        for _ in range(ROUNDS):
            FAULTS[FAULT](campaign)
        result = campaign.finish()
    print(f"\n{result}")
    assert_nothing_lost_doubled_or_reordered(result)
    # Read read_committed, the topic holds each message once: no transaction's records twice.
    assert result.records_on_topic == result.messages, result
    # A controlled shutdown is at most one outage for a worker, which ends it by itself.
    for restart in result.restarts:
        assert restart.said == {}, restart
