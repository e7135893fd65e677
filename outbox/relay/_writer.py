"""``BackgroundWriter``: a relay's helper thread for writing a batch's outcomes, never joined at exit;
``DaemonPool``, several such threads (exactly-once mode's shard transactions).

``ThreadPoolExecutor``'s threads are joined when the interpreter exits. A
write stuck in a commit to a frozen database then held a stopped relay alive
after ``run`` had given up on it at its stop bound (``outbox.core._stopping``), until
the platform killed it. The write it abandons is safe to lose: its rows stay
pending and are sent again, and the inbox drops the duplicates.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

_Job = tuple[Future[Any], Callable[[], Any]]


class Writer(Protocol):
    """Where a pipelined batch's outcome write runs: calls start in the order submitted (on one thread,
    a relay's own writer, they run in that order; a fleet's writers run several at once)."""

    def submit(self, call: Callable[[], T]) -> Future[T]: ...


class DaemonPool:
    """Runs submitted calls on ``threads`` daemon threads: each on the first free, in the order submitted."""

    def __init__(self, name: str, threads: int = 1) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=name if threads == 1 else f"{name}-{i}",
                                          daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, call: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, call))
        return future

    def shutdown(self, timeout: float | None = None) -> None:
        """End the threads once the calls submitted so far have run; wait for them (``timeout`` s at most)."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, call = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:  # handed to whoever waits on the future
                    future.set_exception(exc)
            # Nothing of the job stays with a thread that waits for the next one: a failed call's
            # exception holds its frames (a take-over's: the producer and admin client it made), and
            # the future holding the exception would stay until this thread's next job.
            del job, future, call


class BackgroundWriter(DaemonPool):
    """Runs submitted calls one after another, in order, on one daemon thread."""

    def __init__(self, name: str) -> None:
        super().__init__(name, 1)
