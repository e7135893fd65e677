"""The wire audit: what the topic itself holds, read through Spark's Kafka source, against the outbox.

The outbox table says what was written and what the relay believes it sent;
the topic says what every consumer will read. Reading it read_committed (as a
consumer of the exactly-once mode must), from the earliest to the latest
offset, the audit reports per topic and key:

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

A message is known by its id, a UUID in any spelling; envelope headers by
their names in any case (as the inbox reads them, ``outbox._wire``).
Records of ours are matched to the audited outbox rows by (topic, message id);
other records count as foreign when the ``outbox-created-at`` they carry, or
lacking an envelope the record's timestamp, lies in the audit's window.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from .. import _wire as envelope
from .._errors import ConfigurationError
from .._tables import OutboxStatus
from .._validation import validate_topic
from ._session import KAFKA_SOURCE_HINT, require_kafka_source
from ._window import Window as Span

DETAILS = ("wire_missing", "wire_duplicates", "wire_out_of_order", "wire_foreign")
READ_COMMITTED = "read_committed"
# Options the audit sets itself: another value would make it check something else.
FIXED_OPTIONS = frozenset({"bootstrap.servers", "isolation.level", "group.id", "enable.auto.commit",
                           "key.deserializer", "value.deserializer", "auto.offset.reset"})
UUID_TEXT = "^[0-9a-f]{32}$"


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


@dataclass(frozen=True)
class Wire:
    """What the audit reads besides the tables: the topic itself, through Spark's Kafka source.

    ``bootstrap`` is the Kafka cluster's ``host:port[,host:port]``; ``topics`` the
    topics to read (empty: every topic of the audited outbox rows); ``options``
    Kafka consumer settings the read needs (``security.protocol``, ``sasl.*``,
    ``ssl.*`` …; never logged). ``exactly_once=True`` makes a duplicate on the
    wire fail the audit, as the relay's exactly-once mode promises none; otherwise
    duplicates are counted (at-least-once allows them) and only loss and
    reordering fail it. Checked here, before any Spark runs.
    """

    bootstrap: str
    topics: tuple[str, ...] = ()
    options: Mapping[str, str] = field(default_factory=dict, repr=False)
    exactly_once: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.bootstrap, str) or not self.bootstrap.strip():
            raise ConfigurationError(f"wire bootstrap must be host:port[,host:port], got {self.bootstrap!r}")
        try:
            topics = tuple(dict.fromkeys(validate_topic(t) for t in self.topics))
        except ValueError as exc:
            raise ConfigurationError(f"wire topic: {exc}") from None
        object.__setattr__(self, "topics", topics)
        object.__setattr__(self, "options", checked_options(self.options))


def checked_options(options: Mapping[str, str] | None) -> dict[str, str]:
    """Kafka consumer settings for the read (security, timeouts), refused when they change what it reads."""
    checked: dict[str, str] = {}
    for name, value in (options or {}).items():
        if not isinstance(name, str) or not name or not isinstance(value, str):
            raise ConfigurationError(f"wire options are NAME=VALUE strings, got {name!r}")
        bare = name.removeprefix("kafka.")
        if bare in FIXED_OPTIONS:
            raise ConfigurationError(f"wire option {bare!r} is set by the audit (it reads "
                                     f"{READ_COMMITTED}, earliest to latest); leave it out")
        checked[f"kafka.{bare}"] = value
    return checked


def read_wire(spark: SparkSession, bootstrap: str, topics: Sequence[str],
              options: Mapping[str, str]) -> DataFrame:
    """Every committed record of ``topics``, earliest to latest offset, with its envelope decoded."""
    require_kafka_source(spark)
    reader = (spark.read.format("kafka")
              .option("kafka.bootstrap.servers", bootstrap)
              .option("kafka.isolation.level", READ_COMMITTED)
              .option("subscribe", ",".join(topics))
              .option("startingOffsets", "earliest")
              .option("endingOffsets", "latest")
              .option("includeHeaders", "true"))
    for name, value in options.items():
        reader = reader.option(name, value)
    try:
        raw = reader.load()
    except AnalysisException as exc:
        if "DATA_SOURCE_NOT_FOUND" in str(exc):
            raise ConfigurationError(KAFKA_SOURCE_HINT) from None
        raise
    return decoded(raw)


def canonical_uuid(text: Column) -> Column:
    """A UUID's canonical text (lower case, hyphenated) from any spelling ``uuid.UUID`` takes, else null."""
    bare = F.regexp_replace(F.lower(text), "urn:|uuid:", "")
    hexits = F.regexp_replace(F.regexp_replace(bare, r"^\{+|\}+$", ""), "-", "")
    parts = [F.substring(hexits, start, length) for start, length in
             ((1, 8), (9, 4), (13, 4), (17, 4), (21, 12))]
    return F.when(hexits.rlike(UUID_TEXT), F.concat_ws("-", *parts))


def _header_values(name: str) -> Column:
    """The non-null values of envelope header ``name`` (any case), as UTF-8 text."""
    present = F.filter("headers", lambda h: (F.lower(h["key"]) == name) & h["value"].isNotNull())
    return F.transform(present, lambda h: F.decode(h["value"], "UTF-8"))


def decoded(raw: DataFrame) -> DataFrame:
    """Kafka source rows as ``topic, partition, offset, timestamp, key, message_id, broken,
    seq, incarnation, created_at, event_type`` (envelope fields null where absent)."""
    ids = F.array_distinct(F.transform(_header_values(envelope.MESSAGE_ID), canonical_uuid))
    first = {name: F.try_element_at(_header_values(name), F.lit(1))
             for name in (envelope.SEQ, envelope.INCARNATION, envelope.CREATED_AT, envelope.EVENT_TYPE)}
    only = F.try_element_at(ids, F.lit(1))
    sole = F.when((F.size(ids) == 1) & only.isNotNull(), only)
    return raw.select(
        "topic", "partition", "offset", "timestamp",
        F.decode("key", "UTF-8").alias("key"),
        sole.alias("message_id"),
        (F.size(ids) > 0).alias("has_id"),
        first[envelope.SEQ].try_cast("long").alias("seq"),
        canonical_uuid(first[envelope.INCARNATION]).alias("incarnation"),
        first[envelope.CREATED_AT].try_cast("timestamp").alias("created_at"),
        first[envelope.EVENT_TYPE].alias("event_type"),
    )


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


def counts(wire: DataFrame, rows: DataFrame) -> DataFrame:
    """Per topic: records read (in any window) and the outbox's published rows among the audited."""
    read = wire.groupBy("topic").agg(F.count(F.lit(1)).alias("records"))
    published = rows.where(F.col("status") == OutboxStatus.PUBLISHED.value).groupBy("topic").agg(
        F.count(F.lit(1)).alias("published"))
    return read.join(published, "topic", "full").fillna(0)
