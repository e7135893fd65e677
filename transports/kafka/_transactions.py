"""Kafka transactions for the relay's exactly-once mode: a producer per transactional id.

``KafkaTransactionalProducer`` is confluent-kafka's transactional producer,
one per ``transactional.id``. Making one calls ``init_transactions``, which
fences every older producer of the id: the broker aborts (or, if its commit
was under way, completes) the older one's open transaction before it answers,
and refuses anything the older one writes afterwards (``PRODUCER_FENCED``).
``send`` is one transaction: the records are produced (each key to the
partition Kafka's Java client picks), then ``commit_transaction``. Its outcome
is one of four (``TransactionOutcome``): committed; aborted (nothing of it will
ever be read committed), with the record the broker refused for good named
``FAILED``; fenced; or unknown (the commit was asked for and not answered: the
caller makes a new producer of the id, which settles the transaction, and reads
back what it carried).

The last record of each transaction names the transaction's topics (header
``TOPICS_HEADER``): should the broker leave the transaction open after its producer
is fenced (it drops the commit or abort markers of partitions whose leader it does not
know, e.g. while a restarted broker's old registration is fenced), a later producer of
the id ends it on every partition of those topics (``end_left_open``), since its
markers are the only ones that can still end it. The last record is produced once the others'
delivery reports came, and names where each went (header ``POSITIONS_HEADER``): when the
broker split a commit, the markers of some partitions written and the last record's dropped,
a read-back tells the committed records from the others (``_read_back.read_back``). It costs
one produce round trip per transaction.

The coordinator answers a commit once it has decided it, and writes the markers after.
A commit whose markers it then drops (above: a broker killed just after it answered, and
restarted) was decided, yet no read_committed reader ever gets its records: they stay undecided
until a later marker of the same producer id ends them, the next producer's abort or an aborted
transaction of the same producer on that partition. So ``send`` reports ``COMMITTED`` only once
the partition of its last record (the relay's progress record, on a partition no other producer
writes) has its last stable offset past that record (read back after the commit, within the
producer's timeout); otherwise the outcome is ``UNKNOWN``, settled like a commit never answered:
the next producer of the id ends the transaction (``end_left_open``, its records never read) or
finds it committed. That partition speaks for the others: a restarted broker drops all of a
transaction's markers together, its partitions being leaderless at once (on several brokers a drop
on some partitions only, the last record's among them, is settled by the read-back, which tells the
committed records from the others by their positions; a drop that spares the last record's partition
is ``docs/relay.md``'s remaining limit); and the data partitions' last stable offsets would also
wait for other producers' open transactions there.

Reading back the last committed record of a key (a shard's progress) is ``_read_back``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from .._errors import ConfigurationError, RetriableTransportError, TransportError
from .._protocol import Outcome, Record, SendResult, TransactionOutcome, TransactionResult
from .._waves import key_partition
from ._admin import partition_counts
from ._held import HELD_FOR, settle_held
from ._implied import UNPROVEN, unproven
from ._logging import ClientErrors, LibrdkafkaLog
from ._queue_full import produce_waiting
from ._stable import FLUSH_STEP, StableOffsets
from ._txn_headers import with_positions, with_topics

# librdkafka's producer settings a transactional producer must not carry: the gap-less
# guarantee is the idempotent producer's (a transaction aborts whole instead), and a record
# timeout of 0 ("never") is refused next to transaction.timeout.ms.
NOT_TRANSACTIONAL = frozenset({"enable.gapless.guarantee", "message.timeout.ms"})

FENCED_ERRORS = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH,
                           KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED})

PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})

ABANDON_AT_MOST = 5.0
"""Seconds a settle that failed gives the abort of what it wrote (``KafkaTransactionalProducer._abandon``)."""

SILENT_FOR = 0.5
"""Of a transaction's deadline: a broker that acknowledged none of its records for at least this much
of it at the end, and throttled none (no quota), went silent (a host crashed, a network partition): it
was given up for want of the broker, not for a pace (``send``, ``TransactionResult.answered`` 0)."""

DECIDED_AT_LEAST = 1.0
"""Seconds the check that a commit ended everywhere may take, even when the commit used the timeout up."""

BROKER_MAX_TRANSACTION_MS = 900_000
"""Apache Kafka's default ``transaction.max.timeout.ms``: a producer asking for more is refused."""


