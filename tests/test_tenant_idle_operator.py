"""An operator's decision on a failed row (``outbox failed retry`` / ``skip``, the console's buttons)
is acted on by a tenant fleet within ``poll_interval``, though the tenant's polls have backed off.

Found by an attack on the idle backoff: neither ``retry_failed`` nor ``skip_failed`` NOTIFied; a
tenant whose key is blocked by a failed row fetches nothing, so its polls back off
(``_idle_polls``) and the decision waited for the next one: up to 60 s, where it was
``poll_interval`` before the backoff. Both now notify the changed rows' shards.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import sqlalchemy as sa
from _relay_helpers import Running, pending, wait_for
from test_tenant_polls import ROOMY, Fetches, listening, publish, schema_outbox
from test_tenant_polls import running as running  # the fixture

from outbox.relay import retry_failed, skip_failed
from outbox.tenants import TenantRelay
from transports import Outcome, Record, SendResult
from transports.memory import InMemoryBroker, InMemoryTransport


class Refusing(InMemoryTransport):
    """Refuses for ever the records of the keys in ``refused`` (a shared set the test empties)."""

    def __init__(self, broker: InMemoryBroker, refused: set[bytes]) -> None:
        super().__init__(broker)
        self.refused = refused

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        return [SendResult(Outcome.FAILED, error="refused") if r.key in self.refused
                else super(Refusing, self).publish([r])[0] for r in records]


@pytest.mark.postgres
@pytest.mark.parametrize("decide", [retry_failed, skip_failed], ids=["retry", "skip"])
def test_an_operators_decision_on_a_failed_row_is_acted_on_though_polls_backed_off(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch, running: list[Running], decide: object) -> None:
    fetches = Fetches(monkeypatch)
    outbox = schema_outbox(pg, "ops")
    broker, refused = InMemoryBroker(max_record_bytes=ROOMY), {b"k"}
    fleet = Running(TenantRelay(["ops"], lambda: Refusing(broker, refused), tenant_header="x-tenant",
                                poll_interval=0.25, lease_ttl=3.0, refresh_every=60.0, database=pg))
    running.append(fleet)
    wait_for(lambda: listening(pg), 20, "the fleet listening")
    publish(outbox, "k")  # refused: failed, blocking its key
    publish(outbox, "k")  # waits behind it
    wait_for(lambda: pending(outbox) == 1, 10, "the head failed, the second row blocked")
    # Just after a poll whose gap was 4 s (3.5 s at least: the upper half of its 3-4 s with the
    # jitter, or the 8 s step's): the next one comes 8 s later, 6 s at least, so at least 5.5 s after
    # the decision: 5 s leave a loaded host seconds to act on it and still tell its notification from
    # that poll. (Backing off to 8 s gaps first proved nothing more and took 16-30 s.)
    wait_for(lambda: fetches.backed_off("ops", 3.5) and time.monotonic() - fetches.at["ops"][-1] < 0.5,
             60, "its polls 4 s apart, one just made")
    refused.clear()
    assert callable(decide)
    decide(outbox, by="operator")
    wait_for(lambda: pending(outbox) == 0, 5, "the decision acted on before the next poll")
