"""Registering handlers: the part of ``Inbox`` that says which function takes a topic's messages.

``handler`` and ``batch_handler`` check a function when it is registered —
callable, the arguments it takes, sync or ``async def`` as the inbox is — so
a mistake fails at import time, not on the first message. A mixin of
``Inbox`` by role: it reads the three attributes below, which ``Inbox`` sets.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

import pydantic
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ..core._envelope import Message
from ..core._errors import ConfigurationError
from ..core._events import EventReader
from ..core._validation import validate_topic
from ._calls import TopicHandler, TopicHandlers
from ._kinds import UnknownEvents
from ._sessions import Sessions
from ._typed import HandlerRegistry

H = TypeVar("H", bound=Callable[[Session, Message], Any] | Callable[[AsyncSession, Message], Awaitable[Any]])
B = TypeVar("B", bound=Callable[[Session, list[Message]], Any]
            | Callable[[AsyncSession, list[Message]], Awaitable[Any]])
F = TypeVar("F", bound=Callable[..., Any])


class HandlerRegistration:
    """``handler``, ``batch_handler`` and ``topics`` of ``Inbox``; safe to register from several threads."""

    _handlers: HandlerRegistry
    _sessions: Sessions
    unknown_event: UnknownEvents

    @overload
    def handler(self, topic: str, *, replace: bool = False) -> Callable[[H], H]: ...

    @overload
    def handler(self, topic: str, event: type[pydantic.BaseModel], *,
                replace: bool = False) -> Callable[[F], F]: ...

    def handler(self, topic: str, event: type[pydantic.BaseModel] | None = None, *,
                replace: bool = False) -> Callable[[Any], Any]:
        """Register ``fn(session, message)`` for ``topic``: the untyped handler, one per topic.

        The handler runs inside the inbox's transaction: write through
        ``session``, never commit or roll back. On an inbox built on an
        ``AsyncEngine``, ``fn`` is an ``async def`` function given an
        ``AsyncSession``. Raise to fail (it is retried,
        then parked) or raise ``RetryLater`` / ``SkipMessage`` / ``ParkMessage``.

        With ``event`` (a pydantic model class), a typed handler: called for
        the messages of ``topic`` whose event type is the model's
        (``outbox.event``: its type, aliases, and older versions it has
        upcasters from), as ``fn(session, event)`` with the payload validated
        into the model, or ``fn(session, event, message)`` when it takes a
        third argument. A topic has one handler per event type; its untyped
        handler, if any, takes every other message. A message none takes, or
        whose payload does not validate, follows ``unknown_event``. Messages of
        one key are handled one at a time in seq order, whichever handler each gets.

        A second handler for the same topic (and event type) is refused, unless
        ``replace=True``: then ``fn`` takes the place of the one registered,
        per-message or batch, for the messages that come after (a test
        "deploying the fix" before a replay; in production, deploy and restart).
        The topic's other handlers stay. The checks above apply all the same.
        """
        return self._register(topic, batch=False, event=event, replace=replace)

    @overload
    def batch_handler(self, topic: str, *, replace: bool = False) -> Callable[[B], B]: ...

    @overload
    def batch_handler(self, topic: str, event: type[pydantic.BaseModel], *,
                      replace: bool = False) -> Callable[[F], F]: ...

    def batch_handler(self, topic: str, event: type[pydantic.BaseModel] | None = None, *,
                      replace: bool = False) -> Callable[[Any], Any]:
        """Register ``fn(session, messages)`` for ``topic``: many messages per call, for throughput.

        ``messages`` may hold several consecutive messages of one key, always
        in seq order (a hot key's run), so one ``executemany`` can write them
        all; a write that folds messages into one row per key must follow
        that order. Same contract as ``handler``; when a call raises, the
        inbox rolls back and calls ``fn`` once per message, each in a
        SAVEPOINT, so only the failing message is retried and parked, and
        attempts count only those calls.

        With ``event``, typed as in ``handler``: ``fn(session, events)`` or
        ``fn(session, events, messages)``. A call holds consecutive messages
        of its type only: a key's messages of other types between them go to
        their handlers in seq order, so a batch is cut there.

        ``replace=True`` as in ``handler``.
        """
        return self._register(topic, batch=True, event=event, replace=replace)

    def _register(self, topic: str, *, batch: bool, event: type[pydantic.BaseModel] | None = None,
                  replace: bool = False) -> Callable[[Any], Any]:
        validate_topic(topic)
        reader = None if event is None else EventReader(event)
        many = "events" if batch else "event"

        def register(fn: Any) -> Any:
            if not callable(fn):
                raise ConfigurationError(f"handler for {topic!r} must be callable, got {fn!r}")
            with_message = False
            try:
                if reader is not None and _takes(fn, 3):
                    with_message = True
                else:
                    inspect.signature(fn).bind(None, None)
            except TypeError:
                raise ConfigurationError(
                    f"handler {getattr(fn, '__qualname__', fn)!r} must take "
                    + (f"(session, {'messages' if batch else 'message'})" if reader is None else
                       f"(session, {many}) or (session, {many}, {'messages' if batch else 'message'})")
                ) from None
            if self._sessions.is_async != _is_async(fn):
                raise ConfigurationError(
                    f"handler {getattr(fn, '__qualname__', fn)!r} must be "
                    + ("an async def function: this Inbox is built on an AsyncEngine"
                       if self._sessions.is_async else
                       "a plain function: an async def handler needs an Inbox built on an "
                       "AsyncEngine or async_sessionmaker"))
            handler = TopicHandler(fn, batch=batch, reader=reader, with_message=with_message,
                                   unknown=self.unknown_event)
            if replace:  # a new set, swapped in at once: a worker sees the old handler or the new
                handlers = self._without(topic, handler)
            else:
                handlers = self._handlers.get(topic) or TopicHandlers(topic, self.unknown_event)
            handlers.add(handler)
            self._handlers[topic] = handlers
            return fn

        return register

    def _without(self, topic: str, new: TopicHandler) -> TopicHandlers:
        """A copy of ``topic``'s handlers without the one(s) ``new`` would collide with.

        That is the untyped handler for an untyped ``new``; for a typed one, every
        handler taking one of its event types, under all the types it took.
        """
        old = self._handlers.get(topic)
        kept = TopicHandlers(topic, self.unknown_event)
        if old is None:
            return kept
        if new.reader is None:
            kept.typed = dict(old.typed)
            return kept
        kept.untyped = old.untyped
        displaced = {id(old.typed[t]) for t in new.reader.accepts if t in old.typed}
        kept.typed = {t: h for t, h in old.typed.items() if id(h) not in displaced}
        return kept

    @property
    def topics(self) -> list[str]:
        """The topics with a handler, to subscribe to."""
        return sorted(self._handlers)


def _takes(fn: Any, count: int) -> bool:
    """Whether ``fn`` can be called with ``count`` positional arguments."""
    try:
        inspect.signature(fn).bind(*([None] * count))
    except TypeError:
        return False
    return True


def _is_async(fn: object) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
