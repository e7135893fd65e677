"""Calling a topic's handler inside an inbox transaction, and catching what it raised.

Which handler is the message's: its event type's, else the topic's untyped one
(``_typed.TopicHandlers``); a batch goes to a batch handler in runs of
consecutive messages of one handler, so a key's order holds across types.

A call runs either bare (the first pass over a batch: savepoints cost two
round trips per message, ``AllAtOnce``) or in its own SAVEPOINT (the redo
after a failure, retries, replays: ``OneByOne``), so a failure rolls back
only that call's writes. Either way a ``Budget`` may end the calls early:
once the transaction is ``batch_budget`` seconds old, no handler starts, and
what was not called is *deferred* to the next transaction (it is nobody's
attempt); the first call always runs, so every transaction makes progress.
A failure comes back as an ``Error`` for the settle stage; a database
outage under the handler is raised as ``Outage``: the whole transaction is
lost, and it is nobody's attempt.

On an async inbox (``_sessions``) the call is the one thing that differs: the
handler is called with the ``AsyncSession`` around the transaction's session
and awaited from inside the transaction (``await_result``).

Each call is traced when OpenTelemetry records (``_tracing``): a per-message
handler gets a ``process {topic}`` span per message, continuing the trace in
the message's ``traceparent``; a batch handler gets one span per call, linked
to each message's context. This is the one place that knows both the handler
call and each message's partition and offset.
"""

from __future__ import annotations

import inspect
import time
import traceback
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from sqlalchemy.orm import Session

from ..core._envelope import Message
from ..core._tracing import process_batch_span, process_span
from ._delivery import Delivery
from ._metrics import InboxMetrics
from ._outage import Outage, is_handler_outage
from ._sessions import async_view, await_result
from ._signals import ParkMessage
from ._typed import TopicHandler, TopicHandlers

__all__ = [
    "AllAtOnce", "Budget", "Error", "HandlerCalls", "Handlers", "OneByOne", "Redo", "TopicHandler",
    "TopicHandlers",
]

Error = tuple[BaseException, str]
"""An exception and its formatted traceback."""


class Redo(Exception):
    """A handler failed in a batch without savepoints: roll it all back, redo with savepoints.

    ``delivery`` is the message that failed, when a call had only that one.
    """

    def __init__(self, delivery: Delivery | None, error: Error) -> None:
        super().__init__(f"redo batch: {error[0]!r}")
        self.delivery = delivery
        self.error = error


class Budget:
    """When one transaction stops starting handlers: ``seconds`` after it began, once one ran.

    None: never (an operator's replay runs what it was given). A batch of a
    slow handler commits what ran instead of holding its transaction, and its
    keys' locks, for ``batch_size`` calls.
    """

    def __init__(self, seconds: float | None) -> None:
        self._ends = None if seconds is None else time.monotonic() + seconds
        self._called = False

    def called(self) -> None:
        """A handler ran (or its failure was reused): the transaction made progress."""
        self._called = True

    def spent(self) -> bool:
        """Whether no further handler may start in this transaction."""
        return self._called and self._ends is not None and time.monotonic() >= self._ends


