"""``KafkaTransport``: the relay's broker edge on confluent-kafka (librdkafka).

The per-key contract of ``transports.Transport`` (a record is never written
behind an undelivered record of its key) is kept by *pipelining* a batch on
librdkafka's idempotent producer, so a hot key costs no round trip per record:

- every record of a batch is produced at once, each key to its one partition;
  the idempotent producer writes a partition's records in produce order across
  retries (up to 5 requests in flight), the broker refusing any sequence gap;
- ``message.timeout.ms=0``: librdkafka never times a record out of its queue,
  the one way it would knowingly skip a record and write its successor
  (INTRODUCTION.md, "Message timeout considerations": 1, 4, 5);
- ``enable.gapless.guarantee=true``: a record the broker refuses for good fails
  the producer fatally instead of letting the next one through;
- a partition's first record from a producer goes alone, the rest once it is written
  (``_first_contact``): the broker checks no sequence number before that;
- a record reported delivered without an offset is sent again (``_implied``):
  librdkafka implies such deliveries, and the broker may not have written it;
- the transport bounds its own wait: records without a report after
  ``delivery_timeout`` are purged (queued and in flight) and the producer is
  recreated, as it is after a fatal error. A producer thus never carries on
  past a record it did not write: it is dropped first. A purged in-flight
  request may still land later, but only behind everything it followed.

The broker refuses a *request* (a partition's batch), not a record: a record
over the topic's ``max.message.bytes`` fails every record of its request, other
keys' too. When more than one record came back with such a refusal
(``REFUSED_WHOLE``), they are sent again one per request, where each gets its own
answer, and what the refusal held back is sent again after them
(``transports._refusals``): only the record at fault fails.

Results then go through ``hold_behind_undelivered``: after a key's first
record that was not delivered, the later ones come back ``RETRY``.

Setting ``message.timeout.ms`` (``delivery_timeout_ms``) or ``retries``, or
turning the gap-less guarantee off, falls back to waves (``transports._waves``): the n-th
record of a key is sent only once the (n-1)-th is acknowledged.

Keyed records go to the partition Kafka's Java client would choose
(``partition_for_key``: murmur2 of the key modulo the partition count), so JVM
producers and consumers agree; partition counts come from topic metadata and are
refreshed every ``metadata_refresh`` seconds. Unkeyed records let librdkafka
spread them. The producer is idempotent (``enable.idempotence``, ``acks=all``).

Not safe to call ``publish`` from several threads at once; one relay thread
owns a transport.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Collection, Iterable, Mapping, Sequence
from contextlib import suppress
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ClusterMetadata

from transports._errors import ConfigurationError

from .._protocol import Outcome, ReadBack, Record, SendResult, TransportFeatures
from .._refusals import NOT_SENT_ALONE, resendable, settled
from .._unknown_topics import PROPAGATION_SECONDS, UnknownTopics
from .._waves import NO_REPORT, hold_behind_undelivered, key_partition, publish_in_waves
from .._weak import weakly
from ._admin import ADMIN, connection_settings
from ._first_contact import NOT_FIRST, WrittenPartitions
from ._implied import UNPROVEN, unproven
from ._logging import ClientErrors, LibrdkafkaLog
from ._outcomes import REFUSED_WHOLE, TOPIC_GONE_ERRORS, UNKNOWN_TOPIC_ERRORS, result_of
from ._progress_topic import ensure_compacted_topic
from ._queue_full import ProducerStopped, fatal_error, produce_waiting
from ._read_back import last_committed, read_back
from ._settings import check_with_librdkafka, librdkafka_config, redacted
from ._transactions import KafkaTransactionalProducer, Unsettled

# A producer whose every request holds one record: a refusal it meets is that record's own.
ONE_PER_REQUEST = {"batch.num.messages": 1, "linger.ms": 0}

FATAL_CHECK = 0.2  # seconds between looks at a fatal error while waiting for delivery reports
ABANDON_WAIT = 2.0  # seconds to serve the reports of purged and refused records

LIBRDKAFKA_MESSAGE_MAX_BYTES = 1_000_000  # librdkafka's default message.max.bytes
LIBRDKAFKA_QUEUE_MAX_KBYTES = 1_048_576  # librdkafka's default queue.buffering.max.kbytes


def record_limit(config: Mapping[str, Any]) -> tuple[int, str]:
    """The largest record a producer of ``config`` sends, and the setting that decides it.

    librdkafka refuses a record larger than ``message.max.bytes`` at produce() (counting key,
    value, headers and a fixed per-record overhead), and never takes one whose value is larger
    than its whole queue (``queue.buffering.max.kbytes``: produce() says the queue is full, and
    it stays so for that record, ``_queue_full``). A queue set smaller decides.
    """
    message = int(config.get("message.max.bytes", LIBRDKAFKA_MESSAGE_MAX_BYTES))
    queue = int(config.get("queue.buffering.max.kbytes", LIBRDKAFKA_QUEUE_MAX_KBYTES)) * 1024
    if queue < message:
        return queue, "queue.buffering.max.kbytes"
    return message, "message.max.bytes"

DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "enable.gapless.guarantee": True,
    "acks": "all",
    "linger.ms": 5,
    "compression.type": "lz4",
}


MAX_DELIVERY_TIMEOUT = (2**31 - 1) // 1000
"""Seconds: librdkafka takes its timeouts as an int of milliseconds (a larger one overflowed, and the
relay ran on logging a broker it could not reach)."""


class KafkaTransport:
    """Publishes outbox batches to Kafka with per-key order and per-record results.

    ``settings`` and keyword arguments take kafka-python-ng names
    (``bootstrap_servers``, ``linger_ms``, ``sasl_plain_password`` …) or raw
    librdkafka keys (``"linger.ms"``); unknown or invalid ones raise
    ``ConfigurationError`` here. ``delivery_timeout`` bounds how long one
    ``publish`` waits for delivery reports; records still without one are
    purged and come back as ``RETRY`` (unreachable), and the producer is
    recreated. A key's records are pipelined (module doc) unless
    ``message.timeout.ms`` or ``retries`` is set or ``enable.gapless.guarantee`` is off, in
    which case they go in waves, one round trip per record of a key.
    """

    features = TransportFeatures(transactions=True)
    """All of them: per-key order, offsets, records the broker keeps, oversized records refused,
    and Kafka transactions (``transactional``: the relay's exactly-once mode)."""

    def __init__(
        self,
        settings: Mapping[str, Any] | None = None,
        /,
        *,
        delivery_timeout: float = 30.0,
        metadata_refresh: float = 30.0,
        **kwargs: Any,
    ) -> None:
        config = {**DEFAULTS, **librdkafka_config(settings, **kwargs)}
        if not config.get("bootstrap.servers"):
            raise ConfigurationError("KafkaTransport needs bootstrap_servers")
        if str(config.get("enable.idempotence")).lower() not in {"true", "1"}:
            raise ConfigurationError(
                "KafkaTransport keeps per-key order across retries only with enable.idempotence=True"
            )
        if not 0 < delivery_timeout <= MAX_DELIVERY_TIMEOUT or not 0 < metadata_refresh < math.inf:
            raise ConfigurationError(
                f"delivery_timeout must be positive seconds up to {MAX_DELIVERY_TIMEOUT:g} (librdkafka's "
                f"milliseconds are an int), and metadata_refresh positive, finite seconds")
        # A user-set timeout or retry limit would let librdkafka drop a record and write
        # its successor (the gap-less guarantee does not cover timeouts): waves then.
        # The config holds each property under one name (``delivery.timeout.ms`` is here as
        # ``message.timeout.ms``, librdkafka_config): a key is the property.
        timeout_set = "message.timeout.ms" in config
        self._pipelined = (
            not timeout_set and "retries" not in config
            and str(config.get("enable.gapless.guarantee")).lower() in {"true", "1"}
        )
        # Pipelined: librdkafka never times a record out (that would skip it and write
        # its successor); the transport bounds its wait and purges. Waves: a timeout
        # just below delivery_timeout, so every record gets a report.
        if not timeout_set:
            config["message.timeout.ms"] = (0 if self._pipelined
                                            else max(1, int(delivery_timeout * 1000) - 500))
        check_with_librdkafka(config)
        self._config = config
        self._delivery_timeout = delivery_timeout
        self._metadata_refresh = metadata_refresh
        self._partitions: dict[str, tuple[float, int]] = {}
        propagation = int(config.get("topic.metadata.propagation.max.ms", PROPAGATION_SECONDS * 1000))
        self._unknown = UnknownTopics(min(delivery_timeout, propagation / 1000))
        self._log = LibrdkafkaLog()
        self._errors = ClientErrors("producer")
        self._producer = self._new_producer()
        self._written = WrittenPartitions()  # the producer's; a new producer starts with none
        self._fatal: KafkaError | None = None
        # Transactional producers made, by id, for as long as their owner keeps them (``last_committed``).
        self._admin: AdminClient | None = None  # the transactional producers' commit check, shared
        self._admin_lock = threading.Lock()
        self._made: weakref.WeakValueDictionary[str, KafkaTransactionalProducer] = (
            weakref.WeakValueDictionary())
        # Where each id's transactions that did not commit wrote, until a producer of the id ends it.
        self._unsettled: dict[str, Unsettled] = {}

    def __repr__(self) -> str:
        return f"KafkaTransport({redacted(self._config)!r})"

    @property
    def max_record_bytes(self) -> int:
        """The largest record this producer sends (``record_limit``)."""
        return record_limit(self._config)[0]

    @property
    def max_record_setting(self) -> str:
        """The setting that decides ``max_record_bytes`` (``record_limit``)."""
        return record_limit(self._config)[1]

    @staticmethod
    def max_record_bytes_for(settings: Mapping[str, Any] | None = None, /, **kwargs: Any) -> int:
        """``max_record_bytes`` of a transport built with these settings, without building it.

        For a command that must refuse a setting before a producer starts
        connecting (and logging).
        """
        return record_limit(librdkafka_config(settings, **kwargs))[0]

    @staticmethod
    def max_record_setting_for(settings: Mapping[str, Any] | None = None, /, **kwargs: Any) -> str:
        """``max_record_setting`` of a transport built with these settings, without building it."""
        return record_limit(librdkafka_config(settings, **kwargs))[1]

    # -- publishing ---------------------------------------------------------

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        """Send ``records``; one result per record, in input order (see module doc)."""
        # Serve what librdkafka queued since the last batch (its log lines, its errors: an
        # unresolvable host, a failed authentication) now, not at the next flush, which a
        # batch refused before any produce (no metadata) never reaches.
        try:
            self._producer.poll(0)
        except (KafkaException, SystemError) as exc:
            self._fatal = self._fatal or fatal_error(exc)
        if self._fatal is not None:
            self._rebuild()
        if not self._pipelined:
            return publish_in_waves(records, partial(self._send_wave_isolating, records))
        results: list[SendResult | None] = [None] * len(records)
        self._send_pipelined(records, results)
        return hold_behind_undelivered(records, results)

    def _send_pipelined(self, records: Sequence[Record], results: list[SendResult | None]) -> None:
        """Send every record at once; then sort out requests the broker refused whole.

        When more than one record came back refused whole (``REFUSED_WHOLE``), those go
        again one per request (``_isolate``), then what is still to send after them
        (``resendable``: the rest of their keys, records behind them in their
        partitions) goes again, and so on while each round settles something. The
        rounds after the first share one more ``delivery_timeout``.
        """
        first = time.monotonic() + self._delivery_timeout  # the first contacts and the pipeline
        rest = self._first_contacts(records, range(len(records)), results, first)
        refused = self._send_wave(records, rest, results, max(0.1, first - time.monotonic()))
        deadline = time.monotonic() + self._delivery_timeout
        while len(refused) > 1:  # one alone in its request: the refusal is its own
            # A refused record's failure was its request's, not yet its own: settled once alone.
            before = settled(results) - len(refused)
            self._isolate(records, refused, results, deadline)
            again = resendable(records, results)
            if settled(results) == before or not again or time.monotonic() >= deadline:
                return
            # On the new producer ``_isolate`` left, whose first requests the broker does not check.
            again = self._first_contacts(records, again, results, deadline)
            refused = self._send_wave(records, again, results, max(0.1, deadline - time.monotonic()))

    def _first_contacts(self, records: Sequence[Record], indexes: Iterable[int],
                        results: list[SendResult | None], deadline: float) -> list[int]:
        """Of the records at ``indexes``, write one keyed record alone to each partition this producer
        has not written to lately (``_first_contact``), round after round until ``deadline``; the
        indexes left to pipeline.

        A partition whose record came back ``RETRY`` keeps its other records back as that one
        was kept (unreachable or not, its error named): sent behind an unwritten first request,
        they could be written ahead of it. One whose record failed for good is tried with its
        next record, on a new producer if the refusal stopped this one. A producer stopped with
        no time left sends nothing more: the rest comes back unreachable, as after a timeout.
        """
        pending = list(indexes)
        counts: dict[str, int | SendResult] = {}
        where: dict[int, tuple[str, int]] = {}
        for i in pending:
            results[i] = None  # sent again: an earlier round's answer no longer holds
            partition = key_partition(records[i], counts, self._partition_count)
            if isinstance(partition, int):
                where[i] = (records[i].topic, partition)
            elif partition is not None:
                # Its partition not known now: not sent. Left to ``_send_wave``, which asks again, it
                # would go with no first contact once the topic's partitions are known (a topic being
                # created, answered at the next look).
                results[i] = partition
        while True:
            now = time.monotonic()
            stopped = self._stopped_keys(records, results)
            renew = self._fatal is not None  # a new producer id then: known on no partition yet
            firsts: dict[tuple[str, int], int] = {}
            for i in pending:
                if (i in where and (renew or not self._written.proven(where[i], now))
                        and (records[i].topic, records[i].key) not in stopped):
                    firsts.setdefault(where[i], i)
            if not firsts or (renew and now >= deadline):
                break
            if renew:
                self._rebuild()
            self._send_wave(records, list(firsts.values()), results, max(0.1, deadline - now))
            sent = set(firsts.values())
            held: dict[tuple[str, int], SendResult] = {}  # partition -> its first record's RETRY
            for place, i in firsts.items():
                result = results[i] or SendResult(Outcome.RETRY, error=NO_REPORT, unreachable=True)
                if result.outcome is Outcome.DELIVERED:
                    self._written.note(place, time.monotonic())
                elif result.outcome is Outcome.RETRY:
                    held[place] = result
            for i in pending:
                if i not in sent and where.get(i) in held:
                    first = held[where[i]]
                    results[i] = SendResult(Outcome.RETRY, error=f"{NOT_FIRST} ({first.error})",
                                            unreachable=first.unreachable)
            pending = [i for i in pending if i not in sent and results[i] is None]
        # A key whose first record was not written sends nothing after it (``hold_behind_undelivered``
        # reports the rest).
        stopped = self._stopped_keys(records, results)
        pending = [i for i in pending if (records[i].topic, records[i].key) not in stopped]
        if pending and self._fatal is not None:  # what is left needs no first contact (unkeyed)
            if time.monotonic() < deadline:
                self._rebuild()
            else:  # stopped, and no time left for a new one
                for i in pending:
                    results[i] = SendResult(Outcome.RETRY, error=NO_REPORT, unreachable=True)
                return []
        return pending

    @staticmethod
    def _stopped_keys(records: Sequence[Record],
                      results: Sequence[SendResult | None]) -> set[tuple[str, bytes]]:
        """The keys with a record that has a result other than delivered."""
        return {(records[i].topic, key) for i, result in enumerate(results)
                if result is not None and result.outcome is not Outcome.DELIVERED
                and (key := records[i].key) is not None}

    def _send_wave_isolating(self, records: Sequence[Record], indexes: list[int],
                             results: list[SendResult | None]) -> None:
        """A wave (one record per key), its records refused whole sent again one per request."""
        refused = self._send_wave(records, indexes, results)
        if len(refused) > 1:
            self._isolate(records, refused, results, time.monotonic() + self._delivery_timeout)

    def _isolate(self, records: Sequence[Record], refused: list[int], results: list[SendResult | None],
                 deadline: float) -> None:
        """Send the ``refused`` records again, in order, one at a time, each in a request of its own:
        each refusal is then the record's own. A new producer of the transport's settings after.

        One at a time: a record is produced only once the one before has its report, and a
        key's records stop at its first one not delivered. The producer is a new producer id,
        and Apache Kafka checks no sequence number of a producer id with nothing written to the
        partition yet (``ProducerAppendInfo.checkSequence``: "accept writes with any sequence
        number"). Had the next record been on its way when the first was refused (for its own
        fault, or for a passing reason such as NOT_ENOUGH_REPLICAS), the broker would have
        written it ahead of it; and librdkafka, seeing the later one acknowledged, reports the
        earlier one delivered ("R2 succeeded, so R1 was in fact persisted"). One request in
        flight is not enough: librdkafka sent a queued request right after the gap-less stop of
        the one before (seen on the mock cluster with ``max.in.flight.requests.per.connection=1``).
        """
        stopped: set[tuple[str, bytes]] = set()
        self._rebuild(ONE_PER_REQUEST)
        try:
            for i in refused:
                record = records[i]
                key = None if record.key is None else (record.topic, record.key)
                if key in stopped or time.monotonic() >= deadline:
                    results[i] = SendResult(Outcome.RETRY, error=NOT_SENT_ALONE, unreachable=True)
                    continue
                if self._fatal is not None:  # a refusal stopped it (the gap-less guarantee)
                    self._rebuild(ONE_PER_REQUEST)
                self._send_wave(records, [i], results, max(0.1, deadline - time.monotonic()))
                answer = results[i]
                if key is not None and (answer is None or answer.outcome is not Outcome.DELIVERED):
                    stopped.add(key)
        finally:
            self._rebuild()

    def _send_wave(
        self, records: Sequence[Record], indexes: list[int], results: list[SendResult | None],
        timeout: float | None = None,
    ) -> list[int]:
        """Produce the records at ``indexes``, then wait (up to ``timeout``, by default
        ``delivery_timeout``) for all delivery reports; return the indexes the broker
        refused whole (``REFUSED_WHOLE``).

        A key whose record could not even be queued (no room in the queue by then, refused
        locally) gets none of its later records queued: they would be written behind it.
        """
        budget = self._delivery_timeout if timeout is None else timeout
        waited = 0.0  # for room in the queue (``_queue_full``): out of the wait for the reports
        report = self._report
        reports: dict[int, tuple[KafkaError | None, Any]] = {}
        counts: dict[str, int | SendResult] = {}  # per wave: metadata looked up once per topic
        lookup = self._partition_count
        outstanding = 0
        stopped: set[tuple[str, bytes | None]] = set()
        finished: SendResult | None = None  # the producer stopped while waiting for room
        for i in indexes:
            results[i] = None  # sent again: an earlier round's answer no longer holds
        for i in indexes:
            record = records[i]
            if finished is not None:
                results[i] = finished
                continue
            if (record.topic, record.key) in stopped:
                continue  # hold_behind_undelivered gives it its result
            partition = key_partition(record, counts, lookup)
            if isinstance(partition, SendResult):
                results[i] = partition
                if record.key is not None:
                    stopped.add((record.topic, record.key))
                continue
            if partition is None:
                partition = -1  # librdkafka's "unassigned": it spreads unkeyed records
            callback = partial(report, reports, i)
            headers: Any = record.headers  # librdkafka's stubs want a list of str | bytes | None
            try:
                # Local queue full: wait for room, out of the wave's time (``_queue_full``).
                started = time.monotonic()
                results[i] = produce_waiting(self._producer, started + budget - waited, record.topic,
                                             record.value, record.key, partition, on_delivery=callback,
                                             headers=headers)
                waited += time.monotonic() - started
                if results[i] is None:
                    outstanding += 1
            except ProducerStopped as exc:
                # Stopped by an earlier record's refusal (the gap-less guarantee), not this one's: it
                # and the rest of the wave were never sent; the producer is recreated (``_wait``).
                self._fatal = self._fatal or exc.args[0]
                finished = results[i] = SendResult(Outcome.RETRY, error=f"not sent: {exc.args[0].str()}",
                                                   unreachable=True)
            except KafkaException as exc:
                results[i] = result_of(exc.args[0])
                self._forget_if_gone(record.topic, exc.args[0])
            except (TypeError, ValueError) as exc:
                # The client refused the record's own values (text it cannot encode, a
                # header of the wrong type): that record fails, not the batch.
                results[i] = SendResult(Outcome.FAILED, error=f"producer refused the record: {exc}")
            if results[i] is not None and record.key is not None:
                stopped.add((record.topic, record.key))
        if outstanding:
            self._wait(max(0.0, budget - waited))
        if any(error is None for error, _ in reports.values()):
            self._errors.cleared()
        refused = []
        for i, (error, message) in reports.items():
            if error is not None:
                results[i] = result_of(error)
            elif unproven(message):  # not heard from the broker: sent again (``_implied``)
                # Its answer never came, as a record without a report: no attempt counted.
                results[i] = SendResult(Outcome.RETRY, message.partition(), error=UNPROVEN, unreachable=True)
            else:
                results[i] = SendResult(Outcome.DELIVERED, message.partition(), message.offset())
            if error is not None and error.code() in REFUSED_WHOLE:
                refused.append(i)
            if error is not None:
                self._forget_if_gone(records[i].topic, error)
        return sorted(refused)

    def _wait(self, timeout: float) -> None:
        """Serve delivery reports until none is outstanding or ``timeout`` passed.

        What is left then is purged (its reports say so) and the producer is
        marked for recreation: it must not go on sending behind records it
        dropped. A fatal error ends the wait the same way, once the reports that came
        with it were served: librdkafka reports it through ``error_cb`` and sends nothing
        after it, so the records queued behind it would otherwise hold the wait to
        ``timeout``.
        """
        deadline = time.monotonic() + timeout
        left = len(self._producer)
        try:
            while left:
                before = left
                left = self._producer.flush(min(FATAL_CHECK, max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline or (self._fatal is not None and left == before):
                    break
        except (KafkaException, SystemError) as exc:
            self._fatal = fatal_error(exc)
        if left or self._fatal is not None:
            self._abandon()

    def _abandon(self) -> None:
        """Purge everything outstanding, serve the reports left, recreate on next publish.

        Every record then gets a report: the purged ones say so, the ones a fatal error
        refused say why. The latter may still be on their way: librdkafka raises the
        fatal error before it queues the reports of the request that caused it, and a
        raise stops serving. So serve until none is outstanding (``ABANDON_WAIT`` at most).
        """
        with suppress(KafkaException, SystemError):
            self._producer.purge(in_queue=True, in_flight=True)
        deadline = time.monotonic() + ABANDON_WAIT
        while len(self._producer) and time.monotonic() < deadline:
            try:
                self._producer.poll(0.05)
            except (KafkaException, SystemError) as exc:
                self._fatal = self._fatal or fatal_error(exc)
        if self._fatal is None:
            self._fatal = KafkaError(KafkaError._TIMED_OUT, "no delivery report within delivery_timeout")

    @staticmethod
    def _report(reports: dict[int, tuple[KafkaError | None, Any]], index: int,
                error: KafkaError | None, message: Any) -> None:
        # Only stored here, read after the wait: once librdkafka raises a fatal error,
        # confluent-kafka runs the remaining callbacks with that exception pending, and
        # any call into it (error.code(), message.offset()) would fail with SystemError.
        reports[index] = (error, message)

    # -- partitions ---------------------------------------------------------

    def _partition_count(self, topic: str) -> int | SendResult:
        """The topic's partition count (cached for ``metadata_refresh`` s), or the error as a result."""
        count = self._lookup_partitions(topic)
        return result_of(count) if isinstance(count, KafkaError) else count

    def _lookup_partitions(self, topic: str) -> int | KafkaError:
        """Partition counts are cached for ``metadata_refresh`` s; errors never are.

        A topic the broker calls unknown is asked about again for up to
        ``topic.metadata.propagation.max.ms`` (at most ``delivery_timeout``) before it is
        believed: it may be being created (``transports._unknown_topics``).
        """
        cached = self._partitions.get(topic)
        if cached is not None and time.monotonic() - cached[0] < self._metadata_refresh:
            return cached[1]
        while True:
            found = self._ask_partitions(topic)
            if not (isinstance(found, KafkaError) and found.code() in UNKNOWN_TOPIC_ERRORS):
                self._unknown.known(topic)
                return found
            left = self._unknown.wait_left(topic)
            if left <= 0:
                return found
            time.sleep(min(0.1, left))

    def _forget_if_gone(self, topic: str, error: KafkaError) -> None:
        """A record refused because its topic is unknown: the cached partition count no longer
        holds. The next batch asks the broker again, which also renews librdkafka's own view of
        the topic: a deleted topic created again is then written at once, not after the cache
        (and librdkafka's "no such topic") ran out, which failed a row retried in between again."""
        if error.code() in TOPIC_GONE_ERRORS:
            self._partitions.pop(topic, None)

    def _ask_partitions(self, topic: str) -> int | KafkaError:
        """One metadata request for ``topic``: its partition count (now cached), or the error."""
        now = time.monotonic()
        try:
            metadata: ClusterMetadata = self._producer.list_topics(
                topic, timeout=min(10.0, self._delivery_timeout))
        except KafkaException as exc:
            with suppress(KafkaException, SystemError):
                self._producer.poll(0)  # the cause (unresolvable, refused, authentication) is logged now
            unreachable: KafkaError = exc.args[0]
            return unreachable  # broker unreachable: not cached, asked again next time
        info = metadata.topics.get(topic)
        if info is None:
            return KafkaError(KafkaError._UNKNOWN_TOPIC, f"no metadata for topic {topic!r}")
        if info.error is not None:
            # Not cached, not even an unknown topic: the operator may create it and run
            # `outbox failed retry` at once, and a cached error would fail the row again
            # (with a second alert). The per-wave cache still asks once per wave.
            self._partitions.pop(topic, None)
            return info.error
        if not info.partitions:
            return KafkaError(KafkaError.LEADER_NOT_AVAILABLE, f"topic {topic!r} has no partitions yet")
        self._partitions[topic] = (now, len(info.partitions))
        return len(info.partitions)

    # -- transactions (``transports.Transactions``) ------------------------------------

    @property
    def transaction_timeout(self) -> float:
        """``delivery_timeout``: one bound on waiting for the broker, whichever mode the relay runs in."""
        return self._delivery_timeout

    def transactional(self, transactional_id: str, timeout: float, *, one_per_request: bool = False,
                      left_open: Collection[str] = ()) -> KafkaTransactionalProducer:
        """A transactional producer of this transport's settings; every older one of the id fenced.

        ``one_per_request``: each request holds one record, so a refusal is that record's own.
        Before it is returned, it ends what the id's transactions that did not commit may have left
        open (``Unsettled``): where this transport's did, and every partition of ``left_open``'s
        topics (named by the caller: transactions of other processes, gone since, may have written
        there; kept as this id's until ended); ``RetriableTransportError`` if the broker does not
        take that in time, ``HeldByOpenTransactionError`` if a partition is held by a transaction
        open there.
        """
        settings = {**self._config, **(ONE_PER_REQUEST if one_per_request else {})}
        unsettled = self._unsettled.setdefault(transactional_id, Unsettled())
        unsettled.topics.update(left_open)
        producer = KafkaTransactionalProducer(settings, transactional_id, timeout=timeout,
                                              partitions=self._partition_count, results_of=result_of,
                                              admin=self._shared_admin, unsettled=unsettled)
        self._made[transactional_id] = producer  # the newest of the id: it ends what is left open
        try:
            producer.settle()
        except BaseException:
            producer.close()  # its client destroyed now, though the exception's traceback holds it
            raise
        return producer

    def _newest(self, transactional_id: str) -> KafkaTransactionalProducer | None:
        """The newest transactional producer made here of the id, unless it is closed (nothing of a
        closed one is used: its client may be destroyed)."""
        producer = self._made.get(transactional_id)
        return None if producer is None or producer.closed else producer

    def _shared_admin(self, stale: AdminClient | None = None) -> AdminClient:
        """One admin client for every transactional producer made here (``KafkaTransactionalProducer``
        reads its commits back with it): a fleet's hundreds of shard producers share its connections.
        ``stale``: a client whose request failed, replaced by a new one if it is still the shared one."""
        with self._admin_lock:
            if self._admin is None or self._admin is stale:
                self._admin = AdminClient({**connection_settings(self._config), **ADMIN})
            return self._admin

    def ensure_compacted_topic(self, topic: str, partitions: int, timeout: float,
                               stopping: threading.Event | None = None) -> None:
        ensure_compacted_topic(self._config, topic, partitions, timeout, stopping)

    def last_committed(self, topic: str, partition: int, key: bytes, timeout: float) -> bytes | None:
        """``_read_back.last_committed``; a transaction of ``key`` the broker left open is ended by the
        newest producer this transport made whose transactional id ``key`` is, if there is one."""
        producer = self._newest(key.decode(errors="replace"))
        settle = None if producer is None else (
            lambda topics: producer.end_left_open(topics, (topic, self._partition_of(topic, partition))))
        return last_committed(self._config, topic, partition, key, timeout, settle)

    def read_back(self, topic: str, partition: int, key: bytes, timeout: float) -> ReadBack:
        """``_read_back.read_back``; what the broker left open of ``key``'s transactions is ended as in
        ``last_committed``, each partition by itself where only that one is."""
        producer = self._newest(key.decode(errors="replace"))
        if producer is None:
            return read_back(self._config, topic, partition, key, timeout)
        made = producer  # the newest of the id when the read began
        return read_back(
            self._config, topic, partition, key, timeout,
            lambda topics: made.end_left_open(topics, (topic, self._partition_of(topic, partition))),
            lambda at, number: made.end_left_open((), (at, number)))

    def _partition_of(self, topic: str, partition: int) -> int:
        """``partition`` modulo ``topic``'s partition count, as a ``Record``'s."""
        count = self._partition_count(topic)
        return partition % count if isinstance(count, int) else partition

    # -- lifecycle ----------------------------------------------------------

    def _on_error(self, error: KafkaError) -> None:
        self._errors(error)
        # Fatal errors (e.g. the idempotent producer fenced) make the instance unusable.
        if error.fatal():
            self._fatal = error

    def _rebuild(self, settings: Mapping[str, Any] | None = None) -> None:
        """A new producer (with ``settings`` over the transport's): the old one is finished."""
        with suppress(KafkaException, SystemError):  # the fatal error that brought us here, again
            self._producer.flush(0)
        self._producer = self._new_producer(settings)
        self._written.clear()
        self._fatal = None

    def _new_producer(self, settings: Mapping[str, Any] | None = None) -> Producer:
        """librdkafka's log lines go to Python logging (``_logging``), not raw to stderr; its errors to
        ``_on_error``, held weakly (``_weak``: a transport dropped unclosed is freed at once)."""
        return Producer({**self._config, **(settings or {}), "error_cb": weakly(self._on_error),
                         "logger": self._log})

    def close(self, timeout: float = 10.0) -> None:
        """Wait up to ``timeout`` seconds for queued records. The producer itself is destroyed with the
        transport (dropped, it goes at once: ``_weak``).

        A producer stopped by a fatal error raises it again from ``flush``; its
        records were all reported already, so there is nothing left to wait for.
        """
        with suppress(KafkaException, SystemError):
            self._producer.flush(timeout)
