"""``KafkaSource``: the inbox's ``Source`` on a confluent-kafka consumer.

Offsets are never committed behind the inbox's back: auto-commit and the
automatic offset store are off, and ``commit`` commits exactly the positions
it is given, synchronously, waiting for an answer at most a session timeout
(``_commit``: librdkafka alone may wait for as long as the coordinator is gone).
The rebalance callbacks are wired to
``on_revoke``, so the inbox can finish in-flight work and commit before the
partitions go. librdkafka errors are translated here and nowhere else.

A consumer can lose its group and not get it back by itself: a JoinGroup
request in flight when the broker froze (a long GC pause, a partition) is
never answered, and librdkafka gives up on it only after
``max.poll.interval.ms`` + 3 s (five minutes by default), consuming nothing
meanwhile. So the source watches the group state in librdkafka's statistics:
when the consumer has been out of the ``steady`` join state for
``rejoin_after`` seconds and the broker answers a metadata request (the
consumer's own, else one of a client made afresh from ``bootstrap.servers``:
``_bootstrap_answers``), it logs one line and replaces the consumer with a new
one on the same settings, which joins afresh. Nothing is lost or doubled: it held no partition (or
gives them up through ``on_revoke`` first), offsets are committed only for
finished records, and the next assignment starts at the committed offsets.

A consumer can also sit in a steady group and never fetch one of its partitions (librdkafka
leaves a partition unstarted when fetching its committed offset failed): the watch also replaces
a consumer one of whose partitions is *starved* (``_starvation``), the same way.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from transports._errors import (
    CommitUnconfirmedError,
    ConfigurationError,
    RetriableTransportError,
    TransportError,
    validate_topic,
)
from transports._protocol import Record, RevokeCallback, SourceFeatures

from .._logsafe import safe_logger
from .._weak import weakly
from ._commit import BoundedCommits, translated
from ._logging import ClientErrors, LibrdkafkaLog
from ._settings import check_with_librdkafka, librdkafka_config, redacted
from ._starvation import StarvationWatch

log = safe_logger("transports.kafka")

DEFAULT_SESSION_TIMEOUT_MS = 45_000
"""librdkafka's ``session.timeout.ms`` when the settings leave it out."""
REJOIN_AFTER = 60.0
"""Seconds out of the group (join not steady) before a consumer whose broker answers is replaced."""
STATISTICS_INTERVAL_MS = 2000
"""How often librdkafka reports the group state the rejoin watch reads (unless the settings say)."""
_PROBE_EVERY = 5.0
"""Seconds between metadata requests asking whether the broker answers again."""

# Owned by the inbox: a user value would break "commit only what is finished".
_FORCED = {"enable.auto.commit": False, "enable.auto.offset.store": False}


