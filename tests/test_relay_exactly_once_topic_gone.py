"""An exactly-once relay whose shard's last transaction names a data topic deleted since, on one
Apache Kafka broker.

The relay is cut between its transaction's last record (the progress record, naming where each data
record went) and the commit: the commit never answered, its producer dropped (as a relay SIGKILLed
there). The data topic is deleted meanwhile. The shard's next producer aborts the transaction, and
the take-over reads back where its records went: the read of the deleted topic's partition never
ended (assigned, a partition that does not exist neither returns nor fails), so every take-over
failed at its timeout and the shard's rows, on every topic, were never sent again. Now that
partition counts as not committed: the shard is taken over and its rows flow.
"""

from __future__ import annotations

from typing import Any

import pytest
from _kafka_transactions import KilledAtCommit
from _relay_helpers import publish, rows, wait_for
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from outbox import Outbox, Relay, create_engine
from tests.test_transport_kafka_read_back_data import delete, make
from transports import TransactionOutcome
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_a_shard_whose_cut_transaction_named_a_topic_deleted_since_is_taken_over_and_flows(
        kafka: str, sqlite_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    gone, alive, progress = "relay-gone-rows", "relay-gone-alive", "relay-gone-progress"
    admin = AdminClient({"bootstrap.servers": kafka, "log_level": 0})
    make(admin, gone, 1)
    make(admin, alive, 1)
    transport = KafkaTransport(bootstrap_servers=kafka, delivery_timeout=5.0)
    real = transport.transactional
    outcomes: list[TransactionOutcome] = []
    made: list[Any] = []

    def transactional(*args: Any, **kwargs: Any) -> Any:
        producer = real(*args, **kwargs)
        made.append(producer)
        real_send = producer.send

        def send(records: Any) -> Any:
            if len(outcomes) == 1:  # the second transaction: cut, its data topic deleted meanwhile
                def cut() -> None:  # the data topic deleted, then the commit fails unanswered, left open
                    delete(admin, gone)
                    raise KafkaException(KafkaError(KafkaError._TRANSPORT, "cut before the commit"))
                monkeypatch.setattr(producer, "_producer", KilledAtCommit(producer._producer, before=cut))
            answer = real_send(records)
            outcomes.append(answer.outcome)
            return answer

        monkeypatch.setattr(producer, "send", send)
        return producer

    monkeypatch.setattr(transport, "transactional", transactional)
    relay = Relay(outbox, transport, exactly_once=True, progress_topic=progress, worker_id="w")
    try:
        publish(outbox, gone, ["a"])
        wait_for(lambda: (relay.run_once(), not rows(outbox, status="pending"))[1], 60, "the first row")
        publish(outbox, gone, ["b"])
        wait_for(lambda: (relay.run_once(), len(outcomes) > 1)[1], 60, "the cut transaction")
        assert outcomes == [TransactionOutcome.COMMITTED, TransactionOutcome.UNKNOWN]
        publish(outbox, alive, ["c"])
        wait_for(lambda: (relay.run_once(), not rows(outbox, status="pending"))[1], 40,
                 "every row published (the shard taken over)", interval=0.0)
    finally:
        relay.close()
        transport.close()
    assert {r.status for r in rows(outbox)} == {"published"}
    def keys(topic: str) -> list[bytes | None]:
        return [r.key for r in read_topic(kafka, topic, expected=1, settle=1.0, isolation="read_committed")]

    assert keys(alive) == [b"c"]
    assert keys(gone) == [b"b"]  # made again by the row sent again (auto-creation on); a went with it
    engine.dispose()
