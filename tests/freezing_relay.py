"""Run ``outbox relay`` so that it stops itself (SIGSTOP) inside a mark's transaction, once.

``python tests/freezing_relay.py N relay --db …`` runs ``outbox relay …``. The
mark that takes the rows it marked published past N (``RelayStatements.published``:
a batch's outcome write, or an exactly-once take-over's marks) stops the whole
process right after its UPDATE, before its COMMIT: the rows locked, the
transaction open and idle, as a SIGSTOP or a VM stall landing there would leave
them. A test then finds the freeze exactly where it aimed it, however short a
mark is, instead of stopping the process at random moments until one lands
inside a mark. ``SIGCONT`` resumes it; it never stops itself again.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from outbox.relay._sql_shared import RelayStatements


def freeze_inside_the_mark_past(rows: int) -> None:
    real = RelayStatements.published
    lock = threading.Lock()
    so_far, froze = 0, False

    def published(self: RelayStatements, *args: Any, **kwargs: Any) -> int:
        nonlocal so_far, froze
        marked = real(self, *args, **kwargs)
        with lock:
            so_far += marked
            freeze = marked > 0 and so_far >= rows and not froze  # its rows locked, not committed
            froze = froze or freeze
        if freeze:  # sent to this thread: it stops before its next instruction (sent to the process,
            # another thread may take the signal and this one went on to COMMIT before the stop reached it)
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return marked

    RelayStatements.published = published  # type: ignore[method-assign]


if __name__ == "__main__":
    freeze_inside_the_mark_past(int(sys.argv[1]))
    from outbox.cli import main

    sys.argv = ["outbox", *sys.argv[2:]]
    main()
