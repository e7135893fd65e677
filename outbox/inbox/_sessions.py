"""Where the inbox's transactions run: in the calling thread (sync), or on the inbox's event loop (async).

The inbox has one set of rules, written as synchronous code against a
``Session``: the transaction step, the storage's statements, replay, discard and
the gap sweep. An inbox on an ``AsyncEngine`` runs that same code, unchanged,
inside SQLAlchemy's greenlet bridge (``greenlet_spawn``) on an event loop
thread of its own: the sync ``Session`` it gets is the ``sync_session`` of an
``AsyncSession``, its statements go through the async driver (asyncpg,
psycopg async, aiosqlite), and the one thing that differs — the handler call
— awaits the ``async def`` handler with that ``AsyncSession`` (``await_``), so
the handler's writes, the dedup row and the key's ``last_seq`` are still one
transaction.

One loop serves all the worker threads, and every inbox on the same engine:
asyncpg connections belong to the loop that opened them, so a pool shared by
several loops would hand a connection to the wrong one. The worker threads
keep what they do (key scheduling, settling, retry timers, alerts); each
waits for its transaction's result. That loop is the engine's: give an async
inbox an engine that no other event loop uses.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import greenlet
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.util import greenlet_spawn

from ..core._engine import root_engine, worker_engine

try:
    from sqlalchemy.util import await_
except ImportError:  # SQLAlchemy 2.0 names it await_only
    from sqlalchemy.util import await_only as await_

from transports._logsafe import safe_logger

from ..core._errors import ConfigurationError

log = safe_logger("outbox.inbox")

T = TypeVar("T")

_ASYNC_VIEW = "outbox.inbox.async_session"


def in_greenlet() -> bool:
    """Running inside ``greenlet_spawn`` (SQLAlchemy marks its greenlets; 2.0 has no public test)."""
    return getattr(greenlet.getcurrent(), "__sqlalchemy_greenlet_provider__", False) is True


class Sessions:
    """Opens the inbox's sessions and runs the functions that use them; safe from several threads."""

    engine: Engine
    """The sync engine: dialect, URL, pool (an async engine's ``sync_engine``)."""
    is_async = False

    def __call__(self) -> Session:
        raise NotImplementedError

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Call ``fn(*args)`` where this inbox's sessions work; its result or its exception."""
        raise NotImplementedError


class SyncSessions(Sessions):
    """A sync ``sessionmaker``: everything runs in the calling thread."""

    def __init__(self, maker: sessionmaker[Session]) -> None:
        self.maker = maker
        self.engine = maker.kw["bind"]

    def __call__(self) -> Session:
        return self.maker()

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)


class AsyncSessions(Sessions):
    """An ``async_sessionmaker``: functions run in a greenlet on its engine's event loop thread.

    The loop thread starts on first use, is shared by every ``AsyncSessions``
    on the same engine, and ends when that engine is gone (``_stop``).
    ``run`` called from inside a function it runs (replay calls the
    transaction step) runs the nested function in place.
    """

    is_async = True

    def __init__(self, maker: async_sessionmaker[AsyncSession]) -> None:
        self.maker = maker
        self.async_engine: AsyncEngine = maker.kw["bind"]
        self.engine = self.async_engine.sync_engine

    def __call__(self) -> Session:
        session = self.maker()
        sync = session.sync_session
        sync.info[_ASYNC_VIEW] = session  # the handler's view of it; kept alive with it
        return sync

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        if threading.current_thread() in _loop_threads:
            if in_greenlet():
                return fn(*args)
            raise RuntimeError("an async inbox's blocking call (handle, replay, …) was made on the "
                               "inbox's own event loop: it would wait for itself")
        return asyncio.run_coroutine_threadsafe(greenlet_spawn(fn, *args), _loop_of(self.engine)).result()


_loops: weakref.WeakKeyDictionary[Engine, asyncio.AbstractEventLoop] = weakref.WeakKeyDictionary()
_loop_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_loops_lock = threading.Lock()


