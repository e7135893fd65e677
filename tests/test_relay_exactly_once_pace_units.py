"""How a shard's transactions are sized to the broker's pace (``ExactlyOnce._pace``), without a broker."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from outbox.relay._exactly_once import ExactlyOnce
from outbox.relay._shard_producer import ShardState
from transports import Outcome, SendResult, TransactionOutcome, TransactionResult

DEADLINE = 10.0


def aborted_for_want_of_the_broker(count: int, answered: int) -> TransactionResult:
    """``count`` rows and the progress record, every one a retry for want of the broker, ``answered``
    of them acknowledged before the transaction was aborted."""
    results = [SendResult(Outcome.RETRY, error="broker gone", unreachable=True) for _ in range(count + 1)]
    return TransactionResult(TransactionOutcome.ABORTED, results, "broker gone", answered=answered)


def pace(state: ShardState, count: int, answer: TransactionResult, took: float) -> None:
    relay = SimpleNamespace(_timeout=DEADLINE, name="relay w")
    ExactlyOnce._pace(relay, 0, state, count, answer, took)


def test_a_transaction_ended_long_before_its_deadline_leaves_the_pace_alone(
        caplog: pytest.LogCaptureFixture) -> None:
    """Aborted 50 ms in, 10 of its 11 records acknowledged (a retriable refusal, a broker that went
    away at once): nothing says the broker is slow. The shard's transactions keep their size, and
    nothing says "given up after 10 s" of a transaction that took milliseconds."""
    caplog.set_level(logging.WARNING)
    state = ShardState(1)
    pace(state, 10, aborted_for_want_of_the_broker(10, 11), took=0.05)
    assert state.cap is None
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_a_transaction_given_up_at_its_deadline_halves_the_next_and_says_what_it_took(
        caplog: pytest.LogCaptureFixture) -> None:
    """Given up at its deadline with its 10 rows and its progress record acknowledged: the next ones
    carry half, and the line says how long it took and how many of its rows were acknowledged, no
    more than it had (not "11 of them", the progress record counted as a row)."""
    caplog.set_level(logging.WARNING)
    state = ShardState(1)
    pace(state, 10, aborted_for_want_of_the_broker(10, 11), took=10.4)
    assert state.cap == 5
    [said] = [r.getMessage() for r in caplog.records]
    assert "a transaction of 10 records was given up after 10 s with 10 of them acknowledged" in said, said
