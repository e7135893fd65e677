"""What a held exactly-once shard's take-over logs when it ends (``relay._shard_producer``), without a
broker: a held shard whose lease another relay took meanwhile, which takes two relays, a lease that
lapses, and a take-over timed between a renewal and the confirm of the lease through the public API."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import pytest

from outbox import HeldByOpenTransactionError, RetriableTransportError
from outbox.relay._shard_producer import ShardState, settle_take_overs, take_turns


def test_a_held_shard_whose_lease_was_lost_meanwhile_is_not_said_to_send_again(
        caplog: pytest.LogCaptureFixture) -> None:
    """The shard was held (``held``: its ``stuck`` set); its next take-over found the lease another
    relay's (``ProducerMaker.make``: ``state.lost``, no producer made, the future's result False).
    The relay logged "no longer holds shard 0's lease": it must not then say it took the shard over
    and that it sends again."""
    caplog.set_level(logging.INFO)
    state = ShardState(3)
    state.stuck = "the settle of 'outbox-x-0' is held by an open transaction (...)"
    state.held_until = 1.0
    state.lost = True  # what ``ProducerMaker._confirmed`` sets before make returns False
    taking: Future[bool] = Future()
    taking.set_result(False)
    state.taking = taking
    assert settle_take_overs({0: state}, "relay w") is None
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "took shard 0 over after all" in m], said


def test_held_shards_take_turns_so_that_the_pool_keeps_threads_for_the_busy_ones() -> None:
    """Forty held shards of forty-eight due again at once (``HELD_AGAIN`` passed): their take-overs
    each hold a thread of the relay's pool (16) for ``HELD_FOR`` s and more, the pool the busy shards'
    transactions run on. Started all at once they delayed the eight free shards' rows by up to 5.7 s
    (an attack's run of forty of forty-eight on Apache Kafka, 2026-12-04). At most ``HELD_AT_ONCE``
    are under way at a time; shards not held are never held back; the next turns go to the others."""
    owned = {shard: ShardState(1) for shard in range(48)}
    for shard in range(40):
        owned[shard].held_until = 1.0  # held, and due again
    due = sorted(owned)
    first = take_turns(due, owned)
    assert first == [0, 1, 2, 3, *range(40, 48)], first
    for shard in first:  # under way: a held one's held_until stays set until it ends
        owned[shard].taking = Future()
    assert take_turns([s for s in due if owned[s].taking is None], owned) == []
    owned[2].taking, owned[2].held_until = None, 99.0  # held again: not due before then
    assert take_turns([s for s in due if owned[s].taking is None and owned[s].held_until <= 1.0],
                      owned) == [4]


def test_a_take_over_that_fails_for_another_cause_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """"cannot take shard N over yet" was logged once until a take-over succeeded: a shard held by an
    open transaction whose next take-overs failed for want of the broker said nothing of the broker.
    Once a cause (the failure's class), not once a message (the offsets in it change every time)."""
    state = ShardState(1)

    def ended(error: Exception) -> None:
        taking: Future[bool] = Future()
        taking.set_exception(error)
        state.taking = taking
        settle_take_overs({0: state}, "relay w")

    ended(HeldByOpenTransactionError("held at offset 7"))
    ended(HeldByOpenTransactionError("held at offset 9"))
    ended(RetriableTransportError("init_transactions timed out"))
    ended(RetriableTransportError("init_transactions timed out again"))
    ended(HeldByOpenTransactionError("held at offset 11"))
    said = [r.getMessage() for r in caplog.records if "cannot take shard 0 over" in r.getMessage()]
    assert [m.split("(")[1].split(")")[0] for m in said] == [
        "held at offset 7", "init_transactions timed out", "held at offset 11"], said
