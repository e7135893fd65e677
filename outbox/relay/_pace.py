"""A shard's transactions sized to the broker's pace (``ShardState.cap``), in exactly-once mode.

A transaction is given up at its deadline; a broker throttled by a quota or slower than the
deadline allows fails it for its size, forever, unless the shard's next ones carry fewer
records. The relay's ``ExactlyOnce`` calls ``paced`` after every transaction and logs a cap
lowered for a slow broker.
"""

from __future__ import annotations

import time

from transports import Outcome, TransactionOutcome, TransactionResult

from ._shard_producer import ShardState

PACE_GROWS_BELOW = 4
"""A shard's capped transactions grow again after a commit within 1/4 of the deadline (``_pace``)."""

PACE_GIVEN_UP_AT = 0.9
"""A transaction that did not commit paces its shard only if it took this much of the deadline at least
(given up at it, ``_pace``): one ended sooner (a refusal, a broker that went away at once) says nothing
of the broker's pace; taken for slowness, it halved the shard's transactions and was logged as "given
up after 10 s" though it took milliseconds."""

PACE_HOLD = 1
"""Deadlines after a transaction given up with records acknowledged before its shard's cap may grow
(30 s with ``KafkaTransport``'s default ``delivery_timeout``: longer than a Kafka quota's window,
11 s by default)."""


def paced(state: ShardState, count: int, answer: TransactionResult, took: float,
          timeout: float) -> int | None:
    """Size the shard's next transactions to the broker's pace (``ShardState.cap``); the new cap when a
    transaction given up with records acknowledged lowered it (the caller says so), else None.

    A transaction given up at its deadline may have failed for its size, not for want of the
    broker: one throttled by a quota, or a broker that takes its records more slowly than the
    deadline allows. Sent again as it was it would time out again, forever, counted as an
    outage and never as an attempt. So each one given up halves the shard's next ones (to
    half of what the broker acknowledged of it, when it acknowledged some; the batch's other
    rows go in the transactions after, in order).

    The cap grows back only by doubling at a commit that filled it within a quarter of the
    deadline, and not for a deadline (``PACE_HOLD``) after a transaction given up with records
    acknowledged: a broker throttled by a quota answers a request at once and holds back the
    ones after it, so one quick commit says little about its pace (doubled at once, the cap
    grew back into the deadline). A small commit leaves it as it is: the next burst of rows
    starts capped. A broker that answered nothing is an outage (logged as one by the relay):
    the cap is halved silently and may grow again at once once the broker is back; so is one
    that went away during the transaction (``TransactionResult.answered`` 0: a connection lost). One that
    ended well before its deadline (``PACE_GIVEN_UP_AT``) says nothing of the pace: the cap stays.
    """
    now = time.monotonic()
    if answer.outcome is TransactionOutcome.COMMITTED:
        if (state.cap is not None and count >= state.cap and took < timeout / PACE_GROWS_BELOW
                and now >= state.cap_held_until):
            state.cap *= 2
        return None
    if answer.outcome is TransactionOutcome.FENCED or took < PACE_GIVEN_UP_AT * timeout or not all(
            r.outcome is Outcome.RETRY and r.unreachable for r in answer.results):
        return None
    if answer.answered:
        state.cap_held_until = now + PACE_HOLD * timeout
    cap = max(1, min(answer.answered or count, count) // 2)
    if state.cap is not None and cap >= state.cap:
        return None
    state.cap = cap
    return cap if answer.answered else None
