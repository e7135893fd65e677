"""What only an async inbox has: `async def` handlers awaited on the transaction's `AsyncSession`.

The inbox's rules are proved for both kinds by the core, holes and crash
tests (parametrised over ``INBOX_KINDS``); here are the seams: the session an
async handler gets is the transaction's, on every asyncio driver we support,
and a handler of the wrong kind can never pass for an applied message.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from outbox import Disposition, Inbox, Message, create_async_engine
from tests.inbox_support import TOPIC, AlertLog, applied, async_url, business, dispose, effects, record


@pytest.fixture(params=["aiosqlite", "asyncpg", "psycopg"])
def async_inbox(request: pytest.FixtureRequest, tmp_path) -> Iterator[tuple[Inbox, sa.Engine]]:  # type: ignore[no-untyped-def]
    """An async Inbox through each asyncio driver, and a sync engine on its database to look."""
    if request.param == "aiosqlite":
        url = request.getfixturevalue("sqlite_db")
    else:
        url = request.getfixturevalue("postgres_db")
    driver = {"aiosqlite": "sqlite+aiosqlite", "asyncpg": "postgresql+asyncpg",
              "psycopg": "postgresql+psycopg"}[request.param]
    from outbox import create_engine

    engine = create_engine(url)
    inbox = Inbox(create_async_engine(sa.make_url(async_url(url)).set(drivername=driver)
                                      .render_as_string(hide_password=False)),
                  group="async", retry_backoff=0.001, retry_backoff_max=0.01, alert=AlertLog())
    inbox.create_tables()
    business.create_all(engine)
    yield inbox, engine
    dispose(inbox)
    engine.dispose()


def test_the_handler_writes_through_the_transactions_async_session(async_inbox) -> None:  # type: ignore[no-untyped-def]
    inbox, engine = async_inbox
    sessions: list[object] = []

    @inbox.handler(TOPIC)
    async def handle(session, message):  # type: ignore[no-untyped-def]
        sessions.append(session)
        await session.execute(effects.insert().values(topic=message.topic, key=message.key,
                                                      seq=message.seq, message_id=message.message_id))
        await asyncio.sleep(0)  # a real suspension inside the transaction
        if message.seq == 2:
            raise ValueError("after the write")  # the write must roll back with the transaction

    first = record(TOPIC, "a", 1)
    assert inbox.handle(first) is Disposition.APPLIED
    assert inbox.handle(first) is Disposition.DUPLICATE  # a redelivery: only a known id is one
    assert inbox.handle(record(TOPIC, "a", 2)) is Disposition.PARKED
    assert applied(engine) == [("a", 1)]  # seq 2's three attempts wrote nothing
    assert all(isinstance(s, AsyncSession) for s in sessions) and len(sessions) == 4
    [parked] = inbox.parked()
    assert (parked.seq, parked.attempts) == (2, 3) and "after the write" in parked.error
    inbox.handler(TOPIC, replace=True)(_insert)  # the fix is deployed
    assert inbox.replay(TOPIC, "a").unparked
    assert applied(engine) == [("a", 1), ("a", 2)]


async def _insert(session, message) -> None:  # type: ignore[no-untyped-def]
    await session.execute(effects.insert().values(topic=message.topic, key=message.key,
                                                  seq=message.seq, message_id=message.message_id))


def test_an_async_batch_handler_gets_the_batch_in_one_awaited_call(async_inbox) -> None:  # type: ignore[no-untyped-def]
    inbox, engine = async_inbox
    calls: list[int] = []

    @inbox.batch_handler(TOPIC)
    async def handle(session, messages):  # type: ignore[no-untyped-def]
        calls.append(len(messages))
        await session.execute(effects.insert(), [
            {"topic": m.topic, "key": m.key, "seq": m.seq, "message_id": m.message_id} for m in messages])

    from tests.inbox_support import settle_all

    records = [record(TOPIC, f"k{n}", 1) for n in range(5)]
    assert {disposition for _, disposition in settle_all(inbox, records)} == {Disposition.APPLIED}
    assert calls == [5] and len(applied(engine)) == 5


class _LooksAsync:
    """A callable that ``inspect`` takes for an ``async def`` function (as a mock or a careless
    decorator can be) and that returns None: the registration check cannot see through it."""

    __name__ = __qualname__ = "looks_async"
    __code__ = _insert.__code__
    __defaults__ = None
    __kwdefaults__ = None
    __annotations__: dict[str, object] = {}

    def __call__(self, session: object, message: object) -> None:
        return None


def test_a_handler_of_the_wrong_kind_fails_and_parks_never_applies(async_inbox, sqlite_db: str) -> None:  # type: ignore[no-untyped-def]
    inbox, engine = async_inbox
    inbox.handler(TOPIC)(_LooksAsync())  # passes the registration check, returns no awaitable
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.PARKED
    assert "not an awaitable" in inbox.parked()[0].error

    from outbox import create_engine

    sync = Inbox(create_engine(sqlite_db), group="sync", retry_backoff=0.001, alert=AlertLog())
    sync.create_tables()
    # A plain function returning a coroutine passes the check: one nobody awaits would write nothing.
    sync.handler(TOPIC)(lambda session, message: _insert(session, message))
    assert sync.handle(record(TOPIC, "b", 1)) is Disposition.PARKED
    assert "returned an awaitable" in sync.parked()[0].error
    assert applied(engine) == []


def test_a_blocking_call_from_the_inbox_loop_is_refused_not_a_deadlock(async_inbox) -> None:  # type: ignore[no-untyped-def]
    inbox, _ = async_inbox
    refused: list[BaseException] = []

    @inbox.handler(TOPIC)
    async def handle(session, message):  # type: ignore[no-untyped-def]
        try:
            inbox.parked()
        except RuntimeError as exc:
            refused.append(exc)
        await _insert(session, message)

    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED
    assert len(refused) == 1 and "would wait for itself" in str(refused[0])


@pytest.fixture
def pg_async(postgres_db: str) -> Iterator[tuple[Inbox, sa.Engine]]:
    """An async Inbox on asyncpg with 16 workers, and a sync engine on its database to look."""
    from outbox import create_engine

    engine = create_engine(postgres_db)
    inbox = Inbox(create_async_engine(async_url(postgres_db), pool_size=20), group="async-kafka",
                  concurrency=16, batch_size=1, retry_backoff=0.001, alert=AlertLog())
    inbox.create_tables()
    business.create_all(engine)
    yield inbox, engine
    dispose(inbox)
    engine.dispose()


@pytest.mark.postgres
def test_async_handlers_of_different_keys_of_one_partition_overlap_one_key_at_a_time(
    pg_async, kafka: str, topic: str  # type: ignore[no-untyped-def]
) -> None:
    """Key-ordered concurrency, async: the workers' transactions interleave at the handlers' awaits."""
    from tests.test_inbox_kafka import produce, running, wait_for

    inbox, engine = pg_async
    running_now: dict[str, int] = {}
    peak = {"all": 0, "per_key": 0}

    @inbox.handler(topic)
    async def handle(session, message):  # type: ignore[no-untyped-def]
        running_now[message.key] = running_now.get(message.key, 0) + 1  # one loop: no lock needed
        peak["all"] = max(peak["all"], sum(running_now.values()))
        peak["per_key"] = max(peak["per_key"], running_now[message.key])
        await asyncio.sleep(0.02)  # I/O-bound
        running_now[message.key] -= 1
        await _insert(session, message)

    produce(kafka, [record(topic, f"k{k}", seq) for seq in range(1, 6) for k in range(40)], partition=0)
    with running(inbox, kafka, topic):
        wait_for(lambda: len(applied(engine)) == 200, what="200 applied")
    assert peak["per_key"] == 1
    assert peak["all"] >= 8, f"only {peak['all']} handlers ever ran at once on 16 workers"
    for k in range(40):
        assert [s for _, s in applied(engine, f"k{k}")] == [1, 2, 3, 4, 5]


@pytest.mark.postgres
def test_an_async_handler_waiting_holds_back_only_its_key_and_the_offset(
    pg_async, kafka: str, topic: str  # type: ignore[no-untyped-def]
) -> None:
    from tests.test_inbox_kafka import committed, produce, running, wait_for

    inbox, engine = pg_async
    release = asyncio.Event()
    loop: list[asyncio.AbstractEventLoop] = []

    @inbox.handler(topic)
    async def handle(session, message):  # type: ignore[no-untyped-def]
        if message.key == "slow":
            loop.append(asyncio.get_running_loop())
            await asyncio.wait_for(release.wait(), 30)
        await _insert(session, message)

    produce(kafka, [record(topic, "a", 1), record(topic, "slow", 1),
                    *[record(topic, f"k{i}", 1) for i in range(20)]], partition=0)
    with running(inbox, kafka, topic):
        wait_for(lambda: len(applied(engine)) == 21, what="everything but the slow key applied")
        # Committed up to the slow record (a loaded host may take longer than two commit
        # intervals to get there), and still there two intervals later: never past it.
        wait_for(lambda: committed(kafka, inbox.group, topic)[0] == 1, what="offset 1 committed")
        time.sleep(1.2)
        assert committed(kafka, inbox.group, topic)[0] == 1  # stuck at the slow record's offset
        loop[0].call_soon_threadsafe(release.set)
        wait_for(lambda: committed(kafka, inbox.group, topic)[0] == 22, what="commit after release")
    assert len(applied(engine)) == 22


def _loop_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in set(threading.enumerate()) - before if t.name == "outbox-inbox-loop"]


def test_the_loop_thread_outlives_dispose_and_ends_with_its_engine(sqlite_db: str) -> None:
    """An async inbox's loop belongs to its engine: ``engine.dispose()`` (a new pool) keeps it, so
    every connection of the engine, old pool or new, opens on that one loop; two inboxes on the
    engine share it; dropping the engine ends the thread (it used to run idle until the process
    exited: one thread per engine ever made, 85 of them in one test worker)."""
    from outbox import create_engine

    engine = create_engine(sqlite_db)
    business.create_all(engine)
    engine.dispose()
    before = set(threading.enumerate())
    async_engine = create_async_engine(async_url(sqlite_db))
    inbox = Inbox(async_engine, group="loops", alert=AlertLog())
    inbox.create_tables()
    other = Inbox(async_engine, group="loops-too", alert=AlertLog())
    other.create_tables()
    thread, = _loop_threads(before)

    @inbox.handler(TOPIC)
    async def handle(session: AsyncSession, message: Message) -> None:
        await _insert(session, message)

    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED
    dispose(inbox)
    assert inbox.handle(record(TOPIC, "a", 2)) is Disposition.APPLIED  # the new pool, the same loop
    assert _loop_threads(before) == [thread]
    dispose(inbox)
    del inbox, other, handle, async_engine
    gc.collect()
    thread.join(5)
    assert not thread.is_alive(), "a dropped engine's loop thread still runs"


_FORKS = """
import os, threading
from outbox import Disposition, Inbox, create_async_engine
from tests.inbox_support import TOPIC, AlertLog, record

