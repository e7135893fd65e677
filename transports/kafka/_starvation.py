"""The starvation watch of ``KafkaSource``: a steady consumer that never fetches one of its partitions.

A consumer can also sit in a steady group and never fetch one of its partitions: librdkafka
starts a partition's fetcher only once its committed offset was fetched, and a failed
OffsetFetch (a per-partition error, or a request-level one after retries: seen with a single
KRaft broker fenced by its own controller under load) leaves it assigned and never started
until the next rebalance, while the group looks steady. So ``KafkaSource``'s watch also looks for a
*starved* partition (``StarvationWatch``) and replaces the consumer the same way. A
partition is starved when, for ``rejoin_after`` seconds of statistics while the group was
steady, all of these held:

- nothing is queued for the application (``fetchq_cnt`` 0: librdkafka counts the consumer's
  whole queue there, so a busy application that has not polled its records yet, or is simply
  behind, is never starved: its records are queued, or its position moves);
- its leader is known (``leader`` not -1: a partition without one is an outage, not starvation);
- its fetch state and fetch position (``fetch_state``, ``next_offset``) did not change: a
  partition being fetched moves, and a partition never started stays as it is;
- and records wait beyond its position: the broker, asked then (a ListOffsets request for the
  latest offset, which librdkafka sends with the consumer's ``isolation.level``: the last stable
  offset under ``read_committed``, so an open transaction is not records waiting), names an end
  beyond the position, and a statistics report emitted at least ``PROBE_EVERY`` seconds (and a
  statistics interval) after that answer still shows the position unmoved with nothing queued.
  The position is the fetch position (``next_offset``, which steps over transaction markers and
  aborted records, unlike ``app_offset``), else the committed offset, else (never committed) the
  first offset under ``auto.offset.reset=earliest``; a partition at its end is idle, not starved,
  and with no position and another reset policy nothing waits for it. (A partition never started
  because its committed offset never arrived is so measured from its first offset: if the group
  had committed its end, that costs one rebalance, after which it is started and idle.)

The end is asked of the broker rather than read from the statistics (``hi_offset``,
``ls_offset``): those come with fetch responses, so a partition never fetched has none and one
no longer fetched has a stale one. The answer after it is what tells a starved partition from an
idle one that just received records: a live fetcher takes them within a fetch wait. The request
is also the outage probe: a broker or leader that does not answer it (or answers with an error
for the partition) is an outage, said once, and no consumer is replaced for it. An idle partition
is asked again only after another ``rejoin_after``, so an idle consumer sends one batched
request per ``rejoin_after`` at most. Report times come from the statistics' own ``ts``
(librdkafka's monotonic clock), mapped onto ``time.monotonic`` by the smallest delay seen
between emission and delivery: reports queued while the application did not poll are dated
when they were taken, not when they arrived.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from .._logsafe import safe_logger

log = safe_logger("transports.kafka")

PROBE_EVERY = 5.0
"""Seconds between two asks of the broker, and how long after its answer a report must still show the
partition unmoved."""
_LATEST, _EARLIEST = -1, -2
"""ListOffsets timestamps asking for a partition's end (last stable offset under read_committed)
and its first offset."""


class StarvationWatch:
    """The assigned partitions unmoved with nothing queued, since when, and those whose end the broker
    named beyond their position (module doc). Owned by one ``KafkaSource``, fed its statistics."""

    def __init__(self, group: str, rejoin_after: float, interval: float, auto_offset_reset: str) -> None:
        self._group = group
        self.rejoin_after = rejoin_after
        self._interval = interval  # seconds between statistics reports
        self._from_earliest = auto_offset_reset.lower() in ("earliest", "smallest", "beginning")
        self.still: dict[tuple[str, int], _Still] = {}
        self._clock: float | None = None  # time.monotonic() minus librdkafka's ts, at its smallest
        self.next_probe = 0.0
        self._told_silent = False

    def forget(self) -> None:
        """Out of the group, or a new consumer: nothing is known to be unmoved."""
        self.still.clear()

    def emitted(self, report: Mapping[str, Any], received: float) -> float:
        """When librdkafka took ``report``, on ``time.monotonic``'s clock (module doc); also what
        ``KafkaSource.answering`` tells an old report by."""
        ts = report.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, int):
            return received
        taken = ts / 1e6
        delay = received - taken
        if self._clock is None or delay < self._clock:
            self._clock = delay
        return taken + self._clock

    def track(self, report: Mapping[str, Any], received: float, assignment: Set[tuple[str, int]]) -> None:
        """Note, per partition of ``assignment``, since when it is unmoved with nothing queued, from a
        statistics ``report`` of a steady group delivered at ``received`` (module doc)."""
        emitted = self.emitted(report, received)
        seen: dict[tuple[str, int], Mapping[str, Any]] = {}
        topics = report.get("topics")
        for name, topic in (topics.items() if isinstance(topics, Mapping) else ()):
            partitions = topic.get("partitions") if isinstance(topic, Mapping) else None
            for number, part in (partitions.items() if isinstance(partitions, Mapping) else ()):
                try:
                    tp = (str(name), int(number))
                except ValueError:
                    continue
                if tp in assignment and isinstance(part, Mapping):  # never the -1 "unassigned" one
                    seen[tp] = part
        for tp in [tp for tp in self.still if tp not in seen]:
            del self.still[tp]
        for tp, part in seen.items():
            queued, leader = part.get("fetchq_cnt"), part.get("leader")
            if not isinstance(queued, int) or queued != 0 or not isinstance(leader, int) or leader < 0:
                self.still.pop(tp, None)  # records queued for the application, or no leader: an outage
                continue
            where = (str(part.get("fetch_state")), _offset(part.get("next_offset")))
            still = self.still.get(tp)
            if still is None or still.where != where:
                self.still[tp] = _Still(where, emitted, part)
            else:
                still.last, still.part = emitted, part

    def starved(self, consumer: Consumer, now: float) -> str | None:
        """What a starved partition shows, once one is (module doc), else None; asks ``consumer``'s
        broker for the ends of partitions unmoved for ``rejoin_after``."""
        if now < self.next_probe:
            return None
        for tp, still in self.still.items():
            if still.asked is not None and still.last >= still.asked + max(PROBE_EVERY, self._interval):
                return (f"has not fetched {_names([tp])} for {now - still.since:.0f}s (fetch_state "
                        f"{still.where[0]}, position {still.asked_position}, end {still.end})")
        due = {tp: still for tp, still in self.still.items()
               if still.asked is None and still.last - still.since >= self.rejoin_after}
        if not due:
            return None
        self.next_probe = now + PROBE_EVERY
        ends = self._ask(consumer, due, _LATEST)
        if ends is None:
            return None
        unknown = {tp: still for tp, still in due.items() if tp in ends and still.position() is None}
        firsts = self._ask(consumer, unknown, _EARLIEST) if unknown and self._from_earliest else {}
        if firsts is None:
            for still in due.values():
                still.since = now
            return None
        for tp, still in due.items():
            position = still.position()
            if position is None:
                position = firsts.get(tp)
            end = ends.get(tp)
            if position is not None and end is not None and end > position:
                still.asked, still.asked_position, still.end = now, position, end
            else:  # idle, nothing it would read, or no answer for it (an outage): asked again later
                still.since = now
        return None

    def _ask(self, consumer: Consumer, partitions: Mapping[tuple[str, int], _Still],
             timestamp: int) -> dict[tuple[str, int], int] | None:
        """The broker's offsets of ``partitions`` at ``timestamp`` (``_LATEST``, ``_EARLIEST``), those it
        answered for; None (said once) when it does not answer at all or for none of them."""
        asked = [TopicPartition(t, p, timestamp) for t, p in sorted(partitions)]
        try:
            answers = consumer.offsets_for_times(asked, timeout=2.0)
            error: object = None
        except KafkaException as exc:
            answers = []
            error = exc.args[0].str() if exc.args and isinstance(exc.args[0], KafkaError) else exc
        offsets = {(tp.topic, tp.partition): tp.offset for tp in answers
                   if tp.error is None and tp.offset >= 0}
        if not offsets:
            if error is None:
                errors = [tp.error for tp in answers if tp.error is not None]
                error = errors[0].str() if errors else "no offset"
            if not self._told_silent:
                self._told_silent = True
                log.info("consumer of group %s: %s unmoved for %gs with nothing queued, and the broker does "
                         "not answer for their offsets (%s): an outage, no new consumer; asked every %gs",
                         self._group, _names(partitions), self.rejoin_after, error,
                         self.rejoin_after)
            for still in partitions.values():  # asked again after another rejoin_after
                still.since = still.last
            return None
        self._told_silent = False
        return offsets


class _Still:
    """An assigned partition unmoved with nothing queued: since when (``time.monotonic``), its
    latest report, and once the broker named records beyond its position, when it was asked."""

    __slots__ = ("asked", "asked_position", "end", "last", "part", "since", "where")

    def __init__(self, where: tuple[str, int | None], since: float, part: Mapping[str, Any]) -> None:
        self.where = where  # (fetch_state, next_offset)
        self.since = self.last = since
        self.part = part
        self.asked: float | None = None
        self.asked_position: int | None = None
        self.end: int | None = None

    def position(self) -> int | None:
        """Where the consumer reads next: the fetch position, else the committed offset, else unknown."""
        return self.where[1] if self.where[1] is not None else _offset(self.part.get("committed_offset"))


def _offset(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _names(partitions: Sequence[tuple[str, int]] | Mapping[tuple[str, int], object]) -> str:
    return ", ".join(f"{t}[{p}]" for t, p in sorted(partitions))
