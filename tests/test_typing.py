"""Type checkers accept the producer API: ``@transactional`` functions are called without the session.

mypy runs on ``typed_usage.py`` (must pass ``--strict``) and on a snippet with
a wrong argument (must fail: the decorator keeps the signature, minus the
session, instead of hiding it behind ``Any``). The usage file also runs.

One mypy run checks every file of the three tests that need it (``checked``): a run is
10-15 s, nearly all of it the analysis of what the files import (outbox, SQLAlchemy), the
same for each; each test reads the errors of its own files, and none may name another file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from typed_usage import build, run, run_async, run_async_outbox

from outbox import AsyncOutbox, ConfigurationError, Outbox, create_async_engine, create_engine

HERE = Path(__file__).parent


WRONG = (
    "from sqlalchemy.orm import Session\n"
    "from outbox import Outbox, create_engine\n"
    "outbox = Outbox(create_engine('sqlite://'))\n\n"
    "@outbox.transactional\n"
    "def place(session: Session, order_id: int) -> str:\n"
    "    return str(order_id)\n\n"
    "count: int = place('seven')\n"
)
"""A call with a wrong argument: mypy must see it through the decorator."""

FIRST_EXAMPLES = {"readme_example": "README.md", "getting_started_example": "docs/getting-started.md"}
"""README's and getting-started's first example, what a newcomer copies: typed, they type-check.

(The keyword form ``def f(order_id, *, session)`` fails: ``Missing named argument "session"``.)"""


class Checked:
    """One ``mypy --strict`` run over several files: its output, read per file."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.result = subprocess.run(
            [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental",
             *map(str, paths)], cwd=HERE.parent, capture_output=True, text=True, timeout=300)
        self.output = self.result.stdout + self.result.stderr

    def errors(self, *names: str) -> list[str]:
        """The error lines of the files named ``names`` (file names, e.g. ``wrong.py``)."""
        return [line for line in self.result.stdout.splitlines()
                if ": error:" in line and Path(line.split(":", 1)[0]).name in names]

    def assert_clean(self, *names: str) -> None:
        """No error in ``names``, nor in any file but the snippet that must fail; mypy checked (exit
        0 or 1, never 2)."""
        assert self.result.returncode in (0, 1), self.output
        assert self.errors(*names) == [], self.output
        others = [line for line in self.result.stdout.splitlines()
                  if ": error:" in line and Path(line.split(":", 1)[0]).name != "wrong.py"]
        assert others == [], self.output


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> Checked:
    import re

    where = tmp_path_factory.mktemp("typed")
    (where / "wrong.py").write_text(WRONG)
    for name, doc in FIRST_EXAMPLES.items():
        first = re.search(r"^```python\n(.*?)^```", (HERE.parent / doc).read_text(), re.S | re.M)
        assert first is not None and "@outbox.transactional" in first.group(1), doc
        (where / f"{name}.py").write_text(first.group(1))
    return Checked([HERE / "typed_usage.py", where / "wrong.py",
                    *(where / f"{name}.py" for name in FIRST_EXAMPLES)])


# A mypy run, 5-30 s, shared (``checked``): the group keeps its tests on one worker.
@pytest.mark.slow
@pytest.mark.xdist_group("mypy")
def test_typed_usage_passes_mypy_strict(checked: Checked) -> None:
    checked.assert_clean("typed_usage.py")


@pytest.mark.slow
@pytest.mark.xdist_group("mypy")
def test_mypy_sees_the_decorated_signature(checked: Checked) -> None:
    assert checked.result.returncode == 1, checked.output
    said = "\n".join(checked.errors("wrong.py"))
    assert 'Argument 1 to "place" has incompatible type "str"; expected "int"' in said, checked.output
    assert 'expression has type "str", variable has type "int"' in said, checked.output


def test_the_typed_usage_runs(sqlite_db):
    outbox = build(sqlite_db)
    outbox.create_tables()
    assert run(outbox) == ["first"]
    m = outbox.tables.messages
    with outbox.engine.connect() as conn:  # type: ignore[union-attr]
        assert list(conn.scalars(sa.select(m.c.key).order_by(m.c.id))) == ["1", "2"]


