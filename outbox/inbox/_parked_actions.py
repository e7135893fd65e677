"""An operator's actions on parked messages, each recorded: the one service the CLI and the console render.

``outbox parked list|replay|discard`` and the web console's parked pages do
the same things: list what is parked, replay keys one after another (a key
that fails again stays parked, the others go on), discard one message. Each
action that changes something, refused or not, writes one line to an audit
logger naming what, the group, where (a database, a tenant), who, why and
the outcome: the replay's only record, since a replayed message is applied
like a live one. Both front ends call this; each renders its results its own
way and keeps its own logger (``outbox.cli.audit``, ``outbox.console.audit``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from logging import Logger

from ..core._validation import listed_message_id
from ._admin import DiscardRefusedError, NotParkedError, ParkedMessage, ParkedReplay
from ._inbox import Inbox

Lane = tuple[str, str | None]
"""A parked key: (topic, key), or (topic, None) for the topic's parked unkeyed messages."""


@dataclass(frozen=True, slots=True)
class KeyReplayed:
    """One key of ``ParkedActions.replay``: what its replay did, or why nothing was done."""

    topic: str
    key: str | None
    result: ParkedReplay | None
    """None: nothing of the key was parked (any more): ``not_parked`` says so."""
    not_parked: str | None = None

    @property
    def name(self) -> str:
        """``topic/key`` (``topic/(unkeyed)`` for a topic's unkeyed messages), as the audit line names it."""
        return f"{self.topic}/{self.key if self.key is not None else '(unkeyed)'}"

    @property
    def unparked(self) -> bool:
        return self.result is not None and self.result.unparked


class ParkedActions:
    """List, replay and discard one inbox's parked messages, recording each action on ``audit``.

    ``where`` names the database in the audit lines (the console serves
    several); ``tenant`` is the tenant whose messages these are, on an inbox
    serving tenants (None: the inbox's own database; there, replay sends
    messages parked as ``tenant_unknown`` to their tenants). Safe from
    several threads, as the inbox's own methods are.
    """

    def __init__(self, inbox: Inbox, *, audit: Logger, where: str | None = None,
                 tenant: str | None = None) -> None:
        self.inbox = inbox
        self.audit = audit
        self.tenant = tenant
        self._at = (f" in {where}" if where else "") + (f" of tenant {tenant}" if tenant else "")

    def parked(self, topic: str | None = None, key: str | None = None) -> list[ParkedMessage]:
        """Parked messages, per key in seq order (``Inbox.parked``)."""
        return self.inbox.parked(topic, key, tenant=self.tenant)

    def lanes(self, topic: str | None = None) -> list[Lane]:
        """The parked keys (of ``topic``), in (topic, key) order; a topic's unkeyed messages are one."""
        lanes = {(p.topic, p.key) for p in self.parked(topic)}
        return sorted(lanes, key=lambda lane: (lane[0], lane[1] or ""))

    def replay_key(self, topic: str, key: str | None, *, by: str, reason: str) -> ParkedReplay:
        """Replay one key (``Inbox.replay``) and record it; ``NotParkedError`` (recorded too) when none is."""
        done = self._replay(topic, key, by=by, reason=reason)
        if done.result is None:
            raise NotParkedError(done.not_parked)
        return done.result

    def replay(self, lanes: Iterable[Lane], *, by: str, reason: str) -> list[KeyReplayed]:
        """Replay each key in turn, each its own replay: one that fails again stays parked, the rest go on."""
        return [self._replay(topic, key, by=by, reason=reason) for topic, key in lanes]

    def _replay(self, topic: str, key: str | None, *, by: str, reason: str) -> KeyReplayed:
        try:
            result = self.inbox.replay(topic, key, tenant=self.tenant)
        except NotParkedError as exc:
            done = KeyReplayed(topic, key, None, str(exc))
            self.audit.info("replay %s group %s%s by %s (%s): nothing parked", done.name, self.inbox.group,
                            self._at, by, reason)
            return done
        done = KeyReplayed(topic, key, result)
        self.audit.info("replay %s group %s%s by %s (%s): applied %d, remaining %d, unparked %s, error %s",
                        done.name, self.inbox.group, self._at, by, reason, result.applied, result.remaining,
                        result.unparked, result.error)
        return done

    def discard(self, message_id: uuid.UUID | str, *, by: str, reason: str) -> None:
        """Discard one parked message (``Inbox.discard``) and record it, refused or done.

        Raises what ``Inbox.discard`` raises: ``NotParkedError`` or
        ``DiscardRefusedError`` when the key's state forbids it now (recorded
        as refused), ``ValueError`` for a malformed id or an empty ``by`` or
        ``reason`` (not recorded: nothing was asked of the inbox).
        """
        # The audit line names the message as listed (a UUID in any spelling is one id); a malformed
        # one is not recorded: Inbox.discard says what is wrong with it.
        message_id = listed_message_id(message_id)
        try:
            self.inbox.discard(message_id, by=by, reason=reason, tenant=self.tenant)
        except (NotParkedError, DiscardRefusedError) as exc:
            self.audit.info("discard %s group %s%s by %s (%s): refused: %s", message_id, self.inbox.group,
                            self._at, by, reason, exc)
            raise
        self.audit.info("discard %s group %s%s by %s (%s): done", message_id, self.inbox.group, self._at,
                        by, reason)
