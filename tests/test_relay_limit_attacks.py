"""Attacks on a batch's row limit (``BatchRunner.run(limit=)``)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from _relay_helpers import ScriptedTransport, publish

from outbox import Outbox, Relay, create_engine
from transports import Record, SendResult


class _FinishingWrite(ScriptedTransport):
    """Counts each batch's records; the fake write in flight commits once the batch is sent."""

    def __init__(self, write: Future[Any]) -> None:
        super().__init__()
        self.write, self.batches = write, []  # type: list[int]

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        self.batches.append(len(records))
        if not self.write.done():
            self.write.set_result(None)
        return super().publish(records)


@pytest.mark.mysql
@pytest.mark.parametrize("limit", [None, 4])
def test_on_mysql_a_batch_never_takes_more_rows_than_its_limit_while_writes_are_in_flight(
        mysql_db: str, limit: int | None) -> None:
    """MySQL fetches as many more rows as are busy and drops the busy ones after (``without_busy``).
    When the busy rows were marked already (their write committed after the relay settled its
    writes, before the fetch), none is dropped: the batch must still stop at its limit."""
    outbox = Outbox(create_engine(mysql_db))
    outbox.create_tables()
    publish(outbox, "t", [None] * 50)
    write: Future[Any] = Future()
    transport = _FinishingWrite(write)
    relay = Relay(outbox, transport, worker_id="w", batch_size=10)
    try:
        batches = relay._step._batch
        # A write in flight (``_batch._Writing``'s fields) whose rows the fetch no longer finds:
        # marked published already.
        batches._writes.append(SimpleNamespace(future=write, busy=[10**9 + i for i in range(20)],  # type: ignore[arg-type]
                                               held=set()))
        done = relay._step.run(wait=True, leases=True, limit=limit)
        assert transport.batches and transport.batches[0] <= (limit or 10), transport.batches
        assert done.batch.fetched == (limit or 10)
        assert done.again  # a full batch: more is waiting
    finally:
        relay.close()

