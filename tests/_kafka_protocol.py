"""The Kafka protocol spoken by hand, for what no client lets a test do: a producer id and batches
at chosen sequence numbers (``test_kafka_sequence_premise``), and the producers a broker still
knows on a partition (``DescribeProducers``: ``test_kafka_implied_delivery`` waits until it has
forgotten one)."""

from __future__ import annotations

import socket
import time
from typing import Any

from kafka.protocol.api import Request, Response
from kafka.protocol.parser import KafkaProtocol
from kafka.protocol.produce import ProduceRequest
from kafka.protocol.types import (
    CompactArray,
    CompactString,
    Int16,
    Int32,
    Int64,
    Schema,
    String,
    TaggedFields,
)
from kafka.record.default_records import DefaultRecordBatchBuilder

NONE = 0


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
        self.protocol = KafkaProtocol(client_id="outbox-tests")

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




class DescribeProducersResponseV0(Response):  # kafka-python-ng 2.2 has no DescribeProducers
    API_KEY = 61
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("topics", CompactArray(
            ("name", CompactString("utf-8")),
            ("partitions", CompactArray(
                ("partition_index", Int32), ("error_code", Int16),
                ("error_message", CompactString("utf-8")),
                ("active_producers", CompactArray(
                    ("producer_id", Int64), ("producer_epoch", Int32), ("last_sequence", Int32),
                    ("last_timestamp", Int64), ("coordinator_epoch", Int32),
                    ("current_txn_start_offset", Int64), ("tags", TaggedFields))),
                ("tags", TaggedFields))),
            ("tags", TaggedFields))),
        ("tags", TaggedFields))


class DescribeProducersRequestV0(Request):
    API_KEY = 61
    API_VERSION = 0
    FLEXIBLE_VERSION = True
    RESPONSE_TYPE = DescribeProducersResponseV0
    SCHEMA = Schema(
        ("topics", CompactArray(
            ("name", CompactString("utf-8")), ("partition_indexes", CompactArray(Int32)),
            ("tags", TaggedFields))),
        ("tags", TaggedFields))


def known_producers(address: str, topic: str, partition: int) -> list[int]:
    """The producer ids the partition's leader at ``address`` still has state for."""
    connection = Connection(address)
    try:
        answer = connection.call(DescribeProducersRequestV0(topics=[(topic, [partition], {})], tags={}))
    finally:
        connection.close()
    [(_, [(_, error, message, producers, _)], _)] = answer.topics
    assert error == NONE, f"DescribeProducers: error {error} {message}"
    return [producer[0] for producer in producers]
