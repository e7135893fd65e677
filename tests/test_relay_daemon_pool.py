"""``DaemonPool`` (``outbox.relay._writer``): what a thread keeps of a job once it ran."""

from __future__ import annotations

import gc
import weakref
from concurrent.futures import Future

from _relay_helpers import wait_for

from outbox.relay._writer import DaemonPool


class Client:
    """Stands for what a failed take-over made (a producer, an admin client)."""


def test_a_failed_job_leaves_nothing_with_the_thread_that_waits_for_the_next() -> None:
    """A take-over that fails raises out of frames that hold what it made. The exception goes to the
    job's future, and the future must not stay with the pool's idle thread: its loop's names held it,
    and so the exception, its frames and the clients in them, until that thread's next job (a relay's
    sixteen threads could keep sixteen failed take-overs' clients through a broker's kills)."""
    pool = DaemonPool("test-pool", 1)
    made = Client()
    freed = weakref.ref(made)

    def take_over(client: Client = made) -> None:
        raise RuntimeError("the broker did not answer")

    enabled = gc.isenabled()
    gc.disable()  # freed by reference counts alone, no cycle collector
    try:
        future: Future[None] = pool.submit(take_over)
        del made, take_over
        assert isinstance(future.exception(10), RuntimeError)
        del future
        wait_for(lambda: freed() is None, 5, "the failed job's frames freed while the thread waits")
    finally:
        if enabled:
            gc.enable()
        pool.shutdown(5)
