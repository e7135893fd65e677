"""Deliveries librdkafka implies rather than hears: reported without an offset, not proven written.

librdkafka's idempotent producer reports a record delivered, with no offset, when a
*later* request of its partition was acknowledged while the record's own request
had failed: "R1 failed, but R2 succeeded, so the messages in R1 were in fact
persisted" (``rd_kafka_dr_implicit_ack``). Apache Kafka does not bear that out for
a producer id that has nothing written to the partition yet: it takes that
producer's first batch at any sequence number (``ProducerAppendInfo.checkSequence``:
"accept writes with any sequence number"; ``tests/test_kafka_sequence_premise.py``).
So when the first request of a new producer to a partition is refused for a passing
reason (the topic just created, a leader moving) and the request behind it is
taken, the first request's records are reported delivered and are in no log:
``tests/test_kafka_implied_delivery.py`` plays it on a real broker, and a clean-clone
CI run met it on a topic its first send created (a row marked published with no
offset, its partition one record short). It is a known, open report against the
client (confluentinc/confluent-kafka-go#921: "data loss when a new producer produce
messages while the partition preferred leader is being re-elected"; the client log
there says "implicitly acked by subsequent batch success", as ours does).

The same report without an offset is what a retried request the broker already had
(DUPLICATE_SEQUENCE_NUMBER) gets; the record was then written. The two cannot be told
apart from the report, so neither is taken as proof: the record is sent again. A
copy the broker did have is one more duplicate, which consumers drop by message id
(and the relay's inbox does); a record it did not have arrives after the key's later
records, and the inbox holds those until it comes (docs/guarantees.md).
"""

from __future__ import annotations

from typing import Any

UNPROVEN = ("reported delivered without an offset (librdkafka implied it from a later record's "
            "acknowledgement; Apache Kafka may not have written it): sent again")


def unproven(message: Any) -> bool:
    """Whether a delivery report without an error is one librdkafka implied (no offset)."""
    return message.offset() is None
