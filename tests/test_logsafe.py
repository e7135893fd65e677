"""Log lines cannot be forged: client-controlled text is escaped in every library logger's output."""

from __future__ import annotations

import importlib
import io
import logging
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import outbox
import transports
from outbox import Inbox, create_engine
from tests.inbox_support import TOPIC, record
from transports._logsafe import escape_controls, safe_logger

FORGED = "k\nINFO outbox.relay all clear"
# Names the library logs under today; the test also finds any logger a new module adds.
LIBRARY_LOGGERS = ["outbox.inbox", "outbox.relay", "outbox.relay.leases", "outbox.alerts",
                   "outbox.health", "outbox.console.audit", "transports.kafka",
                   "transports.kafka.librdkafka", "transports.kafka_python"]
any_text = st.text(st.characters(codec=None, categories=None), max_size=60)


def _capture(name: str) -> tuple[logging.Logger, io.StringIO, logging.Handler]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    return logger, stream, handler


@pytest.fixture(scope="module")
def relay_log() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    logger, stream, handler = _capture("outbox.relay")
    yield safe_logger("outbox.relay"), stream
    logger.removeHandler(handler)


def _breaks(text: str) -> int:
    """How many extra lines a reader (a terminal, ``str.splitlines``, a log shipper) would see."""
    return len(text.splitlines()) - 1


@given(any_text)
def test_escaped_text_is_one_printable_line_and_keeps_printable_text(text: str) -> None:
    safe = escape_controls(text)
    assert _breaks(safe + "x") == 0
    safe.encode("utf-8")  # no lone surrogate left to make a UTF-8 handler fail
    if text.isprintable():
        assert safe == text


@given(key=any_text, number=st.integers())
def test_a_record_with_any_arguments_stays_one_line(
        relay_log: tuple[logging.Logger, io.StringIO], key: str, number: int) -> None:
    log, stream = relay_log
    stream.seek(0), stream.truncate()
    log.warning("key %s (%r) seq %d failed: %s", key, key, number, ValueError(key))
    log.warning("mapping %(key)s", {"key": key})
    out = stream.getvalue()
    assert _breaks(out) == 1  # the two records, nothing else
    out.encode("utf-8")


def test_an_exception_message_cannot_add_a_line_to_its_traceback(
        relay_log: tuple[logging.Logger, io.StringIO]) -> None:
    log, stream = relay_log
    try:
        try:
            raise KeyError(FORGED)
        except KeyError as inner:
            raise RuntimeError(f"while sending {FORGED}") from inner
    except RuntimeError:
        log.exception("batch failed")
    lines = stream.getvalue().splitlines()
    assert not [line for line in lines if line.startswith("INFO outbox.relay all clear")]
    assert "RuntimeError: while sending k\\nINFO outbox.relay all clear" in lines


_LIST_LOGGERS = """
import importlib, logging, pkgutil, outbox, transports
for package in (outbox, transports):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
print("\\n".join(sorted(name for name, logger in logging.Logger.manager.loggerDict.items()
                        if isinstance(logger, logging.Logger)
                        and name.split(".")[0] in {"outbox", "transports"})))
"""


def _library_loggers() -> list[str]:
    """Every logger a module of the two packages makes, once all of them are imported.

    Listed by a fresh interpreter: in this one, tests create loggers of their own
    (``caplog.set_level(logger=...)``), which are not the library's.
    """
    listed = subprocess.run([sys.executable, "-c", _LIST_LOGGERS], capture_output=True, text=True,
                            check=True, timeout=120)
    for package in (outbox, transports):  # the same modules here, so the filters are attached
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not module.name.endswith("__main__"):
                importlib.import_module(module.name)
    return listed.stdout.split()


def test_every_library_logger_escapes() -> None:
    names = _library_loggers()
    assert set(LIBRARY_LOGGERS) <= set(names)
    for name in names:
        logger, stream, handler = _capture(name)
        try:
            logger.warning("topic %s", FORGED)
        finally:
            logger.removeHandler(handler)
        assert stream.getvalue() == f"WARNING {name} topic k\\nINFO outbox.relay all clear\n", name


def test_a_forged_key_failing_in_the_inbox_is_logged_on_one_line(tmp_path: Path) -> None:
    """The real path: a handler fails on a client's key; the inbox's warning names the key safely."""
    inbox = Inbox(create_engine(f"sqlite:///{tmp_path / 'inbox.db'}"), group="billing",
                  retry_backoff=0.001, retry_backoff_max=0.001, alert=lambda alert: None)
    inbox.create_tables()

    @inbox.handler(TOPIC)
    def fail(session, message):  # type: ignore[no-untyped-def]
        raise ValueError(f"cannot bill {message.key}")

    logger, stream, handler = _capture("outbox.inbox")
    try:
        inbox.handle(record(TOPIC, FORGED, 1))
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "handler failed" in out
    assert not [line for line in out.splitlines() if line.startswith("INFO outbox.relay")]
    assert "k\\nINFO outbox.relay all clear" in out


def _raise_group() -> None:
    raise ExceptionGroup("handlers failed", [ValueError(FORGED), KeyError("k")])


def _raise_with_note() -> None:
    error = ValueError("send failed")
    error.add_note(f"while sending {FORGED}")
    raise error


@pytest.mark.parametrize("raises", [_raise_group, _raise_with_note], ids=["group-member", "note"])
def test_what_a_traceback_prints_besides_the_message_cannot_add_a_line(
        relay_log: tuple[logging.Logger, io.StringIO], raises: Any) -> None:
    """asyncio's TaskGroup raises an ExceptionGroup; a note is printed after the message."""
    log, stream = relay_log
    stream.seek(0), stream.truncate()
    try:
        raises()
    except Exception:
        log.exception("batch failed")
    lines = stream.getvalue().splitlines()
    assert not [line for line in lines if line.lstrip(" |").startswith("INFO outbox.relay")], lines
    assert any("k\\nINFO outbox.relay all clear" in line for line in lines), lines


class _Says(str):
    def __str__(self) -> str:
        return FORGED


class _Counts(int):
    def __str__(self) -> str:
        return FORGED

    __repr__ = __str__


def test_a_subclass_argument_is_shown_as_the_value_it_holds(
        relay_log: tuple[logging.Logger, io.StringIO]) -> None:
    log, stream = relay_log
    stream.seek(0), stream.truncate()
    log.warning("key %s seq %s of %d", _Says("k"), _Counts(3), _Counts(4))
    assert stream.getvalue() == "WARNING outbox.relay key k seq 3 of 4\n"
