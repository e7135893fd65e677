"""A commit the broker splits, proved through a relay on three Apache Kafka nodes.

The coordinator decides a shard's commit, writes its marker on the data partition (its leader
alive) and drops the progress partition's (its only replica killed meanwhile). The relay's
commit check does not read the progress back: UNKNOWN, settled by the next producer of the id.
That producer's take-over found the progress record left open, aborted it and read the earlier
one (none): the relay sent every row of the batch again, though read_committed readers had them
(``docs/relay.md``, "Limits"). Now the take-over reads the data records back at the offsets the
progress record names and counts the committed ones as sent.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

import pytest
from _kafka_transactions import KilledAtCommit, one_replica_topics, wait_until
from _relay_helpers import publish, rows, seqs_by_key, wait_for
from confluent_kafka.admin import AdminClient

from outbox import Outbox, Relay, create_engine
from outbox.testing import LocalKafkaCluster
from transports import TransactionOutcome
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.xdist_group("kafka-cluster")]

MESSAGE_ID = "outbox-message-id"


def test_a_batch_whose_commit_the_broker_split_is_neither_sent_twice_nor_lost(
        kafka_cluster: LocalKafkaCluster, sqlite_db: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Without the read-back each of the batch's rows is on the wire twice (the take-over sent them
    again); with it each is there once, every row published, the take-over's count logged."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    tid = f"outbox-{outbox.load_schema().incarnation}-0"
    data, progress = "split-relay-rows", "split-relay-progress"
    _, coordinator, victim = one_replica_topics(kafka_cluster, tid, data, progress, victim_holds="progress")
    live = AdminClient({"bootstrap.servers": kafka_cluster.live_bootstrap(), "log_level": 0})
    node = next(n for n in kafka_cluster.nodes if n.node_id == coordinator)
    restarted = threading.Event()

    def kill_the_progress_replica() -> None:
        kafka_cluster.kill(victim)
        wait_until(lambda: live.list_topics(progress, timeout=5).topics[progress].partitions[0].leader == -1,
                   60, "the progress partition without a leader")

    def restart_once_the_marker_is_dropped() -> None:
        wait_until(lambda: "likely deleted already and hence can be skipped" in node.log_since_launch(), 30,
                   "the coordinator dropping the progress marker")
        kafka_cluster.start(victim)
        restarted.set()

    keys = [f"k{i % 3}" for i in range(9)]
    publish(outbox, data, keys)
    transport = KafkaTransport(bootstrap_servers=kafka_cluster.bootstrap, delivery_timeout=10.0)
    # Every broker knows the progress topic (one that does not yet answers the relay's look at its
    # configuration with UNKNOWN_TOPIC_OR_PART, an outage the relay waits out), so that the relay's
    # first transaction is the one whose commit is split.
    wait_until(lambda: transport.ensure_compacted_topic(progress, 1, 10) or True, 30,
               "the progress topic's configuration readable")
    real = transport.transactional
    outcomes: list[TransactionOutcome] = []

    def transactional(*args: Any, **kwargs: Any) -> Any:
        producer = real(*args, **kwargs)
        real_send = producer.send
        if not outcomes:  # the relay's first producer: its commit is split
            after = lambda: threading.Thread(target=restart_once_the_marker_is_dropped).start()  # noqa: E731
            monkeypatch.setattr(producer, "_producer",
                                KilledAtCommit(producer._producer, kill_the_progress_replica, after))

        def send(records: Any) -> Any:
            answer = real_send(records)
            outcomes.append(answer.outcome)
            return answer

        monkeypatch.setattr(producer, "send", send)
        return producer

    monkeypatch.setattr(transport, "transactional", transactional)
    caplog.set_level(logging.INFO, logger="outbox.relay")
    relay = Relay(outbox, transport, exactly_once=True, progress_topic=progress, worker_id="w")
    try:
        wait_for(lambda: (relay.run_once(), bool(outcomes))[1], 120, "the first transaction's answer",
                 interval=0.0)
        assert outcomes == [TransactionOutcome.UNKNOWN]
        assert restarted.wait(60), "the progress replica was not restarted"
        wait_for(lambda: (relay.run_once(), not rows(outbox, status="pending"))[1], 120,
                 "every row published", interval=0.0)
    finally:
        relay.close()
    on_wire = read_topic(kafka_cluster.bootstrap, data, expected=len(keys), settle=2.0,
                         isolation="read_committed")
    copies = Counter(dict(r.headers)[MESSAGE_ID] for r in on_wire)
    assert max(copies.values()) == 1, f"{sum(copies.values()) - len(copies)} rows sent twice"
    assert len(copies) == len(keys)
    assert seqs_by_key(on_wire) == {k.encode(): [1, 2, 3] for k in set(keys)}
    assert {r.status for r in rows(outbox)} == {"published"}
    # The progress record the broker left open was ended by the relay's next producer of the id as it
    # was made (``Unsettled``), before the read-back, which found the data record committed.
    assert any(f"{len(keys)} rows a transaction had committed marked published" in r.getMessage()
               for r in caplog.records)
    engine.dispose()
