"""Alerts the inbox raises: once per incident, after the transaction that caused it committed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from ..core._alerts import Alert, AlertKind, AlertSink, deliver
from ._committed import Parked
from ._kinds import Reason
from ._metrics import InboxMetrics


class Alerter:
    """Turns parked messages into metrics and alerts; safe to call from several threads.

    A parked key raises ``key_parked``; a message parked alone raises
    ``message_parked``; a foreign record raises ``foreign_record`` once per
    topic and process (a misrouted producer must not flood the pager). A
    message parked behind its parked key raises nothing.
    """

    def __init__(self, sink: AlertSink | Callable[[Alert], None], group: str,
                 metrics: InboxMetrics, tenant: str | None = None) -> None:
        self.sink = sink
        self.group = group
        self.tenant = tenant
        """The tenant whose place this alerter serves (``_tenants``): every alert's ``tenant``."""
        self.metrics = metrics
        self._foreign_alerted: set[str] = set()
        self._lock = threading.Lock()

    def parked(self, events: Iterable[Parked]) -> None:
        for event in events:
            self.metrics.parked(event.delivery.message.topic, event.reason)
            alert = self._alert_for(event)
            if alert is not None:
                deliver(self.sink, alert)

    def _alert_for(self, event: Parked) -> Alert | None:
        d, reason = event.delivery, event.reason
        if reason is Reason.KEY_PARKED:
            return None
        if reason is Reason.FOREIGN:
            with self._lock:
                if d.message.topic in self._foreign_alerted:
                    return None
                self._foreign_alerted.add(d.message.topic)
            return self._alert(AlertKind.FOREIGN_RECORD, event)
        if event.key_parked:
            return self._alert(AlertKind.KEY_PARKED, event, reason=reason.value)
        return self._alert(AlertKind.MESSAGE_PARKED, event, reason=reason.value)

    def _alert(self, kind: AlertKind, event: Parked, **details: object) -> Alert:
        d, msg = event.delivery, event.delivery.message
        return Alert(kind=kind, topic=msg.topic, key=msg.key, message_id=str(msg.message_id),
                     error=event.error or event.reason.value, group=self.group, tenant=self.tenant,
                     details={"seq": msg.seq, "partition": d.partition, "offset": d.offset, **details})