async def handle(session, message):
    pass

engine = create_async_engine(URL)
inbox = Inbox(engine, group="forks", alert=AlertLog())
inbox.create_tables()
inbox.handler(TOPIC)(handle)
assert inbox.handle(record(TOPIC, "parent", 1)) is Disposition.APPLIED  # its loop thread runs
pid = os.fork()
if pid == 0:
    # SQLAlchemy's rule for a fork: the parent's connections stay its own
    engine.sync_engine.dispose(close=False)
    done = []
    child = threading.Thread(target=lambda: done.append(inbox.handle(record(TOPIC, "child", 1))), daemon=True)
    child.start()
    child.join(20)
    print("child:", done[0].name if done else "waits", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
assert inbox.handle(record(TOPIC, "parent", 2)) is Disposition.APPLIED  # the parent's loop goes on
print("parent: APPLIED", flush=True)
"""


def test_a_forked_child_runs_the_inbox_on_a_loop_of_its_own(sqlite_db: str) -> None:
    """``os.fork()`` copies the loop but not its thread: the child's first transaction waited for
    ever on a loop nothing ran. The child now starts its own; the parent's goes on."""
    script = f"URL = {async_url(sqlite_db)!r}\n" + _FORKS
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["child: APPLIED", "parent: APPLIED"], (
        done.stdout, done.stderr[-3000:])