class HandlerCalls:
    """Runs the registered handlers; safe from several threads (each call has its own session)."""

    def __init__(self, handlers: Mapping[str, TopicHandlers], metrics: InboxMetrics, group: str) -> None:
        self.handlers = handlers
        self.metrics = metrics
        self.group = group

    def unguarded(self, session: Session, fresh: list[Delivery], budget: Budget) -> set[uuid.UUID]:
        """Run the handlers without savepoints, a batch handler once per topic; ``Redo`` on a failure.

        ``fresh`` holds each key's messages in seq order; a batch handler gets them in that order.
        Returns the ids of the messages not called because ``budget`` was spent: the tail of
        each key's run, as calls go in ``fresh``'s order.
        """
        by_topic: dict[str, list[Delivery]] = {}
        for d in fresh:
            by_topic.setdefault(d.message.topic, []).append(d)
        called: set[uuid.UUID] = set()
        for topic, group in by_topic.items():
            for handler, run in self._runs(topic, group):
                if budget.spent():
                    return {d.message.message_id for d in fresh} - called
                if handler is not None and handler.batch and len(run) > 1:
                    error = self._call(session, topic, run, savepoint=False)
                    if error is not None:
                        raise Redo(None, error)  # which message failed is found by the redo
                    budget.called()
                    called.update(d.message.message_id for d in run)
                    continue
                for d in run:
                    if budget.spent():
                        return {d.message.message_id for d in fresh} - called
                    error = self._call(session, topic, [d], savepoint=False)
                    if error is not None:
                        raise Redo(d, error)
                    budget.called()
                    called.add(d.message.message_id)
        return set()

    def _runs(self, topic: str,
              group: list[Delivery]) -> Iterator[tuple[TopicHandler | None, list[Delivery]]]:
        """``group`` cut into runs of consecutive deliveries that go to one handler.

        Consecutive, not gathered: a batch handler of OrderPaid must not run a
        key's OrderPaid before another handler ran the same key's earlier OrderCreated.
        """
        handlers = self.handlers.get(topic)
        run: list[Delivery] = []
        current: TopicHandler | None = None
        for d in group:
            handler = None if handlers is None else handlers.find(d.message)
            if run and handler is not current:
                yield current, run
                run = []
            current = handler
            run.append(d)
        if run:
            yield current, run

    def one(self, session: Session, d: Delivery) -> Error | None:
        """Run the topic's handler for ``d`` alone in a SAVEPOINT; the error and traceback if it raised.

        Raises ``Outage`` when the database failed under the handler.
        """
        return self._call(session, d.message.topic, [d], savepoint=True)

    def _call(self, session: Session, topic: str, deliveries: list[Delivery], *,
              savepoint: bool) -> Error | None:
        handlers = self.handlers.get(topic)
        started = time.perf_counter()
        nested = session.begin_nested() if savepoint else None
        try:
            if handlers is None:
                raise ParkMessage(f"no handler registered for topic {topic!r}")
            self._run(handlers.choose(deliveries[0].message), session, topic, deliveries)
            session.flush()
            if nested is not None:
                nested.commit()
        except Exception as exc:
            if is_handler_outage(exc):
                raise Outage(f"the database failed under the handler: {exc!r}") from exc
            if nested is not None:
                try:
                    nested.rollback()
                except Exception as rollback_error:
                    if is_handler_outage(rollback_error):
                        raise Outage(f"rollback failed: {rollback_error!r}") from rollback_error
                    raise
            # A failed call of several messages is no one's attempt yet: the redo finds whose it is.
            self.metrics.ran(topic, time.perf_counter() - started, failed=len(deliveries) == 1)
            return exc, traceback.format_exc()
        self.metrics.ran(topic, time.perf_counter() - started, failed=False)
        return None

    def _run(self, handler: TopicHandler, session: Session, topic: str,
             deliveries: list[Delivery]) -> None:
        """Call ``handler`` once (batch) or once per delivery, each call inside its span."""
        if handler.batch:
            messages: list[Message] = [d.message for d in deliveries]
            with process_batch_span(topic, [m.headers for m in messages], group=self.group,
                                    count=len(messages)):
                _invoke(handler, session, handler.arguments(messages))
            return
        for d in deliveries:
            m = d.message
            with process_span(topic, m.headers, message_id=str(m.message_id), key=m.key,
                              group=self.group, partition=d.partition, offset=d.offset):
                _invoke(handler, session, handler.arguments([m]))


class Handlers(Protocol):
    """How the run phase calls the handlers: all at once, or each message in its SAVEPOINT."""

    def call(self, session: Session, fresh: list[Delivery]) -> None:
        """Before the run phase walks ``fresh``: the calls that need no SAVEPOINT."""

    def deferred(self, d: Delivery) -> bool:
        """Whether ``d`` waits for the next transaction: the budget was spent before its call."""

    def error(self, session: Session, d: Delivery) -> Error | None:
        """What ``d``'s handler raised, calling it now if it was not called yet."""


class AllAtOnce:
    """The first pass over a batch: every handler called bare, ``Redo`` on the first failure."""

    def __init__(self, calls: HandlerCalls, budget: float | None = None) -> None:
        self.calls = calls
        self.budget = Budget(budget)
        self.unrun: set[uuid.UUID] = set()

    def call(self, session: Session, fresh: list[Delivery]) -> None:
        self.unrun |= self.calls.unguarded(session, fresh, self.budget)

    def deferred(self, d: Delivery) -> bool:
        return d.message.message_id in self.unrun

    def error(self, session: Session, d: Delivery) -> Error | None:
        return None  # a failure raised Redo in call()


class OneByOne:
    """The redo, retries and replays: each handler in its own SAVEPOINT; a failure rolls back only it."""

    def __init__(self, calls: HandlerCalls, known: dict[uuid.UUID, Error],
                 budget: float | None = None) -> None:
        self.calls = calls
        self.known = known
        """Failures met by the first pass: reused, not run again."""
        self.budget = Budget(budget)

    def call(self, session: Session, fresh: list[Delivery]) -> None:
        pass

    def deferred(self, d: Delivery) -> bool:
        # A failure the first pass met costs no call: settled here, it counts its attempt. Deferred,
        # its handler would run again uncounted, after a redo (slower than the first pass) ran late.
        return d.message.message_id not in self.known and self.budget.spent()

    def error(self, session: Session, d: Delivery) -> Error | None:
        self.budget.called()
        return self.known.get(d.message.message_id) or self.calls.one(session, d)


def _invoke(handler: TopicHandler, session: Session, args: tuple[Any, ...]) -> None:
    """``fn(session, *args)``; on an async inbox ``await fn(async_session, *args)``.

    A result of the wrong kind is the handler's failure, never a silent success:
    an un-awaited coroutine would record the message as applied without its writes.
    """
    view = async_view(session)
    result = handler.fn(session if view is None else view, *args)
    if view is None and inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise TypeError(f"handler {_name(handler.fn)} returned an awaitable: an async handler needs "
                        f"an Inbox built on an AsyncEngine or async_sessionmaker")
    if view is not None:
        if not inspect.isawaitable(result):
            raise TypeError(f"handler {_name(handler.fn)} returned {type(result).__name__}, not an "
                            f"awaitable: an Inbox on an AsyncEngine takes async def handlers")
        await_result(result)


def _name(fn: Any) -> str:
    return repr(getattr(fn, "__qualname__", fn))