async def test_the_typed_async_usage_runs(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"
    from outbox import create_async_engine

    await Outbox(create_async_engine(url)).create_tables_async()
    assert await run_async(url) == 4


def test_a_session_first_function_can_join_a_callers_transaction(outbox):
    @outbox.transactional
    def place(session, order_id):
        outbox.publish(session, "orders", {"id": order_id}, key=order_id)
        return session

    with outbox.begin() as session:
        assert place(1, session=session) is session  # joined: no new session, no commit of its own
        session.rollback()
    with outbox.engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(outbox.tables.messages)) == 0


def test_begin_refuses_the_wrong_engine_kind():
    from outbox import create_async_engine

    with pytest.raises(ConfigurationError, match="begin_async"), \
            Outbox(create_async_engine("sqlite+aiosqlite://")).begin():
        pass


@pytest.mark.slow
@pytest.mark.xdist_group("mypy")
def test_the_first_examples_pass_mypy_strict(checked: Checked) -> None:
    """README's and getting-started's first example are what a newcomer copies: typed, they type-check
    (``FIRST_EXAMPLES``)."""
    checked.assert_clean(*(f"{name}.py" for name in FIRST_EXAMPLES))


async def test_an_async_outbox_writes_what_an_outbox_on_an_async_engine_writes(tmp_path):
    """``AsyncOutbox`` and the older ``Outbox(async_engine)`` are one implementation: same rows, same seqs."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"
    assert await run_async_outbox(url) == [7, 16]
    legacy = Outbox(create_async_engine(url))
    async with legacy.begin_async() as session:
        await legacy.publish_async(session, "orders", {"id": 9}, key=7)
    m = legacy.tables.messages
    async with legacy.engine.connect() as conn:
        rows = (await conn.execute(sa.select(m.c.key, m.c.seq, m.c.shard).order_by(m.c.id))).all()
    await legacy.engine.dispose()
    assert [(key, seq) for key, seq, _ in rows] == [("7", 1), ("7", 2), ("7", 3)]
    assert len({shard for _, _, shard in rows}) == 1


def test_each_flavour_refuses_the_other_kind_of_engine_and_function():
    with pytest.raises(ConfigurationError, match=r"AsyncOutbox needs an AsyncEngine.*use Outbox"):
        AsyncOutbox(create_engine("sqlite://"))
    outbox = AsyncOutbox(create_async_engine("sqlite+aiosqlite://"))

    def sync_place(session: object) -> None: ...

    with pytest.raises(ConfigurationError, match="sync_place is sync but this outbox has an AsyncEngine"):
        outbox.transactional(sync_place)


async def test_create_tables_async_creates_the_tables_declared_on_the_outboxs_metadata(tmp_path):
    """Business tables declared on ``outbox.tables.metadata`` (one MetaData for Alembic) are created too."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
    for outbox in (Outbox(engine, prefix="legacy_"), AsyncOutbox(engine, prefix="new_")):
        sa.Table(f"{outbox.tables.prefix}orders", outbox.tables.metadata,
                 sa.Column("id", sa.Integer, primary_key=True))
        if isinstance(outbox, AsyncOutbox):
            await outbox.create_tables()
        else:
            await outbox.create_tables_async()
    async with engine.connect() as conn:
        names = await conn.run_sync(lambda sync: sa.inspect(sync).get_table_names())
    await engine.dispose()
    assert {"legacy_orders", "new_orders", "legacy_outbox_messages", "new_outbox_messages"} <= set(names)


def test_the_inbox_type_checks_without_ignores() -> None:
    """The inbox's types say what differs (an ordered delivery has a lane and a seq), so mypy
    follows its code without ``# type: ignore``; one coming back means the data model drifted."""
    ignored = [f"{path.relative_to(HERE.parent)}:{n}"
               for path in sorted((HERE.parent / "outbox" / "inbox").glob("*.py"))
               for n, line in enumerate(path.read_text().splitlines(), 1) if "type: ignore" in line]
    assert ignored == []
