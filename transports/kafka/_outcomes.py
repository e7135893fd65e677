"""What a librdkafka error means for the record it kept from delivery: tried again, or never.

One record's ``SendResult`` from its error: ``FAILED`` when sending the same record again
cannot succeed (too large, its topic unknown or forbidden), else ``RETRY``; ``unreachable``
when the broker did not answer at all or cannot take writes now, an outage that counts no
attempt (DESIGN §9). The kafka-python-ng transport has its own table of the same meanings.
"""

from __future__ import annotations

from confluent_kafka import KafkaError

from .._protocol import Outcome, SendResult

# Errors that cannot succeed by sending the same record again.
PERMANENT_ERRORS = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_MSG_SIZE,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.TOPIC_EXCEPTION,
    KafkaError.INVALID_RECORD,
    KafkaError._BAD_MSG,
    KafkaError.POLICY_VIOLATION,
    KafkaError._INVALID_ARG,
})

# Refusals the broker gives a whole request for what one record in it is (transports._refusals).
REFUSED_WHOLE = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_MSG_SIZE,
    KafkaError.INVALID_RECORD,
})

# A topic's metadata errors that may mean "not created yet" (transports._unknown_topics).
UNKNOWN_TOPIC_ERRORS = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})

# A record's errors saying its topic (or partition) is gone: deleted, or fewer partitions now.
TOPIC_GONE_ERRORS = UNKNOWN_TOPIC_ERRORS | {KafkaError._UNKNOWN_PARTITION}

# Errors meaning the broker did not answer at all (frozen, down, unreachable), or answered that
# the cluster cannot take writes now: too few in-sync replicas for acks=all (followers down). An
# outage, never the record's fault (DESIGN §9). librdkafka retries those itself; pipelined, the
# record then has no report within delivery_timeout, in waves its retries may run out.
UNREACHABLE_ERRORS = frozenset({
    KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
    KafkaError._MSG_TIMED_OUT,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._RESOLVE,
    # Purged by the transport itself: no report within its delivery_timeout.
    KafkaError._PURGE_QUEUE,
    KafkaError._PURGE_INFLIGHT,
})


def classify(error: KafkaError) -> Outcome:
    """Map a librdkafka error to RETRY (may pass later) or FAILED (never will)."""
    if error.code() in PERMANENT_ERRORS:
        return Outcome.FAILED
    return Outcome.RETRY


def result_of(error: KafkaError) -> SendResult:
    """The ``SendResult`` of a record that ``error`` kept from being delivered."""
    return SendResult(classify(error), error=error.str(), unreachable=error.code() in UNREACHABLE_ERRORS)