def transaction_timeout_ms(ms: int) -> int:
    """The producers' ``transaction.timeout.ms`` for a relay deadline of ``ms``: twice it (a minute at
    least), so the coordinator never aborts a transaction the relay still waits for; within the
    broker's default maximum while that still leaves the deadline, since librdkafka refuses a
    ``message.timeout.ms`` above it."""
    return max(ms, 60_000, min(2 * ms, BROKER_MAX_TRANSACTION_MS))


@dataclass
class Unsettled:
    """Where one transactional id's transactions that did not end committed wrote: partitions, and
    topics whose partition librdkafka chose. Their markers may have been dropped (module doc).

    An aborted or unknown transaction whose last record was never produced names no topics anywhere
    a read-back finds, yet its records may stay open on their partitions: the coordinator drops the
    abort markers of a partition whose leader it cannot find (a broker frozen past its session
    and thawed). The next producer of the id then committed there, which ended them too, committed:
    rows twice on the wire. So the transport keeps this for each id, and the next producer it makes
    of the id ends them (``KafkaTransactionalProducer.settle``) before it is used. Held by the
    transport (strongly): a producer dropped after an unknown outcome is gone, this is not. It ends
    with the process, though: a caller that keeps where the id's transactions wrote beyond it names
    those topics to ``KafkaTransport.transactional`` (``left_open``), and they are added here.
    """

    partitions: set[tuple[str, int]] = field(default_factory=set)
    topics: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.partitions or self.topics)


class Heard:
    """When a transactional producer's broker last acknowledged one of its records, and how often it
    said it throttled the producer (``throttle_cb``: a quota). Apart from the producer, as
    ``ClientErrors`` is: a callback of its client holding the producer would keep it in a reference
    cycle with its client (a librdkafka client, its threads and connections, freed only by the cycle
    collector; tests/test_relay_exactly_once_producer_lifetime.py)."""

    def __init__(self) -> None:
        self.at = 0.0
        self.throttled = 0

    def throttle(self, event: Any) -> None:
        if event.throttle_time > 0:
            self.throttled += 1


