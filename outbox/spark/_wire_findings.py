"""The wire audit's rules: what the topic holds, read through Spark's Kafka source, against the outbox.

The outbox table says what was written and what the relay believes it sent;
the topic says what every consumer will read. Per topic and key:

- ``wire_missing``: published rows whose message is not on the topic. Only
  published rows are due: a pending row is not yet sent, a failed one never
  will be (each has its own count). In exactly-once mode a row can be on the
  topic and still pending (the mark follows Kafka's commit); that is no finding.
- ``wire_duplicates``: messages of this outbox on the topic more than once
  (same message id): what at-least-once delivery allows and exactly-once forbids.
- ``wire_out_of_order``: messages of this outbox whose first copy follows, in
  its partition, the first copy of a later seq of its key. A re-sent copy is a
  duplicate, not a reordering, so only first copies are compared.
- ``wire_foreign``: records on the topic this outbox never wrote: no envelope,
  a broken one, another outbox's (its incarnation), or an id this outbox does
  not hold.

Records of ours are matched to the audited outbox rows by (topic, message id);
other records count as foreign when the ``outbox-created-at`` they carry, or
lacking an envelope the record's timestamp, lies in the audit's window.
"""

from __future__ import annotations

import enum

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from ..core._tables import OutboxStatus
from ._window import Window as Span
from ._wire import canonical_uuid

DETAILS = ("wire_missing", "wire_duplicates", "wire_out_of_order", "wire_foreign")


class Foreign(enum.StrEnum):
    """Why a record on the topic is not one this outbox wrote."""

    NO_ENVELOPE = "no_envelope"
    """It has no ``outbox-message-id`` header: another producer's record."""
    BROKEN_ENVELOPE = "broken_envelope"
    """Its message id is not a UUID, or it carries two different ones."""
    OTHER_OUTBOX = "other_outbox"
    """Its ``outbox-incarnation`` names another outbox database."""
    UNKNOWN_MESSAGE = "unknown_message"
    """Its id is not among this outbox's rows of the window (deleted, or never written)."""


def findings(wire: DataFrame, outbox: DataFrame, *, span: Span, incarnation: str | None,
             event_type: str | None) -> dict[str, DataFrame]:
    """The four wire findings, each a DataFrame with a ``topic`` column (see the module docstring).

    ``outbox`` holds the audited rows (``message_id, topic, key, seq, status,
    created_at, published_at, event_type``) of the topics ``wire`` was read from.
    """
    if event_type is not None:
        wire = wire.where(F.col("event_type") == event_type)
    rows = outbox.select(
        "topic", canonical_uuid(F.col("message_id").cast("string")).alias("message_id"), "key", "seq",
        "status", "event_type", "created_at", "published_at")
    ours = wire.where(F.col("message_id").isNotNull()).select(
        "topic", "message_id", "partition", "offset").join(
        rows.select("topic", "message_id", "key", "seq", "event_type"), ["topic", "message_id"])
    return {
        "wire_missing": _missing(rows, ours),
        "wire_duplicates": _duplicates(ours),
        "wire_out_of_order": _out_of_order(ours),
        "wire_foreign": _foreign(wire, rows, span, incarnation),
    }


def _missing(rows: DataFrame, ours: DataFrame) -> DataFrame:
    published = rows.where(F.col("status") == OutboxStatus.PUBLISHED.value)
    return published.join(ours.select("topic", "message_id").distinct(), ["topic", "message_id"],
                          "left_anti").select("topic", "key", "seq", "event_type", "message_id",
                                              "created_at", "published_at")


def _duplicates(ours: DataFrame) -> DataFrame:
    copies = F.array_sort(F.collect_list(F.struct("partition", "offset")))
    return (ours.groupBy("topic", "message_id", "key", "seq", "event_type")
            .agg(F.count(F.lit(1)).alias("copies"), copies.alias("at"))
            .where(F.col("copies") > 1)
            .select("topic", "key", "seq", "event_type", "message_id", "copies",
                    F.transform("at", lambda p: F.concat_ws(
                        ":", p["partition"].cast("string"), p["offset"].cast("string"))).alias("offsets")))


def _out_of_order(ours: DataFrame) -> DataFrame:
    first_copy = Window.partitionBy("topic", "message_id").orderBy("partition", "offset")
    firsts = (ours.where(F.col("key").isNotNull() & F.col("seq").isNotNull())
              .withColumn("copy", F.row_number().over(first_copy)).where(F.col("copy") == 1))
    before = (Window.partitionBy("topic", "partition", "key").orderBy("offset")
              .rowsBetween(Window.unboundedPreceding, -1))
    return (firsts.withColumn("after_seq", F.max("seq").over(before))
            .where(F.col("seq") < F.col("after_seq"))
            .select("topic", "key", "seq", "event_type", "after_seq", "message_id", "partition", "offset"))


def _foreign(wire: DataFrame, rows: DataFrame, span: Span, incarnation: str | None) -> DataFrame:
    unknown = wire.join(rows.select("topic", "message_id"), ["topic", "message_id"], "left_anti")
    when = F.coalesce(F.col("created_at"), F.col("timestamp"))
    in_window = (when >= F.lit(span.since)) & (when < F.lit(span.until))
    other = F.col("incarnation").isNotNull() & (F.col("incarnation") != F.lit(incarnation)) \
        if incarnation else F.lit(False)
    reason = (F.when(~F.col("has_id"), Foreign.NO_ENVELOPE.value)
              .when(F.col("message_id").isNull(), Foreign.BROKEN_ENVELOPE.value)
              .when(other, Foreign.OTHER_OUTBOX.value)
              .otherwise(Foreign.UNKNOWN_MESSAGE.value))
    return unknown.where(in_window).select(
        "topic", "key", "seq", "event_type", "message_id", reason.alias("reason"), "partition", "offset",
        "timestamp")
