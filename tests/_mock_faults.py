"""librdkafka's mock cluster with its fault injection, reached through ctypes.

confluent-kafka does not wrap ``rd_kafka_mock_push_request_errors`` (the
mock broker answers the next N requests of a kind with the given errors) nor
``rd_kafka_mock_broker_set_rtt``; the librdkafka that confluent-kafka's wheel
bundles exports both, so the tests call them directly. The broker is the real
protocol, so the transport under test sees real ProduceResponse errors, real
retries and real sequence-number checks.
"""

from __future__ import annotations

import ctypes
import glob
import os

import confluent_kafka

PRODUCE = 0  # ApiKey of ProduceRequest


def _library() -> ctypes.CDLL:
    here = os.path.dirname(confluent_kafka.__file__)
    found = glob.glob(os.path.join(here, os.pardir, "confluent_kafka.libs", "librdkafka*.so*"))
    if not found:
        raise RuntimeError(f"no bundled librdkafka next to {here}: the fault-injection tests need "
                           "confluent-kafka's binary wheel")
    lib = ctypes.CDLL(found[0])
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                      ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
    lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_mock_cluster_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_push_request_errors_array.argtypes = [
        ctypes.c_void_p, ctypes.c_int16, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)]
    lib.rd_kafka_mock_broker_set_rtt.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int]
    lib.rd_kafka_mock_partition_set_leader.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32,
                                                       ctypes.c_int32]
    lib.rd_kafka_mock_group_initial_rebalance_delay_ms.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.rd_kafka_mock_group_initial_rebalance_delay_ms.restype = None
    return lib


class MockCluster:
    """A mock cluster in this process whose produce responses a test can script; a context manager."""

    def __init__(self, brokers: int = 3, rtt_ms: int = 0) -> None:
        self._lib = _library()
        conf = self._lib.rd_kafka_conf_new()
        error = ctypes.create_string_buffer(512)
        self._lib.rd_kafka_conf_set(conf, b"log_level", b"3", error, len(error))
        self._rk = self._lib.rd_kafka_new(0, conf, error, len(error))
        if not self._rk:
            raise RuntimeError(f"rd_kafka_new: {error.value.decode()}")
        self._cluster = self._lib.rd_kafka_mock_cluster_new(self._rk, brokers)
        self.bootstrap = self._lib.rd_kafka_mock_cluster_bootstraps(self._cluster).decode()
        for broker in range(1, brokers + 1):
            self._lib.rd_kafka_mock_broker_set_rtt(self._cluster, broker, rtt_ms)

    def join_at_once(self) -> None:
        """A new consumer group forms at once, not after the 3 s ``group.initial.rebalance.delay.ms``.

        The delay (Kafka's default too) waits for more members before the first assignment;
        a group that grows later rebalances as it would on a broker set to 0, as many are.
        """
        self._lib.rd_kafka_mock_group_initial_rebalance_delay_ms(self._cluster, 0)

    def fail_produce(self, *codes: int) -> None:
        """The next ``len(codes)`` ProduceRequests (to any broker) are answered with these errors."""
        array = (ctypes.c_int * len(codes))(*codes)
        self._lib.rd_kafka_mock_push_request_errors_array(self._cluster, PRODUCE, len(codes), array)

    def move_leader(self, topic: str, partition: int, broker: int) -> None:
        """Make ``broker`` the partition's leader: the old one answers NOT_LEADER from now on."""
        self._lib.rd_kafka_mock_partition_set_leader(self._cluster, topic.encode(), partition, broker)

    def close(self) -> None:
        if self._cluster:
            self._lib.rd_kafka_mock_cluster_destroy(self._cluster)
            self._lib.rd_kafka_destroy(self._rk)
            self._cluster = self._rk = None

    def __enter__(self) -> MockCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
