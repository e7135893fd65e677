"""The consumer side: an inbox that applies each message once, per key in seq order.

One pipeline, one module per stage: decode (``_delivery``) → schedule by key
(``_schedule``) → one transaction: claim, order check, handler, advance
(``_transaction``, the only stage with a session) → settle: done, retry later
or park (``_settle``) → commit offsets (``_offsets``, driven by ``_runner``).
``_store`` owns every inbox statement and the one way to park. The public
names are re-exported by ``outbox``.
"""

from .._stopping import StopRequested
from ._admin import DiscardRefusedError, NotParkedError, ParkedMessage, ParkedReplay
from ._inbox import Inbox
from ._kinds import Finished, Reason, StartPolicy
from ._signals import Disposition, HandlerSignal, ParkMessage, RetryLater, SkipMessage

__all__ = [
    "DiscardRefusedError",
    "Disposition",
    "Finished",
    "HandlerSignal",
    "Inbox",
    "NotParkedError",
    "ParkMessage",
    "ParkedMessage",
    "ParkedReplay",
    "Reason",
    "RetryLater",
    "SkipMessage",
    "StartPolicy",
    "StopRequested",
]
