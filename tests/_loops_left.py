"""A test must not leave a worker's loop running after it: the loop would go on calling a broker.

A relay or inbox stopped while a broker call blocks returns on time and leaves its
loop behind on a daemon thread (``outbox.core._stopping``): by design, and the
process that ran it normally exits. In the test process it lives on into the tests
after it, and keeps calling the broker its test shut down: librdkafka's "Connect
to ... failed" lines then reached the log of whichever test ran next (CI of
a1c97b4: ``test_tenant_attacks``, an in-memory fleet, failed on a WARNING of a
transactional producer left flushing for up to 600 s by
``test_a_stop_with_a_long_deadline_and_the_broker_frozen_returns_within_the_stop_bound``;
a run of the suite that listed each test's threads found that loop alive 137 tests later).

So after each test's teardown (its fixtures' included: a broker stopped there
may be what ends the loop), every loop thread the test started must end within
``GRACE`` seconds, or the test fails naming the thread and where it is.
``tests/conftest.py`` registers it.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Generator

import pytest

LOOPS = ("outbox-relay-loop", "outbox-tenant-relay", "outbox-relay-worker-", "outbox-inbox-consumer")
"""Names (or name prefixes) of the threads that run a worker's loop: the ones that call a broker."""

GRACE = 10.0
"""Seconds a loop has, after its test's teardown, to see its stop and return."""

_BEFORE = pytest.StashKey[set[threading.Thread]]()


def _loops() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(LOOPS)}


def _where(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident or -1)
    return "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "  (ended)\n"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    item.stash[_BEFORE] = _loops()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    result = yield  # the test's fixtures are torn down first
    deadline = time.monotonic() + GRACE
    for thread in _loops() - item.stash.get(_BEFORE, set()):
        thread.join(max(0.0, deadline - time.monotonic()))
    started = [t for t in _loops() - item.stash.get(_BEFORE, set()) if t.is_alive()]
    if started:
        raise AssertionError(
            f"{len(started)} worker loop(s) this test started still run {GRACE:g} s after its teardown "
            "(they would go on calling its broker during the tests after it):\n"
            + "\n".join(f"{t.name}:\n{_where(t)}" for t in started))
    return result

