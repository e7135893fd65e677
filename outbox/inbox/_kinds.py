"""The inbox's vocabulary: why a message is parked, how it was recorded, where a key starts.

String enums, so a member is stored and compared as its value: ``Reason.GAP ==
"gap"``, and the tables keep the same strings as before.
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """Why a message sits in ``inbox_parked``."""

    FAILED = "failed"
    """The handler raised ``max_attempts`` times, or raised ``ParkMessage``; its key is parked."""
    KEY_PARKED = "key_parked"
    """Arrived after its key was parked; never ran. Replay carries it along."""
    GAP = "gap"
    """The key's next seq did not arrive within ``gap_timeout``; its key is parked."""
    FOREIGN = "foreign"
    """No (or a broken) outbox envelope; parked alone, never replayed."""
    UNDECODABLE = "undecodable"
    """The payload does not match its content type; a keyed one parks its key."""
    BEFORE_START = "before_start"
    """Arrived below the seq its key started at (start policy ``first_seen``); parked alone."""
    NEW_INCARNATION = "new_incarnation"
    """A new id at or below its key's last seq from another producer incarnation: the
    producer database was rebuilt and counts again (start policy ``strict``); its key is
    parked. Replay starts the key again at this message."""
    SEQ_CONFLICT = "seq_conflict"
    """A new id at or below its key's last seq from the same producer incarnation (or
    one unknown): two messages claim one seq; its key is parked. Replay starts the key
    again at this message; discard it if it is not to be applied."""
    UNKNOWN_EVENT = "unknown_event"
    """Its topic has typed handlers, none for its event type, and no untyped one
    (``unknown_event="park"``); its key is parked. Deploy a handler, then replay."""
    INVALID_EVENT = "invalid_event"
    """Its payload does not validate against the model of its event type's handler (or an
    upcaster failed); the error holds the validation error. Its key is parked."""
    TENANT_UNKNOWN = "tenant_unknown"
    """On an inbox serving many tenants: its tenant header is missing or names no tenant
    served (or ``tenant_of`` failed on it). Parked alone in the default database, never
    run; replay sends it to its tenant once that tenant exists (docs/tenants.md)."""

    @property
    def parks_key(self) -> bool:
        """Whether parking a keyed message for this reason stops its key."""
        return self in (Reason.FAILED, Reason.GAP, Reason.UNDECODABLE, Reason.NEW_INCARNATION,
                        Reason.SEQ_CONFLICT, Reason.UNKNOWN_EVENT, Reason.INVALID_EVENT)

    @property
    def restarts_on_replay(self) -> bool:
        """Whether replaying a message parked for this reason starts its key again at its seq."""
        return self in (Reason.NEW_INCARNATION, Reason.SEQ_CONFLICT)




class StartPolicy(enum.StrEnum):
    """What a consumer group does with a key whose first message it meets is past seq 1.

    That happens to a group that joins mid-stream, after retention deleted a
    key's first messages, or after the relay skipped a failed row.
    """

    STRICT = "strict"
    """Hold it and wait for the missing seqs; park the key as a gap after ``gap_timeout``.

    A rebuilt producer (a new incarnation whose seqs count again) parks its
    keys with reason ``new_incarnation`` until an operator replays them."""
    FIRST_SEEN = "first_seen"
    """Start the key at the first seq met and record that seq in ``inbox_keys.started_at_seq``;
    a lower seq that arrives later is parked alone with reason ``before_start``.

    A rebuilt producer (a new incarnation whose seqs count again) starts its
    keys again the same way, at the first seq of the new incarnation met."""


class ForeignRecords(enum.StrEnum):
    """What the inbox does with a record that has no outbox envelope (``Inbox(foreign_records=…)``)."""

    PARK = "park"
    """Park it alone with reason ``foreign`` (one alert per topic): it never runs a handler."""
    ACCEPT = "accept"
    """Hand it to the handler as a ``Message`` without seq or incarnation; it is never ordered."""


class UnknownEvents(enum.StrEnum):
    """What a typed inbox does with a message it cannot hand to a typed handler
    (``Inbox(unknown_event=…)``): its event type has no handler on its topic and the
    topic has no untyped handler, or its payload does not validate against the model."""

    PARK = "park"
    """Park it (and its key) with reason ``unknown_event`` or ``invalid_event``: nothing of
    the key applies past it until a handler is deployed and the key replayed, or it is discarded."""
    SKIP = "skip"
    """Record it as skipped (``inbox_messages.outcome='skipped'``, the note says why) and go
    on with its key: for topics that carry events this consumer does not care about."""