class KafkaSource:
    """Delivers records of ``topics`` for consumer group ``group_id``.

    Takes kafka-python-ng style settings (``session_timeout_ms``,
    ``security_protocol``, ``sasl_plain_password`` …) or raw librdkafka keys;
    a bad one raises ``ConfigurationError`` here. ``auto_offset_reset``
    defaults to ``"earliest"``: a new group starts with the oldest record
    rather than silently skipping what was published before it joined.
    ``isolation_level`` is ``read_committed`` unless set otherwise (librdkafka's
    default, made explicit): records of open or aborted Kafka transactions are
    never read; another level is logged as a warning at start.
    Not thread-safe: poll, commit and close from one thread (the inbox does).
    """

    features = SourceFeatures()
    """Both: Kafka offsets and committed positions that outlive the consumer."""

    def __init__(
        self,
        *,
        bootstrap_servers: str | Sequence[str],
        group_id: str,
        topics: Sequence[str],
        settings: Mapping[str, Any] | None = None,
        rejoin_after: float = REJOIN_AFTER,
        **kwargs: Any,
    ) -> None:
        if not isinstance(group_id, str) or not group_id:
            raise ConfigurationError(f"group_id must be a non-empty str, got {group_id!r}")
        if isinstance(topics, str) or not topics:
            raise ConfigurationError(f"topics must be a non-empty list of topic names, got {topics!r}")
        self.topics = [validate_topic(t) for t in topics]
        config = librdkafka_config(settings, bootstrap_servers=bootstrap_servers,
                                   group_id=group_id, **kwargs)
        for key, forced in _FORCED.items():
            if key in config and str(config[key]).lower() not in (str(forced).lower(), "0"):
                raise ConfigurationError(f"{key} must stay off: the inbox commits offsets itself, "
                                         "after its database transaction")
        if isinstance(rejoin_after, bool) or not isinstance(rejoin_after, int | float) or rejoin_after <= 0:
            raise ConfigurationError(f"rejoin_after must be positive seconds, got {rejoin_after!r}")
        config = {"auto.offset.reset": "earliest", "statistics.interval.ms": STATISTICS_INTERVAL_MS,
                  "isolation.level": "read_committed", **config, **_FORCED}
        if str(config["isolation.level"]).lower() != "read_committed":
            # Said once, at start: an exactly-once relay's aborted records are read as if sent.
            log.warning("consumer of group %s reads with isolation.level=%s: records of aborted Kafka "
                        "transactions (an exactly-once relay's retried batches) reach the inbox, "
                        "which drops them as duplicates only if their copy was committed too",
                        group_id, config["isolation.level"])
        check_with_librdkafka(config, "consumer")
        self.config = config
        self.rejoin_after = float(rejoin_after)
        self.rejoins = 0
        self._revoke_callbacks: list[RevokeCallback] = []
        self._assignment: frozenset[tuple[str, int]] = frozenset()
        self._errors = ClientErrors("consumer")
        self._log = LibrdkafkaLog()
        self._join_state = "init"
        # The clock starts at the first poll (the join starts there), not at construction;
        # without statistics (statistics.interval.ms=0) there is nothing to watch.
        self._watching = int(config["statistics.interval.ms"]) > 0
        self._unjoined_since: float | None = None
        self._last_report: float | None = None  # when librdkafka last reported the group state
        # Since when the statistics say the group's coordinator is out of reach (``unavailable``).
        self._coordinator_lost_since: float | None = None
        self._coordinator_state = "unknown"
        # What the newest report says of the group (``answering``): its coordinator up and this consumer
        # in it (join state ``steady``), and when librdkafka made that report, on ``time.monotonic``'s clock.
        self._in_group = False
        self._report_made: float | None = None  # ``StarvationWatch.emitted``
        self._report_interval = int(config["statistics.interval.ms"]) / 1000
        # When a commit last failed for want of a broker (``time.monotonic``): no report made before it
        # tells that the broker serves this consumer again (``answering``).
        self._commit_failed_at: float | None = None
        self.session_timeout = int(config.get("session.timeout.ms", DEFAULT_SESSION_TIMEOUT_MS)) / 1000
        # A commit waits as long as librdkafka waits for an unknown coordinator: a session timeout.
        self._commits = BoundedCommits(self.session_timeout)
        # KIP-848's protocol: librdkafka serves no synchronous commit while a revoke callback runs
        # (it answers once the callback returned, which waits for the commit): see ``commit``.
        self._broker_assigns = str(config.get("group.protocol", "classic")).lower() == "consumer"
        self._revoking = False
        # The positions of commits sent without waiting (above), until librdkafka reports them.
        self._unconfirmed: dict[tuple[str, int], int] = {}
        self._polled = False
        self._next_probe = 0.0
        # Whether the watch said it found the consumer out of its group and the broker silent (once).
        self._told_silent = False
        # The partitions revoked during a poll's second call (``poll``); None outside it.
        self._revoked_meanwhile: set[tuple[str, int]] | None = None
        self._losses = 0  # ``lost_assignments``
        self._starvation = StarvationWatch(str(config.get("group.id")), self.rejoin_after,
                                           int(config["statistics.interval.ms"]) / 1000,
                                           str(config.get("auto.offset.reset", "")))
        self._consumer = self._subscribed()

    def _subscribed(self) -> Consumer:
        generation = self.rejoins

        statistics = weakly(self._statistics_of)
        # Every callback holds the source weakly (``_weak``): a source dropped unclosed is freed at once.
        consumer = Consumer({**self.config, "logger": self._log, "error_cb": self._errors,
                             "stats_cb": lambda text: statistics(generation, text),
                             "on_commit": weakly(self._reported)})
        consumer.subscribe(self.topics, on_assign=weakly(self._assigned), on_revoke=weakly(self._revoked),
                           on_lost=weakly(self._lost))
        return consumer

    def _statistics_of(self, generation: int, text: str) -> None:
        if generation == self.rejoins:  # not a replaced consumer's, on its way out
            self._statistics(text)

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        """Up to ``max_records`` records, waiting up to ``timeout`` seconds for the first (and, while
        an offset commit given up on is still pending, up to a commit timeout for it first: below).

        librdkafka's ``consume(n, timeout)`` waits until it has ``n`` messages or
        the timeout passed: at 500 records a second, a poll of up to 500 held
        the first one 100 ms, most of a consumer's send-to-commit latency. So
        one call waits for the first message, and a second takes what is
        queued behind it without waiting (what Kafka's own consumer does).
        Rebalance callbacks run inside this call. A record of the first call
        whose partition the second call's rebalance revoked is dropped: within
        one call librdkafka drops such records itself, but the first call's are
        handed over already, and the revoke callback has committed and
        forgotten the partition they would come back to.

        While an offset commit given up on is still pending, the consumer is not
        called (``_commit``: it would wait inside the C call for the commit, for as long
        as the commit waits): the poll waits up to a commit timeout for it to end
        (a commit held by a rebalance ends so, and this poll then serves the revoke),
        else returns nothing.
        """
        if not self._commits.wait_pending(self._commits.timeout):
            return []
        self._watch_group()
        messages = self._consumer.consume(1, timeout)
        if messages and max_records > 1:
            self._revoked_meanwhile = set()
            try:
                behind = self._consumer.consume(max_records - 1, 0)
            finally:
                gone, self._revoked_meanwhile = self._revoked_meanwhile, None
            if gone:
                messages = [m for m in messages if (m.topic(), m.partition()) not in gone]
            messages.extend(behind)
        records = []
        for msg in messages:
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    continue
                if error.fatal():
                    raise TransportError(f"Kafka consumer failed: {error.str()}")
                self._errors(error)  # once per change, not once per poll; librdkafka retries
                continue
            timestamp_type, timestamp = msg.timestamp()
            # A consumed message always has a topic; value and header values are bytes
            # (None only for tombstones and null headers, which the inbox rejects itself).
            records.append(Record(
                topic=cast(str, msg.topic()), value=cast(bytes, msg.value()), key=msg.key(),
                headers=cast("list[tuple[str, bytes]]", list(msg.headers() or ())), partition=msg.partition(),
                offset=msg.offset(), timestamp_ms=timestamp if timestamp_type else None,
            ))
        return records

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Commit "everything before these offsets is done", synchronously.

        Raises ``CommitRefusedError`` when the group refused it (a rebalance
        moved on): nothing was committed, and the caller must not record it.
        Raises ``RetriableTransportError`` when no coordinator could store it now
        (the broker or coordinator down or moving, its offsets not replicated), or
        none answered within ``commit_timeout`` seconds (a session timeout; the commit
        may still land later: ``_commit``): an outage, to try again as it is.
        Raises ``CommitUnconfirmedError`` when the commit was sent but cannot be
        waited for (inside a revoke callback under KIP-848): its answer comes
        later, and only a refusal is logged (``_reported``).
        Anything else is ``TransportError``.
        """
        if not offsets:
            return
        positions = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        if self._revoking and self._broker_assigns:
            # Under KIP-848 librdkafka holds a synchronous commit made inside a revoke callback
            # until the callback returns: the consumer stalled the commit timeout (45 s) at each
            # revocation with work to commit, and a stop in one never finished. Sent without
            # waiting, it goes out once the callback returned; if the group refuses it, the next
            # owner receives those records again and the inbox drops them as duplicates.
            try:
                self._consumer.commit(offsets=positions, asynchronous=True)
            except KafkaException as exc:
                raise translated(exc.args[0]) from None
            self._unconfirmed.update(offsets)
            raise CommitUnconfirmedError("offset commit sent; librdkafka answers it after the revoke "
                                         "callback")
        try:
            self._commits.commit(self._consumer, positions)
        except RetriableTransportError:
            self._commit_failed_at = time.monotonic()
            raise

    @property
    def commit_timeout(self) -> float:
        """Seconds ``commit`` waits for an answer: the session timeout unless set."""
        return self._commits.timeout

    @commit_timeout.setter
    def commit_timeout(self, seconds: float) -> None:
        self._commits.timeout = seconds

    def on_revoke(self, callback: RevokeCallback) -> None:
        self._revoke_callbacks.append(callback)

    def close(self) -> None:
        """Leave the group (partitions go to the others at once) and close (after a pending commit)."""
        self._commits.wait()
        self._consumer.close()

    def assigned(self) -> frozenset[tuple[str, int]]:
        """The (topic, partition) pairs this consumer holds now; safe to read from any thread."""
        return self._assignment  # replaced, never changed in place

    def group_problem(self) -> str | None:
        """Why the consumer is not in its group, once it has been out longer than a rebalance; else None.

        Safe to call from any thread (the health server's ``/readyz``).
        """
        since = self._out_since()
        if since is None:
            return None
        out = time.monotonic() - since
        if out < min(self.rejoin_after, 10.0):
            return None  # a rebalance in progress
        return (f"not joined to the consumer group for {out:.0f}s (join state {self._join_state}); "
                f"rejoined {self.rejoins} time(s), a new consumer after {self.rejoin_after:g}s "
                "once the broker answers")

    def unavailable(self) -> str | None:
        """Why the broker cannot serve this consumer now, or None: its group's coordinator has been
        out of reach for longer than a session timeout. Safe to call from any thread.

        ``Inbox.run`` logs it once as a broker outage, and once when it ends. It shows what
        an offset commit would meet (a commit waits that long for a coordinator, then fails
        with ``_WAIT_COORD``) when there is nothing to commit: a consumer whose coordinator's
        node died, or that no node can replace (no quorum), says so even while idle. A
        coordinator that moves within the session timeout is a failover, not an outage.
        """
        since = self._coordinator_lost_since
        if since is None:
            return None
        out = time.monotonic() - since
        if out < self.session_timeout:
            return None
        return f"group coordinator out of reach for {out:.0f}s, state {self._coordinator_state}"

    def answering(self) -> bool:
        """True when librdkafka's newest statistics, made within the last two statistics intervals,
        say the group's coordinator is up and this consumer is in its group (join state ``steady``);
        or when statistics are off (nothing to tell). Safe to call from any thread.

        What ends an outage ``Inbox.run`` logged when no commit can: ``unavailable`` saying None
        is no answer, since it gives a lost coordinator a session timeout of grace first. Nor is
        a coordinator that is merely "up": that is librdkafka's connection to its node, which a
        restarted node accepts while the group waits to be joined again, and a frozen one keeps
        open; only a join the coordinator completed shows it serves the group. Nor is an old
        report: a report waits in the consumer's queue until a poll serves it, which no poll does
        while an offset commit holds the consumer (the failover campaign's inboxes were served
        reports 10 to 57 s old, the first ones made before the nodes were killed). Nor, whatever its
        age, a report made before a commit last failed for want of a broker: a user's long
        ``statistics.interval.ms`` makes two intervals longer than the commit's wait.
        """
        if not self._watching:
            return True
        made, failed = self._report_made, self._commit_failed_at
        return (self._in_group and made is not None
                and time.monotonic() - made <= 2 * self._report_interval
                and (failed is None or made > failed))

    def lost_assignments(self) -> int:
        """How many times the consumer lost its partitions rather than giving them up to a rebalance.

        A loss (librdkafka's ``on_lost``) is served like a revocation, through the
        ``on_revoke`` callbacks, but no coordinator asked for it: its session ran
        out without an answer (a coordinator gone or frozen), or it did not poll in
        time. ``Inbox.run`` tells an unanswered commit by it (``CommitUnansweredError``).
        """
        return self._losses

    # -- the rejoin watch (module doc) ------------------------------------------

    def _statistics(self, text: str) -> None:
        """librdkafka's statistics (served inside ``consume``): the coordinator's and the group's state."""
        try:
            report = json.loads(text)
            group = report.get("cgrp") or {}
        except (ValueError, AttributeError):
            return
        coordinator = str(group.get("state", "unknown"))
        self._report_made = self._starvation.emitted(report, time.monotonic())
        self._coordinator_state = coordinator
        if coordinator == "up":
            self._coordinator_lost_since = None
        elif self._coordinator_lost_since is None:
            self._coordinator_lost_since = time.monotonic()
        state = str(group.get("join_state", "")) if coordinator == "up" else f"coordinator {coordinator}"
        self._join_state = state
        # Under KIP-848's protocol librdkafka 2.16 reports a member the broker gave no partition (more
        # consumers than partitions) as "init" for as long as it has none, where the classic protocol
        # says "steady": taken for out of the group, it never ended an outage and the rejoin watch
        # replaced it every ``rejoin_after``. A member not joined yet says "init" too: the watch
        # cannot tell the two apart there, and leaves both alone.
        in_group = state == "steady" or (self._broker_assigns and state == "init")
        self._in_group = in_group
        if not self._watching:
            return
        now = self._last_report = time.monotonic()
        if in_group:
            self._unjoined_since = None
            self._told_silent = False
            self._starvation.track(report, now, self._assignment)
        else:
            self._starvation.forget()
            if self._unjoined_since is None:
                self._unjoined_since = now

    def _out_since(self) -> float | None:
        """Since when the consumer is out of its group, once a report said so; else None.

        The clock starts at the first poll, but only a statistics report naming a
        state other than ``steady`` is evidence: with ``statistics.interval.ms``
        longer than ``rejoin_after``, no report yet is only silence, and acting on
        it would replace every consumer (and each successor) before it joined.
        """
        since, reported = self._unjoined_since, self._last_report
        return since if since is not None and reported is not None and reported >= since else None

    def _watch_group(self) -> None:
        now = time.monotonic()
        if not self._polled:
            self._polled = True
            if self._watching and self._unjoined_since is None:
                self._unjoined_since = now
        since = self._out_since()
        if since is None:
            self._watch_partitions(now)
            return
        if now - since < self.rejoin_after or now < self._next_probe:
            return
        self._next_probe = now + _PROBE_EVERY
        try:
            self._consumer.list_topics(timeout=2.0)
        except KafkaException as exc:
            if not self._bootstrap_answers():
                # The broker does not answer yet: a new consumer would wait the same way. Said once,
                # so that a consumer stuck out of its group tells which of the two keeps it there: no
                # answer to this probe (this line, then nothing), or a watch that never got this far.
                if not self._told_silent:
                    self._told_silent = True
                    log.info("consumer of group %s not joined for %.0fs (join state %s) and the broker does "
                             "not answer a metadata request (%s): no new consumer until it does, asked every "
                             "%gs", self.config.get("group.id"), now - since, self._join_state,
                             exc.args[0].str() if exc.args and isinstance(exc.args[0], KafkaError) else exc,
                             _PROBE_EVERY)
                return
        self._rejoin(now - since)

    def _bootstrap_answers(self) -> bool:
        """Whether ``bootstrap.servers`` answer a metadata request of a client made for the question.

        The consumer's own client can be past asking while the broker answers: librdkafka drops
        every broker a metadata response leaves out, and a response from a broker that its
        controller has just fenced (a single node thawed after a freeze longer than its 9 s
        session, fenced for a few hundred ms) lists none. Its bootstrap entry dropped at start,
        the client is left with no broker at all: no coordinator query, no metadata request,
        until it bootstraps again after ``metadata.recovery.rebootstrap.trigger.ms`` (5 minutes).
        Seen in ``test_inbox_rejoin.py``'s join round (docs/testing.md): stuck in ``query-coord``
        with every probe of its own unanswered. A new consumer starts from ``bootstrap.servers``,
        so this one asks them before the watch calls the broker silent.
        """
        probe = Consumer({**self.config, "statistics.interval.ms": 0, "logger": self._log,
                          "error_cb": lambda error: None})  # an outage is the watch's to tell, once
        try:
            probe.list_topics(timeout=2.0)
            return True
        except KafkaException:
            return False
        finally:
            probe.close()

    def _watch_partitions(self, now: float) -> None:
        """Replace the consumer when one of its partitions is starved (``_starvation``)."""
        why = self._starvation.starved(self._consumer, now)
        if why is not None:
            log.warning("consumer of group %s %s although records wait and the broker answers: replacing "
                        "it with a new consumer that joins afresh; uncommitted records come again and are "
                        "dropped as duplicates", self.config.get("group.id"), why)
            self._replace()

    def _rejoin(self, out: float) -> None:
        log.warning("consumer of group %s not joined for %.0fs (join state %s) although the broker "
                    "answers: replacing it with a new consumer that joins afresh; uncommitted records "
                    "come again and are dropped as duplicates", self.config.get("group.id"), out,
                    self._join_state)
        self._replace()

    def _replace(self) -> None:
        self._starvation.forget()
        if self._assignment:  # give them up properly first: finished work is committed
            self._revoked(self._consumer, [TopicPartition(t, p) for t, p in sorted(self._assignment)])
        self.rejoins += 1
        self._told_silent = False
        old, self._consumer = self._consumer, self._subscribed()
        self._join_state = "init"
        self._in_group = False  # the new consumer is in no group until a report says so
        self._unjoined_since, self._last_report = time.monotonic(), None
        # Its close may wait for the request that never came back: never on this thread.
        threading.Thread(target=_close_quietly, args=(old, self._commits), name="outbox-consumer-retired",
                         daemon=True).start()
        self._commits = BoundedCommits(self._commits.timeout)  # the new consumer's

    def _reported(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """librdkafka's answer to a commit (served inside a poll): log a refused unawaited one.

        Synchronous commits raise their own errors (``commit``); this speaks only for
        the positions a commit sent without waiting, which would otherwise fail in silence.
        """
        mine = [tp for tp in partitions if self._unconfirmed.get((tp.topic, tp.partition)) == tp.offset]
        for tp in mine:
            del self._unconfirmed[(tp.topic, tp.partition)]
        failed = [tp for tp in mine if error is not None or tp.error is not None]
        if failed:
            reason = error if error is not None else failed[0].error
            log.warning("offset commit at revocation not stored (%s) for %s: the next owner receives "
                        "those records again and drops them as duplicates",
                        reason.str() if reason is not None else "unknown",
                        sorted((tp.topic, tp.partition) for tp in failed))

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if consumer is not self._consumer:
            return  # a replaced consumer, closing
        added = {(tp.topic, tp.partition) for tp in partitions}
        self._assignment = self._assignment | added
        self._errors.cleared()
        log.info("assigned %s", sorted(added))

    def _lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if consumer is self._consumer:
            self._losses += 1
        self._revoked(consumer, partitions)

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if consumer is not self._consumer:
            return  # a replaced consumer, closing: what it held was given up before
        gone = [(tp.topic, tp.partition) for tp in partitions]
        self._assignment = self._assignment - set(gone)
        if self._revoked_meanwhile is not None:
            self._revoked_meanwhile.update(gone)
        self._revoking = True
        try:
            for callback in self._revoke_callbacks:
                try:
                    callback(gone)
                except Exception:  # librdkafka would swallow it; say so instead
                    log.exception("revoke callback failed for %s", gone)
        finally:
            self._revoking = False

    def __repr__(self) -> str:
        return f"KafkaSource({redacted(self.config)!r})"


def _close_quietly(consumer: Consumer, commits: BoundedCommits) -> None:
    try:
        commits.wait()
        consumer.close()
    except (KafkaException, RuntimeError) as exc:
        log.info("the replaced consumer closed with %s", exc)
