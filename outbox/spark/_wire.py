"""The wire audit's reading side: which topics, how to reach them, and their records decoded.

``Wire`` says what the audit reads besides the tables; ``read_wire`` reads every
committed record of the topics through Spark's Kafka source (read_committed,
earliest to latest offset) and decodes the envelope in Spark: the message id
as a UUID in any spelling, the envelope's headers by their names in any case
(as the inbox reads them, ``outbox.core._wire``). What the records are checked for
is ``_wire_findings``.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from ..core import _wire as envelope
from ..core._errors import ConfigurationError, OutboxError, SchemaError
from ..core._schema import read as read_schema
from ..core._tables import OutboxTables
from ..core._validation import validate_topic
from ._session import KAFKA_SOURCE_HINT, require_kafka_source
from ._tablemap import connect

READ_COMMITTED = "read_committed"
# Options the audit sets itself: another value would make it check something else.
FIXED_OPTIONS = frozenset({"bootstrap.servers", "isolation.level", "group.id", "enable.auto.commit",
                           "key.deserializer", "value.deserializer", "auto.offset.reset"})
UUID_TEXT = "^[0-9a-f]{32}$"
CONNECT_TIMEOUT = 5.0  # seconds per bootstrap address; Spark's own read would wait minutes


class WireUnreachableError(OutboxError, ConnectionError):
    """No bootstrap address of the wire audit accepts a connection."""


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
        addresses(self.bootstrap)


def addresses(bootstrap: str) -> list[tuple[str, int]]:
    """The (host, port) pairs of ``host:port[,host:port]`` (``[::1]:9092`` and ``SSL://`` prefixes too)."""
    found = []
    for entry in bootstrap.split(","):
        text = entry.strip().rpartition("://")[2]
        host, colon, port = text.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigurationError(f"wire bootstrap must be host:port[,host:port], got {entry.strip()!r}")
        found.append((host.strip("[]"), int(port)))
    return found


def check_reachable(bootstrap: str) -> None:
    """Raise ``WireUnreachableError`` unless some bootstrap address accepts a TCP connection.

    Spark's Kafka source would retry for minutes before failing with a JVM stack
    trace; this answers in seconds, naming the addresses, before Spark starts.
    """
    refused = []
    for host, port in addresses(bootstrap):
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT).close()
            return
        except OSError as exc:
            refused.append(f"{host}:{port} ({exc.strerror or type(exc).__name__})")
    raise WireUnreachableError(f"no Kafka broker answers at {', '.join(refused)}: "
                               "check --wire-bootstrap, or run the audit when the cluster is up")


def incarnation(url: str, prefix: str, schema: str | None) -> str | None:
    """The outbox database's identity (its envelopes' ``outbox-incarnation``), None if it records none."""
    engine = connect(url)
    try:
        with engine.connect() as conn:
            return read_schema(conn, OutboxTables(prefix=prefix, schema=schema)).incarnation or None
    except SchemaError:
        return None  # tables made without outbox_meta: foreign records are told apart by id alone
    finally:
        engine.dispose()


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
    """Kafka source rows as ``topic, partition, offset, timestamp, key, message_id, has_id,
    seq, incarnation, created_at, event_type`` (envelope fields null where absent).

    ``message_id`` is null and ``has_id`` true for a broken id: not a UUID, or two different
    ones. A record without any header has a null ``headers`` array, hence the coalesce.
    """
    ids = F.array_distinct(F.transform(_header_values(envelope.MESSAGE_ID), canonical_uuid))
    first = {name: F.try_element_at(_header_values(name), F.lit(1))
             for name in (envelope.SEQ, envelope.INCARNATION, envelope.CREATED_AT, envelope.EVENT_TYPE)}
    only = F.try_element_at(ids, F.lit(1))
    sole = F.when((F.size(ids) == 1) & only.isNotNull(), only)
    return raw.select(
        "topic", "partition", "offset", "timestamp",
        F.decode("key", "UTF-8").alias("key"),
        sole.alias("message_id"),
        F.coalesce(F.size(ids) > 0, F.lit(False)).alias("has_id"),
        first[envelope.SEQ].try_cast("long").alias("seq"),
        canonical_uuid(first[envelope.INCARNATION]).alias("incarnation"),
        first[envelope.CREATED_AT].try_cast("timestamp").alias("created_at"),
        first[envelope.EVENT_TYPE].alias("event_type"),
    )
