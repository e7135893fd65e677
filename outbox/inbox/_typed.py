"""A topic's handlers: one per event type, and the untyped one, which is the fallback.

A typed handler (``@inbox.handler("orders", OrderPaid)``) is chosen by the
message's event type (``Message.event_type``, the ``outbox-event-type``
header) and given the payload validated as its model (``_events.EventReader``:
the model's own type, its aliases, older versions through upcasters). A
message no handler takes, or whose payload its model refuses, follows the
inbox's ``UnknownEvents`` policy: parked with ``Reason.UNKNOWN_EVENT`` /
``Reason.INVALID_EVENT`` (``EventNotHandled``), or recorded as skipped with
the reason (``SkipMessage``). Never dropped: both end in a table.

Choosing a handler per message does not touch order: the inbox orders a key's
messages before any handler runs, whichever handler each one gets.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic

from ..core._envelope import Message
from ..core._errors import ConfigurationError
from ..core._events import EventReader
from ._kinds import Reason, UnknownEvents
from ._signals import ParkMessage, SkipMessage


class EventNotHandled(ParkMessage):
    """A message the typed handlers of its topic cannot take: parked with ``reason``."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TopicHandler:
    """A registered handler: ``fn(session, message)``, or ``fn(session, messages)`` when ``batch``.

    A typed one (``reader`` set) is called ``fn(session, event)`` / ``fn(session,
    events)``, and with the message(s) as a third argument when ``with_message``.
    """

    fn: Callable[..., Any]
    batch: bool = False
    reader: EventReader | None = None
    with_message: bool = False
    unknown: UnknownEvents = UnknownEvents.PARK

    def arguments(self, messages: list[Message]) -> tuple[Any, ...]:
        """What ``fn`` is called with after the session, for these messages (one unless ``batch``)."""
        if self.reader is None:
            return (messages if self.batch else messages[0],)
        events = [self._read(m) for m in messages]
        if self.batch:
            return (events, messages) if self.with_message else (events,)
        return (events[0], messages[0]) if self.with_message else (events[0],)

    def _read(self, m: Message) -> pydantic.BaseModel:
        assert self.reader is not None and m.event_type is not None  # chosen by its type
        try:
            return self.reader.read(m.event_type, m.payload)
        except (pydantic.ValidationError, ValueError, TypeError, KeyError, json.JSONDecodeError) as exc:
            detail = (f"{m.event_type!r} payload does not validate as "
                      f"{self.reader.model.__name__}: {exc}")
            raise unhandled(self.unknown, Reason.INVALID_EVENT, detail) from exc


def unhandled(policy: UnknownEvents, reason: Reason, detail: str) -> ParkMessage | SkipMessage:
    """What to raise for a message the typed handlers cannot take, under ``policy``."""
    if policy is UnknownEvents.SKIP:
        return SkipMessage(f"{reason}: {detail}")
    return EventNotHandled(reason, detail)


class TopicHandlers:
    """The handlers of one topic; registered before consuming, then only read."""

    __slots__ = ("topic", "typed", "unknown", "untyped")

    def __init__(self, topic: str, unknown: UnknownEvents) -> None:
        self.topic = topic
        self.unknown = unknown
        self.untyped: TopicHandler | None = None
        self.typed: dict[str, TopicHandler] = {}

    @classmethod
    def only(cls, topic: str, handler: TopicHandler) -> TopicHandlers:
        """A topic whose one handler is ``handler`` (tests swap a topic's handlers so)."""
        handlers = cls(topic, handler.unknown)
        handlers.add(handler)
        return handlers

    def add(self, handler: TopicHandler) -> None:
        """Register ``handler``; refuse a second untyped one, or a type two handlers would take."""
        if handler.reader is None:
            if self.untyped is not None:
                raise ConfigurationError(f"topic {self.topic!r} already has a handler: one untyped "
                                         "handler per topic (a typed one takes one event type)")
            self.untyped = handler
            return
        taken = [t for t in handler.reader.accepts if t in self.typed]
        if taken:
            raise ConfigurationError(
                f"topic {self.topic!r} already has a handler for event type(s) {taken}: one "
                "handler per event type")
        for event_type in handler.reader.accepts:
            self.typed[event_type] = handler

    def find(self, message: Message) -> TopicHandler | None:
        """The handler of ``message``: its type's, else the untyped one, else None."""
        if message.event_type is not None:
            handler = self.typed.get(message.event_type)
            if handler is not None:
                return handler
        return self.untyped

    def choose(self, message: Message) -> TopicHandler:
        """``find``, or raise what the policy says for a message no handler takes."""
        handler = self.find(message)
        if handler is None:
            kind = "no event type" if message.event_type is None else f"event type {message.event_type!r}"
            raise unhandled(self.unknown, Reason.UNKNOWN_EVENT,
                            f"topic {self.topic!r} has no handler for {kind} (typed handlers: "
                            f"{sorted(self.typed)[:10]}) and no untyped handler")
        return handler


class HandlerRegistry(dict[str, TopicHandlers]):
    """Topic -> its handlers; ``Inbox.handler(..., replace=True)`` is how a handler is swapped."""
