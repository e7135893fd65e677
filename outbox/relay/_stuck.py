"""Keys stuck behind a head the relay keeps retrying: one ``key_stuck`` alert each, and a gauge.

A retried row holds back every later row of its key (per-key order), so a
head that keeps failing with a *retriable* error stops its key without ever
becoming a failed row: nothing alerts, and the backlog only grows. After
``after`` seconds that is worth a page. The watch reads the table (the
retrying heads of the shards this relay owns, on the small partial index
``retrying_heads`` uses), so it survives restarts and shard moves; how long a
head has been retrying counts from the row's ``created_at`` (a delayed
publish that then fails counts its delay too). Each stuck head alerts once
per relay that owns it; a later head of the same key that gets stuck alerts
again. A broker outage postpones rows without counting attempts, so it never
makes a key "stuck" here: it is logged once as an outage instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sqlalchemy import Connection, Engine

from ..core._alerts import Alert, AlertKind, AlertSink, deliver
from ..core._envelope import utcnow
from ..core._metric_views import GaugeFamily
from ..producer import Outbox
from ._admin import RetryingHead, retrying_heads

WATCH_LIMIT = 500
"""Retrying heads read per check, oldest first: enough to alert on, bounded for a big incident."""


class StuckKeys:
    """Watches one relay's retrying heads; ``check`` is called from one thread (the watch loop)."""

    def __init__(self, outbox: Outbox, engine: Engine, after: float,
                 alert: AlertSink | Callable[[Alert], None], gauge: GaugeFamily, worker_id: str) -> None:
        self.outbox, self.engine, self.after = outbox, engine, after
        self.alert, self.worker_id = alert, worker_id
        self.gauge = gauge.labels(worker_id)
        self._alerted: set[str] = set()  # message ids of heads already alerted on

    def check(self, shards: Sequence[int]) -> list[RetryingHead]:
        """Alert on heads newly stuck in ``shards``, set the gauge; returns the stuck heads."""
        return self.judge(self.read(shards))

    def read(self, shards: Sequence[int], conn: Connection | None = None) -> list[RetryingHead]:
        """The retrying heads of ``shards`` (none without shards), for ``judge``.

        ``conn``: read on it (a fleet's idle poll, in its fetch's transaction).
        """
        return retrying_heads(self.outbox, limit=WATCH_LIMIT, shards=shards,
                              engine=self.engine, conn=conn) if shards else []

    def judge(self, heads: list[RetryingHead]) -> list[RetryingHead]:
        """Alert on the heads of ``heads`` newly stuck, set the gauge; returns the stuck heads.

        Outside any transaction: a sink may take seconds an alert (a webhook's
        POST), and a transaction held open that long would hold its snapshot
        (the outbox's vacuum), its locks and its connection, and meet a
        server's ``idle_in_transaction_session_timeout``.
        """
        now = utcnow()
        stuck = [h for h in heads if (now - h.created_at).total_seconds() >= self.after]
        self.gauge.set(len(stuck))
        current = {str(h.message_id) for h in stuck}
        for head in stuck:
            if str(head.message_id) not in self._alerted:
                deliver(self.alert, Alert(
                    kind=AlertKind.KEY_STUCK, topic=head.topic, key=head.key, message_id=str(head.message_id),
                    error=head.last_error or "retrying",
                    details={"seq": head.seq, "attempts": head.attempts, "waiting": head.waiting,
                             "retrying_for_s": round((now - head.created_at).total_seconds(), 1),
                             "worker": self.worker_id}))
        self._alerted = current  # a head that moved on is forgotten; stuck again = alerted again
        return stuck
