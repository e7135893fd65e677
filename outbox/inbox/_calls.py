"""Calling a topic's handler inside an inbox transaction, and catching what it raised.

A call runs either bare (the first pass over a batch: savepoints cost two
round trips per message) or in its own SAVEPOINT (the redo after a failure,
retries, replays), so a failure rolls back only that call's writes. A failure
comes back as an ``Error`` for the settle stage; a database outage under the
handler is raised as ``Outage``: the whole transaction is lost, and it is
nobody's attempt.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from .._envelope import Message
from ._delivery import Delivery
from ._metrics import InboxMetrics
from ._outage import Outage, is_outage
from ._signals import ParkMessage

Error = tuple[BaseException, str]
"""An exception and its formatted traceback."""


@dataclass(frozen=True, slots=True)
class TopicHandler:
    """A registered handler: ``fn(session, message)``, or ``fn(session, messages)`` when ``batch``."""

    fn: Callable[[Session, Any], Any]
    batch: bool = False

    def __call__(self, session: Session, messages: list[Message]) -> None:
        if self.batch:
            self.fn(session, messages)
        else:
            for message in messages:
                self.fn(session, message)


class Redo(Exception):
    """A handler failed in a batch without savepoints: roll it all back, redo with savepoints.

    ``delivery`` is the message that failed, when a call had only that one.
    """

    def __init__(self, delivery: Delivery | None, error: Error) -> None:
        super().__init__(f"redo batch: {error[0]!r}")
        self.delivery = delivery
        self.error = error


class HandlerCalls:
    """Runs the registered handlers; safe from several threads (each call has its own session)."""

    def __init__(self, handlers: Mapping[str, TopicHandler], metrics: InboxMetrics) -> None:
        self.handlers = handlers
        self.metrics = metrics

    def unguarded(self, session: Session, fresh: list[Delivery]) -> None:
        """Run the handlers without savepoints, a batch handler once per topic; ``Redo`` on a failure.

        ``fresh`` holds each key's messages in seq order; a batch handler gets them in that order.
        """
        by_topic: dict[str, list[Delivery]] = {}
        for d in fresh:
            by_topic.setdefault(d.message.topic, []).append(d)
        for topic, group in by_topic.items():
            handler = self.handlers.get(topic)
            if handler is not None and handler.batch and len(group) > 1:
                error = self._call(session, topic, [d.message for d in group], savepoint=False)
                if error is not None:
                    raise Redo(None, error)  # which message failed is found by the redo
                continue
            for d in group:
                error = self._call(session, topic, [d.message], savepoint=False)
                if error is not None:
                    raise Redo(d, error)

    def one(self, session: Session, d: Delivery) -> Error | None:
        """Run the topic's handler for ``d`` alone in a SAVEPOINT; the error and traceback if it raised.

        Raises ``Outage`` when the database failed under the handler.
        """
        return self._call(session, d.message.topic, [d.message], savepoint=True)

    def _call(self, session: Session, topic: str, messages: list[Message], *,
              savepoint: bool) -> Error | None:
        handler = self.handlers.get(topic)
        started = time.perf_counter()
        nested = session.begin_nested() if savepoint else None
        try:
            if handler is None:
                raise ParkMessage(f"no handler registered for topic {topic!r}")
            handler(session, messages)
            session.flush()
            if nested is not None:
                nested.commit()
        except Exception as exc:
            if is_outage(exc):
                raise Outage(f"the database failed under the handler: {exc!r}") from exc
            if nested is not None:
                try:
                    nested.rollback()
                except Exception as rollback_error:
                    if is_outage(rollback_error):
                        raise Outage(f"rollback failed: {rollback_error!r}") from rollback_error
                    raise
            # A failed call of several messages is no one's attempt yet: the redo finds whose it is.
            self.metrics.ran(topic, time.perf_counter() - started, failed=len(messages) == 1)
            return exc, traceback.format_exc()
        self.metrics.ran(topic, time.perf_counter() - started, failed=False)
        return None
