"""A consumer's synchronous offset commit with a bound on its wait, its errors translated.

librdkafka's synchronous commit has no timeout of its own. With the group
coordinator unknown it waits up to a session timeout and fails with
``_WAIT_COORD``; with a coordinator it knows but cannot reach (its node dead,
and no quorum to elect another leader of its ``__consumer_offsets`` partition)
it retries the request for as long as that lasts (librdkafka issue #3740): the
failover campaign on three Apache Kafka nodes saw an inbox's consumer loop sit
in one commit for minutes, polling nothing and saying nothing. So the commit
runs on a helper thread and the caller waits at most ``timeout`` seconds; a
commit still waiting then is ``CommitUnansweredError`` (an outage, unless what it
waited for was a rebalance behind the caller's next poll: see the error) and stays
pending on its thread, and the next commit is refused at once until it ends
(one commit in flight at a time, so a late answer never lands behind a newer
commit). A commit that lands after it was given up on committed positions of
finished work; the inbox commits them (or later ones) again.

While it is pending nothing else may call the consumer: confluent-kafka lets one
thread at a time into a consumer (its reentrancy gate, ``Handle_serialize_enter``):
a ``consume`` waits, inside the C call, for the commit to leave, and a commit that
never ends held the inbox's poll forever, polling nothing and saying nothing (the
failover campaign's inboxes never said the broker was gone). So the source asks
``wait_pending`` before it polls (``KafkaSource.poll``) and does not poll while one is.
"""

from __future__ import annotations

import threading
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from transports._errors import (
    CommitRefusedError,
    CommitUnansweredError,
    RetriableTransportError,
    TransportError,
)

# A commit refused because the group moved on: nothing committed; the next owner replays.
STALE_COMMIT = frozenset({
    KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION,
    KafkaError.UNKNOWN_MEMBER_ID, KafkaError._NO_OFFSET, KafkaError._STATE,
})
# A commit that did not reach a coordinator able to store it *now*: the broker or the group
# coordinator is down, moving, or cannot replicate the offsets (``min.insync.replicas`` not met).
# Retried unchanged, it succeeds once the cluster is back (Kafka's Java consumer retries these
# too). librdkafka raises a synchronous commit's error as a bare code, whose ``retriable()`` is
# always False, so the codes decide: without them a coordinator lost for longer than the session
# timeout (_WAIT_COORD) ended the inbox.
UNAVAILABLE_COMMIT = frozenset({
    KafkaError._WAIT_COORD, KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._TIMED_OUT_QUEUE,
    KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE, KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION, KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND, KafkaError.UNKNOWN_TOPIC_OR_PART,
})


class BoundedCommits:
    """Synchronous commits of one source, each waited for at most ``timeout`` s (module doc).

    Called from the source's polling thread; ``wait`` (before a close) from any.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._pending: threading.Thread | None = None

    def commit(self, consumer: Any, positions: list[TopicPartition]) -> None:
        """Commit ``positions`` through ``consumer``; raise as ``KafkaSource.commit`` documents."""
        pending = self._pending
        if pending is not None and pending.is_alive():
            raise CommitUnansweredError("offset commit failed: an earlier commit still waits for the "
                                        "group coordinator")
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                consumer.commit(offsets=positions, asynchronous=False)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run, name="outbox-offset-commit", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            self._pending = thread
            raise CommitUnansweredError(f"offset commit failed: no answer within {self.timeout:g}s "
                                        "(the group coordinator out of reach)")
        error = outcome[0] if outcome else None
        if error is None:
            return
        if not isinstance(error, KafkaException):
            raise error
        raise translated(error.args[0]) from None

    def wait_pending(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a commit still pending; whether none is now."""
        pending = self._pending
        if pending is None:
            return True
        pending.join(timeout)
        if pending.is_alive():
            return False
        self._pending = None
        return True

    def wait(self) -> None:
        """Wait for a commit still pending: a consumer must not be closed under one."""
        pending = self._pending
        if pending is not None:
            pending.join()


def translated(error: KafkaError) -> TransportError:
    """A commit's librdkafka error as the ``Source`` protocol's error."""
    if error.code() in STALE_COMMIT:
        return CommitRefusedError(f"offset commit refused: {error.str()}")
    if error.retriable() or error.code() in UNAVAILABLE_COMMIT:
        return RetriableTransportError(f"offset commit failed: {error.str()}")
    return TransportError(f"offset commit failed: {error.str()}")
