"""FaultyTransport, the fault injector of the relay's crash test, keeps the per-key contract."""

from __future__ import annotations

import pytest

from transports import Outcome, Record, SendResult
from transports.testing import INJECTED_LOST_ACK, INJECTED_NOT_SENT, FaultyTransport


class Recording:
    def __init__(self) -> None:
        self.written: list[Record] = []

    def publish(self, records):
        self.written.extend(records)
        return [SendResult(Outcome.DELIVERED, 0, n) for n, _ in enumerate(records)]

    def close(self, timeout: float = 10.0) -> None:
        pass


def test_faults_never_let_a_later_record_of_a_key_through() -> None:
    inner = Recording()
    faulty = FaultyTransport(inner, rate=0.3, seed=11)
    records = [Record(topic="t", value=str(i).encode(), key=f"k{i % 300}".encode()) for i in range(900)]
    results = faulty.publish(records)
    assert faulty.injected > 30
    errors = {r.error for r in results if r.outcome is not Outcome.DELIVERED}
    assert INJECTED_NOT_SENT in errors and INJECTED_LOST_ACK in errors
    written = {id(r) for r in inner.written}
    for key in {r.key for r in records}:
        mine = [(rec, res) for rec, res in zip(records, results, strict=True) if rec.key == key]
        first_bad = next((i for i, (_, res) in enumerate(mine) if res.outcome is not Outcome.DELIVERED),
                         len(mine))
        assert all(res.outcome is Outcome.DELIVERED for _, res in mine[:first_bad])
        assert all(res.outcome is Outcome.RETRY for _, res in mine[first_bad:])
        # Nothing after the faulted record reached the broker; a lost ack did reach it.
        assert all(id(rec) not in written for rec, _ in mine[first_bad + 1:])
        if first_bad < len(mine):
            rec, res = mine[first_bad]
            assert (id(rec) in written) == (res.error == INJECTED_LOST_ACK)


def test_rate_is_checked() -> None:
    with pytest.raises(ValueError, match="rate"):
        FaultyTransport(Recording(), rate=1.5)
