"""Three Apache Kafka nodes fail under a running relay and inbox: nothing lost, doubled or reordered.

The failover campaign of issue 34, on a ``LocalKafkaCluster`` (three KRaft nodes,
each broker and controller; replication factor 3, ``min.insync.replicas`` 2,
``replica.lag.time.max.ms`` 4 s). Two ``outbox relay`` processes publish from
PostgreSQL with their idempotent ``acks=all`` producer; two ``outbox inbox run``
processes apply every message to a business table in a second database
(``tests.inbox_support.apply_effect``: one row per message under a unique
(topic, key, seq), seq order checked in the handler). Writers commit keyed
messages the whole time, over many keys and a few hot ones. Each cycle of the
campaign (``tests/_failover.py``):

1. SIGKILL the leader of the busiest partition (the hottest key's); start it again;
2. SIGSTOP a follower of that partition until the leader drops it from the ISR; thaw it;
3. SIGKILL the active controller; start it again;
4. SIGKILL two of the three nodes: no quorum, ``min.insync.replicas`` not met. The
   relays and the inbox wait: no row's attempt count moves, nothing parks or
   alerts, each process logs the outage once when it begins and once when it
   ends, and all resume by themselves when the two nodes are back.

Between steps the campaign waits until every replica is back in sync and the
pipeline made progress. Then the writers stop, the backlog drains, and:
every committed outbox row took effect exactly once in the inbox's database,
per key in seq order (the order the handler applied them); the topic, read back
``read_committed``, holds every message with each key's first occurrences in
seq order; no row failed, none counted an attempt beyond its one delivery;
every process ran throughout and exits 0 on SIGTERM.

``FAILOVER_ROUNDS`` (default 1: one campaign in CI, about four minutes) runs
more campaigns, each on a fresh cluster with its own seed (``FAILOVER_SEED``,
default 1, for the first); ``FAILOVER_CYCLES`` (default 1) repeats the four
faults within a campaign (docs/testing.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from _failover import Campaign, CampaignResult

from outbox import Inbox, Outbox, create_engine
from outbox.testing import LocalKafkaCluster, fresh_database
from tests.conftest import unavailable
from tests.inbox_support import business

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow,
              pytest.mark.xdist_group("kafka-cluster")]

ROUNDS = int(os.environ.get("FAILOVER_ROUNDS", "1"))
FIRST_SEED = int(os.environ.get("FAILOVER_SEED", "1"))
CYCLES = int(os.environ.get("FAILOVER_CYCLES", "1"))

CLUSTER_SETTINGS = {
    # A frozen follower leaves the ISR after 4 s instead of 30 s.
    "replica.lag.time.max.ms": "4000",
}


@pytest.fixture
def cluster() -> Iterator[LocalKafkaCluster]:
    """Three nodes of the test's own (RF 3, min ISR 2), with a short ``replica.lag.time.max.ms``."""
    try:
        nodes = LocalKafkaCluster(settings=CLUSTER_SETTINGS)
    except FileNotFoundError as exc:
        unavailable(str(exc))
    try:
        yield nodes
    finally:
        nodes.close()


@pytest.fixture
def inbox_db(postgres_server: str) -> Iterator[str]:
    """The consumer's own database: the inbox's tables and the business table of effects."""
    with fresh_database(postgres_server) as url:
        engine = create_engine(url)
        Inbox(engine, group="unused").create_tables()
        business.create_all(engine)
        engine.dispose()
        yield url


@pytest.fixture
def outbox_engine(postgres_db: str) -> Iterator[sa.Engine]:
    engine = create_engine(postgres_db, pool_size=6)
    Outbox(engine).create_tables()
    yield engine
    engine.dispose()


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + ROUNDS))
def test_leaders_followers_the_controller_and_two_of_three_nodes_fail_under_load(
    cluster: LocalKafkaCluster, outbox_engine: sa.Engine, postgres_db: str, inbox_db: str,
    topic: str, tmp_path: Path, seed: int,
) -> None:
    campaign = Campaign(cluster, outbox_url=postgres_db, outbox_engine=outbox_engine,
                        inbox_url=inbox_db, topic=topic, workdir=tmp_path, seed=seed)
    with campaign:
        for _ in range(CYCLES):
            campaign.kill_the_busiest_leader()
            campaign.freeze_a_follower()
            campaign.kill_the_active_controller()
            campaign.lose_two_of_three()
        result = campaign.finish()
    print(f"\n{result}")
    assert_nothing_lost_doubled_or_reordered(result)


def assert_nothing_lost_doubled_or_reordered(result: CampaignResult) -> None:
    assert result.exit_codes == {name: 0 for name in result.exit_codes}, result.exit_codes
    assert result.failed_rows == 0
    assert result.counted_attempts == {}, f"rows whose attempts count more than their delivery: " \
                                          f"{result.counted_attempts}"
    assert result.order_violations == [], result.order_violations[:5]
    assert (result.parked, result.held) == (0, 0)
    assert result.alerts == [], result.alerts[:5]
    # Nothing lost, nothing doubled: each committed row took effect once.
    assert result.doubled_effects == 0
    assert result.missing_effects == [], f"{len(result.missing_effects)} rows never took effect"
    assert result.unknown_effects == 0
    assert result.applied_out_of_order == {}, list(result.applied_out_of_order.items())[:5]
    # On the wire: every message, each key's first occurrences in seq order.
    assert result.missing_on_topic == [], f"{len(result.missing_on_topic)} rows missing on the topic"
    assert result.wire_out_of_order == {}, list(result.wire_out_of_order.items())[:5]
    # The outage with two of three nodes gone: waited out, one line each way, nothing counted.
    for outage in result.outages:
        assert outage.attempts_moved == [], outage
        assert outage.tried_during > 0, f"no row was even tried while two nodes were down: {outage}"
        assert outage.lines == {name: (1, 1) for name in outage.lines}, outage
