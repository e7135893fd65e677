"""A new message id at or below its key's position: what it is, and what becomes of it.

Only a recorded message id is a duplicate (the transaction step looks the ids
up, one statement a batch). Any other message at or below its key's
``last_seq`` would be dropped silently if taken for one, so it is judged here,
against the key's state, and the verdict is counted, logged or parked:

- older than the group's dedup window (``Inbox(dedup_window=...)``), whose
  record was pruned (``outbox spark archive --dedup-window``): an expired
  redelivery, counted and logged, not applied again;
- from another producer incarnation than the key's (both known): the producer
  database was rebuilt and counts again. ``first_seen`` starts the key again at
  this seq; ``strict`` parks the key (``Reason.NEW_INCARNATION``);
- below the seq a ``first_seen`` key started at: ``Reason.BEFORE_START``, alone;
- on a parked key: parked behind it;
- anything else — the same incarnation, or a message or key without one (an
  older producer release): two messages claim one seq, ``Reason.SEQ_CONFLICT``,
  and the key is parked.

A key holds one message per seq ahead of a gap. Another id arriving for a
held seq is judged the same way against the held one (``judge_held``): from
another incarnation, ``Reason.NEW_INCARNATION``; else ``Reason.SEQ_CONFLICT``;
either way it parks with its key, the held one behind it, whatever the start
policy — which of the two follows the gap cannot be told before it fills.

A message taken out of ``inbox_held`` never restarts a key: it waited behind a
gap of the incarnation it came from, so it is older than the key's state.
"""

from __future__ import annotations

import enum
from datetime import datetime

from ._delivery import OrderedDelivery
from ._kinds import Reason, StartPolicy
from .storage import KeyState


class Verdict(enum.StrEnum):
    """What a new id at or below its key's ``last_seq`` is (the metric's ``verdict`` label)."""

    EXPIRED = "expired"
    """Older than the dedup window: its record was pruned; counted as a redelivery."""
    RESTART = "restart"
    """A new producer incarnation under ``first_seen``: the key starts again at this seq."""
    NEW_INCARNATION = "new_incarnation"
    """A new producer incarnation under ``strict``: parked with its key."""
    BEFORE_START = "before_start"
    """Below the seq the key started at: parked alone."""
    KEY_PARKED = "key_parked"
    """Its key is parked: parked behind it."""
    SEQ_CONFLICT = "seq_conflict"
    """Two messages claim one seq within one incarnation: parked with its key."""

    @property
    def reason(self) -> Reason | None:
        """The reason it is parked with; None when it is not parked."""
        return _REASONS.get(self)


_REASONS = {Verdict.NEW_INCARNATION: Reason.NEW_INCARNATION, Verdict.BEFORE_START: Reason.BEFORE_START,
            Verdict.KEY_PARKED: Reason.KEY_PARKED, Verdict.SEQ_CONFLICT: Reason.SEQ_CONFLICT}


def rebuilt(recorded: str | None, incoming: str | None) -> bool:
    """Whether a message comes from another producer incarnation than its key's (both known)."""
    return recorded is not None and incoming is not None and recorded != incoming


def judge(d: OrderedDelivery, state: KeyState, start: StartPolicy,
          expired_before: datetime | None) -> Verdict:
    """The verdict on ``d``, a keyed message with an unrecorded id and ``seq <= state.last_seq``."""
    msg = d.message
    if expired_before is not None and msg.created_at < expired_before:
        return Verdict.EXPIRED
    if rebuilt(state.incarnation, msg.incarnation) and not d.from_held:
        if state.parked:
            return Verdict.KEY_PARKED
        return Verdict.RESTART if start is StartPolicy.FIRST_SEEN else Verdict.NEW_INCARNATION
    if state.started_at_seq is not None and d.seq < state.started_at_seq:
        return Verdict.BEFORE_START
    if state.parked:
        return Verdict.KEY_PARKED
    return Verdict.SEQ_CONFLICT


def judge_held(d: OrderedDelivery, holder: OrderedDelivery) -> Verdict:
    """The verdict on ``d``, ahead of its key's gap, whose seq ``holder`` (another id) holds."""
    if rebuilt(holder.message.incarnation, d.message.incarnation):
        return Verdict.NEW_INCARNATION
    return Verdict.SEQ_CONFLICT


def describe_held(verdict: Verdict, d: OrderedDelivery, holder: OrderedDelivery,
                  state: KeyState) -> str:
    """The parked row's error text for ``judge_held``'s verdict."""
    msg, held = d.message, holder.message
    where = (f"seq {msg.seq} (incarnation {msg.incarnation or 'unknown'}) arrived while message "
             f"{held.message_id} (incarnation {held.incarnation or 'unknown'}) waits at that seq "
             f"for the gap after the key's last seq {state.last_seq}")
    if verdict is Verdict.NEW_INCARNATION:
        return (f"{where}: the producer database was rebuilt and counts again; replay the key to "
                "apply its parked messages in seq order, or discard the ones you do not want")
    return (f"{where}: two messages claim one seq; replay the key to apply its parked messages in "
            "seq order, or discard the one you do not want")


def describe(verdict: Verdict, d: OrderedDelivery, state: KeyState) -> str:
    """The parked row's error text: what the conflict is and what an operator can do."""
    msg = d.message
    if verdict is Verdict.BEFORE_START:
        return (f"seq {msg.seq} arrived after its key started at seq {state.started_at_seq} "
                "(start policy first_seen)")
    if verdict is Verdict.KEY_PARKED:
        return ""
    where = (f"seq {msg.seq} (incarnation {msg.incarnation or 'unknown'}) is at or below the key's "
             f"last seq {state.last_seq} (incarnation {state.incarnation or 'unknown'}) and its id "
             "was never seen here")
    if verdict is Verdict.NEW_INCARNATION:
        return (f"{where}: the producer database was rebuilt and counts again (start policy "
                "strict); replay the key to start it again at this incarnation")
    return (f"{where}: two messages claim one seq; replay the key to start it again at this "
            "message, or discard it")