class KafkaTransactionalProducer:
    """One ``transactional.id``'s producer; each ``send`` one transaction (module doc).

    ``results_of`` turns a record's librdkafka error into its ``SendResult``
    (the transport's classification: refused for good, retriable, unreachable).
    Not safe for several threads.
    """

    def __init__(self, config: Mapping[str, Any], transactional_id: str, *, timeout: float,
                 partitions: Callable[[str], int | SendResult],
                 results_of: Callable[[KafkaError], SendResult],
                 admin: Callable[[AdminClient | None], AdminClient],
                 unsettled: Unsettled | None = None) -> None:
        self.transactional_id = transactional_id
        # Where this id's transactions that did not commit wrote (its transport's, shared by every
        # producer of the id); this transaction's, added to it unless it commits.
        self._unsettled = Unsettled() if unsettled is None else unsettled
        self._touched = Unsettled()
        self._timeout = timeout
        self._partitions = partitions
        self._result_of = results_of
        self._config = config
        self._errors = ClientErrors(f"transactional producer {transactional_id}")
        # When the broker last acknowledged a record of it, and how often it said it throttled it (a
        # quota): ``send`` tells a broker that went silent from a slow one by them.
        self._heard = Heard()
        # Whether its transactions ended on their partitions (``_undecided``, ``_end_open``).
        self._stable = StableOffsets(admin)
        settings = {k: v for k, v in config.items() if k not in NOT_TRANSACTIONAL}
        ms = int(timeout * 1000)
        settings.update({"transactional.id": transactional_id, "message.timeout.ms": ms,
                         "transaction.timeout.ms": transaction_timeout_ms(ms),
                         "error_cb": self._errors, "throttle_cb": self._heard.throttle,
                         "logger": LibrdkafkaLog()})
        # Whether a transaction of it may be open (begun, its commit or abort not answered), and whether
        # it met a fatal error (fenced): either way ``close`` leaves its client to its last reference.
        self._open = self._fatal = self._closed = False
        self._producer = Producer(settings)
        try:
            self._producer.init_transactions(timeout)
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            # A fatal error raises again from the next call that serves callbacks: this one's is the
            # one to tell (it escaped raw, and the relay retried a refused setting forever).
            with suppress(KafkaException, SystemError):
                self._producer.flush(0)
            # Never returned to anyone: closed now. Not destroyed, though: librdkafka may still be
            # initializing it (a timeout here does not end its init), and confluent-kafka's close would
            # try an abort that it refuses ("Conflicting init_transactions API call is already in
            # progress", a warning at every take-over tried during an outage); its last reference ends it.
            self._open, self._fatal = True, error.fatal()
            self.close()
            if error.code() == KafkaError.INVALID_TRANSACTION_TIMEOUT:
                raise ConfigurationError(
                    f"the broker refuses transaction.timeout.ms={settings['transaction.timeout.ms']} "
                    f"(twice the delivery_timeout of {timeout:g} s, a minute at least): raise its "
                    f"transaction.max.timeout.ms (15 minutes by default) or lower delivery_timeout") from None
            if error.fatal():
                raise TransportError(
                    f"cannot start transactions as {transactional_id!r}: {error.str()}") from None
            raise RetriableTransportError(
                f"no answer to init_transactions as {transactional_id!r}: {error.str()}") from None

    def __repr__(self) -> str:
        return f"KafkaTransactionalProducer({self.transactional_id!r})"

    def send(self, records: Sequence[Record]) -> TransactionResult:
        """Write ``records`` in one transaction; its outcome and one result per record.

        The last record carries ``TOPICS_HEADER`` and ``POSITIONS_HEADER`` (module doc): it is
        produced once the others' delivery reports came. Where a transaction that does not commit
        wrote is kept (``Unsettled``) for the next producer of the id to end.

        One given up while the client lost or was refused a connection (``ClientErrors.disconnects``)
        says nothing of the broker's pace (``TransactionResult.answered`` 0): with some records
        acknowledged before a broker was killed and the rest given up at the deadline, it was taken
        for a broker too slow for its size, its shard's transactions halved and "too slowly" logged.
        So is one whose broker went silent (``SILENT_FOR``: acknowledged nothing in the deadline's
        second half, and throttled nothing of it) without closing a connection: a host crashed, a
        network partition, a long pause. A broker a quota holds back says so in its answers
        (``throttle_cb``); one that is only slow keeps acknowledging until the deadline."""
        self._touched = Unsettled()
        result: TransactionResult | None = None
        with suppress(KafkaException, SystemError):
            self._producer.poll(0)  # a connection lost before it (closed idle) is not counted in it
        heard = self._heard
        disconnects, throttled = self._errors.disconnects, heard.throttled
        heard.at = began = time.monotonic()
        try:
            result = self._send(records)
            if result.answered and (self._errors.disconnects != disconnects or (
                    heard.throttled == throttled and heard.at - began < (1 - SILENT_FOR) * self._timeout)):
                # A broker that went away meanwhile (killed, restarted, silent) gave it up, not its pace.
                result = replace(result, answered=0)
            return result
        finally:
            if result is None or result.outcome is not TransactionOutcome.COMMITTED:
                self._unsettled.partitions |= self._touched.partitions
                self._unsettled.topics |= self._touched.topics

    def _send(self, records: Sequence[Record]) -> TransactionResult:
        producer = self._producer
        records = with_topics(records)
        try:
            producer.begin_transaction()
        except KafkaException as exc:
            return self._ended(exc.args[0], len(records))
        self._open = True
        deadline = time.monotonic() + self._timeout
        reports: dict[int, tuple[KafkaError | None, Any]] = {}
        counts: dict[str, int | SendResult] = {}
        refused = self._produce(records, range(len(records) - 1), reports, counts, deadline)
        if refused:  # not all of it could even be produced: the transaction cannot commit
            return self._abort(len(records), reports, refused, None)
        if len(records) > 1:
            failure = self._delivered(reports, deadline, len(records))
            if failure is not None:
                return failure if isinstance(failure, TransactionResult) else self._abort(
                    len(records), reports, {}, failure)
            records = with_positions(records, [reports[i][1] for i in range(len(records) - 1)])
        refused = self._produce(records, [len(records) - 1], reports, counts, deadline)
        if refused:
            return self._abort(len(records), reports, refused, None)
        return self._commit(len(records), reports, deadline)

    def _produce(self, records: Sequence[Record], indexes: Iterable[int],
                 reports: dict[int, tuple[KafkaError | None, Any]],
                 counts: dict[str, int | SendResult], deadline: float) -> dict[int, SendResult]:
        """Produce ``records[i]`` for each of ``indexes`` (their reports go to ``reports``; room in the
        queue waited for until ``deadline``); the first one that could not even be produced, with why
        (a retry, if the transaction had failed already: why it did, ``_failed``)."""
        producer = self._producer
        refused: dict[int, SendResult] = {}
        for i in indexes:
            record = records[i]
            partition = (key_partition(record, counts, self._partitions) if record.partition is None
                         else self._chosen(record, counts))
            if isinstance(partition, SendResult):
                refused[i] = partition
                break
            if partition is None:  # librdkafka's partitioner picks: any partition of the topic
                self._touched.topics.add(record.topic)
            else:
                self._touched.partitions.add((record.topic, partition))
            headers: Any = record.headers

            def report(error: KafkaError | None, message: Any, i: int = i,
                       heard: Heard = self._heard) -> None:
                reports[i] = (error, message)  # only stored: read once the transaction ended
                if error is None:
                    heard.at = time.monotonic()

            try:
                # Local queue full: wait for room until the transaction's deadline (``_queue_full``).
                result = produce_waiting(producer, deadline, record.topic, record.value, record.key,
                                         -1 if partition is None else partition, on_delivery=report,
                                         headers=headers)
                if result is not None:
                    refused[i] = result
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.code() == KafkaError._STATE:  # not the record's fault
                    refused[i] = replace(self._result_of(self._failed(reports, error)), outcome=Outcome.RETRY)
                else:
                    refused[i] = self._result_of(error)
            except (TypeError, ValueError) as exc:
                refused[i] = SendResult(Outcome.FAILED, error=f"producer refused the record: {exc}")
            if refused:
                break
        return refused

    def _failed(self, reports: dict[int, tuple[KafkaError | None, Any]], state: KafkaError) -> KafkaError:
        """Why a transaction whose producer refused a record for its state (``_STATE``) failed.

        librdkafka takes no more records into a transaction that failed already: one of its
        records timed out in the queue (a frozen broker: ``message.timeout.ms`` is the deadline, and
        a record waiting for room can outlive it by a moment), or the broker refused one. That record's
        report says which, and decides whether the transaction's rows count an attempt; refused as
        the record's own retriable error, the state once counted one for each of a batch's rows
        after a frozen broker (the CI of 9b197e0).
        """
        with suppress(KafkaException, SystemError):
            self._producer.poll(0)  # the failed record's report
        errors = [error for error, _ in list(reports.values()) if error is not None]
        # Its own error, not the purge of the records queued behind it.
        return next((e for e in errors if e.code() not in PURGED), errors[0] if errors else state)

    def _delivered(self, reports: dict[int, tuple[KafkaError | None, Any]], deadline: float,
                   count: int) -> KafkaError | TransactionResult | None:
        """Wait for every produced record's report; the first error (it dooms the transaction), or the
        transaction's end if the producer cannot go on, or None once all were delivered."""
        try:
            while len(self._producer) and time.monotonic() < deadline:
                self._producer.flush(min(FLUSH_STEP, max(0.0, deadline - time.monotonic())))
                if any(error is not None for error, _ in list(reports.values())):
                    break
        except KafkaException as exc:
            return self._ended(exc.args[0], count)
        failures = [error for error, _ in list(reports.values()) if error is not None]
        if not failures and not len(self._producer) and any(
                unproven(message) for _, message in list(reports.values())):
            # A delivery librdkafka implied (``_implied``): the commit could seal the transaction
            # without that record. Aborted, the rows go again in a transaction of their own.
            failures = [KafkaError(KafkaError._INCONSISTENT, UNPROVEN, retriable=True)]
        if failures or len(self._producer):
            return failures[0] if failures else KafkaError(KafkaError._TIMED_OUT, "no report in time")
        return None

    def _chosen(self, record: Record, counts: dict[str, int | SendResult]) -> int | SendResult:
        """The partition a record names, modulo its topic's partition count."""
        count = counts.get(record.topic)
        if count is None:
            count = counts[record.topic] = self._partitions(record.topic)
        return count if isinstance(count, SendResult) else (record.partition or 0) % count

    def _commit(self, count: int, reports: dict[int, tuple[KafkaError | None, Any]],
                deadline: float) -> TransactionResult:
        """Wait for the records' reports; abort at the first error (it dooms the transaction), else commit."""
        failure = self._delivered(reports, deadline, count)
        if isinstance(failure, TransactionResult):
            return failure
        if failure is not None:
            return self._abort(count, reports, {}, failure)
        while True:
            try:
                self._producer.commit_transaction(max(0.1, deadline - time.monotonic()))
                self._open = False
                break
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.txn_requires_abort():
                    return self._abort(count, reports, {}, error)
                if error.fatal() or not error.retriable():
                    return self._ended(error, count)
                if time.monotonic() >= deadline:  # its records were answered, its commit not in time
                    return replace(self._ended(error, count), answered=_answered(reports))
        self._errors.cleared()
        results: list[SendResult] = []
        for i in range(count):
            failure, message = reports.get(i, (None, None))
            if message is None or failure is not None:  # cannot be after a commit; say so if it is
                return TransactionResult(TransactionOutcome.UNKNOWN, _retry(count, "no delivery report"),
                                         "committed without a delivery report")
            results.append(SendResult(Outcome.DELIVERED, message.partition(), message.offset()))
        last = reports[count - 1][1] if count else None  # its partition speaks for all (module doc)
        check_until = max(deadline, time.monotonic() + DECIDED_AT_LEAST)
        undecided = None if last is None else self._undecided(
            last.topic(), last.partition(), last.offset(), check_until)
        if undecided is not None:
            # The coordinator decided the commit, but the broker has not ended the transaction
            # (module doc): its records are not readable, and may never be.
            return TransactionResult(TransactionOutcome.UNKNOWN, _retry(count, undecided, True), undecided)
        return TransactionResult(TransactionOutcome.COMMITTED, results)

    def _undecided(self, topic: str, partition: int, offset: int, deadline: float) -> str | None:
        """None once the partition's last stable offset is past the transaction's record at ``offset``
        (its commit marker written: read_committed readers get the records); else, at ``deadline``,
        why not."""
        pending, why = self._stable.past({(topic, partition): offset}, deadline)
        if not pending:
            return None
        why = why or "its commit marker is not written there (the last stable offset is not past it)"
        return (f"the commit was answered, but the transaction is not ended on {topic}[{partition}] "
                f"(its records up to offset {offset} are not readable): {why}")

    def _abort(self, count: int, reports: dict[int, tuple[KafkaError | None, Any]],
               refused: dict[int, SendResult], cause: KafkaError | None) -> TransactionResult:
        """Abort; each record's result: its own refusal, or a retry (it went down with the transaction).

        The records still queued or in flight are purged first and their reports
        served: librdkafka aborts only once every record has its report.
        """
        producer = self._producer
        deadline = time.monotonic() + self._timeout
        # Aborted for want of the broker (no answer, no room in the queue by the deadline): an
        # outage for every record of it, none counts an attempt. So for a delivery librdkafka
        # implied (``_delivered``): its answer never came, as in at-least-once mode (``UNPROVEN``);
        # but the broker was not slow, so nothing of it counts as acknowledged (``_pace``).
        implied = cause is not None and cause.code() == KafkaError._INCONSISTENT
        unreachable = implied or (self._result_of(cause).unreachable if cause is not None else any(
            r.outcome is Outcome.RETRY and r.unreachable for r in refused.values()))
        answered = _answered(reports) if unreachable and not implied else 0  # before the purge's reports
        try:
            with suppress(KafkaException):
                producer.purge(in_queue=True, in_flight=True)
            while len(producer) and time.monotonic() < deadline:
                producer.poll(0.05)
            while True:
                try:
                    producer.abort_transaction(max(0.1, deadline - time.monotonic()))
                    self._open = False
                    break
                except KafkaException as exc:
                    if not exc.args[0].retriable() or time.monotonic() >= deadline:
                        raise
                    producer.poll(0.05)
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.fatal():
                return self._ended(error, count)
            # Not aborted in time: it can never commit either; a new producer of the id aborts it.
            return TransactionResult(TransactionOutcome.UNKNOWN, _retry(count, error.str(), True),
                                     error.str(), answered=answered)
        results: list[SendResult] = []
        reason = cause.str() if cause is not None else "aborted with its transaction"
        for i in range(count):
            result = refused.get(i)
            if result is None and i in reports and reports[i][0] is not None:
                result = self._result_of(reports[i][0])  # type: ignore[arg-type]
            if result is None or result.outcome is Outcome.DELIVERED:
                result = SendResult(Outcome.RETRY, error=reason, unreachable=unreachable)
            results.append(result)
        if not any(r.outcome is Outcome.FAILED for r in results) and any(
                error is not None and error.code() in PURGED for error, _ in list(reports.values())):
            # A request purged in flight may still reach the broker, late (a connection a quota holds
            # muted), after the abort: with this producer's epoch it was appended to the producer's
            # next transaction, and committed with it, though its rows were taken for not sent (7
            # rows twice on the wire, tests/test_relay_exactly_once_pace_attacks.py). A new producer
            # of the id (``UNKNOWN``: the caller makes one) bumps the epoch, and the broker refuses it.
            # Records purged in the queue, never sent, leave the producer suspect too: after such an
            # abort on a frozen broker, thawed meanwhile, the kept producer committed one transaction
            # and failed the next for "skipped sequence numbers (OUT_OF_ORDER_SEQUENCE_NUMBER,
            # requires epoch bump)", one run in about twenty of tests/test_relay_broker_outage.py's
            # frozen queue (a second outage logged for one freeze). A new producer starts clean.
            # (Not when a record was refused for good: ``ABORTED`` names it, and the caller sends the
            # rest again without it, on a new producer as well. Refused for good, whether at produce()
            # or by its delivery report: ended UNKNOWN, a refusal met on a slow broker, whose requests
            # are still in flight when it comes, was taken for an outage, and the batch was sent again
            # whole, forever (tests/test_relay_exactly_once_state_attacks.py). And a record refused at
            # produce() only for want of room or for the failed state, a retry, leaves the producer
            # kept by an ``ABORTED``: so it is ``UNKNOWN`` too.)
            return TransactionResult(TransactionOutcome.UNKNOWN, results,
                                     f"{reason}; records purged in flight", answered=answered)
        return TransactionResult(TransactionOutcome.ABORTED, results, reason, answered=answered)

    def end_left_open(self, topics: Sequence[str], also: tuple[str, int]) -> None:
        """Abort, with this producer's epoch, what an earlier producer of the id left open on every
        partition of ``topics`` and on partition ``also`` (``also``'s topic's other partitions
        left out: the progress topic, named in ``topics`` too, has one per shard).

        A transactional record of the same producer id joins the transaction open on its
        partition, and the abort marker then ends both there: an empty record (the id as key)
        goes to each partition, is delivered, and the transaction is aborted. Nothing of it is
        ever read committed. A topic that no longer exists is left out (deleted since the
        transaction wrote it, it holds nothing open). Raises ``RetriableTransportError`` if the broker
        does not take it within the producer's timeout, ``HeldByOpenTransactionError`` (one) if a
        partition is held by a transaction open there (``_held``).
        """
        self._end_open(sorted(set(topics) - {also[0]}), [also])

    def settle(self) -> None:
        """End what this id's transactions that did not commit may have left open (``Unsettled``),
        before this producer sends anything; ``RetriableTransportError`` if the broker does not take
        it in time, ``HeldByOpenTransactionError`` (one) if a partition does not read past it, held by
        a transaction open there (``_held``): kept either way, for the next producer of the id to try."""
        if not self._unsettled:
            return
        unsettled = self._unsettled
        topics, partitions = sorted(unsettled.topics), sorted(unsettled.partitions)
        self._end_open(topics, partitions)
        # What was ended, not what an older producer of the id still sending added meanwhile.
        unsettled.topics.difference_update(topics)
        unsettled.partitions.difference_update(partitions)

    def _end_open(self, topics: Sequence[str], partitions: Sequence[tuple[str, int]]) -> None:
        """Abort an empty record's transaction on every partition of ``topics`` and on ``partitions``,
        those of topics that still exist (``end_left_open``); unless each partition then reads past its
        empty record read_committed, ``HeldByOpenTransactionError`` if a transaction open there holds it
        (``_held``), else ``RetriableTransportError``.

        One that cannot be ended now (its leader gone) fails it: what the others' empty records
        joined is aborted all the same (``_abandon``), not held from their read_committed readers."""
        producer, key = self._producer, self.transactional_id.encode()
        deadline = time.monotonic() + self._timeout
        # A topic deleted since the transaction was written holds nothing open; asking the producer
        # for it would fail at every take-over ('Unknown topic') or make it anew (auto-creation).
        # A partition past its topic's count now went with the topic (deleted and made anew with
        # fewer): it holds nothing open, and a record to it is refused at every try ('Unknown
        # partition'), which kept the id's next producer from being made for good.
        named = sorted(set(topics) | {topic for topic, _ in partitions})
        existing = partition_counts(self._config, named, deadline)
        targets = [(topic, p) for topic, p in dict.fromkeys(partitions) if p < existing.get(topic, 0)]
        for topic in topics:  # every partition it has now (the transport's cached count may be stale)
            targets += [(topic, p) for p in range(existing.get(topic, 0)) if (topic, p) not in targets]
        failures: list[KafkaError] = []
        written: dict[tuple[str, int], int] = {}

        def report(error: KafkaError | None, message: Any) -> None:
            if error is not None:
                failures.append(error)
            elif message.offset() is not None:
                written[(message.topic(), message.partition())] = message.offset()

        begun = aborted = False
        try:
            producer.begin_transaction()
            begun = self._open = True
            for topic, partition in targets:
                producer.produce(topic, b"", key, partition, on_delivery=report)
            while len(producer) and time.monotonic() < deadline:
                producer.flush(min(FLUSH_STEP, max(0.0, deadline - time.monotonic())))
            if failures or len(producer):
                cause = failures[0].str() if failures else "no delivery report in time"
                raise RetriableTransportError(f"cannot end the transaction {self.transactional_id!r} "
                                              f"left open: {cause}")
            producer.abort_transaction(max(0.1, deadline - time.monotonic()))
            aborted, self._open = True, False
        except KafkaException as exc:
            self._fatal = self._fatal or exc.args[0].fatal()  # fenced by a newer producer of the id
            raise RetriableTransportError(f"cannot end the transaction {self.transactional_id!r} left "
                                          f"open: {exc.args[0].str()}") from None
        finally:
            if begun and not aborted:
                self._abandon()
        # The coordinator answers an abort once it decided it and writes the markers after, dropping a
        # partition's whose leader it cannot find: forgotten then, the partition's open records were
        # committed by the id's next commit there (as without ``settle``). So each must read past its
        # empty record. Another producer's transaction open there since before it holds that too (its
        # last stable offset is the oldest open transaction's, whoever's): after ``HELD_FOR`` s without
        # a move, given up (``_held``), not waited for until the timeout at every try.
        open_on, why = self._stable.past(written, max(deadline, time.monotonic() + DECIDED_AT_LEAST),
                                         held_for=HELD_FOR)
        if not open_on:
            return
        stable = {where: offset for where, offset in open_on.items() if offset is not None}
        if why is None and len(stable) == len(open_on):
            raise settle_held(self.transactional_id, {w: (stable[w], written[w]) for w in stable})
        where = ", ".join(f"{t}[{p}]" for t, p in open_on)
        raise RetriableTransportError(
            f"cannot end the transaction {self.transactional_id!r} left open: its abort was answered, but "
            f"{where} does not read past it yet: {why or 'its last stable offset is not past it'}")

    def _abandon(self) -> None:
        """Abort the transaction of a ``_end_open`` that failed: the partitions its empty records reached
        (joined to what was open there) held every read_committed reader until the next producer of
        the id fenced this one (a relay's next try) or the transaction timed out (a minute at least:
        a relay stopped meanwhile). Best effort, ``ABANDON_AT_MOST`` seconds."""
        producer = self._producer
        until = time.monotonic() + ABANDON_AT_MOST
        with suppress(KafkaException, SystemError):
            producer.purge(in_queue=True, in_flight=True)
            while len(producer) and time.monotonic() < until:
                producer.poll(0.05)
            producer.abort_transaction(max(0.1, until - time.monotonic()))
            self._open = False

    def _ended(self, error: KafkaError, count: int) -> TransactionResult:
        """The producer cannot go on: fenced by a newer one, or its transaction's fate unknown."""
        fenced = error.code() in FENCED_ERRORS
        self._fatal = self._fatal or fenced or error.fatal()
        outcome = TransactionOutcome.FENCED if fenced else TransactionOutcome.UNKNOWN
        return TransactionResult(outcome, _retry(count, error.str(), not fenced), error.str())

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called: nothing of it may be used since."""
        return self._closed

    def close(self) -> None:
        """End the producer: its librdkafka client (threads, a connection to every broker, buffers) is
        destroyed now, not once the last reference to this object goes (a relay drops one after every
        transaction that did not commit; one kept in a traceback, a log record or a reference cycle
        kept its client). Whatever is still queued or in flight is purged first: its transaction
        cannot commit any more. An open transaction is aborted by the next producer of the id (or
        times out). Nothing of it is used after; a second call does nothing.

        Destroyed only when no transaction of it may be open and it met no fatal error:
        confluent-kafka's ``Producer.close`` aborts an open transaction first, waiting up to the
        transaction's timeout (a minute or more) on a broker that does not answer. Such a client
        (a commit or abort not answered, a producer fenced), and every client of a confluent-kafka
        release without ``Producer.close``, is destroyed with this object's last reference."""
        if self._closed:
            return
        self._closed = True
        producer = self._producer
        with suppress(KafkaException, SystemError):
            producer.purge(in_queue=True, in_flight=True)
            producer.flush(0)  # the purged records' reports: nothing left to wait for
        close = getattr(producer, "close", None)
        if close is None or self._open or self._fatal:
            return
        with suppress(KafkaException, SystemError, RuntimeError):
            close()


def _answered(reports: Mapping[int, tuple[KafkaError | None, Any]]) -> int:
    """How many of a transaction's records the broker acknowledged (``TransactionResult.answered``)."""
    return sum(1 for error, message in list(reports.values()) if error is None and message is not None)


def _retry(count: int, error: str, unreachable: bool = False) -> list[SendResult]:
    return [SendResult(Outcome.RETRY, error=error, unreachable=unreachable)] * count
