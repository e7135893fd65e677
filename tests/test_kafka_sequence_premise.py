"""What Apache Kafka checks of an idempotent producer's sequence numbers: the premise of ``_isolate``.

``KafkaTransport`` sends the records of a request refused whole again one at a time on a new
producer (``transports/kafka/_transport.py``, ``_isolate``), because a new producer id's first
batch on a partition is taken at any sequence number (``ProducerAppendInfo.checkSequence``):
a second request on its way behind a refused first one would be written ahead of it. This
speaks the protocol itself (InitProducerId, then ProduceRequest v7 with chosen sequence
numbers), which no client lets a test do, so that a broker that starts checking shows here.
"""

from __future__ import annotations

import socket
import time
import uuid
from typing import Any

from confluent_kafka.admin import AdminClient
from kafka.protocol.api import Request, Response
from kafka.protocol.parser import KafkaProtocol
from kafka.protocol.produce import ProduceRequest
from kafka.protocol.types import Int16, Int32, Int64, Schema, String
from kafka.record.default_records import DefaultRecordBatchBuilder

from outbox.testing import create_topic

NONE = 0
OUT_OF_ORDER_SEQUENCE_NUMBER = 45


class InitProducerIdResponseV1(Response):  # kafka-python-ng 2.2 has no InitProducerId
    API_KEY = 22
    API_VERSION = 1
    SCHEMA = Schema(("throttle_time_ms", Int32), ("error_code", Int16), ("producer_id", Int64),
                    ("producer_epoch", Int16))


class InitProducerIdRequestV1(Request):
    API_KEY = 22
    API_VERSION = 1
    RESPONSE_TYPE = InitProducerIdResponseV1
    SCHEMA = Schema(("transactional_id", String("utf-8")), ("transaction_timeout_ms", Int32))


class Connection:
    """One connection to a partition's leader; one request answered at a time."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.protocol = KafkaProtocol(client_id="sequence-premise")

    def call(self, request: Any) -> Any:
        self.protocol.send_request(request)
        self.sock.sendall(self.protocol.send_bytes())
        while True:
            responses = self.protocol.receive_bytes(self.sock.recv(65536))
            if responses:
                return responses[0][1]

    def producer_id(self) -> tuple[int, int]:
        deadline = time.monotonic() + 30  # the broker may still be loading its transaction state
        while True:
            answer = self.call(InitProducerIdRequestV1(transactional_id=None, transaction_timeout_ms=60000))
            if answer.error_code == NONE:
                return answer.producer_id, answer.producer_epoch
            assert time.monotonic() < deadline, f"InitProducerId: error {answer.error_code}"
            time.sleep(0.2)

    def produce(self, topic: str, partition: int, pid: tuple[int, int], sequence: int) -> int:
        """Write one record with this producer id and first sequence; the partition's error code."""
        batch = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0,
                                          producer_id=pid[0], producer_epoch=pid[1],
                                          base_sequence=sequence, batch_size=1 << 20)
        batch.append(0, int(time.time() * 1000), b"k", f"k:{sequence}".encode(), [])
        request = ProduceRequest[7](transactional_id=None, required_acks=-1, timeout=5000,
                                    topics=[(topic, [(partition, bytes(batch.build()))])])
        answer = self.call(request)
        error: int = answer.topics[0][1][0][1]
        return error

    def close(self) -> None:
        self.sock.close()


def leader_of(bootstrap: str, topic: str, partition: int) -> str:
    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    leader = metadata.topics[topic].partitions[partition].leader
    broker = metadata.brokers[leader]
    return f"{broker.host}:{broker.port}"


def test_a_new_producer_ids_first_batch_is_taken_at_any_sequence_and_then_gaps_are_refused(
    kafka: str,
) -> None:
    topic = f"seq-{uuid.uuid4().hex[:10]}"
    create_topic(kafka, topic, 1)
    connection = Connection(leader_of(kafka, topic, 0))
    try:
        pid = connection.producer_id()
        # As hot:1 after hot:0's request was refused before the log: written, the partition's first.
        assert connection.produce(topic, 0, pid, 1) == NONE
        # hot:0 sent again after it: now it is the one out of order.
        assert connection.produce(topic, 0, pid, 0) == OUT_OF_ORDER_SEQUENCE_NUMBER
        # Once the producer id has state on the partition, a gap is refused: what pipelining rests on.
        assert connection.produce(topic, 0, pid, 2) == NONE
        assert connection.produce(topic, 0, pid, 4) == OUT_OF_ORDER_SEQUENCE_NUMBER
    finally:
        connection.close()
