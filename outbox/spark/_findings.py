"""The audit's Spark computations: each function takes DataFrames and returns one.

Kept apart from I/O so each rule (what counts as lost, as a duplicate, as out
of order) is one readable expression.

Columns used: outbox ``message_id, topic, key, seq, status, created_at,
published_at``; inbox ``consumer_group, message_id, received_at,
processed_at, deliveries, outcome``; parked and held ``consumer_group,
message_id``.
"""

from __future__ import annotations

import enum
from datetime import datetime

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from ..core._tables import InboxOutcome, OutboxStatus

QUANTILES = [0.5, 0.95, 0.99]


class Seen(enum.StrEnum):
    """``consumer_side``'s ``kind``: where the consumer side holds a message."""

    INBOX = "inbox"
    """Recorded: a row of ``inbox_messages`` (its ``outcome`` says how)."""
    PARKED = "parked"
    """In ``inbox_parked``."""
    HELD = "held"
    """In ``inbox_held``, waiting for an earlier seq."""


INBOX = ["consumer_group", "message_id", "received_at", "processed_at", "deliveries", "outcome"]


def millis_between(later: str, earlier: str) -> Column:
    return (F.unix_micros(F.col(later)) - F.unix_micros(F.col(earlier))) / 1000.0


def percentiles(column: Column, name: str) -> Column:
    return F.percentile_approx(column, F.array(*map(F.lit, QUANTILES)), 10_000).alias(name)


def topic_counts(outbox: DataFrame) -> DataFrame:
    """Per topic: produced, published, pending, failed, relay lag (ms) percentiles, first creation."""
    status = F.col("status")
    return outbox.groupBy("topic").agg(
        F.count(F.lit(1)).alias("produced"),
        F.sum((status == OutboxStatus.PUBLISHED.value).cast("long")).alias("published"),
        F.sum((status == OutboxStatus.PENDING.value).cast("long")).alias("pending"),
        F.sum((status == OutboxStatus.FAILED.value).cast("long")).alias("failed"),
        percentiles(F.when(status == OutboxStatus.PUBLISHED.value,
                           millis_between("published_at", "created_at")), "relay_lag_ms"),
        # Epoch micros, not a collected timestamp: those come back naive in local time.
        F.min(F.unix_micros("created_at")).alias("first_created_us"),
    )


def consumed(inbox: DataFrame, outbox: DataFrame) -> DataFrame:
    """Consumer-side rows of messages in the window, with the outbox's topic, key, seq and times."""
    produced = outbox.select("message_id", "topic", "key", "seq", "created_at", "published_at", "event_type")
    return inbox.join(produced, "message_id")


def group_counts(known: DataFrame) -> DataFrame:
    """Per (group, topic) the consumer side knows: consumed, discarded, parked, held,
    duplicates and end-to-end latency (ms), from ``consumed(consumer_side(…), outbox)``."""
    deliveries, kind = F.col("deliveries"), F.col("kind")
    return known.groupBy("consumer_group", "topic").agg(
        F.sum((F.col("outcome") == InboxOutcome.PROCESSED.value).cast("long")).alias("consumed"),
        F.sum((F.col("outcome") == InboxOutcome.DISCARDED.value).cast("long")).alias("discarded"),
        F.sum((kind == Seen.PARKED.value).cast("long")).alias("parked"),
        F.sum((kind == Seen.HELD.value).cast("long")).alias("held"),
        F.sum((deliveries > 1).cast("long")).alias("duplicated_messages"),
        F.sum(F.greatest(deliveries - 1, F.lit(0))).alias("extra_deliveries"),
        percentiles(millis_between("processed_at", "created_at"), "latency_ms"),
    )


def consumer_side(inbox: DataFrame, parked: DataFrame, held: DataFrame) -> DataFrame:
    """Every (group, message) the consumer side knows, with ``kind`` inbox, parked or held.

    A (group, topic) pair appears here exactly when the group has consumed,
    parked or holds a message of that topic: those are the pairs audited.
    """
    def waiting(frame: DataFrame, kind: Seen) -> DataFrame:
        return frame.select(
            "consumer_group", "message_id", F.lit(None).cast("timestamp").alias("received_at"),
            F.lit(None).cast("timestamp").alias("processed_at"), F.lit(None).cast("long").alias("deliveries"),
            F.lit(None).cast("string").alias("outcome"), F.lit(kind.value).alias("kind"),
        )
    return (inbox.select(*INBOX, F.lit(Seen.INBOX.value).alias("kind"))
            .unionByName(waiting(parked, Seen.PARKED)).unionByName(waiting(held, Seen.HELD)))


def lost(outbox: DataFrame, pairs: DataFrame, seen: DataFrame, as_of: datetime,
         sla_seconds: float) -> DataFrame:
    """Published more than the SLA before ``as_of`` and neither processed, parked nor held.

    ``seen`` holds (consumer_group, message_id) of every message a group
    processed, discarded, parked or holds; parked and held messages are
    reported under their own counts, not as lost.
    """
    deadline = F.lit(as_of) - F.make_dt_interval(secs=F.lit(sla_seconds))
    published = F.col("status") == OutboxStatus.PUBLISHED.value
    overdue = outbox.where(published & (F.col("published_at") < deadline))
    expected = overdue.join(F.broadcast(pairs), "topic")
    return expected.join(seen, ["consumer_group", "message_id"], "left_anti").select(
        "consumer_group", "topic", "key", "seq", "event_type", "message_id", "created_at", "published_at"
    )


def duplicates(consumed_rows: DataFrame) -> DataFrame:
    """Messages a group received more than once (the inbox counts deliveries)."""
    return consumed_rows.where(F.col("deliveries") > 1).select(
        "consumer_group", "topic", "key", "seq", "event_type", "message_id", "deliveries", "processed_at"
    )


def out_of_order(consumed_rows: DataFrame) -> DataFrame:
    """Messages processed after a message of the same key with a higher seq.

    Processing order is ``processed_at``, then ``received_at``; exact ties
    fall back to seq, so only a real inversion counts.
    """
    by_key = (
        Window.partitionBy("consumer_group", "topic", "key")
        .orderBy("processed_at", "received_at", "seq")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    keyed = consumed_rows.where(F.col("key").isNotNull() & F.col("seq").isNotNull())
    return (
        keyed.withColumn("processed_after_seq", F.max("seq").over(by_key))
        .where(F.col("seq") < F.col("processed_after_seq"))
        .select("consumer_group", "topic", "key", "seq", "event_type", "processed_after_seq",
                "message_id", "processed_at")
    )


def timeline(outbox: DataFrame, consumed_rows: DataFrame, start: datetime,
             bucket_seconds: float) -> tuple[DataFrame, DataFrame]:
    """Per time bucket: (topic, created, published) and (group, topic, processed) counts."""
    def bucket(column: str) -> Column:
        offset = F.unix_micros(F.col(column)) - F.unix_micros(F.lit(start))
        return F.floor(offset / (bucket_seconds * 1e6)).alias("bucket")

    made = outbox.groupBy("topic", bucket("created_at")).agg(F.count(F.lit(1)).alias("created"))
    sent = (outbox.where(F.col("published_at").isNotNull())
            .groupBy("topic", bucket("published_at")).agg(F.count(F.lit(1)).alias("published")))
    produced = made.join(sent, ["topic", "bucket"], "full").fillna(0)
    processed = consumed_rows.groupBy("consumer_group", "topic", bucket("processed_at")).agg(
        F.count(F.lit(1)).alias("processed")
    )
    return produced, processed
