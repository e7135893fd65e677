"""What a held exactly-once shard's take-over logs when it ends (``relay._shard_producer``), without a
broker: a held shard whose lease another relay took meanwhile, which takes two relays, a lease that
lapses, and a take-over timed between a renewal and the confirm of the lease through the public API."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import pytest

from outbox.relay._shard_producer import ShardState, settle_take_overs


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
