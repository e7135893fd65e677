"""The consumer side: an inbox that applies each message once, per key in seq order.

One pipeline, one module per stage: decode into typed deliveries
(``_delivery``) → schedule by key (``_schedule``) → one transaction in rounds
of phases: triage, claim, run, advance, successors (``_transaction``, ``_phases``: the only
stage with a session, and **where a delivery becomes applied or parked**; what the rounds
decide is kept by ``_ledger`` and written once at the end) →
settle: done, retry later or park (``_settle``) → commit offsets
(``_offsets``, driven by ``_runner``). An operator's replay (``_admin``) runs
through the same phases. ``storage`` owns every inbox statement and the one way
to park: a store per concern (dedup records, key positions, held and parked
messages), each a protocol with one class per dialect, injectable with
``Inbox(storage=…)``. The public names are re-exported by ``outbox``; tools that
read what waits (``outbox status``, the console) use ``outbox.inbox.admin``.
"""

from ..core._stopping import StopRequested
from ..core._tables import InboxOutcome
from ._admin import DiscardRefusedError, NotParkedError, ParkedMessage, ParkedReplay
from ._inbox import Inbox
from ._kinds import ForeignRecords, Reason, StartPolicy, UnknownEvents
from ._metrics import InboxMetrics, TenantInboxMetrics, tenant_inbox_metrics
from ._parked_actions import KeyReplayed, ParkedActions
from ._signals import Disposition, HandlerSignal, ParkMessage, RetryLater, SkipMessage

__all__ = [
    "DiscardRefusedError",
    "Disposition",
    "ForeignRecords",
    "HandlerSignal",
    "Inbox",
    "InboxMetrics",
    "InboxOutcome",
    "KeyReplayed",
    "NotParkedError",
    "ParkMessage",
    "ParkedActions",
    "ParkedMessage",
    "ParkedReplay",
    "Reason",
    "RetryLater",
    "SkipMessage",
    "StartPolicy",
    "StopRequested",
    "TenantInboxMetrics",
    "UnknownEvents",
    "tenant_inbox_metrics",
]
