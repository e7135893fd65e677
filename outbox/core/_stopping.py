"""Workers stop on time (DESIGN §10): the thread that must see SIGTERM never calls a broker or a database.

A worker's loop (``Inbox.run``'s consumer, ``Relay.run``'s publisher) calls
librdkafka and the database driver, and some of those calls block for as long
as a dead peer lets them: a synchronous offset commit waits for a coordinator
that is gone, a consumer's close for a group that never answers, a query for
a frozen server. A Python signal handler runs only when the main thread comes
back to the interpreter, so a loop on the main thread could sit through
SIGTERM until the platform kills it.

``run_with_stop_bound`` runs the loop on a thread of its own; the calling
thread only waits (an ``Event`` wait, which a signal interrupts). Once a stop
is asked for (``stop()``, SIGTERM or SIGINT), the loop has ``stop_timeout``
seconds to wind down as it always did (finish, commit, close, release); if it
has not by then, it is left behind on its daemon thread and the call returns
anyway, with one WARNING. What it could not finish is safe to lose: an
offset not committed is a redelivery the inbox drops as a duplicate, a row
sent but not marked is sent again, a lease not released expires within its
TTL. The tables and the committed offsets stay the truth.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator

from ._errors import ConfigurationError, OutboxError

STOP_TIMEOUT = 10.0
"""Seconds a worker has, after the stop was asked for, before ``run`` returns without it."""



class StopRequested(OutboxError):
    """A worker that is stopping gave up on what it was waiting for (``Inbox.handle(cancel=…)``)."""


_WATCH = 0.1
"""How often the waiting thread looks whether a stop was asked for (signals interrupt it anyway)."""


def run_with_stop_bound(
    body: Callable[[], None], *, stop: Callable[[], None], stopping: Callable[[], bool],
    name: str, what: str, log: logging.Logger, stop_timeout: float = STOP_TIMEOUT,
    install_signal_handlers: bool = True,
) -> threading.Thread | None:
    """Run ``body`` on a daemon thread ``name``; return when it ends or ``stop_timeout`` s after a stop.

    Returns the thread when it was left behind still running, else None.

    ``stop()`` asks ``body`` to end (SIGTERM and SIGINT call it too, when this
    runs on the main thread and ``install_signal_handlers``); ``stopping()``
    says whether it was asked. An exception of ``body`` is raised here.
    """
    if isinstance(stop_timeout, bool) or not isinstance(stop_timeout, int | float) or stop_timeout <= 0:
        raise ConfigurationError(f"stop_timeout must be positive seconds, got {stop_timeout!r}")
    done = threading.Event()
    failure: list[BaseException] = []

    def target() -> None:
        try:
            body()
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)
        finally:
            done.set()

    signals = stop_signals(stop) if install_signal_handlers else contextlib.nullcontext()
    with signals:
        try:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            while not done.wait(_WATCH):
                if stopping():
                    asked = time.monotonic()
                    if not done.wait(stop_timeout):
                        log.warning(
                            "%s did not finish within %gs of the stop (a broker or database call that "
                            "does not return); returning without it: uncommitted offsets are delivered "
                            "again and dropped as duplicates, unmarked rows are sent again, leases "
                            "expire by their TTL", what, time.monotonic() - asked)
                        return thread
                    break
        except BaseException:
            stop()  # KeyboardInterrupt or the like in the waiting thread: the loop must not outlive it
            raise
    if failure:
        # Taken off the list: its traceback holds ``target``'s frame, which holds the list, a cycle
        # that kept the body's objects (a relay's transport, its clients) for the collector.
        raise failure.pop()
    return None


class Fatal:
    """The error that ends a worker's run, met on any of its threads, raised by the run once.

    The first one stays (it made the worker stop; what comes after is the wind-down's). Raised, it is
    kept by nobody, this holder included: its traceback holds the frames that hold the worker, a
    cycle that left the worker, its transport and librdkafka clients and all, to the cycle collector.
    """

    def __init__(self) -> None:
        self._error: Exception | None = None

    def set(self, error: Exception) -> None:
        if self._error is None:
            self._error = error

    def clear(self) -> None:
        self._error = None

    def raise_if_set(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            try:
                raise error
            finally:
                del error


class StopLatch:
    """A worker command's SIGTERM/SIGINT from its first line: a stop that comes before the worker
    exists is kept and handed to it.

    Between the command's start and the worker's ``run()`` (which installs its own
    handlers) there are connections to make, a module to import, a producer to
    build; a signal there took Python's default action and killed the process
    (exit -15) instead of a clean stop (exit 0). Use as ``with stop_signals(latch):``,
    then ``latch.hand_to(worker.stop)`` once the worker exists; its ``run()``
    returns at once when the stop came first.
    """

    def __init__(self) -> None:
        self.asked = threading.Event()
        self._stop: Callable[[], None] | None = None

    def __call__(self) -> None:
        self.asked.set()
        if self._stop is not None:
            self._stop()

    def hand_to(self, stop: Callable[[], None]) -> None:
        self._stop = stop
        if self.asked.is_set():
            stop()


class RunEnd:
    """The end of a worker's run, as an ``Event`` that stays set once it is.

    A worker's stop ``Event`` is cleared when its ``run`` returns (``RunOnce``),
    so a call begun in a run and still hanging after it (a frozen database)
    cannot tell from it that its run ended. ``over()``, asked as the call
    begins, holds the run's own end: ``end()`` sets it and puts a fresh one in
    its place for the calls begun after (the next run, or a call outside any run).
    """

    def __init__(self) -> None:
        self._current = threading.Event()

    def end(self) -> None:
        ended, self._current = self._current, threading.Event()
        ended.set()

    def over(self, stopping: threading.Event) -> Callable[[], bool]:
        """For a call beginning now: whether its run is over, stopping (``stopping``, the worker's
        stop) or returned (this run's end, which stays set once the stop is cleared)."""
        ended = self._current
        return lambda: ended.is_set() or stopping.is_set()


class RunOnce:
    """A worker's ``run``: one at a time, and a ``stop()`` that came before it is kept.

    An application that starts ``run`` on a thread and shuts down at once may
    call ``stop()`` before that thread reached ``run``: clearing the stop at the
    start of ``run`` lost it, and the thread ran on forever. So the stop is
    cleared when ``run`` returns instead. A loop left behind at its stop (in a
    call that has not returned) still waits to see that stop: a new ``run``
    would clear it and revive the old loop beside the new one, so ``run`` is
    refused while it lives, as it is while another ``run`` is running.
    """

    def __init__(self, stopping: threading.Event, what: str) -> None:
        self._stopping, self._what = stopping, what
        self._running = threading.Lock()
        self._behind: threading.Thread | None = None

    def run(self, start: Callable[[], threading.Thread | None]) -> None:
        """``start()`` (which calls ``run_with_stop_bound``), guarded as the class doc says."""
        if not self._running.acquire(blocking=False):
            raise ConfigurationError(f"{self._what}: run() is already running (one run at a time)")
        try:
            if self._behind is not None:
                if self._behind.is_alive():
                    raise ConfigurationError(
                        f"{self._what}: the loop of the previous run() is still running (left behind at "
                        "its stop, in a broker or database call that has not returned); make a new one")
                self._behind = None
                self._stopping.clear()  # that run's stop, seen by its loop at last: not a new one
            self._behind = start()
        finally:
            if self._behind is None:
                self._stopping.clear()  # returned: the next run starts afresh
            self._running.release()


class BoundRun:
    """A worker's ``run`` and ``stop``: its loop on a thread of its own, returning on time after a stop.

    ``run(body)`` runs ``body`` through ``run_with_stop_bound`` (SIGTERM and
    SIGINT stop it; it returns at most ``stop_timeout`` seconds after the
    stop), one run at a time with a stop asked before it kept (``RunOnce``).
    ``stop()`` sets ``stopping`` and calls ``wake`` (to end the loop's wait
    at once); safe from any thread or signal handler.

    ``loop_running`` says whether a loop runs: in ``run``, or left behind by
    it at a stop, still in a broker or database call; a ``close()`` must not
    close what that loop still uses.
    """

    def __init__(self, what: str, *, thread: str, log: logging.Logger,
                 wake: Callable[[], None] | None = None) -> None:
        self.stopping = threading.Event()
        self._what, self._thread, self._log, self._wake = what, thread, log, wake
        self._runs = RunOnce(self.stopping, what)
        self.run_end = RunEnd()
        """Ended as each ``run`` returns, its loop left behind or not: a watch of a call begun in it
        (``core._outage.told_if_late``) tells nothing after that."""
        self._loop = threading.Event()
        """Set while a loop runs (``loop_running``)."""

    @property
    def loop_running(self) -> bool:
        return self._loop.is_set()

    def run(self, body: Callable[[], None], *, stop_timeout: float = STOP_TIMEOUT) -> None:
        def start() -> threading.Thread | None:
            try:
                return run_with_stop_bound(
                    lambda: self._looping(body), stop=self.stop, stopping=self.stopping.is_set,
                    name=self._thread, what=self._what, log=self._log, stop_timeout=stop_timeout)
            finally:
                self.run_end.end()
        self._runs.run(start)

    def _looping(self, body: Callable[[], None]) -> None:
        self._loop.set()
        try:
            body()
        finally:
            self._loop.clear()

    def stop(self) -> None:
        self.stopping.set()
        if self._wake is not None:
            self._wake()


@contextlib.contextmanager
def stop_signals(stop: Callable[[], None], *, seen: list[signal.Signals] | None = None) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT call ``stop`` instead of their handlers; then put back.

    The one place a worker or a command installs its signal handlers. Python
    runs signal handlers on the main thread only, so elsewhere this does nothing.
    ``seen``, when given, gets each signal that came, in order (a command that
    says which one stopped it, and exits 128 + its number).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, _frame: object) -> None:
        if seen is not None:
            seen.append(signal.Signals(signum))
        stop()

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