def _loop_of(engine: Engine) -> asyncio.AbstractEventLoop:
    """The event loop that every async inbox on ``engine`` uses, on a thread of its own; started once.

    Keyed by the engine that owns the pool (``root_engine``), not by ``engine``
    itself: an engine with other execution options (the READ COMMITTED worker
    engine on MySQL) shares its pool, and a pooled asyncio connection works
    only on the loop that opened it. Not by the pool either: ``dispose()``
    gives the engine a new pool, and a transaction that looked up the loop just
    before would open a connection of the new pool on the old pool's loop.
    The loop lives as long as that engine (``_stop``).
    """
    root = root_engine(engine)
    with _loops_lock:
        found = _loops.get(root)
        if found is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=_serve, args=(loop,), name="outbox-inbox-loop", daemon=True)
            _loop_threads.add(thread)
            thread.start()
            found = _loops[root] = loop
            weakref.finalize(root, _stop, loop, os.getpid())
        return found


def _forget_loops() -> None:
    """In a child made by ``os.fork()``: the parent's loop threads were not copied, only their
    loops, which nothing runs here; a call waiting on one waited for ever. The child starts loops
    of its own, on first use (its pooled connections are the parent's: SQLAlchemy's rule for a
    fork, ``engine.dispose(close=False)`` in the child, still holds)."""
    global _loops_lock
    _loops_lock = threading.Lock()  # a thread of the parent may have held it at the fork
    _loops.clear()
    _loop_threads.clear()


os.register_at_fork(after_in_child=_forget_loops)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The loop thread: runs ``loop`` until ``_stop``, then closes it."""
    try:
        loop.run_forever()
    finally:
        loop.close()


def _stop(loop: asyncio.AbstractEventLoop, pid: int) -> None:
    """End an engine's loop thread once the engine is gone: nothing can use the loop any more, and
    a process that makes engines as it goes (a tenant's database, each test) otherwise kept one
    idle thread per engine it ever had. Not in a forked child: the loop runs in the parent."""
    if pid == os.getpid() and not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)


def async_view(session: Session) -> AsyncSession | None:
    """The ``AsyncSession`` around ``session`` (what an async handler is given); None on a sync inbox."""
    return session.info.get(_ASYNC_VIEW)


def await_result(awaitable: Any) -> Any:
    """Wait for ``awaitable`` from inside a function ``AsyncSessions.run`` runs."""
    return await_(awaitable)


def sessions_for(bind: object) -> tuple[Sessions, sessionmaker[Session] | async_sessionmaker[AsyncSession]]:
    """The inbox's ``Sessions`` for what the user passed, and the session maker it wraps.

    Its transactions run on the worker engine (``worker_engine``: READ COMMITTED
    on MySQL/MariaDB, the level the inbox's SQL was proved at); a session maker
    the user passed is copied onto it, keeping its other settings.
    """
    if isinstance(bind, Engine):
        bind = sessionmaker(bind, expire_on_commit=False)
    elif isinstance(bind, AsyncEngine):
        bind = async_sessionmaker(bind, expire_on_commit=False)
    if isinstance(bind, sessionmaker) and isinstance(bind.kw.get("bind"), Engine):
        engine = worker_engine(bind.kw["bind"])
        if engine is not bind.kw["bind"]:
            bind = sessionmaker(class_=bind.class_, **{**bind.kw, "bind": engine})
        return SyncSessions(bind), bind
    if isinstance(bind, async_sessionmaker) and isinstance(bind.kw.get("bind"), AsyncEngine):
        async_engine = worker_engine(bind.kw["bind"])
        if async_engine is not bind.kw["bind"]:
            bind = async_sessionmaker(class_=bind.class_, **{**bind.kw, "bind": async_engine})
        return AsyncSessions(bind), bind
    raise ConfigurationError(f"Inbox needs an Engine or AsyncEngine, or a sessionmaker or "
                             f"async_sessionmaker bound to one, got {bind!r}")


def warn_small_pool(engine: Engine, concurrency: int) -> None:
    """Warn when ``concurrency`` workers would wait for connections of ``engine``'s pool."""
    size = getattr(engine.pool, "size", None)
    overflow = getattr(engine.pool, "_max_overflow", 0)
    if callable(size) and concurrency > size() + max(overflow, 0):
        log.warning("concurrency=%d exceeds the engine's pool (%d + %d overflow): workers will "
                    "wait for connections; create the engine with pool_size=%d",
                    concurrency, size(), overflow, concurrency)
