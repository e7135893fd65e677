"""What an inbox transaction did, as plain results for the stages after it (settle, alerts, metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ._conflicts import Verdict
from ._delivery import Delivery, OrderedDelivery
from ._kinds import Reason
from ._signals import Disposition


@dataclass(slots=True)
class Failure:
    """A handler that failed on one message: what it raised, and where."""

    delivery: Delivery
    error: BaseException
    traceback: str


@dataclass(frozen=True, slots=True)
class Parked:
    """A message this transaction parked, for the alerts and metrics raised after commit."""

    delivery: Delivery
    reason: Reason
    error: str
    key_parked: bool


@dataclass(slots=True)
class Committed:
    """What one committed inbox transaction did with its deliveries."""

    done: list[tuple[Delivery, Disposition]] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    parked: list[Parked] = field(default_factory=list)
    blocked: list[Delivery] = field(default_factory=list)
    """Later messages of a failed message's key: not run, they wait for it, in seq order."""
    deferred: list[Delivery] = field(default_factory=list)
    """Not run because the transaction's budget was spent: for the next transaction at once, each
    key's in seq order, no attempt counted (``_calls.Budget``)."""
    conflicts: list[tuple[OrderedDelivery, Verdict]] = field(default_factory=list)
    """New ids met at or below their key's last seq, and what became of each (``_conflicts``)."""

